"""Prefix-aware routing, P/D orchestration and the OpenAI-compatible Ray Serve ingress."""
