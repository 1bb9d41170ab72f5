"""Routing and the ingress, below the cluster: `ingress/` (the Ray Serve app, the OpenAI HTTP and
gRPC APIs, request preparation, admission) and `routing/` (prefix index, policy, P/D orchestration,
output channels, metrics). What it needs of the cluster is handed to it (records/serving.py:
IngressSpec, cluster/manager.py: ManagerLink); it never imports `cluster/`."""
