"""Model building blocks; each parameter knows how to load its HF checkpoint tensor (weight_loader)."""
