"""The manager's side of a trainer's updates (cluster/weights.py: ModelWeights) over stand-in
replicas: the group's ranks in replica order, every replica checked before any is updated, a pause
around an update that had none, the version, and what a joining or woken replica gets."""
from __future__ import annotations

import asyncio

import pytest

from cluster.weights import ModelWeights


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class FakeReplica:
    """A replica handle's `info` and `weights_call`, recording the calls; `refuse`: a method it
    refuses with a ValueError, as an engine refuses a shape."""

    def __init__(self, ranks: int, refuse: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse
        self.info = _Method(lambda: {"num_ranks": ranks})
        self.weights_call = _Method(self._call)

    def _call(self, method: str, *args):
        self.calls.append((method, *args))
        if method == self.refuse:
            raise ValueError("update_weights: 'w' has shape [3]; this model's checkpoint has [4]")


def run(coro):
    return asyncio.run(coro)


def test_group_ranks_follow_the_replicas_in_order():
    replicas = {"prefill-0": FakeReplica(1), "decode-0": FakeReplica(2)}
    weights = ModelWeights()
    assert run(weights.call(replicas, "group_size")) == 4
    assert run(weights.call(replicas, "join_group", "10.0.0.5", 29555)) == 4
    assert replicas["decode-0"].calls == [("init_weights_update_group", "10.0.0.5", 29555, 1, 4, "gloo")]
    assert replicas["prefill-0"].calls == [("init_weights_update_group", "10.0.0.5", 29555, 3, 4, "gloo")]


def test_an_update_is_checked_everywhere_first_and_paused_around():
    replicas = {"a": FakeReplica(1), "b": FakeReplica(1)}
    weights = ModelWeights()
    out = run(weights.call(replicas, "update_from_group", ["w"], ["float32"], [[4]], None))
    assert out == {"weight_version": "1", "paused": None}
    for r in replicas.values():
        assert [c[0] for c in r.calls] == ["check_weights", "pause", "update_weights_from_distributed", "resume"]
    # Paused by the caller: no pause of its own; a version of the caller's.
    run(weights.call(replicas, "pause", "abort"))
    out = run(weights.call(replicas, "update_from_group", ["w"], ["float32"], [[4]], "step-7"))
    assert out == {"weight_version": "step-7", "paused": "abort"}
    assert [c[0] for c in replicas["a"].calls[-3:]] == ["pause", "check_weights", "update_weights_from_distributed"]
    assert run(weights.call(replicas, "resume")) == {"weight_version": "step-7", "paused": None}
    assert run(weights.call({}, "state")) == {"weight_version": "step-7", "paused": None}


def test_tensors_go_by_one_object_reference_to_every_replica():
    """update_from_tensors: the trainer's [ref] (a Ray object reference of the named tensors, kept
    unresolved by the list) goes to each replica as the call's argument, which Ray resolves there."""
    replicas = {"a": FakeReplica(1), "b": FakeReplica(2)}
    weights = ModelWeights()
    assert run(weights.call(replicas, "update_from_tensors", ["REF"], "7"))["weight_version"] == "7"
    for r in replicas.values():
        assert r.calls == [("pause", "wait"), ("update_weights", "REF", "7", None), ("resume",)]


def test_one_refusal_changes_nothing_anywhere():
    replicas = {"a": FakeReplica(1), "b": FakeReplica(1, refuse="check_weights")}
    weights = ModelWeights()
    with pytest.raises(ValueError, match=r"^b: update_weights: 'w' has shape \[3\]"):
        run(weights.call(replicas, "update_from_group", ["w"], ["float32"], [[3]], None))
    assert all(c[0] == "check_weights" for r in replicas.values() for c in r.calls)
    assert weights.version == "0"
    with pytest.raises(ValueError, match="mode must be one of"):
        run(weights.call(replicas, "pause", "sideways"))
    with pytest.raises(ValueError, match="op must be one of"):
        run(weights.call(replicas, "reload"))


def test_joining_and_woken_replicas_get_the_last_disk_updates():
    """The model's last disk update and each adapter's, in the order they happened."""
    from records.lora import LoRARequest

    replicas = {"a": FakeReplica(1)}
    weights = ModelWeights()
    policy = LoRARequest("policy", 1, "/adapters/policy")
    run(weights.call(replicas, "update_from_disk", "/ckpt/step-1", None))
    run(weights.call(replicas, "update_from_disk", "/adapters/step-2", None, policy))
    run(weights.call(replicas, "update_from_disk", "/ckpt/step-3", None))
    assert replicas["a"].calls[-2] == ("update_weights_from_disk", "/ckpt/step-3", "3", None)
    joining = FakeReplica(1)
    run(weights.on_join(joining))
    assert joining.calls == [("update_weights_from_disk", "/adapters/step-2", "2", policy),
                             ("update_weights_from_disk", "/ckpt/step-3", "3", None)]
    run(weights.woken(replicas))
    assert replicas["a"].calls[-1] == ("update_weights_from_disk", "/ckpt/step-3", "3", None)
    # An adapter's tensors are checked and applied as the adapter's.
    run(weights.call(replicas, "update_from_group", ["w"], ["float32"], [[4]], None, policy))
    assert [c for c in replicas["a"].calls if c[0] == "check_weights"][-1] == ("check_weights", {"w": [4]}, policy)
    with pytest.raises(ValueError, match="expected 2 arguments and an optional adapter"):
        run(weights.call(replicas, "update_from_disk", "/ckpt"))
    # After a broadcast, a woken replica holds the checkpoint's weights: version "0" again.
    run(weights.call(replicas, "update_from_group", ["w"], ["float32"], [[4]], None))
    weights.disk = {}
    run(weights.woken(replicas))
    assert weights.version == "0"
