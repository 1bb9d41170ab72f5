"""The Serve application of a cluster spec: the ingress deployment (router/ingress/app.py) handed
what it needs of the spec (`ClusterConfig.ingress_spec`) and the link to the manager that owns the
pools. `build_app` is what `pdserve serve` runs and what a RayService's serveConfigV2 names
(`import_path: cluster.app:build_app`); Serve validates the args into a `ClusterConfig` through its
annotation.
"""
# No `from __future__ import annotations`: Serve reads build_app's annotation at runtime to validate a
# RayService's args into a ClusterConfig, and a string annotation would hand it the raw dict.
from typing import Any

from cluster.config import ClusterConfig
from cluster.manager import ManagerLink
from router.ingress.app import ingress_app


def build_app(config: ClusterConfig) -> Any:
    """The Serve application serving this cluster spec: one ingress for every model, each with the
    link to its own manager."""
    deployments = config.deployments()
    return ingress_app([d.ingress_spec() for d in deployments],
                       [ManagerLink(d.model_dump_json()) for d in deployments])
