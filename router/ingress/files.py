"""The OpenAI Files API's store: uploaded files and the Batch API's output files, on disk.

Under `root`: `<id>` holds a file's bytes and `<id>.json` its OpenAI file object (plus its owner, the
tenant that uploaded it, which no other tenant sees). Writes go to a temporary name first and are
renamed into place, so a reader (another ingress replica sharing the directory, or this one after
a restart) sees a whole file or none. Sizes are bounded by `serving.max_file_bytes`.

Expiry, as OpenAI's: an upload's `expires_after` ({"anchor": "created_at", "seconds": 3,600 to
2,592,000}) sets its `expires_at`; without one, a "batch" upload expires after 30 days and any other
is kept until deleted (a batch's outputs take the batch's `output_expires_after`). An expired file
is gone from every route at once, and its bytes are deleted by the next upload or listing.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from records.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError

UPLOAD_PURPOSES = ("batch", "user_data")      # what an upload may say; outputs are "batch_output"
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400   # OpenAI's bounds on expires_after.seconds
DEFAULT_EXPIRY_S = {"batch": MAX_EXPIRY_S}      # by purpose; the others are kept until deleted


def expiry_seconds(value: Any, field: str) -> int:
    """The seconds of an `expires_after` object ({"anchor": "created_at", "seconds": N});
    InvalidRequestError naming `field` and the allowed values."""
    if not isinstance(value, dict) or set(value) != {"anchor", "seconds"}:
        raise InvalidRequestError(f'{field} must be {{"anchor": "created_at", "seconds": N}}; got {value!r}', field)
    if value["anchor"] != "created_at":
        raise InvalidRequestError(f"{field}.anchor must be 'created_at'; got {value['anchor']!r}", field)
    seconds = value["seconds"]
    if isinstance(seconds, str) and seconds.isdigit():     # a form field's value
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        raise InvalidRequestError(f"{field}.seconds must be an integer from {MIN_EXPIRY_S} (an hour) to "
                                  f"{MAX_EXPIRY_S} (30 days); got {seconds!r}", field)
    return seconds


class FileStore:
    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        os.makedirs(root, exist_ok=True)

    def create(self, filename: str, purpose: str, data: bytes, owner: str,
               expires_after_s: int | None = None) -> dict[str, Any]:
        """Store an upload; its file object. InvalidRequestError / PayloadTooLargeError naming the field.
        `expires_after_s`: seconds to keep it (checked by `expiry_seconds`); None: the purpose's default."""
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequestError(f"purpose must be one of {list(UPLOAD_PURPOSES)}; got {purpose!r}", "purpose")
        if len(data) > self.max_bytes:
            raise PayloadTooLargeError(f"file is {len(data)} bytes; the limit is {self.max_bytes} "
                                       f"(serving.max_file_bytes)", "file")
        if not data:
            raise InvalidRequestError("file must not be empty", "file")
        self.purge_expired()
        file_id = f"file-{uuid.uuid4().hex}"
        _write_atomic(self._path(file_id), data)
        return self._register(file_id, filename, purpose, len(data), owner,
                              expires_after_s if expires_after_s is not None else DEFAULT_EXPIRY_S.get(purpose))

    def adopt(self, path: str, filename: str, owner: str, expires_after_s: int | None = None) -> dict[str, Any]:
        """Move a finished output (a batch's) into the store as a "batch_output" file."""
        file_id = f"file-{uuid.uuid4().hex}"
        os.replace(path, self._path(file_id))
        return self._register(file_id, filename, "batch_output", os.path.getsize(self._path(file_id)), owner,
                              expires_after_s)

    def get(self, file_id: str, owner: str) -> dict[str, Any]:
        """The file object; NotFoundError when there is none (or another tenant owns it)."""
        meta = self._meta(file_id)
        if meta is None or _expired(meta, time.time()) or meta.get("_owner") != owner:
            raise NotFoundError(f"no file {file_id!r}", "file_id")
        return _public(meta)

    def content_path(self, file_id: str, owner: str) -> str:
        self.get(file_id, owner)
        return self._path(file_id)

    def list(self, owner: str, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> dict[str, Any]:
        metas = [m for m in self.purge_expired()
                 if m.get("_owner") == owner and (purpose is None or m["purpose"] == purpose)]
        metas.sort(key=lambda m: (m["created_at"], m["id"]), reverse=order != "asc")
        if after is not None:
            ids = [m["id"] for m in metas]
            metas = metas[ids.index(after) + 1:] if after in ids else []
        page = metas[:limit]
        return {"object": "list", "data": [_public(m) for m in page], "has_more": len(metas) > len(page),
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    def delete(self, file_id: str, owner: str) -> dict[str, Any]:
        self.get(file_id, owner)
        self._remove(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def purge_expired(self) -> list[dict[str, Any]]:
        """Delete every expired file (any owner's); the stored objects of the others."""
        now, live = time.time(), []
        for name in os.listdir(self.root):
            if name.startswith("file-") and name.endswith(".json") and (meta := self._meta(name[:-5])) is not None:
                if _expired(meta, now):
                    self._remove(meta["id"])
                else:
                    live.append(meta)
        return live

    def _remove(self, file_id: str) -> None:
        for path in (self._path(file_id) + ".json", self._path(file_id)):
            try:
                os.unlink(path)
            except FileNotFoundError:       # another ingress replica removed it first
                pass

    def _register(self, file_id: str, filename: str, purpose: str, size: int, owner: str,
                  expires_after_s: int | None) -> dict[str, Any]:
        created = int(time.time())
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": created,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": created + expires_after_s if expires_after_s is not None else None,
                "status_details": None, "_owner": owner}
        _write_atomic(self._path(file_id) + ".json", json.dumps(meta).encode())
        return _public(meta)

    def _path(self, file_id: str) -> str:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise NotFoundError(f"no file {file_id!r}", "file_id")
        return os.path.join(self.root, file_id)

    def _meta(self, file_id: str) -> dict[str, Any] | None:
        """The stored object (expired or not); None when there is none."""
        try:
            with open(self._path(file_id) + ".json", encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError, NotFoundError):
            return None


def _expired(meta: dict[str, Any], now: float) -> bool:
    return meta.get("expires_at") is not None and meta["expires_at"] <= now


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if not k.startswith("_")}


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
