"""Model architectures (Llama, Mistral, Qwen2, Qwen3) and the registry from HF names."""
