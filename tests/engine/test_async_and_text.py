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
from engine.text.tokenizer import IncrementalDetokenizer


def test_an_abort_that_overtakes_its_submit_leaves_nothing_on_the_channel(tiny_llama):
    """A replica's abort and submit of one request are separate calls and may arrive in either
    order. Abort first: the request never runs and its channel does not wait for it (it was left
    counted there, and the abort storm's accounting found it); the other requests run."""
    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config

    async def main():
        replica = EngineReplica(engine_config(tiny_llama, dtype="float32", max_model_len=128), "r")
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        replica.abort("x")
        replica.submit("ingress", "x", [5, 6, 7], params)
        replica.submit("ingress", "y", [5, 6, 7], params)
        box = replica._outboxes["ingress"]
        for _ in range(500):
            await asyncio.sleep(0.01)
            if not box.request_ids:
                break
        assert replica.leaks() is None
        assert [d.request_id for d in box.deltas if d.finished] == ["y"]
        await replica.engine.shutdown()

    asyncio.run(main())


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
    assert engine.stats().num_requests_running == 0


def test_work_that_arrives_while_a_call_runs_between_steps_is_not_lost(tiny_llama):
    """An idle engine's loop runs a call between steps (an encode replica's images, a peer's
    lease); a second call and a request that arrive while it runs are taken up after it, not left
    waiting for a wake-up the loop cleared (an encode pool's concurrent chats hung on that)."""
    import threading

    engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32")
    running, release = threading.Event(), threading.Event()

    def slow() -> str:
        running.set()
        release.wait(60)
        return "slow"

    async def main():
        first = asyncio.ensure_future(engine.between_steps(slow))
        while not running.is_set():
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(engine.between_steps(lambda: "second"))
        stream = engine.generate("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        answer = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.1)
        release.set()
        # (a generous bound: only a lost wake-up reaches it)
        assert await asyncio.wait_for(asyncio.gather(first, second), 120) == ["slow", "second"]
        assert (await asyncio.wait_for(answer, 120)).request_id == "r"
        async for _ in stream:
            pass
        await engine.shutdown()
    asyncio.run(main())


def test_an_engine_that_dies_sends_each_token_once_then_the_error(tiny_llama):
    """A step raises mid-stream: the consumer gets every token of the steps before exactly once
    (the last step's outputs went out while the failing step ran: once, not again with the error),
    then EngineDeadError. A migrated stream resumes after exactly those tokens."""
    from records.errors import EngineDeadError

    engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32")
    step, calls = engine.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("a worker died")
        return step()

    engine.engine.step = failing_step
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="delta")
    want = LLM(tiny_llama, dtype="float32").generate([{"prompt_token_ids": list(range(10, 40))}], params,
                                                     use_tqdm=False)[0].outputs[0].token_ids

    async def main() -> list[int]:
        got = []
        with pytest.raises(EngineDeadError):
            async for out in engine.generate("a", list(range(10, 40)), params):
                got += out.outputs[0].token_ids
        return got

    assert asyncio.run(main()) == want[:5]


def test_async_constraints_compile_off_the_loop(tiny_llama):
    """A constrained request compiles on the grammar thread while an unconstrained one streams; its
    output follows the grammar; one that cannot compile raises ValueError before any output; one
    aborted while compiling never starts. Every block comes back."""
    import re

    engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32")
    regex = r"[a-z]{3}-[0-9]{2}"

    async def main():
        free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=30, structured_outputs={"regex": regex})

        async def last(rid, ids, params):
            outs = [out async for out in engine.generate(rid, ids, params)]
            return outs[-1].outputs[0].text
        texts = await asyncio.gather(last("free", [5, 6, 7], free), last("re", [8, 9], constrained))
        assert re.fullmatch(regex, texts[1]), texts[1]
        with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled"):
            await last("bad", [1, 2], SamplingParams(structured_outputs={"regex": "(unclosed"}))
        stream = engine.generate("gone", [3, 4], SamplingParams(structured_outputs={"regex": "[a-z]{4,8}x"}))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        task.cancel()                       # aborted while (or right after) its grammar compiles
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if not engine.engine.has_unfinished_requests() and not engine._compiling:
                break
        await engine.shutdown()
    asyncio.run(main())
    assert engine.stats().num_requests_running == 0
    pool = engine.engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_incremental_detokenizer_waits_for_whole_characters(smol_tokenizer):
    text = "Le café coûte 3€ — 東京タワー 🚀🚀 done."
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=True)
    deltas = [detok.update([t]) for t in ids]
    assert "".join(deltas) == smol_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)              # a split character was held back


@pytest.mark.parametrize("skip_special", [True, False])
def test_detokenizer_reads_the_rust_tokenizer_with_the_same_text(smol_tokenizer, skip_special):
    """The fast tokenizer's own decode stands in for transformers' wrapper: the same deltas for
    random token streams (special tokens, split characters and prompt context included)."""
    import random

    rng = random.Random(0)
    vocab = len(smol_tokenizer)
    assert IncrementalDetokenizer(smol_tokenizer, [])._backend is not None
    for _ in range(50):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        out = [rng.randrange(vocab) for _ in range(30)]
        fast = IncrementalDetokenizer(smol_tokenizer, prompt, skip_special_tokens=skip_special)
        plain = IncrementalDetokenizer(smol_tokenizer, prompt, skip_special_tokens=skip_special)
        plain._backend = None
        assert [fast.update([t]) for t in out] == [plain.update([t]) for t in out]


def test_chat_template_options(smol_tokenizer):
    """vLLM's chat extras: the generation prompt by default; continue_final_message leaves the
    assistant's last message open; chat_template_kwargs reach the template; conflicts, a last
    message not the assistant's and kwargs that would override the request's own are ValueErrors."""
    import copy

    from engine.text.tokenizer import apply_chat_template

    tok = smol_tokenizer
    conv = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}]
    asked = tok.decode(apply_chat_template(tok, conv[:1]))
    assert asked.endswith("Capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(apply_chat_template(tok, conv, add_generation_prompt=False, continue_final_message=True)
                      ).endswith("<|im_start|>assistant\nIt is")
    for kwargs, says in (({"continue_final_message": True}, "add_generation_prompt=false"),
                         ({"add_generation_prompt": False, "continue_final_message": True, "messages": conv[:1]},
                          "last message to be the assistant's"),
                         ({"template_kwargs": {"tools": []}}, "chat_template_kwargs must not set")):
        with pytest.raises(ValueError, match=says):
            apply_chat_template(tok, kwargs.pop("messages", conv), **kwargs)
    custom = copy.copy(tok)
    custom.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tok.decode(apply_chat_template(custom, conv[:1], template_kwargs={"greeting": "Hi! "})) == (
        "Hi! Capital of France?")


def test_embedded_model_matches_transformers_and_knows_paris(embedded_gguf_tensors):
    """Greedy chat on the embedded GGUF model token-identical to transformers' copy of it (its model
    class holding the tensors its GGUF loader dequantizes, as `from_pretrained(gguf_file=...)` builds
    it), and its embeddings equal transformers' pooled hidden states."""
    import copy
    import os

    from transformers import AutoModelForCausalLM

    from records.model_source import embedded_model_path

    llm = LLM(dtype="float32")
    tok = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in
                     ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    path = embedded_model_path()
    config, tensors = embedded_gguf_tensors
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()
    # The file holds no lm_head: the model ties it to the embeddings, as from_pretrained does.
    assert hf.load_state_dict(tensors, strict=False).missing_keys == ["lm_head.weight"]
    assert hf.config.tie_word_embeddings
    hf.tie_weights()
    for conv, out in zip(conversations, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    # Its embeddings (last token after the final norm, normalized: the model's pooling) within 1e-4
    # of transformers' (tests/engine/test_embeddings.py has the rest of the embedding tests).
    from records.model_source import model_pooling

    assert model_pooling(os.path.dirname(path), os.path.basename(path)) == ("last", True)
    texts = ["The capital of France is Paris.", "Embeddings place similar texts near each other."]
    for text, emb in zip(texts, llm.embed(texts, use_tqdm=False)):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        assert (torch.tensor(emb.embedding) - want).abs().max().item() <= 1e-4


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


def test_an_engine_loads_its_tokenizer_without_resolving_the_model_config_again(tiny_llama, tmp_path):
    """An engine hands AutoTokenizer the config it resolved (as a replica gets it: frozen, pickled):
    the tokenizer is the one AutoTokenizer loads alone (its ids, specials, template), and the process
    never imports transformers' config class for the model (~1.5 s of CPU per replica). A tokenizer
    config that names no class gets no config (AutoTokenizer would pick its class by the config's)."""
    import pickle

    from records.config_resolution import engine_config

    cfg = tmp_path / "cfg.pkl"
    cfg.write_bytes(pickle.dumps(engine_config(tiny_llama, dtype="float32")))
    code = (
        "import pickle, sys\n"
        "from transformers import AutoTokenizer\n"
        "from engine.text.tokenizer import _known_config, shared_tokenizer\n"
        f"mc = pickle.load(open({str(cfg)!r}, 'rb')).model_config\n"
        "ours = shared_tokenizer(mc.model, mc.gguf_file, mc.hf_config)\n"
        "assert 'transformers.models.llama.configuration_llama' not in sys.modules, 'resolved again'\n"
        "theirs = AutoTokenizer.from_pretrained(mc.model)\n"
        "text = 'Hello <s> world,\\n\\n  caf\\u00e9 \\U0001f600 12345'\n"
        "assert type(ours) is type(theirs) and ours(text)['input_ids'] == theirs(text)['input_ids']\n"
        "assert ours.all_special_ids == theirs.all_special_ids and ours.chat_template == theirs.chat_template\n"
        "assert ours.decode(ours(text)['input_ids']) == theirs.decode(theirs(text)['input_ids'])\n"
        f"assert _known_config({str(tmp_path)!r}, mc.hf_config) == {{}}\n"
        "print('ok')\n")
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 2048}')
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_kv_event_long_poll_answers_only_with_events(tiny_llama):
    """The replica's KV-event long poll answers once a step has produced events (the prompt's full
    blocks) and otherwise waits out its timeout: decode steps that fill no block wake no router."""
    import time

    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config
    from records.kv_events import BlockStored

    async def main() -> None:
        replica = EngineReplica(engine_config(tiny_llama, dtype="float32", num_kv_blocks=64,
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


def test_output_kinds_delta_and_final_only_add_up_to_cumulative(tiny_llama):
    """The same requests (n=2 stopped by a stop string, and one with logprobs) run as "cumulative",
    "delta" and "final_only": the deltas concatenate to the cumulative outputs, each choice's finish
    goes out exactly once, and final_only returns nothing before the end. With stream_interval 4
    (vLLM's --stream-interval) the deltas add up the same, fewer: after a request's first, each
    carries 4 new tokens of a choice or a choice's finish."""
    llm = LLM(tiny_llama, dtype="float32")
    engine = llm.llm_engine
    prompts = [list(range(20, 45)), list(range(300, 310))]
    text = llm.generate([{"prompt_token_ids": prompts[0]}],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]          # met mid-way by the greedy choice
    # Two seeded choices, the first ended early by a token that only it draws: they finish apart.
    sampled = dict(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    first, second = (c.token_ids for c in llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(**sampled),
                                                       use_tqdm=False)[0].outputs)
    only_first = next(t for t in first[2:12] if t not in second and t not in first[:first.index(t)])
    prompts.append(prompts[0])
    base = [dict(n=2, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
            dict(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
            dict(sampled, stop_token_ids=[only_first])]

    def run(kind, tag=None):
        for i, (p, kw) in enumerate(zip(prompts, base)):
            engine.add_request(f"{tag or kind}-{i}", None, p, SamplingParams(**kw, output_kind=kind))
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        return outs

    cumulative = {o.request_id.split("-")[1]: o for o in run("cumulative") if o.finished}
    finals = run("final_only")
    assert all(o.finished for o in finals) and len(finals) == 3
    deltas = run("delta")
    engine.output.stream_interval = 4
    spaced = run("delta", "spaced")
    engine.output.stream_interval = 1
    assert len(spaced) < len(deltas) / 2
    for i, full in cumulative.items():
        final = next(o for o in finals if o.request_id == f"final_only-{i}")
        assert [(c.text, c.token_ids) for c in final.outputs] == [(c.text, c.token_ids) for c in full.outputs]
        mine = [o for o in deltas if o.request_id == f"delta-{i}"]
        assert mine[-1].finished and not any(o.finished for o in mine[:-1])
        few = [o for o in spaced if o.request_id == f"spaced-{i}"]
        for c in full.outputs:
            parts = [d for o in few for d in o.outputs if d.index == c.index]
            assert [t for d in parts for t in d.token_ids] == c.token_ids and "".join(d.text for d in parts) == c.text
        assert all(any(len(d.token_ids) >= 4 or d.finish_reason for d in o.outputs) for o in few[1:])
        for c in full.outputs:
            parts = [d for o in mine for d in o.outputs if d.index == c.index]
            assert "".join(d.text for d in parts) == c.text
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            assert [d.finish_reason for d in parts if d.finish_reason] == [c.finish_reason]
            if c.logprobs is not None:
                assert [lp for d in parts for lp in d.logprobs] == c.logprobs
    assert any(c.finish_reason == "stop" and c.stop_reason == stop for c in cumulative["0"].outputs)
    apart = cumulative["2"].outputs
    assert apart[0].stop_reason == only_first and len(apart[0].token_ids) < len(apart[1].token_ids) == 24
    engine.check_no_leaks()


def _spaced_special_tokens_tokenizer():
    """A fast tokenizer whose decoder (WordPiece's) puts a space before every token, special ones
    included: where vLLM's spaces_between_special_tokens changes the text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_no_spaces_between_special_tokens():
    """vLLM's spaces_between_special_tokens=false (with skip_special_tokens=false): a special token
    that follows another is its bare text; the first, and ordinary tokens, as the decoder writes them;
    true (the default) leaves the decoder's text. The engine's detokenizer takes the option from the
    request's SamplingParams."""
    from engine.output_processor import OutputProcessor
    from records.request import Request

    tok = _spaced_special_tokens_tokenizer()
    ids = tok.encode("hello <a><b> world <b>", add_special_tokens=False)
    assert ids == [1, 3, 4, 2, 4]

    def deltas(**kwargs) -> list[str]:
        detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=False, **kwargs)
        out = [detok.update([t]) for t in ids]
        assert detok.output_text == "".join(out)
        return out

    assert deltas() == [" hello", " <a>", " <b>", " world", " <b>"]
    assert deltas(spaces_between_special_tokens=False) == [" hello", " <a>", "<b>", " world", " <b>"]
    together = IncrementalDetokenizer(tok, [1], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert together.update(ids) == " hello <a><b> world <b>"       # several tokens at once: the same text
    processor = OutputProcessor(tok, lambda ids, status: None)
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        request = Request("r", [1], params, eos_token_ids=frozenset(), block_size=16, max_tokens=4)
        assert (processor._detokenizer(request)._special is None) == spaces


def test_chat_template_special_tokens_and_documents(smol_tokenizer):
    """vLLM's chat add_special_tokens: the tokenizer's own (here a BOS its post-processor adds) on top
    of the template's, off by default; `documents` reach a template that renders them."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from engine.text.tokenizer import apply_chat_template

    tok = copy.deepcopy(smol_tokenizer)
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    conv = [{"role": "user", "content": "Capital of France?"}]
    plain = apply_chat_template(tok, conv)
    assert plain == apply_chat_template(smol_tokenizer, conv) and plain[0] != 0
    assert apply_chat_template(tok, conv, add_special_tokens=True) == [0, *plain]
    tok.chat_template = "{% for d in documents %}[{{ d['title'] }}]{% endfor %}{{ messages[0]['content'] }}"
    docs = [{"title": "Paris", "text": "..."}, {"title": "Lyon", "text": "..."}]
    assert tok.decode(apply_chat_template(tok, conv, documents=docs)) == "[Paris][Lyon]Capital of France?"
