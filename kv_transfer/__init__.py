"""Moving KV blocks between engines (NIXL, torch.distributed): see the KV transfer issue."""
