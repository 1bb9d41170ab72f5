"""Static batching (`batching="static"`): the batch barrier continuous batching is measured against.

A batch is the first `max_num_seqs` waiting sequences at the moment the previous batch has drained;
until every member has finished no other request is admitted (members preempted or pulling KV stay
members). The scheduler asks `form_static_batch` before admitting, and admits only members.
"""
from __future__ import annotations

from collections import deque

from records.request import Request


def form_static_batch(waiting: deque[Request], live: dict[str, Request], batch_ids: set[str],
                      max_num_seqs: int) -> tuple[deque[Request], set[str]]:
    """(the waiting queue, the batch's request ids) for this step. While a member of `batch_ids` is
    still `live`, the batch stands and its waiting members move to the queue's front (a priority
    queue may have put a newcomer before them); once none is, the first waiting requests (up to
    max_num_seqs sequences, n > 1 children included) become the next batch."""
    if any(rid in live for rid in batch_ids):
        if waiting and waiting[0].request_id not in batch_ids:
            members = [r for r in waiting if r.request_id in batch_ids]
            if members:
                waiting = deque(members + [r for r in waiting if r.request_id not in batch_ids])
        return waiting, batch_ids
    batch: set[str] = set()
    num_seqs = 0
    for request in waiting:
        num_seqs += 1 + len(request.fork_children)
        if num_seqs > max_num_seqs and batch:
            break
        batch.add(request.request_id)
        batch.update(child.request_id for child in request.fork_children)
    return waiting, batch
