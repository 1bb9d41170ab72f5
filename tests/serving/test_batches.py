"""The Files and Batch APIs on the shared apps (tests/serving/conftest.py) through the official
`openai` client's `files` and `batches` calls, unchanged: upload, list, retrieve, content, delete,
expiry;
a chat batch and an embeddings batch whose output bodies equal the same requests sent directly
(greedy); progress counts; a bad input line named; one tenant never sees another's files or
batches. Restart survival is tests/unit/test_batches.py's (the runner without Ray)."""
from __future__ import annotations

import io
import json
import time

import openai
import pytest

from serving.apps import TENANT_KEY

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray


def upload(client: openai.OpenAI, lines: list[dict]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def test_batches_answer_as_direct_requests(server, client):
    model = server["model"]
    chats = [{"model": model, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 6 + i,
              "temperature": 0} for i in range(8)]
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(chats)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": model, "messages": [{"role": "user", "content": "x"}], "temperature": -1}})
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    assert file_id in [f.id for f in client.files.list(purpose="batch").data]
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    embeds = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
               "body": {"model": model, "input": text, "encoding_format": "float"}}
              for i, text in enumerate(["first text", "second text"])]
    embed_batch = client.batches.create(input_file_id=upload(client, embeds), endpoint="/v1/embeddings",
                                        completion_window="24h")
    done = wait_done(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 8, 1)
    out = {r["custom_id"]: r for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    for i, body in enumerate(chats):
        direct = client.chat.completions.create(**body)
        got = out[f"chat-{i}"]["response"]
        assert got["status_code"] == 200
        assert got["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert got["body"]["usage"]["completion_tokens"] == direct.usage.completion_tokens
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"] and errors[0]["response"]["status_code"] == 400
    assert "temperature" in errors[0]["response"]["body"]["error"]["message"]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    done = wait_done(client, embed_batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    vectors = {r["custom_id"]: r["response"]["body"]["data"][0]["embedding"]
               for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    direct = client.embeddings.create(model=model, input="first text", encoding_format="float").data[0].embedding
    assert max(abs(a - b) for a, b in zip(vectors["e0"], direct)) <= 1e-5
    assert batch.id in [b.id for b in client.batches.list(limit=10).data]

    # A bad line fails the create, naming it; another tenant sees nothing of this one's.
    bad = upload(client, [lines[0], {**lines[1], "custom_id": "chat-0"}])
    with pytest.raises(openai.BadRequestError, match="line 2: custom_id 'chat-0' is used twice"):
        client.batches.create(input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    other = openai.OpenAI(base_url=f"{server['base']}/v1", api_key=TENANT_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    assert other.files.list().data == []
    assert client.files.delete(bad).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(bad)

    # Expiry as OpenAI's: a batch upload 30 days by default, `expires_after` as the client sends it,
    # a bad one a 400 naming it; a batch's outputs take its `output_expires_after`.
    made = client.files.retrieve(file_id)
    assert made.expires_at == made.created_at + 30 * 86400
    data = io.BytesIO(json.dumps(embeds[0]).encode() + b"\n")
    hour = client.files.create(file=("e.jsonl", data), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600
    with pytest.raises(openai.BadRequestError, match="expires_after.seconds must be an integer from 3600"):
        client.files.create(file=("e.jsonl", io.BytesIO(b"{}")), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 10})
    short = client.batches.create(input_file_id=hour.id, endpoint="/v1/embeddings", completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    out = client.files.retrieve(wait_done(client, short.id).output_file_id)
    assert out.expires_at == out.created_at + 7200
