"""pdserve's protobuf schema (`pdserve.proto`) and its generated Python modules.

The stubs are not committed: on first import this package runs `grpc_tools.protoc` on `pdserve.proto`
into a cache directory keyed by a hash of the schema and of the protobuf / grpcio-tools versions
(`$PDSERVE_PROTO_CACHE`, else `~/.cache/pdserve/proto/<hash>/`, else a temp dir when the home is not
writable), then imports them from there. Generation goes to a private directory renamed into place,
so Ray workers importing this at once never see half-written files. This works the same on a fresh
clone, in an installed wheel (the .proto ships as package data) and in Ray workers started with
`ray job submit --working-dir .` (which uploads no git-ignored files: nothing generated lives here).

The package is named `pdserve_proto`, not `proto`: `proto` is the import name of `proto-plus`, which
Ray Serve brings in (opencensus -> google-api-core), and the two would shadow each other.

Exports: `pb2` (messages), `pb2_grpc` (service stubs), `add_GenerationServicer_to_server` (the generated
registration; Serve's gRPCOptions name `pdserve_proto.serve_proxy`'s, which also repairs the proxy's
cancellation), `CONTROL_SCHEMA_VERSION` and `SchemaVersionMismatch`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from types import ModuleType

from records.cache_dirs import cache_root
from records.errors import SchemaVersionMismatch

# Version of the control-plane messages (KVHandshake, RemotePrefill, KVEventBatch): readers refuse
# any other. Bump it when their fields change meaning.
CONTROL_SCHEMA_VERSION = 3      # 2: per-rank addresses in RemotePrefill; 3: KV events name their medium

_HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_PATH = os.path.join(_HERE, "pdserve.proto")



def check_version(message: str, got: int) -> None:
    """Raise SchemaVersionMismatch unless `got` is this process's CONTROL_SCHEMA_VERSION."""
    if got != CONTROL_SCHEMA_VERSION:
        raise SchemaVersionMismatch(
            f"{message}: schema_version is {got} but this pdserve reads version {CONTROL_SCHEMA_VERSION}; "
            f"every prefill, decode and router process must run the same pdserve version")


def _cache_root() -> str:
    return cache_root("proto", "PDSERVE_PROTO_CACHE")


def _key() -> str:
    from importlib.metadata import version  # noqa: PLC0415

    import google.protobuf  # noqa: PLC0415
    import grpc_tools  # noqa: PLC0415,F401

    h = hashlib.sha256()
    with open(PROTO_PATH, "rb") as f:
        h.update(f.read())
    h.update(f"protobuf={google.protobuf.__version__};grpcio-tools={version('grpcio-tools')}".encode())
    return h.hexdigest()[:20]


def _generate() -> str:
    """The directory holding pdserve_pb2.py and pdserve_pb2_grpc.py for this schema (made if needed)."""
    root = _cache_root()
    final = os.path.join(root, _key())
    if os.path.exists(os.path.join(final, "pdserve_pb2_grpc.py")):
        return final
    import subprocess  # noqa: PLC0415

    import grpc_tools  # noqa: PLC0415

    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".gen-", dir=root)
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")   # google/protobuf/*.proto
    # protoc runs in a child process: its compiler extension bundles its own protobuf/abseil, and
    # once loaded in this process, importing NIXL's bindings afterwards aborts the interpreter
    # (munmap_chunk(): invalid pointer).
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{_HERE}", f"-I{include}",
                           f"--python_out={work}", f"--grpc_python_out={work}", PROTO_PATH],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"grpc_tools.protoc failed ({done.returncode}) on {PROTO_PATH}: {done.stderr.strip()}")
    try:
        os.rename(work, final)        # atomic; another process may have won the race: use its copy
    except OSError:
        if not os.path.exists(os.path.join(final, "pdserve_pb2_grpc.py")):
            raise
        import shutil  # noqa: PLC0415

        shutil.rmtree(work, ignore_errors=True)
    return final


def _load(name: str, directory: str) -> ModuleType:
    # Registered under its own top-level name: pdserve_pb2_grpc does `import pdserve_pb2`, and
    # pickled messages (Serve passes requests pickled) refer to the module `pdserve_pb2`.
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_dir = _generate()
pb2 = _load("pdserve_pb2", _dir)
pb2_grpc = _load("pdserve_pb2_grpc", _dir)
sys.modules[f"{__name__}.pdserve_pb2"] = pb2
sys.modules[f"{__name__}.pdserve_pb2_grpc"] = pb2_grpc
add_GenerationServicer_to_server = pb2_grpc.add_GenerationServicer_to_server  # noqa: N816 (generated name)

__all__ = ["CONTROL_SCHEMA_VERSION", "PROTO_PATH", "SchemaVersionMismatch", "add_GenerationServicer_to_server",
           "check_version", "pb2", "pb2_grpc"]
