"""Serving benchmark workloads: the requests benchmarks/serve.py sends, generated from a seed.

Datasets (`--dataset`), all generated from `--seed`, so two servers see the same requests:
- `random`: token-id prompts of `--input-len` (a range "lo:hi" or one number) and outputs of
  `--output-len`, exact lengths with `ignore_eos`.
- `sharegpt`: ShareGPT-like log-normal input and output lengths (medians `--input-len`/`--output-len`
  as single numbers, clipped to the model's length).
- `prefix`: `--num-prefixes` shared prefixes of `--prefix-len` tokens × suffixes of `--input-len`.
- `multiturn`: `--num-prompts` conversations of `--turns` turns; each turn resends the whole history
  (the previous prompts and the generated text) plus a new user message, as text.
- `trace`: a trace's requests at its own arrival times (`--trace FILE`: Mooncake's JSONL or
  pdserve's, cluster/sim/trace.py), with the prompts `pdserve simulate` replays for it (same
  `--seed`, `--prompt-scale`, `--output-scale`, `--rate-scale`, `--limit`, `--start`, `--duration`):
  what a real server and its simulation are compared on (benchmarks/sim_fidelity.py).
- `mixed`: interference. Each request is, with probability `--long-fraction`, a `long` one
  (`--long-input-len`, `--long-output-len`), else a `short` one (`--input-len`, `--output-len`);
  both classes share one arrival process. Every metric is also reported per class (`classes` in the
  JSON), e.g. the short requests' p99 ITL while long prompts are prefilled.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

DATASETS = ("random", "sharegpt", "prefix", "multiturn", "mixed", "trace")
WORDS = ("river stone light cloud paper engine garden window signal market harbor lantern "
         "forest copper season valley number letter bridge island summer winter mountain").split()


@dataclass
class BenchRequest:
    prompt: list[int] | str
    output_len: int
    conversation: int | None = None       # multiturn: turns of one conversation run in order
    turn: int = 0
    cls: str = ""                          # class label (mixed: "short" / "long"); metrics per class
    arrival_s: float | None = None         # trace: when it is sent, from the start


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
    if args.dataset == "trace":
        return trace_dataset(args)
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


def trace_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    """The trace's requests, as `pdserve simulate` replays them (cluster/sim/trace.py)."""
    from cluster.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceTokens, read_trace, scale_trace

    if not args.trace:
        raise ValueError("--dataset trace needs --trace FILE")
    trace = read_trace(args.trace, MOONCAKE_BLOCK_TOKENS, args.limit, args.start, args.duration)
    trace = scale_trace(trace, args.rate_scale, args.prompt_scale, args.output_scale)
    tokens = TraceTokens(args.vocab_size, max(1, round(MOONCAKE_BLOCK_TOKENS * args.prompt_scale)), args.seed)
    return [BenchRequest(tokens.prompt(r, i), r.output_length, arrival_s=r.arrival_s) for i, r in enumerate(trace)]


def add_trace_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=None, help="trace: the JSONL file")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="trace: arrivals this many times faster")
    ap.add_argument("--prompt-scale", type=float, default=1.0, help="trace: prompts this many times as long")
    ap.add_argument("--output-scale", type=float, default=1.0, help="trace: outputs this many times as long")
    ap.add_argument("--limit", type=int, default=None, help="trace: the first N requests")
    ap.add_argument("--start", type=float, default=0.0, help="trace: from this many seconds in")
    ap.add_argument("--duration", type=float, default=None, help="trace: this many seconds of it")
