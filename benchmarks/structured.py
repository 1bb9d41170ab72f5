"""What structured outputs cost: decode throughput of the embedded model with every request under a
JSON schema, with none, and with half of a batch constrained, at batch 1 and 16, the same prompts
and token counts (a schema that cannot end within `--tokens`: an array of at least 1,000 integers,
so every row decodes exactly `--tokens` tokens under its mask), alternating rounds, best of
`--rounds`; and the first request's grammar compile time (the compiler's tokenizer table built
once per process, then each new schema, and the structural tags that enforce a tool choice). With
`--validate N`, instead: N chat requests spread over the ten SCHEMAS below, sampled at temperature
0.8 in one batch, each output parsed and validated with `jsonschema`.

    python benchmarks/structured.py --batch 1,16 --tokens 64 --rounds 3
    python benchmarks/structured.py --validate 200
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Ten schemas of the kinds issue 27 names (nested objects, arrays, enums, const, anyOf, bounds,
# required fields); tests/engine/test_structured_output.py samples them too.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
     "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 12}},
     "required": ["ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 1,
     "maximum": 5}}, "required": ["status", "count"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"type": "object",
     "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["a", "b"]}},
     "required": ["id", "kind"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
     {"type": "string", "maxLength": 6}]}}, "required": ["answer"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 14},
     "population": {"type": "integer", "minimum": 0, "maximum": 99999}, "capital": {"type": "boolean"}},
     "required": ["city", "population", "capital"], "additionalProperties": False},
]

# Two function tools (tests/engine/test_tool_calls.py offers them too).
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999999}, "minItems": 1000}
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                          "age": {"type": "integer"}}, "required": ["name", "age"]}


def main() -> None:
    from engine import LLM, SamplingParams
    from engine.sample.structured_output import GrammarCompiler
    from engine.text.tokenizer import load_tokenizer
    from engine.text.tool_calls import ToolFormat
    from records.model_source import resolve_model
    from records.sampling_params import StructuredOutputsParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--validate", type=int, default=0, help="validate N sampled outputs instead of timing")
    args = parser.parse_args()
    if args.validate:
        validate(args.validate, args.dtype)
        return

    path, gguf_file, config = resolve_model(None)
    tokenizer = load_tokenizer(path, gguf_file)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, config.vocab_size)
    table_s = time.perf_counter() - start
    times = []
    for schema in (SMALL, SCHEMA):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - start)
    print(f"compiler's tokenizer table: {table_s:.2f} s; first compile of a small object schema: "
          f"{times[0] * 1e3:.1f} ms, of the long-array schema: {times[1] * 1e3:.1f} ms")
    fmt = ToolFormat.of(tokenizer)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    for name, tools, choice in [("required", TOOLS, "required"), ("named", TOOLS, {"type": "function", "function": {
            "name": "add"}}), ("auto with strict tools", strict, "auto")]:
        spec = StructuredOutputsParams(structural_tag=fmt.constraint(tools, choice, True))
        start = time.perf_counter()
        compiler.compile(spec)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec)
        print(f"tool_choice {name} over {len(tools)} tools ({fmt.name}): first compile {first * 1e3:.1f} ms, "
              f"cached {(time.perf_counter() - start) * 1e3:.2f} ms")

    llm = LLM(None, dtype=args.dtype, max_model_len=1024, max_num_seqs=64)
    prompt = llm.llm_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List numbers as a JSON array."}], tokenize=False, add_generation_prompt=True)
    spec = StructuredOutputsParams(json=SCHEMA)

    def params(constrained: bool, i: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens, ignore_eos=True,
                              structured_outputs=spec if constrained else None)

    for batch in (int(b) for b in args.batch.split(",")):
        mixes = {"none": [False] * batch, "all": [True] * batch}
        if batch > 1:
            mixes["half"] = [i % 2 == 0 for i in range(batch)]
        best = dict.fromkeys(mixes, float("inf"))
        for _ in range(args.rounds):
            for name, flags in mixes.items():
                llm.generate([prompt] * batch, [params(c, i) for i, c in enumerate(flags)], use_tqdm=False)  # warm
                start = time.perf_counter()
                outs = llm.generate([prompt] * batch, [params(c, i) for i, c in enumerate(flags)], use_tqdm=False)
                elapsed = time.perf_counter() - start
                assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
                best[name] = min(best[name], elapsed)
        tok = batch * args.tokens
        line = ", ".join(f"{name} constrained {tok / best[name]:.1f} tok/s ({best['none'] / best[name]:.3f}x)"
                         for name in mixes)
        print(f"batch {batch}: {line}")


def validate(num: int, dtype: str) -> None:
    import json

    import jsonschema

    from engine import LLM, SamplingParams

    llm = LLM(None, dtype=dtype, max_model_len=1024, max_num_seqs=64)
    prompts, params = [], []
    for i in range(num):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(llm.llm_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reply in JSON. Case {i}."}], tokenize=False, add_generation_prompt=True))
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=256, structured_outputs={"json": schema}))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    valid = 0
    for i, out in enumerate(outs):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[i % len(SCHEMAS)])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"request {i}: {out.outputs[0].finish_reason}: {e!r:.120}: {out.outputs[0].text[:120]!r}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{valid}/{num} outputs parse and validate ({len(SCHEMAS)} schemas, temperature 0.8); "
          f"{tokens} tokens in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
