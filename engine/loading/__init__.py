"""Loading weights: safetensors and GGUF streaming, quantized checkpoints (int8, fp8)."""
