"""Routing: the prefix index fed by KV events, the policy, P/D orchestration, the per-replica
output channels and the serving metrics."""
