"""The protobuf control-plane messages (pdserve_proto): a KV transfer's RemotePrefill and handshake,
KV events: round trips and refusals of other schema versions, connectors and layouts; and the
stubs, generated on first import, never committed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


# --- control plane (unit: no Ray) -----------------------------------------------------------------------
def _remote(address: dict | list[dict], connector: str = "nixl", **layout_changes):
    from records.kv_layout import KVLayout
    from records.transfer import RemotePrefill

    fields = {"model": "LlamaForCausalLM:0123abcd", "num_layers": 2, "block_size": 16, "num_kv_heads": 2,
              "head_dim": 16, "dtype": "float32", **layout_changes}
    layout = KVLayout(**fields)
    return RemotePrefill(engine_id="p-0", request_id="cmpl-1", block_ids=[3, 9, 4],
                         block_hashes=[bytes([i]) * 32 for i in range(2)], num_tokens=40, lease_slot=7,
                         lease_token=(1 << 50) + 5, lease_expires_at=1_800_000_000.25, layout=layout,
                         addresses=address if isinstance(address, list) else [address], connector=connector)


NIXL_ADDRESS = {"agent_metadata": "bWV0YQ==", "kv_addrs": [1 << 40, (1 << 40) + 4096], "num_blocks": 64,
                "lease_addr": 1 << 41, "num_lease_slots": 4096, "mem": "DRAM", "device_id": 0}


@pytest.mark.parametrize("address,connector", [
    (NIXL_ADDRESS, "nixl"), ([NIXL_ADDRESS, {**NIXL_ADDRESS, "agent_metadata": "cmFuazE="}], "nixl"),
    ({"host": "10.0.0.7", "port": 29517}, "torch_dist")])
def test_remote_prefill_round_trips_through_protobuf(address, connector):
    from pdserve_proto.transfer import decode_remote_prefill, from_params, to_params

    tp = len(address) if isinstance(address, list) else 1
    remote = _remote(address, connector, tp_size=tp)
    assert len(remote.addresses) == tp
    params = to_params(remote)
    assert isinstance(params["pdserve_kv"], bytes)
    assert decode_remote_prefill(params["pdserve_kv"]) == remote
    # The protobuf form is what D reads: the readable keys beside it are only a view.
    assert from_params({**params, "remote_block_ids": [0], "layout": {}}) == remote


def _reencoded(data: bytes, **changes) -> bytes:
    from pdserve_proto import pb2

    msg = pb2.RemotePrefill.FromString(data)
    for path, value in changes.items():
        target = msg
        *parents, leaf = path.split("__")
        for p in parents:
            target = getattr(target, p)
        setattr(target, leaf, value)
    return msg.SerializeToString()


def test_handshake_refuses_other_schema_connector_or_layout():
    from kv_transfer.base import KVConnectorScheduler
    from pdserve_proto import CONTROL_SCHEMA_VERSION
    from pdserve_proto.transfer import decode_remote_prefill, encode_remote_prefill
    from records.config import KVTransferConfig
    from records.errors import KVLayoutMismatch, SchemaVersionMismatch
    from records.transfer import CONNECTOR_VERSION

    mine = _remote(NIXL_ADDRESS)
    scheduler = KVConnectorScheduler(KVTransferConfig("nixl", "d-0"), mine.layout)
    hashes = mine.block_hashes + [b"x" * 32]

    def parse(data: bytes):
        return scheduler.parse({"do_remote_prefill": True, "pdserve_kv": data}, hashes, 48)

    good = encode_remote_prefill(mine)
    assert parse(good) == mine
    with pytest.raises(SchemaVersionMismatch, match=f"schema_version is {CONTROL_SCHEMA_VERSION + 1} .* reads "
                                                    f"version {CONTROL_SCHEMA_VERSION}"):
        parse(_reencoded(good, schema_version=CONTROL_SCHEMA_VERSION + 1))
    with pytest.raises(SchemaVersionMismatch, match="KVHandshake"):
        parse(_reencoded(good, handshake__schema_version=0))
    with pytest.raises(KVLayoutMismatch, match="protocol is version"):
        parse(_reencoded(good, handshake__connector_version=CONNECTOR_VERSION + 1))
    with pytest.raises(KVLayoutMismatch, match="connector is 'torch_dist'"):
        parse(encode_remote_prefill(_remote({"host": "h", "port": 1}, "torch_dist")))
    for field, value in (("block_size", 32), ("dtype", "bfloat16"), ("num_kv_heads", 4),
                         ("model", "Qwen2ForCausalLM:ffff")):
        with pytest.raises(KVLayoutMismatch, match=f"prefill engine's {field} is"):
            parse(encode_remote_prefill(_remote(NIXL_ADDRESS, **{field: value})))
    # TP sizes may differ (each rank pulls its heads), but every prefill rank needs an address.
    assert parse(encode_remote_prefill(_remote([NIXL_ADDRESS] * 2, tp_size=2))).layout.tp_size == 2
    with pytest.raises(ValueError, match="carries 1 rank addresses for a prefill engine of tensor_parallel_size 2"):
        parse(encode_remote_prefill(_remote(NIXL_ADDRESS, tp_size=2)))
    with pytest.raises(ValueError, match="not a RemotePrefill"):
        decode_remote_prefill(b"\xff\xff\xff")


def test_kv_events_round_trip_and_version_refusal():
    from pdserve_proto import CONTROL_SCHEMA_VERSION, pb2
    from pdserve_proto.kv_events import decode_kv_events, encode_kv_events
    from records.errors import SchemaVersionMismatch
    from records.kv_events import AllCleared, BlockRemoved, BlockStored
    from router.routing.prefix_index import PrefixIndex

    a, b, c = (bytes([i]) * 32 for i in range(3))
    events = [BlockStored([a, b]), BlockRemoved([a]), AllCleared(), BlockStored([c]), BlockStored([])]
    data = encode_kv_events(12, events, "decode-0")
    assert decode_kv_events(data) == (12, events)
    index = PrefixIndex()
    index.apply("decode-0", decode_kv_events(data)[1])
    assert index.match([c]) == {"decode-0": 1} and index.num_blocks("decode-0") == 1

    newer = pb2.KVEventBatch.FromString(data)
    newer.schema_version = CONTROL_SCHEMA_VERSION + 1
    with pytest.raises(SchemaVersionMismatch, match="replica decode-0"):
        decode_kv_events(newer.SerializeToString())
    with pytest.raises(ValueError, match="not a KVEventBatch"):
        decode_kv_events(b"\x0a\xff")


def test_stubs_are_generated_not_committed():
    """The generated modules come from the cache keyed by the schema's hash, never from the repo."""
    import pdserve_proto

    assert pdserve_proto.pb2.__file__.startswith(pdserve_proto._dir)
    here = os.path.dirname(pdserve_proto.PROTO_PATH)
    assert not os.path.realpath(pdserve_proto._dir).startswith(os.path.realpath(here))
    assert not [f for f in os.listdir(here) if f.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_stub_generation_leaves_nixl_importable(tmp_path):
    """Generating the stubs in a fresh cache must not load protoc's compiler into this process: with
    it loaded, importing NIXL's bindings aborted the interpreter (a clean clone's first test run)."""
    pytest.importorskip("nixl", reason="needs the nixl package (the kv extra)")
    code = "import pdserve_proto, sys, nixl; print('grpc_tools._protoc_compiler' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PDSERVE_PROTO_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
    assert any(name.endswith("pdserve_pb2.py") for name in map(str, tmp_path.rglob("*.py")))
