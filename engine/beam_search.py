"""Beam search, as transformers' `generate(num_beams=k)` runs it, over any engine that scores a
batch of sequences' next tokens.

`BeamSearch` is the algorithm for one prompt, step by step and transport-free: `live()` are the
sequences (generated tokens after the prompt) to score next; `advance(tops)` takes each one's top
log-probabilities (raw log-softmax, at least `width` entries) and picks the next beams exactly as
transformers does (its `_beam_search`: the top max(2, 1 + #eos) x k continuations of the beams'
accumulated scores; those ending in EOS (or at max_tokens) among the first k become finished
hypotheses, scored sum / length ** length_penalty; the best k others run on; `early_stopping`
True / False / "never" with its heuristics); `results()` are the best n finished. With `logprobs`
each beam keeps, per token, its logprob and the position's top `logprobs` (as a sampled request's).

The sequences are scored as ordinary one-token requests (`scoring_params`): every beam's prompt
blocks, and the full blocks of the tokens the beams share, are the same prefix-cache blocks, held
once (a beam recomputes only its last partial block). The offline LLM (`LLM.generate` with
`use_beam_search`) drives it over its engine (`run_offline`), the ingress over the router
(router/ingress/frontend.py `Frontend.beam_search`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from records.outputs import Logprob
from records.sampling_params import SamplingParams

DEAD = -1.0e9       # transformers' score for a beam that must not be chosen


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens, its score (length-penalized) and its summed logprob."""
    token_ids: list[int]
    score: float
    cumulative_logprob: float
    finish_reason: str          # "stop" (ended in EOS or a stop token) or "length"
    logprobs: list[dict[int, Logprob]] | None = None    # per token, ranked (with `logprobs` asked)


# A running beam: its generated tokens, accumulated logprob and per-token logprobs (when asked).
Beam = tuple[list[int], float, list[dict[int, Logprob]]]


class BeamSearch:
    def __init__(self, params: SamplingParams, model_eos: Iterable[int], prompt_len: int, max_model_len: int) -> None:
        """`model_eos`: the model's end-of-sequence ids (ended on unless `ignore_eos`, beside the
        request's `stop_token_ids`); the beams run to `max_tokens`, within `max_model_len`."""
        self.beams = params.best_of or params.n
        self.n = params.n
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.eos = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(model_eos))
        self.max_tokens = min(params.max_tokens or max_model_len, max_model_len - prompt_len)
        self.width = max(2, 1 + len(self.eos)) * self.beams        # candidates kept per step
        self.num_logprobs = params.logprobs         # top logprobs kept per token; None: none kept
        # transformers starts every beam but the first dead
        self.running: list[Beam] = [([], 0.0, [])] + [([], DEAD, [])] * (self.beams - 1)
        self.finished: list[Hypothesis] = []
        self.improvable = True          # transformers' is_early_stop_heuristic_unsatisfied
        self.generated = 0
        self.done = False

    def live(self) -> list[list[int]]:
        """The generated tokens of each beam to score this step (dead ones are not asked for: no
        continuation of theirs can reach the kept candidates)."""
        return [tokens for tokens, score, _ in self.running if score > DEAD / 2]

    def advance(self, tops: list[dict[int, float]]) -> None:
        """Take this step's top logprobs of each live beam (in `live()`'s order)."""
        live = [beam for beam in self.running if beam[1] > DEAD / 2]
        candidates = sorted(((beam[1] + lp, i, token) for i, (beam, top) in enumerate(zip(live, tops))
                             for token, lp in top.items()), key=lambda c: -c[0])[:self.width]
        length = self.generated + 1
        hits = [token in self.eos or length >= self.max_tokens for _, _, token in candidates]
        # The best non-finished candidates run on (finished ones rank last, dead).
        ranked = sorted(range(len(candidates)), key=lambda j: -(candidates[j][0] + (DEAD if hits[j] else 0.0)))
        self.running = [(live[candidates[j][1]][0] + [candidates[j][2]], candidates[j][0] + (DEAD if hits[j] else 0),
                         self._logprobs(live[candidates[j][1]][2], tops[candidates[j][1]], candidates[j][2]))
                        for j in ranked[:self.beams]]
        self.running += [([], DEAD, [])] * (self.beams - len(self.running))
        # Of the first k candidates, those that finished become hypotheses, unless nothing can improve.
        full = len(self.finished) >= self.beams and self.early_stopping is True
        if self.improvable and not full:
            for j in range(min(self.beams, len(candidates))):
                if hits[j]:
                    total, i, token = candidates[j]
                    reason = "stop" if token in self.eos else "length"
                    logprobs = self._logprobs(live[i][2], tops[i], token) if self.num_logprobs is not None else None
                    self.finished.append(Hypothesis(live[i][0] + [token], total / length ** self.length_penalty,
                                                    total, reason, logprobs))
            self.finished = sorted(self.finished, key=lambda h: -h.score)[:self.beams]
        self.generated = length
        if len(self.finished) >= self.beams:
            if self.early_stopping == "never" and self.length_penalty > 0:
                best_length = self.max_tokens
            else:
                best_length = self.generated
            best_possible = self.running[0][1] / best_length ** self.length_penalty
            self.improvable = self.improvable and best_possible > min(h.score for h in self.finished)
        all_full = len(self.finished) >= self.beams and self.early_stopping is True
        self.done = not self.improvable or all_full or all(hits)

    def results(self) -> list[Hypothesis]:
        """The best n hypotheses, best first."""
        return self.finished[:self.n]

    def _logprobs(self, kept: list[dict[int, Logprob]], top: dict[int, float], token: int
                  ) -> list[dict[int, Logprob]]:
        """A beam's per-token logprobs with `token` chosen from `top` (ranked, most likely first):
        the position's `num_logprobs` most likely, then the token itself if it is not among them."""
        if self.num_logprobs is None:
            return kept
        entry = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(top.items(), start=1) if rank <= self.num_logprobs}
        if token not in entry:
            entry[token] = Logprob(top[token], next(r for r, t in enumerate(top, start=1) if t == token))
        return [*kept, entry]


def scoring_params(search: BeamSearch, params: SamplingParams) -> SamplingParams:
    """What each beam is scored with: one greedy token, the top `width` logprobs, no EOS check."""
    scoring = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False,
                             priority=params.priority, lora_request=params.lora_request,
                             extra_keys=params.extra_keys, output_kind="final_only")
    # Past the API's cap of 20 where a model has several EOS ids (Llama 3: 3, so 4 x best_of):
    # bounded by best_of <= 10, and the step handles any top-k.
    scoring.logprobs = max(search.width, search.num_logprobs or 0)
    return scoring


def check_beam_params(params: SamplingParams) -> None:
    """ValueError naming what beam search cannot take with it."""
    refused = [name for name, on in (("stop", bool(params.stop)),
                                     ("prompt_logprobs", params.prompt_logprobs is not None),
                                     ("structured_outputs", params.structured_outputs is not None),
                                     ("min_tokens", params.min_tokens > 0), ("logit_bias", bool(params.logit_bias)),
                                     ("allowed_token_ids", params.allowed_token_ids is not None),
                                     ("bad_words", bool(params.bad_words or params.bad_words_token_ids)),
                                     ("penalties", params.needs_penalties)) if on]
    if refused:
        raise ValueError(f"{refused[0]} is not supported with use_beam_search")


Batch = list[tuple[list[int], SamplingParams]]
Owners = list[tuple[BeamSearch, int]]


def pending(searches: list[tuple[list[int], BeamSearch]], params: list[SamplingParams]) -> tuple[Batch, Owners]:
    """This step's sequences to score, over every unfinished search: (prompt + beam tokens, scoring
    params) each, and (search, how many of them are its) in order."""
    batch: Batch = []
    owners: Owners = []
    for (prompt, search), p in zip(searches, params):
        if not search.done:
            beams = search.live()
            owners.append((search, len(beams)))
            batch += [(prompt + tokens, scoring_params(search, p)) for tokens in beams]
    return batch, owners


def deliver(owners: Owners, tops: list[dict[int, float]]) -> None:
    """Hand each search its sequences' top logprobs (in `pending`'s order)."""
    at = 0
    for search, count in owners:
        search.advance(tops[at:at + count])
        at += count


def run_offline(searches: list[tuple[list[int], BeamSearch]], params: list[SamplingParams],
                score: Callable[[Batch], list[dict[int, float]]]) -> None:
    """Run every search to its end, all prompts' beams scored together each step: `score` takes
    (token ids, params) per sequence and returns each one's top logprobs."""
    while True:
        batch, owners = pending(searches, params)
        if not batch:
            return
        deliver(owners, score(batch))
