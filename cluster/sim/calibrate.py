"""`pdserve profile`: a linear simulation profile calibrated from the real engine on this machine.

The engine runs a grid of batches one after another, in this process, on the threads a replica gets
(`--threads`, its CPUs): prompts alone (16 to 2,048 tokens), a prompt's second half after its first
half is cached, decode batches of 1 to `max_num_seqs` sequences at several contexts, and decodes
beside a prompt. Each step's forward pass (the executor's `execute_model`) is timed with the step's
`StepShape`, and least squares fit the profile's coefficients (records/sim_profile.py: the step's
time at 1, 2, 4, ... tokens, then LINEAR_FEATURES), a negative one dropped and the rest fitted
again; the rest of each step (the scheduler, outputs) is fitted as `engine_overhead` (base + per
scheduled request). The fit's error on
its own steps (relative, median and p90, and on their total) goes in the profile's `fit`, and
docs/performance.md has its error on a served run (benchmarks/sim_fidelity.py).
"""
from __future__ import annotations

import platform
import time
from typing import Any

import numpy as np

from engine.executor.simulated import step_shape
from engine.llm_engine import LLMEngine
from records.config import EngineConfig
from records.config_resolution import engine_config
from records.sampling_params import SamplingParams
from records.sim_profile import LINEAR_FEATURES, ModelShape, SimProfile, StepShape

PROMPT_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (64, 512, 1536)
# A decode point's prompts in all (its batch times its context) at most: their prefill is what a point
# costs (64 x 1,536 tokens took a minute of one thread here) and adds nothing to the decode fit.
MAX_DECODE_POINT_TOKENS = 24_576


class StepRecorder:
    """Times an engine's forward passes (its executor's execute_model) and whole steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.rows: list[tuple[StepShape, float, float, int]] = []     # (shape, forward s, step s, requests)
        self._forward = 0.0
        self._shape: StepShape | None = None
        self._num = 0
        inner = engine.executor.execute_model

        def timed(sched: Any) -> Any:
            began = time.perf_counter()
            out = inner(sched)
            self._forward = time.perf_counter() - began
            self._shape, self._num = step_shape(sched), len(sched.scheduled)
            return out

        engine.executor.execute_model = timed       # type: ignore[method-assign]

    def run(self, prompts: list[list[int]], max_tokens: int, record: bool = True) -> None:
        for i, prompt in enumerate(prompts):
            self.engine.add_request(f"cal-{time.monotonic_ns()}-{i}", None, prompt,
                                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                   detokenize=False))
        while self.engine.has_unfinished_requests():
            self._shape = None
            began = time.perf_counter()
            self.engine.step()
            step_s = time.perf_counter() - began
            if record and self._shape is not None:
                self.rows.append((self._shape, self._forward, step_s, self._num))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(16, vocab, n).tolist()


def measure(model: str | None, threads: int, engine_args: dict[str, Any], rounds: int = 2, seed: int = 0
            ) -> tuple[EngineConfig, list[tuple[StepShape, float, float, int]]]:
    """Run the grid on an engine of `model` (with `engine_args`, vLLM's names) on `threads` torch
    threads in this process: (its config, every step's (shape, forward s, step s, requests))."""
    import torch  # noqa: PLC0415 - the engine's threads, as a replica actor sets them

    torch.set_num_threads(threads)
    config = engine_config(model, **engine_args)
    engine = LLMEngine(config)
    recorder = StepRecorder(engine)
    vocab, max_len = config.model_config.vocab_size, config.model_config.max_model_len
    max_seqs = config.scheduler_config.max_num_seqs
    rng = np.random.default_rng(seed)
    lengths = [n for n in PROMPT_LENGTHS if n < max_len - 8]
    recorder.run([_tokens(rng, 64, vocab) for _ in range(4)], 8, record=False)      # warm-up
    for _ in range(rounds):
        for n in lengths:
            recorder.run([_tokens(rng, n, vocab)], 1)
        for n in lengths[2:]:                       # its second half after its first half is cached
            first = _tokens(rng, n // 2, vocab)
            recorder.run([first + _tokens(rng, 1, vocab)], 1, record=False)
            recorder.run([first + _tokens(rng, n - n // 2, vocab)], 1)
        for context in (c for c in DECODE_CONTEXTS if c < max_len - 24):
            for batch in (b for b in DECODE_BATCHES if b <= max_seqs and b * context <= MAX_DECODE_POINT_TOKENS):
                recorder.run([_tokens(rng, context, vocab) for _ in range(batch)], 16)
        for batch in (b for b in (4, 16) if b < max_seqs):       # decodes beside a prompt
            prompts = [_tokens(rng, 128, vocab) for _ in range(batch)]
            for p in prompts:
                engine.add_request(f"mix-{time.monotonic_ns()}", None, p,
                                   SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False))
            for _ in range(4):
                engine.step()
            recorder.run([_tokens(rng, min(512, max_len // 2), vocab)], 1)
    engine.check_no_leaks()
    engine.executor.shutdown()
    return config, recorder.rows


def calibrate(model: str | None, threads: int, engine_args: dict[str, Any], name: str, rounds: int = 2,
              copies: int = 1) -> SimProfile:
    """Measure the engine (`measure`) and fit a linear profile named `name`. With `copies` > 1, that
    many engines measure at once, each in a process of its own, as the replicas that will share this
    machine run (their steps slow each other: memory bandwidth, caches); every copy's steps are fitted."""
    if copies == 1:
        config, rows = measure(model, threads, engine_args, rounds)
        return fit_profile(name, rows, config, threads, copies)
    import multiprocessing  # noqa: PLC0415 - only for concurrent copies
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    with ProcessPoolExecutor(copies, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(measure, *zip(*[(model, threads, engine_args, rounds, i) for i in range(copies)])))
    return fit_profile(name, [row for _, rows in done for row in rows], done[0][0], threads, copies)


def fit_linear(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: a feature whose coefficient comes out negative
    is dropped and the rest fitted again."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(x.shape[1])
            out[keep] = np.clip(coef, 0, None)
            return out
        del keep[int(np.argmin(coef))]


def knots_for(rows: list[tuple[StepShape, float, float, int]]) -> tuple[int, ...]:
    """The token counts to fit the step time at: 1, 2, 4, ... up to the largest step measured."""
    most = max(s.num_tokens for s, *_ in rows)
    knots = [1]
    while knots[-1] < most:
        knots.append(knots[-1] * 2)
    return tuple(knots)


def fit_profile(name: str, rows: list[tuple[StepShape, float, float, int]], config: EngineConfig,
                threads: int, copies: int = 1) -> SimProfile:
    knots = knots_for(rows)
    x = np.array([s.features(knots) for s, *_ in rows], dtype=np.float64)
    forward = np.array([f for _, f, _, _ in rows])
    # Relative error matters (a 2 ms decode step as much as a 2 s prompt): weight by 1 / time.
    weights = 1.0 / np.maximum(forward, 1e-4)
    coef = fit_linear(x * weights[:, None], forward * weights)
    predicted = x @ coef
    errors = np.abs(predicted - forward) / forward
    overhead = np.array([step - f for _, f, step, _ in rows])
    requests = np.array([[1.0, n] for *_, n in rows])
    over = fit_linear(requests, overhead)
    mc = config.model_config
    hf = mc.hf_config
    shape = ModelShape(name=str(getattr(hf, "_name_or_path", "") or mc.model), num_layers=mc.num_layers,
                       hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                       num_heads=hf.num_attention_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                       vocab_size=mc.vocab_size, max_model_len=mc.max_model_len,
                       dtype_bytes={"float32": 4}.get(mc.dtype, 2))
    return SimProfile(
        name=name, kind="linear", model=shape,
        description=(f"{mc.model}{'/' + mc.gguf_file if mc.gguf_file else ''} ({mc.dtype}) on {threads} thread(s) of "
                     f"{platform.processor() or platform.machine()}, {copies} engine(s) at once, calibrated by "
                     f"`pdserve profile` from {len(rows)} steps"),
        knots=knots, coefficients=tuple(float(c) for c in coef),
        engine_overhead=(float(over[0]), float(over[1])),
        startup_s=10.0,
        fit={"steps": len(rows), "features": [f"tokens={k}" for k in knots] + list(LINEAR_FEATURES),
             "threads": threads, "copies": copies,
             "max_num_seqs": config.scheduler_config.max_num_seqs, "dtype": mc.dtype,
             "relative_error_p50": round(float(np.median(errors)), 4),
             "relative_error_p90": round(float(np.quantile(errors, 0.9)), 4),
             "total_error": round(float(abs(predicted.sum() - forward.sum()) / forward.sum()), 4),
             "machine": platform.processor() or platform.machine(),
             "date": time.strftime("%Y-%m-%d")})
