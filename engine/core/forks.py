"""n > 1 requests (parallel sampling, vLLM's `n`): the leader computes the prompt but its last token,
then each child takes references to those blocks (copy-on-write: KVCacheManager.fork) and every
sequence samples on its own from there. `Forks` holds the children (WAITING_FOR_FORK) until their
leader's prompt is computed; the scheduler runs or queues what `fork` hands back.
"""
from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from records.request import Request, RequestStatus


class Forks:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.pending: dict[str, Request] = {}       # children waiting for their leader's prompt

    def add(self, leader: Request) -> bool:
        """Hold a leader's children until its prompt but the last token is computed (its
        `compute_limit`); True when it has no prompt to share (fork it at once)."""
        if not leader.fork_children:
            return False
        for child in leader.fork_children:
            self.pending[child.request_id] = child
        leader.compute_limit = leader.num_prompt_tokens - 1
        return leader.compute_limit == 0

    def due(self, request: Request) -> bool:
        """Whether a leader's prompt (but its last token) is computed: its children may fork."""
        return request.compute_limit is not None and request.num_computed_tokens == request.compute_limit

    def waiting(self, leader: Request) -> list[Request]:
        """The leader's children still waiting for its prompt."""
        return [child for child in leader.fork_children if child.request_id in self.pending]

    def drop(self, child_id: str) -> None:
        del self.pending[child_id]

    def fork(self, leader: Request) -> list[Request]:
        """Hand the leader's prompt blocks to its waiting children, each now RUNNING beside a
        running leader (they were counted at its admission) or WAITING; returns them."""
        leader.compute_limit = None
        children = [child for child in leader.fork_children if self.pending.pop(child.request_id, None) is not None]
        for child in children:
            if leader.num_computed_tokens:
                self.kv.fork(leader, child)
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_cached_tokens = leader.num_cached_tokens
            child.status = RequestStatus.RUNNING if leader.status == RequestStatus.RUNNING else RequestStatus.WAITING
        leader.fork_children = []
        return children
