"""The OpenAI Files API's store: uploaded files and the Batch API's output files, on disk.

Under `root`: `<id>` holds a file's bytes and `<id>.json` its OpenAI file object (plus its owner, the
tenant that uploaded it, which no other tenant sees). Writes go to a temporary name first and are
renamed into place, so a reader (another ingress replica sharing the directory, or this one after
a restart) sees a whole file or none. Sizes are bounded by `serving.max_file_bytes`.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from records.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError

UPLOAD_PURPOSES = ("batch", "user_data")      # what an upload may say; outputs are "batch_output"


class FileStore:
    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        os.makedirs(root, exist_ok=True)

    def create(self, filename: str, purpose: str, data: bytes, owner: str) -> dict[str, Any]:
        """Store an upload; its file object. InvalidRequestError / PayloadTooLargeError naming the field."""
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequestError(f"purpose must be one of {list(UPLOAD_PURPOSES)}; got {purpose!r}", "purpose")
        if len(data) > self.max_bytes:
            raise PayloadTooLargeError(f"file is {len(data)} bytes; the limit is {self.max_bytes} "
                                       f"(serving.max_file_bytes)", "file")
        if not data:
            raise InvalidRequestError("file must not be empty", "file")
        file_id = f"file-{uuid.uuid4().hex}"
        _write_atomic(self._path(file_id), data)
        return self._register(file_id, filename, purpose, len(data), owner)

    def adopt(self, path: str, filename: str, owner: str) -> dict[str, Any]:
        """Move a finished output (a batch's) into the store as a "batch_output" file."""
        file_id = f"file-{uuid.uuid4().hex}"
        os.replace(path, self._path(file_id))
        return self._register(file_id, filename, "batch_output", os.path.getsize(self._path(file_id)), owner)

    def get(self, file_id: str, owner: str) -> dict[str, Any]:
        """The file object; NotFoundError when there is none (or another tenant owns it)."""
        meta = self._meta(file_id)
        if meta is None or meta.get("_owner") != owner:
            raise NotFoundError(f"no file {file_id!r}", "file_id")
        return _public(meta)

    def content_path(self, file_id: str, owner: str) -> str:
        self.get(file_id, owner)
        return self._path(file_id)

    def list(self, owner: str, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> dict[str, Any]:
        metas = [m for m in (self._meta(name[:-5]) for name in os.listdir(self.root)
                             if name.endswith(".json") and name.startswith("file-"))
                 if m is not None and m.get("_owner") == owner and (purpose is None or m["purpose"] == purpose)]
        metas.sort(key=lambda m: (m["created_at"], m["id"]), reverse=order != "asc")
        if after is not None:
            ids = [m["id"] for m in metas]
            metas = metas[ids.index(after) + 1:] if after in ids else []
        page = metas[:limit]
        return {"object": "list", "data": [_public(m) for m in page], "has_more": len(metas) > len(page),
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    def delete(self, file_id: str, owner: str) -> dict[str, Any]:
        self.get(file_id, owner)
        for path in (self._path(file_id) + ".json", self._path(file_id)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return {"id": file_id, "object": "file", "deleted": True}

    def _register(self, file_id: str, filename: str, purpose: str, size: int, owner: str) -> dict[str, Any]:
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None, "_owner": owner}
        _write_atomic(self._path(file_id) + ".json", json.dumps(meta).encode())
        return _public(meta)

    def _path(self, file_id: str) -> str:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise NotFoundError(f"no file {file_id!r}", "file_id")
        return os.path.join(self.root, file_id)

    def _meta(self, file_id: str) -> dict[str, Any] | None:
        try:
            with open(self._path(file_id) + ".json", encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError, NotFoundError):
            return None


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if not k.startswith("_")}


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
