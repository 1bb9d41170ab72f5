"""/v1/embeddings on the shared apps (tests/serving/conftest.py) through the official `openai`
client: the vectors equal transformers' pooled hidden states of the tiny model (last token, as its
config says, normalized) within 1e-4 in fp32, as base64 (the client's default) and as floats; on the
disaggregated app they run whole on the prefill pool; bad fields are 400s naming them."""
from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from serving.apps import auth, metric

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray


def test_embeddings_match_transformers(server, client, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    texts = ["The capital of France is Paris.", "A second, longer text to embed beside the first one."]

    def reference(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=0)

    model = server["model"]
    pd = openai.OpenAI(base_url=f"{server['base']}/pd/v1", api_key="none", max_retries=0, timeout=120)
    before = metric(httpx.get(f"{server['base']}/pd/metrics").text, "pdserve:router_decisions_total",
                    reason="embedding_on_prefill")
    worst = 0.0
    # The client's default asks for base64 and decodes it itself.
    for c, fmt in ((client, None), (client, "float"), (pd, "float")):
        out = c.embeddings.create(model=model, input=texts, **({"encoding_format": fmt} if fmt else {}))
        assert [d.index for d in out.data] == [0, 1] and out.model == model
        assert out.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts) == out.usage.total_tokens
        for text, d in zip(texts, out.data):
            worst = max(worst, (torch.tensor(d.embedding) - reference(tok.encode(text))).abs().max().item())
    asked = client.embeddings.create(model=model, input=texts[0], encoding_format="base64").data[0].embedding
    raw = base64.b64decode(asked)
    decoded = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    worst = max(worst, (decoded - reference(tok.encode(texts[0]))).abs().max().item())
    ids = tok.encode(texts[0])
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float").data[0].embedding
    worst = max(worst, (torch.tensor(by_ids) - reference(ids)).abs().max().item())
    assert worst <= 1e-4, f"max abs diff {worst:.2e}"
    after = metric(httpx.get(f"{server['base']}/pd/metrics").text, "pdserve:router_decisions_total",
                   reason="embedding_on_prefill")
    assert after - before == 2

    for body, field in (({"input": ""}, "input"), ({"input": []}, "input"),
                        ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": "x", "encoding_format": "hex"},
                                                                           "encoding_format"),
                        ({"input": [10 ** 9]}, "input"), ({"input": "x", "bogus": 1}, "bogus")):
        r = httpx.post(f"{server['base']}/v1/embeddings", json={"model": model, **body}, headers=auth(), timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)
