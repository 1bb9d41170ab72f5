"""Request: one sequence's token bookkeeping as the scheduler sees it.

A request owns its token ids (prompt + output), how many of them have KV computed, and its block
hashes (extended as blocks fill). Its KV blocks are owned by the KVCacheManager, keyed by request id.
With n > 1 the first child prefills the prompt and the others are forked from it (copy-on-write).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import records.clock as clock
from records.hashing import BlockHash, hash_block_tokens
from records.sampling_params import SamplingParams
from records.step import SampledToken, ScheduledRequest

if TYPE_CHECKING:
    from records.multimodal import ImageInput
    from records.transfer import RemotePrefill


@dataclass(frozen=True, slots=True)
class Continuation:
    """A request resumed on another replica after the one running it was lost (the router's
    migration): the output tokens its client already has, and how many characters of their text it
    was sent (a tail held back for a possible stop string is sent from here). The resuming engine
    computes the prompt and these tokens (a prefix-cache hit where it has them), then generates on
    as the lost one would have: max_tokens, min_tokens, penalties, stop strings and a seeded stream
    count these tokens as its own."""
    token_ids: tuple[int, ...]
    num_chars: int = 0


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request an engine has validated and queues (LLMEngine.enqueue): what `add_request` and
    `AsyncLLMEngine.submit` take, checked once. `block_hashes`: the prompt's hash chain when it came
    prepared (its ingress's router hashed it to route it; Request takes it instead of hashing
    again); `arrival`: when it reached the engine (its queue time counts from there)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    kv_transfer_params: dict[str, Any] | None = None
    continuation: Continuation | None = None
    trace_context: dict[str, str] | None = None
    block_hashes: list[BlockHash] | None = None
    images: tuple[ImageInput, ...] = ()     # the prompt's images (vision-language models: records/multimodal.py)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FORK = enum.auto()        # an n > 1 child waiting for its sibling's prompt KV
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()               # blocks freed; recomputes on resume
    SWAPPED = enum.auto()                 # blocks in the CPU pool; swapped in on resume
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated; their KV is being pulled from a prefill engine
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()          # its KV pull failed under load_failure_policy="fail"

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        block_size: int,
        max_tokens: int,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        index: int = 0,
        block_hashes: list[BlockHash] | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        """`block_hashes`: the prompt's hash chain when the caller has it (the router's, which it
        routed on; a fork's leader's), so that it is not computed again: the hashes of the prompt's
        full blocks are taken from its start (any further ones, from tokens past the prompt, are not)."""
        self.request_id = request_id
        self.parent_id = parent_id or request_id    # the user's request id (n > 1 children share it)
        self.index = index                          # which of the n completions this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens                # resolved: never None
        # The weights that produced its tokens: (first output token, version) per range, one range
        # unless a weight update came while it ran (engine/weight_updates.py: replaced, never
        # changed in place, so that its outputs share it)
        self.weight_versions: list[tuple[int, str]] = []
        self.kv_stale = False       # the KV it is pulling is of weights replaced meanwhile: computed again
        self.arrival_time = arrival_time if arrival_time is not None else clock.monotonic()
        self.priority = sampling_params.priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0                  # prefix-cache hit at first schedule
        self.num_preemptions = 0
        # Tokens beyond this are not computed yet (prompt[:-1] while this request is the prefill
        # leader of an n > 1 fork); None means no cap.
        self.compute_limit: int | None = None
        self.fork_children: list[Request] = []
        # Prefill/decode split: KV to pull from a prefill engine before running (decode side), or
        # keep the blocks under a lease for a decode engine when done (prefill side).
        self.remote_prefill: RemotePrefill | None = None
        self.remote_decode = False
        # Speculative decoding: tokens proposed to follow all_token_ids, verified (and consumed) by
        # the next step that schedules this request; never part of all_token_ids or its hashes.
        self.spec_token_ids: list[int] = []
        # Its timeline beyond arrival, for the engine's per-request histograms and trace spans
        # (engine/telemetry.py): first scheduled (its queue time ends there), and its KV pull from a
        # prefill replica or a peer (start, end; the blocks; why it failed).
        self.scheduled_time: float | None = None
        self.pull_start: float | None = None
        self.pull_end: float | None = None
        self.pull_tokens = 0
        self.pull_error: str | None = None

        self.block_size = block_size
        self.extra_keys = sampling_params.cache_keys
        self.images = images
        self._image_keys = tuple(image.key for image in images)
        self.block_hashes: list[BlockHash] = list(block_hashes[:len(self.prompt_token_ids) // block_size]) \
            if block_hashes else []
        self._update_block_hashes()

        seed = sampling_params.seed
        # The seed of this request's own random stream (the runner keeps the generator): children
        # of a seeded n > 1 request draw distinct but reproducible streams (wrapped into
        # manual_seed's range: any validated seed works, small ones map to themselves).
        self.seed: int | None = None if seed is None else (seed + index * 1_000_003) % (1 << 64)
        self.error: Exception | None = None     # why it ended with an error, when typed (a KV pull)
        self.logprobs: list[dict[int, float]] = []          # per output token: {token_id: logprob}
        self.logprob_ranks: list[int] = []                  # rank of the sampled token
        # The prompt's first token has no logprob: None, even when it is the whole prompt.
        self.prompt_logprobs: list[dict[int, float] | None] = [] if sampling_params.prompt_logprobs is None else [None]
        # An embedding request (sampling_params.pooling): its pooled rows so far, then its vector.
        self.pooled: Any = None
        self.pooled_rows = 0
        self.embedding: list[float] | None = None

    def compute_again(self) -> None:
        """Its computed KV is gone (its blocks freed): it computes from the first token again, and
        an embedding pools its rows again."""
        self.num_computed_tokens = 0
        self.pooled, self.pooled_rows = None, 0

    # --- token accounting -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def pull_blocks(self) -> int:
        """Blocks its KV pull moves (`pull_tokens`, from a block boundary)."""
        return -(-self.pull_tokens // self.block_size)

    def stop_status(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """How the token just appended ends this request (EOS or a stop token once min_tokens are
        out, sets `stop_reason` for a stop token; max_tokens or max_model_len reached), or None."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV must still be computed (limited while a fork is pending)."""
        target = self.num_tokens if self.compute_limit is None else self.compute_limit
        return target - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self._update_block_hashes()

    def append_sampled(self, token: SampledToken) -> None:
        """A sampled token, with its logprobs where the request asked for them."""
        self.append_output_token(token.token_id)
        if token.top_logprobs is not None:
            self.logprobs.append(token.top_logprobs)
            self.logprob_ranks.append(token.rank)

    def add_prompt_logprobs(self, logprobs: list | None) -> None:
        """A step's prompt logprobs, for the positions not yet covered (a prompt computed again after
        a preemption brings them twice)."""
        if logprobs is not None:
            self.prompt_logprobs.extend(logprobs[:self.num_prompt_tokens - len(self.prompt_logprobs)])

    def resume(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """Take `token_ids` as output already generated (a Continuation, before the request is
        scheduled): their KV is computed with the prompt's, as after a preemption by recompute.
        Their logprobs went out from the replica that generated them: empty entries keep the lists
        aligned with the output."""
        assert not self.output_token_ids and self.num_computed_tokens == 0
        for token_id in token_ids:
            self.append_output_token(token_id)
        if self.sampling_params.logprobs is not None:
            self.logprobs = [{} for _ in token_ids]
            self.logprob_ranks = [0] * len(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens (and their logprobs) beyond the first `num_output_tokens`: the tokens
        of a speculative run that came after a stop string. Only for a finished request (its KV
        blocks are freed already)."""
        assert self.is_finished
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        del self.logprobs[num_output_tokens:]
        del self.logprob_ranks[num_output_tokens:]
        del self.block_hashes[self.num_tokens // self.block_size:]

    def _update_block_hashes(self) -> None:
        parent = self.block_hashes[-1] if self.block_hashes else None
        self.block_hashes.extend(hash_block_tokens(
            self.all_token_ids, self.block_size, self.extra_keys, parent, len(self.block_hashes), self._image_keys))

    def describe(self, n: int, spec_token_ids: list[int], block_ids: list[int]) -> ScheduledRequest:
        """The runner's view of this request's next `n` tokens, the last len(spec_token_ids) of them
        proposals (the scheduler's step record)."""
        start = self.num_computed_tokens
        end = start + n - len(spec_token_ids)
        params = self.sampling_params
        prompt_lp_from = None
        if (params.prompt_logprobs is not None and start < self.num_prompt_tokens - 1
                and len(self.prompt_logprobs) < self.num_prompt_tokens):
            prompt_lp_from = start
        return ScheduledRequest(
            request_id=self.request_id, token_ids=self.all_token_ids[start:end] + spec_token_ids, start=start,
            block_ids=block_ids,
            do_sample=self.compute_limit is None and end == self.num_tokens and not params.pooling,
            spec_token_ids=spec_token_ids, prompt_logprobs_from=prompt_lp_from,
            # The request's own objects, not copies: the runner reads them before the scheduler
            # changes them, and the Ray executor sends each once (engine/worker/step_codec.py).
            sampling_params=params, seed=self.seed, output_token_ids=self.output_token_ids,
            prompt_token_ids=self.prompt_token_ids, eos_token_ids=self.eos_token_ids, images=self.images)

    def fork(self, request_id: str, index: int) -> Request:
        """A copy sharing this request's prompt, for an n > 1 sibling (its KV is forked separately)."""
        child = Request(request_id, self.prompt_token_ids, self.sampling_params, self.eos_token_ids,
                        self.block_size, self.max_tokens, self.arrival_time, self.parent_id, index,
                        self.block_hashes, self.images)
        child.status = RequestStatus.WAITING_FOR_FORK
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


# The request id a peer's prefix lease carries (LLMEngine.lease_prefix): what a pull of it is.
PEER_PREFIX = "peer-prefix-"


@dataclass(slots=True)
class BlockHolder:
    """KV blocks held for something other than a request (a prefix leased to a peer replica):
    `KVCacheManager.hold` returns one, and `free` takes it like a request."""
    request_id: str
