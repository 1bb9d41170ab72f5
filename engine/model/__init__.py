"""The model: TP-aware layers (`layers/`), architectures (`models/`) and this process's parallel
state (ranks and collectives)."""
