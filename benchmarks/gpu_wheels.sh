#!/usr/bin/env bash
# Builds .whl/: the wheels that `pdserve serve` needs on the lent GPU machine and its image lacks
# (no network there, no Ray; only the repository's working tree travels, 64 MiB in all; this set is
# ~45 MiB).
#
# What it holds: Ray 2.60.0 repacked slim (no Java jars, no rllib/tune/train/data/llm, no dashboard
# web client, no *.map; the symbol tables of its three big ELF files stripped; RECORD rewritten),
# Ray Serve's HTTP stack (fastapi, starlette, uvicorn), pydantic and its parts, python-multipart,
# opentelemetry-api (fastapi imports it), jsonschema and its parts (Ray imports it), xgrammar and
# apache-tvm-ffi (structured outputs, forced tool calls), grpcio-reflection (Serve imports it), and
# grpcio-tools, with which pdserve_proto generates its stubs on first import (cluster/replica.py,
# kv_transfer/base.py and the router import them on every serve path). Both grpc packages are 1.62.3
# on purpose: their protoc writes old-style gencode (as Ray's own ray/core/generated/*_pb2.py are),
# with no protobuf runtime-version check and no GRPC_GENERATED_VERSION check, so the stubs load on
# the image's protobuf and grpcio whatever their versions (tried: protobuf 5.27/6.31/7.36, grpcio
# 1.66/1.75/1.85). Nothing the image already has (numpy, torch, protobuf, grpcio, aiohttp, ...) is
# included: `pip install --target --upgrade` would shadow the image's copy.
#
# On the device, from the repository root (run's carry: [".whl"]; .git/info/exclude holds /.whl/):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   RAY_USAGE_STATS_ENABLED=0 python3 -m cluster.cli serve --model DIR --replicas 1 --prefill-replicas 0
#   (P/D: --prefill-replicas 1 --connector torch_dist; the default connector, nixl, is not carried.)
#
# Usage: benchmarks/gpu_wheels.sh [OUT_DIR]   (default: <repo>/.whl, rebuilt from scratch)
#   PYVER=3.11 benchmarks/gpu_wheels.sh /tmp/whl311  builds the same set for CPython 3.11 (to try it
#   on a machine without 3.12). XGRAMMAR=0 leaves xgrammar out (-4.5 MiB); STRIP=0 keeps Ray's symbol
#   tables (+4.2 MiB; only crash stack traces use them). Needs pip with network to a package index,
#   and `strip` (binutils) unless STRIP=0.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$REPO/.whl}
PYVER=${PYVER:-3.12}
PY=${PYTHON:-python3}
STRIP=${STRIP:-1}
XGRAMMAR=${XGRAMMAR:-1}
CP="cp${PYVER/./}"

# Pinned to the versions the project's tests ran against (.venv), except pydantic and the grpc pair.
PACKAGES=(
  ray==2.60.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  # pydantic 2.11 rather than the .venv's 2.14: 2.14 (pydantic-core 2.50) imports typing_extensions.sentinel
  # (typing-extensions >= 4.16) and 2.12 needs >= 4.14.1; 2.11 needs 4.12.2, whatever the image has.
  pydantic==2.11.10 pydantic-core==2.33.2 annotated-types==0.8.0 typing-inspection==0.4.2
  python-multipart==0.0.34
  opentelemetry-api==1.45.2      # fastapi 0.165 imports it (fastapi/telemetry)
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
  grpcio-tools==1.62.3
  grpcio-reflection==1.62.3      # ray.serve._private.grpc_util imports it at load (same old-style gencode)
)
# Structured outputs / forced tool calls (engine/sample/structured_output.py imports xgrammar when a
# request is constrained; plain serving never does): +4.5 MiB, under 48 MiB in all only with STRIP=1.
if [ "$XGRAMMAR" = 1 ]; then
  PACKAGES+=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT" "$WORK/dl"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --abi "$CP" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$WORK/dl" "${PACKAGES[@]}"
find "$WORK/dl" -name '*.whl' ! -name 'ray-*' -exec mv {} "$OUT/" \;

# The slim Ray: the same wheel less what ray core + ray.serve never import, RECORD rewritten.
"$PY" - "$WORK/dl"/ray-*.whl "$OUT" "$STRIP" <<'EOF'
import base64, hashlib, os, subprocess, sys, tempfile, zipfile

src, out, strip = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
DROP_PREFIXES = (
    "ray/jars/",                    # ray_dist.jar: the Java worker (33 MB)
    "ray/rllib/", "ray/tune/", "ray/train/", "ray/data/", "ray/llm/",
    "ray/serve/llm/",               # imports ray.llm; only `import ray.serve.llm` reaches it
    "ray/dashboard/client/build/",  # the dashboard's web client (pdserve starts Ray without a dashboard)
)
STRIPPED = ("ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")
DROPPED_SCRIPTS = ("tune =",)       # console script of a dropped package


def dropped(name: str) -> bool:
    return name.startswith(DROP_PREFIXES) or name.endswith(".map")


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


zin = zipfile.ZipFile(src)
names = [i.filename for i in zin.infolist()]
record = next(n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))   # not a vendored one
dist_info = record.rsplit("/", 1)[0]
kept = [i for i in zin.infolist() if not dropped(i.filename) and i.filename != record]
gone = len(names) - 1 - len(kept)
rows = []
dst = os.path.join(out, os.path.basename(src))
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in kept:
        data = zin.read(info)
        if info.filename == f"{dist_info}/entry_points.txt":
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not line.decode().startswith(DROPPED_SCRIPTS))
        if strip and info.filename in STRIPPED:
            with tempfile.NamedTemporaryFile() as f:
                f.write(data)
                f.flush()
                subprocess.run(["strip", "--strip-unneeded", f.name], check=True)
                data = open(f.name, "rb").read()
        info.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(info, data, compresslevel=9)
        if not info.is_dir():
            rows.append(f"{info.filename},{digest(data)},{len(data)}")
    rows.append(f"{record},,")
    zout.writestr(zin.getinfo(record), "\n".join(rows) + "\n", compress_type=zipfile.ZIP_DEFLATED)
print(f"slim ray: dropped {gone} files; {os.path.getsize(src) / 2**20:.1f} MiB -> "
      f"{os.path.getsize(dst) / 2**20:.1f} MiB")
EOF

ls -l "$OUT"
du -sh "$OUT"
