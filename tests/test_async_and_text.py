"""The async front (streaming, cancellation), incremental detokenization, the embedded model, the CLI,
and that transformers does not mistake our `kernels` package for the hub library of that name."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.tokenizer import IncrementalDetokenizer


def test_async_generate_streams_and_cancel_frees_blocks(tiny_llama):
    engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32")

    async def main():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        seen = []
        async for out in engine.generate("a", list(range(10, 40)), params):
            seen.append(len(out.outputs[0].token_ids))
        assert seen == list(range(1, 13)) and out.finished

        async def consume_some(rid):
            async for out in engine.generate(rid, list(range(50, 90)), SamplingParams(max_tokens=200, ignore_eos=True)):
                if len(out.outputs[0].token_ids) == 3:
                    break              # closing the iterator aborts the request
        concurrent = asyncio.gather(consume_some("b"), engine.generate("c", [1, 2, 3], params).__anext__())
        await concurrent
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in engine.generate("d", [1] * 10, SamplingParams(max_tokens=10**6)):
                pass
        for _ in range(50):            # the loop applies aborts between steps
            await asyncio.sleep(0.02)
            if not engine.engine.has_unfinished_requests():
                break
        await engine.shutdown()
    asyncio.run(main())
    assert engine.stats()["num_requests_running"] == 0


def test_incremental_detokenizer_waits_for_whole_characters(smol_tokenizer):
    text = "Le café coûte 3€ — 東京タワー 🚀🚀 done."
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=True)
    deltas = [detok.update([t]) for t in ids]
    assert "".join(deltas) == smol_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)              # a split character was held back


def test_embedded_model_matches_transformers_and_knows_paris():
    from transformers import AutoModelForCausalLM

    from engine.model_source import embedded_model_path
    import os

    llm = LLM(dtype="float32")
    tok = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in
                     ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    for conv, out in zip(conversations, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_cli_generate_and_errors(tiny_llama):
    ok = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "Hello", "--model", tiny_llama,
                         "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "Hello", "--model", "/nonexistent"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_transformers_does_not_take_our_kernels_package(tiny_llama):
    code = (
        "import kernels, engine, transformers\n"
        "from transformers.utils import import_utils as u\n"
        "assert kernels.__file__.endswith('kernels/__init__.py'), kernels.__file__\n"
        "avail = getattr(u, 'is_kernels_available', lambda: False)()\n"
        "assert avail is False, 'transformers thinks the hub kernels library is installed'\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({tiny_llama!r})\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_kv_event_long_poll_answers_only_with_events(tiny_llama):
    """The replica's KV-event long poll answers once a step has produced events (the prompt's full
    blocks) and otherwise waits out its timeout: decode steps that fill no block wake no router."""
    import time

    from cluster.replica import EngineReplica
    from engine.config import EngineConfig
    from engine.outputs import BlockStored

    async def main() -> None:
        replica = EngineReplica(EngineConfig.create(tiny_llama, dtype="float32", num_kv_blocks=64,
                                                    max_model_len=512))
        end, events = await replica.kv_event_records_since(0)
        assert events == []
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

        async def consume() -> None:       # 32 prompt tokens fill 2 blocks; 12 decodes fill none
            async for _ in replica.generate("a", [(7 * i) % 500 + 3 for i in range(32)], params):
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        end, events = await replica.kv_event_records_since(end, 30.0)
        assert [type(e) for e in events] == [BlockStored] and len(events[0].block_hashes) == 2
        start = time.monotonic()
        end2, events = await replica.kv_event_records_since(end, 0.5)
        assert events == [] and end2 == end and time.monotonic() - start >= 0.5
        await task
        replica.engine.engine.check_no_leaks()

    asyncio.run(main())
