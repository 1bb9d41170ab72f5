"""/v1/embeddings of the embedded model through the `openai` client against transformers, and what
an embedding costs beside generation.

    .venv/bin/python benchmarks/embeddings.py        # ~2 min on 2 cores

`pdserve serve` of the embedded model (SmolLM2-135M Q4_1 GGUF, fp32; or --model), one replica.
Reported: the max abs difference between `client.embeddings.create` (the client's default base64
and floats) and transformers' last-token hidden states after the final norm, normalized (the
model's pooling), over --texts texts; then the embeddings' throughput (texts per second, batches
of 16) alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from serve import served

TEXTS = ["The capital of France is Paris.", "Embeddings place similar texts near each other.",
         "A library at night, quiet and full of stories.", "def add(a, b):\n    return a + b",
         "Rain on the roof of an old train station."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an HF directory (default: the embedded GGUF)")
    ap.add_argument("--texts", type=int, default=64)
    args = ap.parse_args()
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from records.model_source import embedded_model_path

    path = args.model or embedded_model_path()
    directory, gguf = (os.path.dirname(path), os.path.basename(path)) if path.endswith(".gguf") else (path, None)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    texts = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(args.texts)]
    model_line = f"model: {args.model}\n" if args.model else ""
    with served(f"{model_line}pools: {{decode: {{replicas: 1}}}}\nengine: {{dtype: float32}}\n"
                f"serving: {{port: PORT}}\n") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        worst = 0.0
        for fmt in (None, "float"):
            for start in range(0, len(texts), 16):
                chunk = texts[start:start + 16]
                out = client.embeddings.create(model=model, input=chunk, **({"encoding_format": fmt} if fmt else {}))
                for text, d in zip(chunk, out.data):
                    with torch.no_grad():
                        hidden = hf.model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]
                    want = torch.nn.functional.normalize(hidden, dim=0)
                    worst = max(worst, (torch.tensor(d.embedding) - want).abs().max().item())
        t0 = time.perf_counter()
        for start in range(0, len(texts), 16):
            client.embeddings.create(model=model, input=texts[start:start + 16], encoding_format="float")
        took = time.perf_counter() - t0
        print(f"model {args.model or 'embedded SmolLM2-135M Q4_1'} (fp32): {len(texts)} texts, max abs diff "
              f"against transformers {worst:.2e} (base64 and float); {len(texts) / took:.1f} texts/s in "
              f"batches of 16")


if __name__ == "__main__":
    main()
