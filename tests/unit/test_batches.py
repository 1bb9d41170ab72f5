"""The Batch API's runner (router/ingress/batches.py) and file store (router/ingress/files.py) as
plain classes, with a fake endpoint: a batch survives its ingress dying mid-run (a new one resumes
it from the state on disk, answering every line once, a line cut by the crash again), cancel keeps
what ran, a bad input is refused naming the line, and lines over a limit (429) wait and retry.
The served path (the `openai` client's calls) is tests/serving/test_batches.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from records.errors import InvalidRequestError, NotFoundError
from router.ingress.batches import Batches
from router.ingress.files import FileStore


def jsonl(n: int, url: str = "/v1/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                               "body": {"prompt": f"p{i}", "max_tokens": 1}}) + "\n" for i in range(n)).encode()


class Endpoint:
    """A fake endpoint: answers each body after `gate` opens for it; counts calls per prompt."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.busy: set[str] = set()

    async def __call__(self, url: str, body: dict, owner: str) -> tuple[int, dict]:
        prompt = body["prompt"]
        self.calls[prompt] = self.calls.get(prompt, 0) + 1
        gate = self.gates.get(prompt)
        if gate is not None:
            await gate.wait()
        if prompt == "p3" and self.calls[prompt] == 1:
            return 429, {"error": {"message": "over the limit"}}      # retried after a second
        return (400, {"error": {"message": "bad"}}) if prompt == "p5" else (200, {"text": prompt, "owner": owner})


async def until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_batch_survives_its_ingress_and_answers_every_line_once(tmp_path):
    async def main() -> None:
        files = FileStore(str(tmp_path / "files"), 1 << 20)
        endpoint = Endpoint()
        endpoint.gates = {f"p{i}": asyncio.Event() for i in range(8)}
        for i in (0, 1, 2, 3, 5):
            endpoint.gates[f"p{i}"].set()
        first = Batches(str(tmp_path / "batches"), files, endpoint, lambda: 3)
        file_id = files.create("in.jsonl", "batch", jsonl(8), "acme")["id"]
        batch = first.create({"input_file_id": file_id, "endpoint": "/v1/completions"}, "acme")
        await until(lambda: first.get(batch["id"], "acme")["request_counts"]["completed"]
                    + first.get(batch["id"], "acme")["request_counts"]["failed"] >= 4)
        assert first.resume() == []                       # it runs here: not started twice
        # The ingress dies: its task is gone, a line half written, the lock released.
        first.tasks[batch["id"]].cancel()
        await asyncio.sleep(0.05)
        with open(tmp_path / "batches" / f"{batch['id']}.output.jsonl", "a") as f:
            f.write('{"custom_id": "r7", "resp')
        for gate in endpoint.gates.values():
            gate.set()
        second = Batches(str(tmp_path / "batches"), files, endpoint, lambda: 3)
        assert second.resume() == [batch["id"]]
        await second.tasks[batch["id"]]
        done = second.get(batch["id"], "acme")
        assert done["status"] == "completed" and done["request_counts"] == {"total": 8, "completed": 7, "failed": 1}
        out = [json.loads(x) for x in open(files.content_path(done["output_file_id"], "acme"))]
        assert sorted(r["custom_id"] for r in out) == [f"r{i}" for i in (0, 1, 2, 3, 4, 6, 7)]
        assert all(r["response"]["body"]["owner"] == "acme" for r in out)
        err = [json.loads(x) for x in open(files.content_path(done["error_file_id"], "acme"))]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in err] == [("r5", 400)]
        # Answered lines ran once (p3 twice: its 429, then its answer); the rest at most twice.
        assert all(endpoint.calls[f"p{i}"] == 1 for i in (0, 1, 2, 5)) and endpoint.calls["p3"] == 2
        with pytest.raises(NotFoundError):
            second.get(batch["id"], "someone-else")

    asyncio.run(main())


def test_cancel_keeps_what_ran_and_bad_inputs_are_named(tmp_path):
    async def main() -> None:
        files = FileStore(str(tmp_path / "files"), 1 << 20)
        endpoint = Endpoint()
        endpoint.gates = {f"p{i}": asyncio.Event() for i in range(1, 6)}
        batches = Batches(str(tmp_path / "batches"), files, endpoint, lambda: 2)
        file_id = files.create("in.jsonl", "batch", jsonl(6), "acme")["id"]
        batch = batches.create({"input_file_id": file_id, "endpoint": "/v1/completions"}, "acme")
        await until(lambda: batches.get(batch["id"], "acme")["request_counts"]["completed"] == 1)
        assert batches.cancel(batch["id"], "acme")["status"] == "cancelling"
        for gate in endpoint.gates.values():    # the two lines running finish; no other starts
            gate.set()
        await batches.tasks[batch["id"]]
        done = batches.get(batch["id"], "acme")
        assert done["status"] == "cancelled" and done["request_counts"]["completed"] == 3
        assert set(endpoint.calls) == {"p0", "p1", "p2"}
        assert len(open(files.content_path(done["output_file_id"], "acme")).readlines()) == 3
        with pytest.raises(InvalidRequestError, match="only a batch validating or in progress"):
            batches.cancel(batch["id"], "acme")

        bad = files.create("bad.jsonl", "batch", jsonl(2) + b"not json\n", "acme")["id"]
        with pytest.raises(InvalidRequestError, match="line 3: not a JSON object"):
            batches.create({"input_file_id": bad, "endpoint": "/v1/completions"}, "acme")
        wrong = files.create("x.jsonl", "batch", jsonl(1, "/v1/embeddings"), "acme")["id"]
        with pytest.raises(InvalidRequestError, match="line 1: url must be the batch's endpoint"):
            batches.create({"input_file_id": wrong, "endpoint": "/v1/completions"}, "acme")
        with pytest.raises(InvalidRequestError, match="completion_window must be '24h'"):
            batches.create({"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"},
                           "acme")
        with pytest.raises(NotFoundError):
            batches.create({"input_file_id": file_id, "endpoint": "/v1/completions"}, "other-tenant")
        with pytest.raises(InvalidRequestError, match="purpose must be one of"):
            files.create("x", "fine-tune", b"x", "acme")
        listed = files.list("acme", purpose="batch")["data"]
        assert file_id in [f["id"] for f in listed] and {f["purpose"] for f in listed} == {"batch"}
        assert files.list("other-tenant")["data"] == []

    asyncio.run(main())


def test_files_expire_as_openai_says(tmp_path, monkeypatch):
    """`expires_after` sets a file's `expires_at`; a "batch" upload expires after 30 days unless told
    otherwise, a "user_data" one is kept; an expired file is gone from every call, and the next
    upload or listing deletes its bytes; bad `expires_after` values are refused naming the field;
    listing pages with `limit` / `after`."""
    import time

    from router.ingress import files as files_module
    from router.ingress.files import expiry_seconds

    store = FileStore(str(tmp_path), 1 << 20)
    now = [1_000_000.0]
    monkeypatch.setattr(files_module.time, "time", lambda: now[0])
    hour = store.create("a.jsonl", "batch", b"x", "t", expires_after_s=3600)
    month = store.create("b.jsonl", "batch", b"y", "t")
    kept = store.create("c.txt", "user_data", b"z", "t")
    assert hour["expires_at"] == hour["created_at"] + 3600
    assert month["expires_at"] == month["created_at"] + 30 * 86400 and kept["expires_at"] is None
    page = store.list("t", limit=2, order="asc")
    assert [f["id"] for f in page["data"]] == sorted([hour["id"], month["id"], kept["id"]])[:2]   # one created_at
    assert page["has_more"] and len(store.list("t", after=page["last_id"], order="asc")["data"]) == 1
    now[0] += 3600
    with pytest.raises(NotFoundError):
        store.get(hour["id"], "t")
    assert {f["id"] for f in store.list("t")["data"]} == {month["id"], kept["id"]}
    assert not (tmp_path / hour["id"]).exists()               # purged by the listing
    now[0] += 30 * 86400
    store.create("d.jsonl", "user_data", b"w", "t")           # an upload purges too
    assert not (tmp_path / month["id"]).exists() and (tmp_path / kept["id"]).exists()
    assert time.time() == now[0]
    for bad, what in (({"anchor": "last_active_at", "seconds": 3600}, "anchor must be 'created_at'"),
                      ({"anchor": "created_at", "seconds": 60}, "from 3600"),
                      ({"anchor": "created_at", "seconds": 31 * 86400}, "2592000"),
                      ({"anchor": "created_at", "seconds": "soon"}, "seconds must be an integer"),
                      ({"seconds": 3600}, "must be"), (3600, "must be")):
        with pytest.raises(InvalidRequestError, match=what) as e:
            expiry_seconds(bad, "expires_after")
        assert e.value.param == "expires_after"
    assert expiry_seconds({"anchor": "created_at", "seconds": "7200"}, "expires_after") == 7200   # a form field
