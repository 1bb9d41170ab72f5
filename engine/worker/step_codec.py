"""Step deltas: what the Ray executor sends its worker ranks each step, O(batch) on a decode step.

A `SchedulerOutput` names every scheduled request's whole state: its block table, prompt, output
tokens, SamplingParams and seed. Pickled for the workers each step, that grew with context and
output length (at batch 64, a decode step's message at context 2,048 was ~20x the one at 128:
benchmarks/step_bytes.py). As vLLM v1 does, the executor's `StepEncoder` sends a request's state
once, when it is first scheduled (and again after a preemption, when its block table is new), and
afterwards only what changed: the step's tokens, the blocks appended to its table (or the tail
that changed, after a copy-on-write), and its new output tokens. Each worker's `StepDecoder` keeps
the request table and rebuilds the SchedulerOutput the runner reads, with the same fields the
engine's in-process executor passes; requests leave both tables when they are freed
(`finished_ids`) or preempted.

Both ends see the same messages in the same order (the executor broadcasts one frame to every
rank), so their tables stay equal; a message the decoder cannot place (a request it does not hold)
raises rather than guesses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from records.step import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class _Sent:
    """What the encoder has sent of one request (its own copy of the table: the scheduler's changes)."""
    block_ids: list[int]
    num_output_tokens: int


@dataclass(slots=True)
class _Held:
    """A worker's copy of one request's state."""
    block_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any
    seed: int | None
    eos_token_ids: frozenset[int]
    images: tuple[Any, ...]


_NEW_FIELDS = 13        # the length of a new request's entry (one sent before has 10)


def _kept_prefix(old: list[int], new: list[int]) -> int:
    """How many leading entries of `old` are still `new`'s."""
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return n
    kept = 0
    for a, b in zip(old, new):
        if a != b:
            break
        kept += 1
    return kept


class StepEncoder:
    """The executor's end: SchedulerOutput -> a compact message (a tuple of plain values), the
    scheduled requests in the scheduler's order.

    A new request: (id, token_ids, start, do_sample, spec_token_ids, prompt_logprobs_from,
    block_ids, sampling_params, seed, prompt_token_ids, output_token_ids, eos_token_ids, images).
    A request sent before: (id, token_ids, start, do_sample, spec_token_ids, prompt_logprobs_from,
    blocks kept, blocks appended after them, output tokens held before, output tokens since)."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def encode(self, sched: SchedulerOutput) -> tuple:
        for rid in sched.finished_ids:
            self._sent.pop(rid, None)
        for rid in sched.preempted_ids:
            self._sent.pop(rid, None)
        requests = []
        for s in sched.scheduled:
            step = (s.request_id, s.token_ids, s.start, s.do_sample, s.spec_token_ids, s.prompt_logprobs_from)
            outputs = s.output_token_ids
            sent = self._sent.get(s.request_id)
            if sent is None or len(outputs) < sent.num_output_tokens:
                requests.append((*step, s.block_ids, s.sampling_params, s.seed, s.prompt_token_ids,
                                 outputs, s.eos_token_ids, s.images))
                self._sent[s.request_id] = _Sent(list(s.block_ids), len(outputs))
                continue
            kept = _kept_prefix(sent.block_ids, s.block_ids)
            appended = s.block_ids[kept:]
            if kept != len(sent.block_ids) or appended:
                del sent.block_ids[kept:]
                sent.block_ids.extend(appended)
            before = sent.num_output_tokens
            sent.num_output_tokens = len(outputs)
            requests.append((*step, kept, appended, before, outputs[before:]))
        return (requests, sched.num_batched_tokens, sched.swap_out, sched.swap_in, sched.copy_blocks,
                sched.preempted_ids, sched.finished_ids, sched.tier_saves, sched.tier_loads)


class StepDecoder:
    """A worker's end: message -> the SchedulerOutput the runner reads."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def decode(self, message: tuple) -> SchedulerOutput:
        requests, num_batched, swap_out, swap_in, copy_blocks, preempted, finished, tier_saves, tier_loads = message
        for rid in finished:
            self._held.pop(rid, None)
        for rid in preempted:
            self._held.pop(rid, None)
        scheduled: list[ScheduledRequest] = []
        for entry in requests:
            rid, token_ids, start, do_sample, spec, lp_from = entry[:6]
            if len(entry) == _NEW_FIELDS:
                blocks, params, gen, prompt, outputs, eos, images = entry[6:]
                held = self._held[rid] = _Held(list(blocks), list(prompt), list(outputs), params, gen, eos, images)
                scheduled.append(self._request(rid, token_ids, start, do_sample, spec, lp_from, held))
                continue
            kept, appended, before, outputs = entry[6:]
            held = self._held.get(rid)
            if held is None:
                raise RuntimeError(f"step message names request {rid!r}, which this worker does not hold")
            if before != len(held.output_token_ids) or kept > len(held.block_ids):
                raise RuntimeError(f"request {rid!r}: this worker holds {len(held.block_ids)} blocks and "
                                   f"{len(held.output_token_ids)} output tokens, the engine sent a change "
                                   f"to {kept} and {before}")
            if kept != len(held.block_ids) or appended:
                del held.block_ids[kept:]
                held.block_ids.extend(appended)
            held.output_token_ids.extend(outputs)
            scheduled.append(self._request(rid, token_ids, start, do_sample, spec, lp_from, held))
        return SchedulerOutput(scheduled=scheduled, num_batched_tokens=num_batched, swap_out=swap_out,
                               swap_in=swap_in, copy_blocks=copy_blocks, preempted_ids=preempted,
                               finished_ids=finished, tier_saves=tier_saves, tier_loads=tier_loads)

    @staticmethod
    def _request(rid: str, token_ids: list[int], start: int, do_sample: bool, spec: list[int],
                 lp_from: int | None, held: _Held) -> ScheduledRequest:
        # The worker's own lists, as the in-process executor passes the scheduler's: the runner
        # reads them and changes nothing.
        return ScheduledRequest(
            request_id=rid, token_ids=token_ids, start=start, block_ids=held.block_ids, do_sample=do_sample,
            spec_token_ids=spec, prompt_logprobs_from=lp_from, sampling_params=held.sampling_params,
            seed=held.seed, output_token_ids=held.output_token_ids,
            prompt_token_ids=held.prompt_token_ids, eos_token_ids=held.eos_token_ids, images=held.images)
