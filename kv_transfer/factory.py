"""Connector by name: `kv_connector` in the engine config -> the worker side of that transport."""
from __future__ import annotations

from kv_transfer.base import KVConnectorWorker
from records.config import KVTransferConfig
from records.engine_args import KV_CONNECTORS
from records.kv_layout import KVLayout


def create_connector_worker(config: KVTransferConfig, layout: KVLayout) -> KVConnectorWorker:
    """The worker side of `config.kv_connector` ("nixl" or "torch_dist")."""
    if config.kv_connector == "nixl":
        from kv_transfer.nixl import NixlConnectorWorker  # noqa: PLC0415 (nixl is an optional install)

        return NixlConnectorWorker(config, layout)
    if config.kv_connector == "torch_dist":
        from kv_transfer.torch_dist import TorchDistConnectorWorker  # noqa: PLC0415

        return TorchDistConnectorWorker(config, layout)
    raise ValueError(f"kv_connector must be one of {KV_CONNECTORS}; got {config.kv_connector!r}")
