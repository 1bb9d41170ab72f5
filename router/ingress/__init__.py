"""The ingress: the Ray Serve app, the HTTP (OpenAI) and gRPC APIs, the protocol records, request
preparation and admission."""
