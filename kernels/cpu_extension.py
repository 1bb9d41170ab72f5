"""The C++ CPU kernels' extension: its sources (kernels/csrc/), its build and its load.

The extension is compiled on first use with the machine's C++ compiler (`$CXX`, default `c++`)
against the installed torch, for this CPU (-march=native): ~30 s once (the sources side by side),
then cached under `$PDSERVE_KERNEL_CACHE` (else ~/.cache/pdserve/kernels, else a temp dir when the
home is not writable) by a key of the sources, flags, torch, compiler and CPU. `make setup` builds
it. Where it cannot be built, kernels.dispatch falls back to the reference and says why;
`PDSERVE_KERNELS=cpu` makes that an error instead.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
import sys
import tempfile

import torch

from records.cache_dirs import cache_root
from records.errors import BuildError

__all__ = ["BuildError", "SOURCES", "build", "library_path", "load"]

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = tuple(os.path.join(CSRC, name) for name in ("cpu_ops.cpp", "prefill_attention.cpp", "gguf_linear.cpp",
                                                      "lora.cpp", "moe.cpp", "bf16_gemm.cpp", "f32_gemm.cpp",
                                                      "sampling.cpp", "host_memory.cpp"))
# Every header in csrc/ keys the build: one added to the directory and not to a list would leave a
# stale library in the cache when only it changes.
HEADERS = tuple(sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith(".h")))


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compile_flags() -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415 (only where a build may happen)

    return ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{p}" for p in cpp_extension.include_paths()]]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415

    libs = cpp_extension.library_paths()
    return ["-shared", "-fopenmp", *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
            "-lc10", "-ltorch_cpu", "-ltorch"]


def _cpu_identity() -> str:
    """Model and feature flags of this CPU: a library built with -march=native runs only where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    return "".join(sorted(set(lines)))


def library_path() -> str:
    """Where this machine's build of the extension lives (built or not)."""
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"no C++ compiler: {_compiler()!r} does not run ({e}); set CXX") from e
    source = b""
    for path in (*SOURCES, *HEADERS):
        with open(path, "rb") as f:
            source += f.read()
    key = hashlib.sha256(b"\0".join(part.encode() if isinstance(part, str) else part for part in (
        source, " ".join(_compile_flags() + _link_flags()), torch.__version__, version, _cpu_identity(),
        sys.platform))).hexdigest()
    return os.path.join(_cache_root(), f"cpu_ops-{key[:20]}.so")


def _cache_root() -> str:
    return cache_root("kernels", "PDSERVE_KERNEL_CACHE")


def _run(cmds: list[list[str]]) -> None:
    """Run compiler commands side by side; BuildError with the output of the first that fails."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in cmds]
    failed = []
    for cmd, proc in zip(cmds, procs):
        try:
            _, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{' '.join(cmd)}:\n{err[-4000:]}")
    if failed:
        raise BuildError(f"building the extension from {' and '.join(SOURCES)} failed: {failed[0]}")


def build(path: str) -> None:
    """Compile the extension to `path` (one compiler per source, side by side, then a link), under a file
    lock so that concurrent processes build it once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as work:
            objects = [os.path.join(work, f"{i}.o") for i in range(len(SOURCES))]
            _run([[_compiler(), "-c", src, *_compile_flags(), "-o", obj] for src, obj in zip(SOURCES, objects)])
            tmp = os.path.join(work, "lib.so")
            _run([[_compiler(), *objects, *_link_flags(), "-o", tmp]])
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)


@functools.cache
def load() -> str:
    """Build (if needed) and load the extension into this process; returns the library's path."""
    path = library_path()
    if not os.path.exists(path):
        build(path)
    try:
        torch.ops.load_library(path)
    except OSError as e:
        raise BuildError(f"loading {path} failed: {e}") from e
    return path


if __name__ == "__main__":                     # `python -m kernels.cpu_extension`: build now (make setup)
    print(load())
