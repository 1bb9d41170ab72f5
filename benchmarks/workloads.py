"""Serving benchmark workloads: the requests benchmarks/serve.py sends, generated from a seed.

Datasets (`--dataset`), all generated from `--seed`, so two servers see the same requests:
- `random`: token-id prompts of `--input-len` (a range "lo:hi" or one number) and outputs of
  `--output-len`, exact lengths with `ignore_eos`.
- `sharegpt`: ShareGPT-like log-normal input and output lengths (medians `--input-len`/`--output-len`
  as single numbers, clipped to the model's length).
- `prefix`: `--num-prefixes` shared prefixes of `--prefix-len` tokens × suffixes of `--input-len`.
- `multiturn`: `--num-prompts` conversations of `--turns` turns; each turn resends the whole history
  (the previous prompts and the generated text) plus a new user message, as text.
- `mixed`: interference. Each request is, with probability `--long-fraction`, a `long` one
  (`--long-input-len`, `--long-output-len`), else a `short` one (`--input-len`, `--output-len`);
  both classes share one arrival process. Every metric is also reported per class (`classes` in the
  JSON), e.g. the short requests' p99 ITL while long prompts are prefilled.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

DATASETS = ("random", "sharegpt", "prefix", "multiturn", "mixed")
WORDS = ("river stone light cloud paper engine garden window signal market harbor lantern "
         "forest copper season valley number letter bridge island summer winter mountain").split()


@dataclass
class BenchRequest:
    prompt: list[int] | str
    output_len: int
    conversation: int | None = None       # multiturn: turns of one conversation run in order
    turn: int = 0
    cls: str = ""                          # class label (mixed: "short" / "long"); metrics per class


def parse_range(spec: str) -> tuple[int, int]:
    lo, _, hi = str(spec).partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"a length range must be 'lo:hi' with 1 <= lo <= hi; got {spec!r}")
    return lo_i, hi_i


def make_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    lo_vocab, hi_vocab = 100, args.vocab_size - 100

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo_vocab, hi_vocab) for _ in range(n)]

    n = args.num_prompts + args.warmup
    if args.dataset == "random":
        ins, outs = parse_range(args.input_len), parse_range(args.output_len)
        return [BenchRequest(tokens(rng.randint(*ins)), rng.randint(*outs)) for _ in range(n)]
    if args.dataset == "sharegpt":
        # Log-normal lengths with the given medians (sigma ~ ShareGPT's spread), clipped.
        med_in, med_out = parse_range(args.input_len)[0], parse_range(args.output_len)[0]
        out = []
        for _ in range(n):
            i = min(args.max_model_len // 2, max(4, int(rng.lognormvariate(0, 0.9) * med_in)))
            o = min(args.max_model_len - i - 1, max(2, int(rng.lognormvariate(0, 0.9) * med_out)))
            out.append(BenchRequest(tokens(i), o))
        return out
    if args.dataset == "prefix":
        prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
        ins, outs = parse_range(args.input_len), parse_range(args.output_len)
        return [BenchRequest(prefixes[rng.randrange(len(prefixes))] + tokens(rng.randint(*ins)),
                             rng.randint(*outs)) for _ in range(n)]
    if args.dataset == "multiturn":
        outs = parse_range(args.output_len)
        ins = parse_range(args.input_len)
        return [BenchRequest(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*ins))),
                             rng.randint(*outs), conversation=c, turn=t)
                for c in range(n) for t in range(args.turns)]
    if args.dataset == "mixed":
        if not 0.0 <= args.long_fraction <= 1.0:
            raise ValueError(f"--long-fraction must be in [0, 1]; got {args.long_fraction}")
        short_in, short_out = parse_range(args.input_len), parse_range(args.output_len)
        long_in, long_out = parse_range(args.long_input_len), parse_range(args.long_output_len)
        out = []
        for _ in range(n):
            is_long = rng.random() < args.long_fraction
            ins, outs = (long_in, long_out) if is_long else (short_in, short_out)
            out.append(BenchRequest(tokens(rng.randint(*ins)), rng.randint(*outs), cls="long" if is_long else "short"))
        return out
    raise ValueError(f"dataset must be one of {DATASETS}; got {args.dataset!r}")
