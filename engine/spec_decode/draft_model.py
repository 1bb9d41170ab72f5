"""Draft-model proposer: a smaller model with the target's vocabulary proposes k tokens greedily.

The draft runs in the engine's process (one rank; on CUDA when the engine's single rank is, else on
the CPU) with its own ModelRunner and its own paged KV cache, managed by its own KVCacheManager
(no prefix caching) over as many blocks as the target has. Each request has a shadow sequence: its
tokens as the draft knows them and how many have draft KV. At each proposal the shadow is cut back
to its common prefix with the request's tokens (rejected proposals drop out; the KV of accepted
ones stays valid, as the tokens are the same) and extended with the new ones; then k batched greedy
steps (the first catches each shadow up) give the proposals. Greedy drafting makes q a point mass,
which the rejection sampler's rule handles exactly. A shadow whose blocks do not fit proposes fewer
tokens (speculation never preempts); a request's shadow and blocks go when it leaves the scheduler.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field, replace

from engine.core.kv_cache_manager import KVCacheManager
from engine.worker.worker import Worker
from records.config import CacheConfig, EngineConfig, ParallelConfig
from records.request import Request
from records.sampling_params import SamplingParams
from records.step import ScheduledRequest, SchedulerOutput

_GREEDY = SamplingParams(temperature=0, max_tokens=None)


@dataclass(slots=True)
class _Shadow:
    """A request as the draft sees it; duck-types the fields KVCacheManager reads (no caching)."""
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_verified: int = 0        # leading tokens known to be the request's (the rest: proposals)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        pc = config.parallel_config
        draft_config = replace(
            config, model_config=spec.draft_model_config,
            cache_config=CacheConfig(block_size=config.cache_config.block_size, num_kv_blocks=num_blocks,
                                     enable_prefix_caching=False, swap_space_bytes=0,
                                     hybrid_kv_cache=False),     # (its manager keeps one table)
            parallel_config=ParallelConfig(worker_num_gpus=pc.worker_num_gpus if pc.world_size == 1 else 0.0),
            kv_transfer_config=None, speculative_config=None)
        device = "cuda" if draft_config.parallel_config.worker_num_gpus else "cpu"
        self.worker = Worker(draft_config, device)
        self.worker.load_model()
        self.worker.init_cache(num_blocks, 0)
        assert self.worker.runner is not None
        self.runner = self.worker.runner
        self.kv = KVCacheManager(num_blocks, config.cache_config.block_size, False, 0)
        self.shadows: dict[str, _Shadow] = {}

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] greedy draft tokens to follow requests[i]'s tokens."""
        shadows = [self._sync(r) for r in requests]
        proposals: list[list[int]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while active:
            scheduled, running = [], []
            for i in active:
                shadow = shadows[i]
                if shadow.num_computed_tokens == len(shadow.all_token_ids):
                    shadow.num_computed_tokens -= 1       # no new token: recompute the last for logits
                n = len(shadow.all_token_ids) - shadow.num_computed_tokens
                if self.kv.allocate_slots(shadow, n) is None:    # type: ignore[arg-type]
                    continue                                      # no room: propose what it has
                start = shadow.num_computed_tokens
                scheduled.append(ScheduledRequest(
                    request_id=shadow.request_id, token_ids=shadow.all_token_ids[start:], start=start,
                    block_ids=self.kv.block_ids(shadow.request_id), do_sample=True, sampling_params=_GREEDY))
                running.append(i)
            if not scheduled:
                break
            out = self.runner.execute(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled)))
            assert out is not None
            active = []
            for i, sched in zip(running, scheduled):
                token_id = out.sampled[sched.request_id].token_id
                shadows[i].num_computed_tokens += len(sched.token_ids)
                shadows[i].all_token_ids.append(token_id)
                proposals[i].append(token_id)
                if len(proposals[i]) < num_tokens[i]:
                    active.append(i)
        return proposals

    def _sync(self, request: Request) -> _Shadow:
        """The request's shadow, cut back to the common prefix with its tokens and extended."""
        shadow = self.shadows.setdefault(request.request_id, _Shadow(request.request_id))
        tokens = request.all_token_ids
        common = shadow.num_verified
        for mine, theirs in zip(shadow.all_token_ids[common:], tokens[common:]):
            if mine != theirs:
                break
            common += 1
        shadow.all_token_ids = list(tokens)
        shadow.num_verified = len(tokens)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common)
        return shadow

    def retain(self, request_ids: Container[str]) -> None:
        """Free the shadows (and draft KV blocks) of requests that left the scheduler."""
        for rid in [rid for rid in self.shadows if rid not in request_ids]:
            self.kv.free(self.shadows.pop(rid))        # type: ignore[arg-type]

    def check_no_leaks(self) -> None:
        assert not self.shadows, f"draft shadows left: {list(self.shadows)}"
        self.kv.check_no_leaks()
