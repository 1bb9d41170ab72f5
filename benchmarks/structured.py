"""What structured outputs cost: decode throughput of the embedded model with every request under a
JSON schema, with none, and with half of a batch constrained, at batch 1 and 16, the same prompts
and token counts (a schema that cannot end within `--tokens`: an array of at least 1,000 integers,
so every row decodes exactly `--tokens` tokens under its mask), alternating rounds, best of
`--rounds`; and the first request's grammar compile time (the compiler's tokenizer table built
once per process, then each new schema).

    python benchmarks/structured.py --batch 1,16 --tokens 64 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999999}, "minItems": 1000}
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                          "age": {"type": "integer"}}, "required": ["name", "age"]}


def main() -> None:
    from engine import LLM, SamplingParams
    from engine.model_source import resolve_model
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output import GrammarCompiler
    from engine.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
