"""Where pdserve keeps what it builds once and reuses: the compiled CPU kernels, the gRPC stubs, a GGUF
file's converted config and tokenizer, a model's resolved config, the tokenizer its engines decode
with. Standard library only (the proto package and configs import it without torch)."""
from __future__ import annotations

import hashlib
import os
import tempfile


def cache_root(kind: str, env: str) -> str:
    """$`env` if set, else ~/.cache/pdserve/`kind` (made if missing), else a per-user temp directory
    when the home is not writable."""
    chosen = os.environ.get(env)
    if chosen:
        return chosen
    home = os.path.join(os.path.expanduser("~"), ".cache", "pdserve", kind)
    try:
        os.makedirs(home, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"pdserve-{kind}-{uid}")


def file_key(path: str, *versions: str) -> str:
    """A cache key for what was derived from the file at `path`: its absolute path, size and mtime
    and `versions` (of what derived it), hashed; OSError where the file cannot be read."""
    st = os.stat(path)
    text = "|".join((os.path.abspath(path), str(st.st_size), str(st.st_mtime_ns), *versions))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def source_digest(*files: str) -> str:
    """A digest of the files' contents: a cache key's part for the code that derived an entry."""
    code = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            code.update(f.read())
    return code.hexdigest()


def write_entry(file: str, data: bytes) -> None:
    """Write a cache entry whole or not at all (another process may read it now): staged beside it,
    then renamed over it. OSError where it cannot be written."""
    root = os.path.dirname(file)
    os.makedirs(root, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=root, prefix=".staging-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(staging, file)
    except OSError:
        if os.path.exists(staging):
            os.unlink(staging)
        raise
