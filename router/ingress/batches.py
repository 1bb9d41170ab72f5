"""The OpenAI Batch API: a JSONL file of requests in, their responses out, at the lowest priority.

`Batches` keeps each batch's state on disk under `root` (`<id>.json`: the OpenAI batch object and its
owner), and runs the batches in progress as tasks of the ingress's event loop: each input line (
`{"custom_id", "method": "POST", "url", "body"}`) is executed through `execute(url, body, tenant)`,
the same endpoint code as a direct request (so the bodies are the same), admitted in the Batch
band (router/ingress/admission.py: below every tenant's, on at most `serving.batch_share` of the
dispatch slots) under the tenant that created the batch. Its outcome is appended to the batch's
output (status 200) or error file (`{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`, OpenAI's line) as it ends. A batch survives an ingress restart: the lines
already answered are read back from those files and skipped; the rest run. With several ingress
replicas sharing the directory, a lock file lets one of them run each batch.

States: validating (the input is read and checked: a bad line fails the batch, naming it),
in_progress, finalizing (the outputs become files), completed; cancelling then cancelled; failed;
expired (the 24h window passed: what ran is kept).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from records.errors import InvalidRequestError, NotFoundError
from router.ingress.files import FileStore, expiry_seconds

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
WINDOW_S = 24 * 3600
MAX_LINES = 50_000
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

# (url, body, owner) -> (HTTP status, response body)
Execute = Callable[[str, dict[str, Any], str], Awaitable[tuple[int, dict[str, Any]]]]


class Batches:
    def __init__(self, root: str, files: FileStore, execute: Execute, concurrency: Callable[[], int]) -> None:
        self.root = root
        self.files = files
        self.execute = execute
        self.concurrency = concurrency          # how many lines of one batch may wait to run at once
        self.tasks: dict[str, asyncio.Task] = {}
        self._locks: dict[str, Any] = {}
        self._counts: dict[str, dict[str, int]] = {}     # the batches running here: their live counts
        os.makedirs(root, exist_ok=True)

    # --- the API -----------------------------------------------------------------------------------
    def create(self, body: dict[str, Any], owner: str) -> dict[str, Any]:
        """Check the request and the input file (every line), save the batch and start it."""
        endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
        unknown = sorted(set(body) - {"endpoint", "input_file_id", "completion_window", "metadata",
                                      "output_expires_after"})
        if unknown:
            raise InvalidRequestError(f"unknown field {unknown[0]!r}", unknown[0])
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"endpoint must be one of {list(ENDPOINTS)}; got {endpoint!r}", "endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise InvalidRequestError(f"completion_window must be '24h'; got {body['completion_window']!r}",
                                      "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise InvalidRequestError("metadata must map at most 16 keys (64 characters) to strings (512)",
                                      "metadata")
        output_expiry = (expiry_seconds(body["output_expires_after"], "output_expires_after")
                         if body.get("output_expires_after") is not None else None)
        if not isinstance(file_id, str):
            raise InvalidRequestError("input_file_id must be the id of an uploaded file", "input_file_id")
        meta = self.files.get(file_id, owner)
        if meta["purpose"] != "batch":
            raise InvalidRequestError(f"input_file_id: file {file_id} has purpose {meta['purpose']!r}, not 'batch'",
                                      "input_file_id")
        read_lines(self.files.content_path(file_id, owner), endpoint)      # every line, before it starts
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 "_owner": owner, "_output_expiry_s": output_expiry}
        self._save(batch)
        self._start(batch)
        return self._public(batch)

    def get(self, batch_id: str, owner: str) -> dict[str, Any]:
        return self._public(self._load_owned(batch_id, owner))

    def list(self, owner: str, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        batches = [b for b in (self._load(name[:-5]) for name in os.listdir(self.root)
                               if name.startswith("batch_") and name.endswith(".json"))
                   if b is not None and b.get("_owner") == owner]
        batches.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        page = batches[:limit]
        return {"object": "list", "data": [self._public(b) for b in page], "has_more": len(batches) > len(page),
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    def cancel(self, batch_id: str, owner: str) -> dict[str, Any]:
        """Stop a batch: no more of its lines start, those running finish, what ran is kept (its
        output files), and it ends cancelled."""
        batch = self._load_owned(batch_id, owner)
        if batch["status"] not in ("validating", "in_progress"):
            raise InvalidRequestError(f"batch {batch_id} is {batch['status']}: only a batch validating or in "
                                      f"progress can be cancelled", "batch_id")
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self._save(batch)
        task = self.tasks.get(batch_id)
        if task is None or task.done():     # run elsewhere or not at all here: its runner sees the state
            self._start(batch)
        return self._public(batch)

    def resume(self) -> list[str]:
        """Start every unfinished batch on disk (after a restart) that no other ingress runs."""
        started = []
        for name in sorted(os.listdir(self.root)):
            if name.startswith("batch_") and name.endswith(".json"):
                batch = self._load(name[:-5])
                if batch is not None and batch["status"] in ACTIVE and self._start(batch):
                    started.append(batch["id"])
        return started

    # --- running -----------------------------------------------------------------------------------
    def _start(self, batch: dict[str, Any]) -> bool:
        """Run `batch` here unless another ingress (or task) holds its lock."""
        batch_id = batch["id"]
        if batch_id in self.tasks and not self.tasks[batch_id].done():
            return False
        lock = open(os.path.join(self.root, f"{batch_id}.lock"), "w")     # held while it runs here
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            return False
        self._locks[batch_id] = lock
        # A context of its own: not the one of the request that created it (its trace, its tenant).
        task = asyncio.get_running_loop().create_task(self._run(batch_id), context=contextvars.Context())
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self._unlock(batch_id))
        return True

    def _unlock(self, batch_id: str) -> None:
        lock = self._locks.pop(batch_id, None)
        if lock is not None:
            lock.close()

    async def _run(self, batch_id: str) -> None:
        batch = self._load(batch_id)
        try:
            await self._drive(batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the batch fails, saying why; the server goes on
            logger.exception("batch %s failed", batch_id)
            batch = self._load(batch_id) or batch
            batch["status"], batch["failed_at"] = "failed", int(time.time())
            batch["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": str(e)[:500],
                                                           "param": None, "line": None}]}
            self._save(batch)

    async def _drive(self, batch: dict[str, Any]) -> None:
        owner, batch_id = batch["_owner"], batch["id"]
        try:
            lines = read_lines(self.files.content_path(batch["input_file_id"], owner), batch["endpoint"])
        except (InvalidRequestError, NotFoundError) as e:
            batch["status"], batch["failed_at"] = "failed", int(time.time())
            batch["errors"] = {"object": "list", "data": [{"code": "invalid_input_file", "message": e.message,
                                                           "param": e.param, "line": getattr(e, "line", None)}]}
            self._save(batch)
            return
        outputs = {kind: os.path.join(self.root, f"{batch_id}.{kind}.jsonl") for kind in ("output", "error")}
        done = {kind: _answered(path) for kind, path in outputs.items()}
        batch["request_counts"] = {"total": len(lines), "completed": len(done["output"]), "failed": len(done["error"])}
        self._counts[batch_id] = batch["request_counts"]
        if batch["status"] == "validating":
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
        self._save(batch)
        pending = [line for line in lines if line["custom_id"] not in done["output"] | done["error"]]
        for path in outputs.values():
            _trim_partial(path)
        files = {kind: open(path, "a", encoding="utf-8") for kind, path in outputs.items()}
        try:
            await self._execute_all(batch, pending, files)
        finally:
            for f in files.values():
                f.close()
        batch = {**self._load(batch_id), "request_counts": batch["request_counts"]}
        ending = {"cancelling": ("cancelled", "cancelled_at")}.get(batch["status"])
        if ending is None and time.time() > batch["expires_at"]:
            ending = ("expired", "expired_at")
        batch["status"], batch["finalizing_at"] = "finalizing", batch["finalizing_at"] or int(time.time())
        self._save(batch)
        for kind, key in (("output", "output_file_id"), ("error", "error_file_id")):
            if batch[key] is None and os.path.exists(outputs[kind]) and os.path.getsize(outputs[kind]):
                batch[key] = self.files.adopt(outputs[kind], f"{batch_id}_{kind}.jsonl", owner,
                                              batch.get("_output_expiry_s"))["id"]
                self._save(batch)
        status, stamp = ending or ("completed", "completed_at")
        batch["status"], batch[stamp] = status, int(time.time())
        self._save(batch)
        self._counts.pop(batch_id, None)

    async def _execute_all(self, batch: dict[str, Any], pending: list[dict[str, Any]], files: dict[str, Any]) -> None:
        """Run the pending lines, at most `concurrency()` at once, until done, cancelled or expired."""
        batch_id, owner = batch["id"], batch["_owner"]
        slots = asyncio.Semaphore(max(1, self.concurrency()))
        running: set[asyncio.Task] = set()
        saved = time.monotonic()

        async def one(line: dict[str, Any]) -> None:
            nonlocal saved
            try:
                while True:
                    status, body = await self.execute(batch["endpoint"], line["body"], owner)
                    if status != 429:
                        break
                    await asyncio.sleep(1.0)        # pushed out or over a limit: wait for room
                kind = "output" if status == 200 else "error"
                request_id = f"batch_req_{uuid.uuid4().hex}"
                record = {"id": request_id, "custom_id": line["custom_id"],
                          "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
                files[kind].write(json.dumps(record) + "\n")
                files[kind].flush()
                batch["request_counts"]["completed" if kind == "output" else "failed"] += 1
                if time.monotonic() - saved > 0.5:       # progress on disk, twice a second at most
                    saved = time.monotonic()
                    self._save_counts(batch_id, batch["request_counts"])
            finally:
                slots.release()

        try:
            for line in pending:
                await slots.acquire()
                current = self._load(batch_id)
                if current is None or current["status"] == "cancelling" or time.time() > batch["expires_at"]:
                    slots.release()
                    break
                task = asyncio.get_running_loop().create_task(one(line))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            self._save_counts(batch_id, batch["request_counts"])

    def _public(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch object a client sees: its counts as of now where it runs here (on disk they
        are saved twice a second at most)."""
        live = self._counts.get(batch["id"])
        return _public(batch if live is None else {**batch, "request_counts": dict(live)})

    # --- state on disk -----------------------------------------------------------------------------
    def _path(self, batch_id: str) -> str:
        if not batch_id.startswith("batch_") or not batch_id[6:].isalnum():
            raise NotFoundError(f"no batch {batch_id!r}", "batch_id")
        return os.path.join(self.root, f"{batch_id}.json")

    def _load(self, batch_id: str) -> dict[str, Any] | None:
        try:
            with open(self._path(batch_id), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError, NotFoundError):
            return None

    def _load_owned(self, batch_id: str, owner: str) -> dict[str, Any]:
        batch = self._load(batch_id)
        if batch is None or batch.get("_owner") != owner:
            raise NotFoundError(f"no batch {batch_id!r}", "batch_id")
        return batch

    def _save(self, batch: dict[str, Any]) -> None:
        tmp = f"{self._path(batch['id'])}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(batch, f)
        os.replace(tmp, self._path(batch["id"]))

    def _save_counts(self, batch_id: str, counts: dict[str, int]) -> None:
        current = self._load(batch_id)
        if current is not None:
            current["request_counts"] = dict(counts)
            self._save(current)


class LineError(InvalidRequestError):
    """A bad line of a batch's input file: `line` is its number (from 1)."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}", "input_file_id")
        self.line = line


def read_lines(path: str, endpoint: str) -> list[dict[str, Any]]:
    """The input file's requests; LineError naming the first bad line (not JSON, a field missing or
    wrong, a custom_id seen before, a url other than the batch's endpoint)."""
    lines, seen = [], set()
    with open(path, encoding="utf-8", errors="strict") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except ValueError:
                raise LineError("not a JSON object", number) from None
            if not isinstance(line, dict):
                raise LineError("not a JSON object", number)
            custom_id = line.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                raise LineError("custom_id must be a non-empty string", number)
            if custom_id in seen:
                raise LineError(f"custom_id {custom_id!r} is used twice", number)
            seen.add(custom_id)
            if line.get("method", "POST") != "POST":
                raise LineError(f"method must be 'POST'; got {line.get('method')!r}", number)
            if line.get("url") != endpoint:
                raise LineError(f"url must be the batch's endpoint {endpoint!r}; got {line.get('url')!r}", number)
            if not isinstance(line.get("body"), dict):
                raise LineError("body must be a JSON object", number)
            if line["body"].get("stream"):
                raise LineError("body.stream must be false in a batch", number)
            lines.append(line)
            if len(lines) > MAX_LINES:
                raise LineError(f"a batch holds at most {MAX_LINES} requests", number)
    if not lines:
        raise InvalidRequestError("input_file_id: the file holds no requests", "input_file_id")
    return lines


def _answered(path: str) -> set[str]:
    """The custom_ids an output or error file of a batch holds whole lines for."""
    found = set()
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for text in f:
            if text.endswith("\n"):             # a line cut by a crash is run again
                with contextlib.suppress(ValueError):
                    found.add(json.loads(text)["custom_id"])
    return found


def _public(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if not k.startswith("_")}


def _trim_partial(path: str) -> None:
    """Cut a line a crash left unfinished at the end of an output file, before more are appended."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
