"""Structured outputs (engine/sample/structured_output.py): sampled JSON that validates against its schema,
regex and choice constraints, greedy constrained output equal to transformers' greedy output under
the same grammar's mask (applied by an independent logits processor here), constrained and
unconstrained requests in one batch, and clear errors. The HTTP side is in tests/serving/test_chat.py."""
from __future__ import annotations

import json
import os
import re
import sys

import jsonschema
import pytest
import torch
from helpers import REPO, hf_model

from engine import LLM, SamplingParams
from records.sampling_params import StructuredOutputsParams

sys.path.append(os.path.join(REPO, "benchmarks"))
from structured import SCHEMAS  # benchmarks/structured.py (appended to the path: it must not shadow the packages)


@pytest.fixture(scope="module")
def embedded() -> LLM:
    return LLM(None, max_model_len=1024, max_num_seqs=32)


def chat(llm: LLM, text: str) -> str:
    return llm.llm_engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True)


def test_sampled_json_validates_against_its_schema(embedded):
    """Ten schemas (nested objects, arrays, enums, const, anyOf, bounds, required fields), three
    requests each sampled at temperature 0.8 in one batch with unconstrained requests beside them:
    every constrained output parses and validates; the unconstrained ones run as usual."""
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for j in range(3):
            prompts.append(chat(embedded, f"Reply in JSON. Case {i}.{j}."))
            params.append(SamplingParams(temperature=0.8, seed=100 * i + j, max_tokens=200,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    free = [chat(embedded, "Say something."), chat(embedded, "Count to five.")]
    outs = embedded.generate(prompts + free, params + [SamplingParams(temperature=0.8, seed=7, max_tokens=16)] * 2,
                             use_tqdm=False)
    for k, out in enumerate(outs[:len(prompts)]):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (k, text)
        jsonschema.validate(json.loads(text), SCHEMAS[k // 3])
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs[len(prompts):])
    pool = embedded.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_regex_choice_and_json_object(embedded):
    prompt = chat(embedded, "Give a short code, or a JSON object with one short field.")
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=200)
    cases = {"regex": r"[A-Z]{2}-\d{3}", "choice": ["alpha", "beta", "gamma (c)"], "json_object": True}
    for kind, value in cases.items():
        params = [SamplingParams(**{**vars(sampled), "seed": s, "structured_outputs": {kind: value}}) for s in range(4)]
        outs = [o.outputs[0] for o in embedded.generate([prompt] * 4, params, use_tqdm=False)]
        assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
        for text in (o.text for o in outs):
            if kind == "regex":
                assert re.fullmatch(value, text), text
            elif kind == "choice":
                assert text in value, text
            else:
                assert isinstance(json.loads(text), dict), text


class MaskProcessor:
    """An HF logits processor applying xgrammar's mask for one sequence (xgrammar's own apply)."""

    def __init__(self, compiled, vocab_size: int, prompt_len: int) -> None:
        import xgrammar as xgr

        self.xgr, self.matcher = xgr, xgr.GrammarMatcher(compiled)
        self.vocab_size, self.prompt_len = vocab_size, prompt_len
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        if self.matcher.is_terminated():
            return scores
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(scores, self.bitmask, vocab_size=self.vocab_size)
        return scores


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_greedy_constrained_equals_transformers_under_the_same_mask(tiny_llama, speculative):
    """fp32, a tiny random model: the engine's greedy tokens under a grammar equal transformers'
    greedy tokens with the same compiled grammar's mask applied by xgrammar's own kernel; with
    n-gram speculative decoding too, where each verification row gets the mask of the state after
    the proposals before it, and proposals the grammar refuses are never verified."""
    from transformers import LogitsProcessorList

    from engine.sample.structured_output import compiler_for
    from records.model_source import resolve_model

    path, _, config = resolve_model(tiny_llama)
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, speculative_config=speculative)
    model = hf_model(tiny_llama)
    specs = [StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "minItems": 40}),
             StructuredOutputsParams(regex=r"(the|a|an) [a-z ]{60,80}"),
             StructuredOutputsParams(grammar='root ::= ("yes" | "no") " " [0-9]+ ", " root')]
    prompts = [[1, 504, 3458, 282], [1, 9690, 198], list(range(100, 140))]
    params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=s) for s in specs]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compiler = compiler_for(path, None, config.vocab_size)
    for ids, spec, out in zip(prompts, specs, got):
        processor = MaskProcessor(compiler.compile(spec), config.vocab_size, len(ids))
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, logits_processor=LogitsProcessorList([processor]))
        tokens = out.outputs[0].token_ids           # up to the grammar's forced EOS, if it ended
        assert len(tokens) >= 8 and tokens == want[0, len(ids):len(ids) + len(tokens)].tolist(), spec.kind
    if speculative is not None:                      # the grammars' repeats were proposed and taken
        stats = llm.llm_engine.spec_stats
        assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_sampled_constrained_with_speculative_decoding(tiny_llama):
    """Sampled (temperature 0.8) under n-gram speculative decoding, beside unconstrained requests:
    every constrained output is complete and valid, and every block comes back."""
    schema = {"type": "object", "properties": {
        "tag": {"enum": ["aa", "bb", "cc"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 4, "maxItems": 12},
        "s": {"type": "string", "maxLength": 6}}, "required": ["tag", "n", "xs", "s"], "additionalProperties": False}
    llm = LLM(tiny_llama, dtype="float32", max_model_len=512, speculative_config=NGRAM)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=300, structured_outputs={"json": schema})
              for i in range(6)] + [SamplingParams(temperature=0.8, seed=9, max_tokens=30)] * 2
    outs = llm.generate([{"prompt_token_ids": [1, 50 + i, 60, 70]} for i in range(8)], params, use_tqdm=False)
    for out in outs[:6]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_start_after_leaves_the_output_free_until_its_tokens(tiny_llama, speculative):
    """structured_outputs.start_after (what a reasoning parser sets to `</think>`): greedy output is
    the unconstrained output up to the first place it holds those tokens, then exactly what the
    constraint gives a prompt that ends there; tokens that never come leave it all free. With n-gram
    speculation too, whose proposals may complete the marker."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, speculative_config=speculative)
    prompt, regex = [1, 504, 3458, 282], r"(the|a|an) [a-z ]{30,40}"
    free = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40),
                        use_tqdm=False)[0].outputs[0].token_ids
    cut = next(k for k in range(4, 12) if tuple(free[k - 2:k]) not in zip(free[:k - 2], free[1:k - 1]))
    marker = tuple(free[cut - 2:cut])                  # first seen ending at `cut`
    never = next(t for t in range(1000, 2000) if t not in free)
    specs = [{"regex": regex, "start_after": marker}, {"regex": regex, "start_after": [never]}, {"regex": regex}]
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": prompt}] * 2 + [{"prompt_token_ids": prompt + free[:cut]}],
        [SamplingParams(temperature=0, max_tokens=40 if i < 2 else 40 - cut, structured_outputs=s)
         for i, s in enumerate(specs)], use_tqdm=False)]
    assert got[0][:cut] == free[:cut] and got[0][cut:] == got[2], (free, got)
    assert re.fullmatch(regex, llm.get_tokenizer().decode(got[2], skip_special_tokens=True)) and got[0] != free
    assert got[1] == free
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    with pytest.raises(ValueError, match=r"structured_outputs.start_after must be token ids in \[0, "):
        llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "a", "start_after": [10 ** 9]}))


def test_start_after_with_proposals(tiny_llama):
    """Constraints.apply_proposals under start_after: before the marker the verification rows stay
    unmasked and only the proposals before the one that completes it are verified (what follows it
    is sampled under the constraint, a step later); once the output holds it, the rows are masked."""
    from transformers import AutoTokenizer

    from engine.sample.structured_output import Constraints
    from records.model_source import resolve_model

    path, _, config = resolve_model(tiny_llama)
    constraints = Constraints(path, None, config.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    spec = StructuredOutputsParams(choice=["yes", "no"], start_after=(7, 8))
    rows = torch.zeros(5, config.vocab_size)
    assert constraints.apply_proposals(rows, "a", spec, [1, 2, 7], [8, 3, 4, 5]) == 0
    assert constraints.apply_proposals(rows, "a", spec, [1, 2], [7, 8, 3, 4]) == 1
    assert constraints.apply_proposals(rows, "a", spec, [1, 2], [7, 3, 4, 5]) == 4
    assert torch.isfinite(rows).all()
    assert constraints.apply_proposals(rows, "a", spec, [1, 2, 7, 8], [3, 4, 5, 6]) == 0
    allowed = [tokenizer.decode([t]) for t in torch.isfinite(rows[0]).nonzero().flatten().tolist()]
    assert 0 < len(allowed) < 10 and all("yes".startswith(t) or "no".startswith(t) for t in allowed), allowed
    assert torch.isfinite(rows[1:]).all()


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 20},                                           # chunked prefill
    {"num_kv_blocks": 14, "max_num_batched_tokens": 64, "preemption_mode": "recompute"},
    {"num_kv_blocks": 14, "max_num_batched_tokens": 64, "preemption_mode": "swap"},
], ids=["chunked-budget20", "preempt-recompute", "preempt-swap"])
def test_constraints_survive_chunking_preemption_and_n(tiny_llama, engine_args):
    """Greedy constrained outputs under chunked prefill or preemption (the matcher is kept, or
    rebuilt and replayed when the output was recomputed), with and without speculation, equal those
    of an engine with room to spare; n=2 samples beside them are valid; the prefix cache serves
    the shared prompt head. Every block comes back."""
    specs = [{"json": {"type": "array", "items": {"type": "integer"}, "minItems": 12}},
             {"regex": r"(the|a|an) [a-z ]{40,50}"},
             {"grammar": 'root ::= ("yes" | "no") " " [0-9]+ ", " root'}]
    head = list(range(300, 330))                                # shared by all: prefix-cache hits
    prompts = [{"prompt_token_ids": head + [400 + i, 500 + i, 600 + i]} for i in range(9)]
    greedy = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=specs[i % 3]) for i in range(9)]
    sampled = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=40, structured_outputs=specs[1])

    def outputs(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompts + [prompts[0]], greedy + [sampled], use_tqdm=False)
        pool = llm.llm_engine.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        for text in (c.text for c in outs[-1].outputs):
            assert re.fullmatch(specs[1]["regex"], text), text
        return [o.outputs[0].token_ids for o in outs[:-1]]

    base = dict(dtype="float32", max_model_len=200)
    want = outputs(LLM(tiny_llama, **base))
    for speculative in (None, NGRAM):
        llm = LLM(tiny_llama, **base, **engine_args, speculative_config=speculative)
        assert outputs(llm) == want, speculative
        stats = llm.llm_engine.stats()
        assert stats.prefix_cache_hits > 0
        if "num_kv_blocks" in engine_args:
            assert stats.num_preemptions > 0


def test_bad_constraints_name_the_field(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256)
    bad = [({"json": {"type": "objectx"}}, "structured_outputs.json cannot be compiled: .*objectx"),
           ({"regex": "(unclosed"}, "structured_outputs.regex cannot be compiled"),
           ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar cannot be compiled"),
           ({"json": "{not json"}, "structured_outputs.json must be a JSON schema"),
           ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
           ({"json": {}, "regex": "a"}, "structured_outputs must be exactly one of"),
           ({"jsn": {}}, "structured_outputs must be fields among")]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate(["hi"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert llm.generate(["hi"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_bounded_json_strings_refuse_control_characters(tiny_llama):
    """A string with maxLength (in a JSON schema, and in a tool's parameters under a structural tag)
    takes characters and refuses a raw control character, as JSON does (xgrammar 0.2.9's own rule
    for it let U+0015 through: engine/sample/structured_output.py `_compile_json`)."""
    import xgrammar as xgr

    from engine.sample.structured_output import compiler_for
    from engine.text.tool_calls import ToolFormat

    compiler = compiler_for(tiny_llama, None, 256)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    tag = ToolFormat("hermes", False).constraint(tools, "required", True)
    for spec, head in [(StructuredOutputsParams(json=params), '{"city": "'),
                       (StructuredOutputsParams(structural_tag=tag), '<tool_call>\n{"name": "get_weather", '
                                                                     '"arguments": {"city": "')]:
        grammar = compiler.compile(spec)
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(head + "Paris"), head
        assert not matcher.accept_string("\x15")
        assert matcher.accept_string('"}')
