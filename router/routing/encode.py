"""EncodeStage: a vision-language model's encode pool (E/P/D). A request with images goes to the
least busy encode replica first; it encodes them (the model's vision tower and projector) and puts
each image's embeddings in its node's Ray object store, returning references
(cluster/replica.py: EngineReplica.encode). The references ride with the images
(records/multimodal.py: ImageInput.embeddings) to the replica that prefills the prompt, whose
worker reads them from the object store, node to node, without the bytes passing through this
ingress (engine/worker/encoder_cache.py). The KV connector is the other way to move them: it
moves KV blocks between engines of one layout, not tensors of an encoder's, and the object store
is what a Ray cluster has between any two actors.

Encoding first is an optimisation, never a condition: with no encode replica available, or one that
fails the call (its process or node died), the images go on without embeddings and the prefilling
replica encodes them itself (as it does when references it got cannot be read: their owner died
between the two hops). Each outcome is counted (`pdserve:router_decisions_total{pool="encode"}`)
and traced (a `pdserve.encode` span).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

from router.routing.pool_router import RequestRouter, replica_lost
from router.routing.request_trace import RequestTrace

logger = logging.getLogger(__name__)


class EncodeStage:
    def __init__(self, pool: RequestRouter) -> None:
        self.pool = pool
        self._turn = itertools.count()

    async def encode(self, images: tuple[Any, ...], trace: RequestTrace | None = None) -> tuple[Any, ...]:
        """The images with their embeddings' references, or as they were (the prefill replica
        encodes them) when no encode replica could."""
        began = time.monotonic()
        candidates = self.pool.available
        if not candidates:
            return self._outcome(images, None, "encode_unavailable", began, trace)
        # The least busy, ties taken in turn (round-robin from this request's turn).
        turn, n = next(self._turn), len(candidates)
        replica = candidates[min(range(n), key=lambda i: (self.pool.loads[candidates[i]].in_flight, (i - turn) % n))]
        load = self.pool.loads[replica]
        load.started(0)
        try:
            refs = await self.pool.replicas[replica].encode.remote(list(images))
        except Exception as e:  # noqa: BLE001 - any failure: the prefill replica encodes them
            if replica_lost(e):
                self.pool.mark_down(replica, e)
            logger.warning("encode replica %s failed a request's images (%s: %s); they are encoded where the "
                           "prompt is prefilled", replica, type(e).__name__, e)
            return self._outcome(images, replica, "encode_failed", began, trace)
        finally:
            load.ended()
        encoded = tuple(dataclasses.replace(image, embeddings=ref) for image, ref in zip(images, refs, strict=True))
        return self._outcome(encoded, replica, "encoded", began, trace)

    def _outcome(self, images: tuple[Any, ...], replica: str | None, outcome: str, began: float,
                 trace: RequestTrace | None) -> tuple[Any, ...]:
        self.pool.metrics.routing.decisions.inc(reason=outcome, pool="encode")
        if trace is not None:
            trace.encoded(replica, outcome, began)
        return images
