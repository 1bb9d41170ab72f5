"""Leases: how a prefill engine keeps a finished prompt's blocks for a remote pull. The engine owns
the slots and tokens (`LeaseSlots`, one `Lease` per leased request); every rank's worker mirrors
them in a `LeaseTable` whose words a remote reader checks after pulling."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from records.request import BlockHolder, Request

# Leases one prefill worker can hold at once (one slot each); beyond that a finished prefill frees
# its blocks at once and returns no transfer parameters (the decode side then computes the prompt).
MAX_LEASES = 4096


@dataclass(slots=True)
class Lease:
    request: Request | BlockHolder      # what holds the blocks (freed when the lease ends)
    slot: int
    token: int
    expires_at: float               # time.time()


class LeaseSlots:
    """The engine's lease slots and tokens (every rank's worker mirrors them in its LeaseTable).
    Tokens start at a random base so that a restarted engine never reissues an old token."""

    def __init__(self, num_slots: int = MAX_LEASES) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._next_token = random.getrandbits(40) << 20 | 1

    @property
    def num_free(self) -> int:
        """Slots not leased."""
        return len(self._free)

    def take(self) -> tuple[int, int] | None:
        if not self._free:
            return None
        token, self._next_token = self._next_token, self._next_token + 1
        return self._free.pop(), token

    def free(self, slot: int) -> None:
        self._free.append(slot)


class LeaseTable:
    """A prefill worker's lease words: slot -> token of the live lease, 0 when free.

    The words live in a tensor so a remote reader (NIXL) can read a lease's token after pulling its
    blocks."""

    def __init__(self, num_slots: int = MAX_LEASES) -> None:
        import torch  # noqa: PLC0415 - a prefill rank's (the scheduler side imports this module without torch)

        self.words = torch.zeros(num_slots, dtype=torch.int64)
        self.block_ids: dict[int, list[int]] = {}

    def hold(self, slot: int, token: int, block_ids: list[int]) -> None:
        self.words[slot] = token
        self.block_ids[slot] = list(block_ids)

    def is_live(self, slot: int, token: int) -> bool:
        return 0 <= slot < len(self.words) and token != 0 and int(self.words[slot]) == token

    def release(self, slot: int) -> None:
        """Clear the word first: from here on a reader sees the lease gone."""
        if slot in self.block_ids:
            self.words[slot] = 0
            del self.block_ids[slot]
