"""The Ray tests of this folder share one simulated three-node cluster (started on first use, shut
down after the folder's last test): engines whose stages and TP ranks run on Ray worker actors
place each stage's ranks on one node and the stages on different nodes, as on real machines."""
from __future__ import annotations

import pytest
from helpers import simulated_cluster

NUM_NODES, CPUS_PER_NODE = 3, 4


@pytest.fixture(scope="package")
def ray_nodes():
    pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    with simulated_cluster(NUM_NODES, CPUS_PER_NODE, "pdserve-test-kv-transfer") as cluster:
        yield cluster
