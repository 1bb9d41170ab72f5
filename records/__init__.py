"""Records: the plain, torch-free data every layer shares.

Configs (`config`, `engine_args`), dtypes, errors, the block-hash chain (`hashing`), sampling
parameters, requests and outputs, LoRA records, where a model comes from (`model_source`, its GGUF
file, its quantization, this host's CPU flags), the cache directories, and the serving spec the
ingress reads. Nothing here imports torch or transformers (tests/unit/test_layers.py checks it in a
fresh process), so the ingress, the KV connectors and the kernels can all stand on it.
"""
