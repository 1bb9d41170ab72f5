"""Moving KV blocks between engines: the connector's two roles (`base.py`), NIXL and
torch.distributed transports, leases, and the engine's view of its ranks' transfers. Its records are
records/kv_layout.py and records/transfer.py; their wire form is pdserve_proto/transfer.py."""
