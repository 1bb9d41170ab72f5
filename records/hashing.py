"""The block-hash chain shared by every engine and the router.

    hash_i = sha256(ROOT if i == 0 else hash_{i-1} || tokens of block i || extra_keys)

over full blocks only. Tokens are encoded as little-endian int64 and `extra_keys` (LoRA name, cache
salt, ...) as UTF-8 of their `repr`, so the value is identical in every process and on every machine;
Python's `hash()` is never used (its per-process seed gave vLLM a silent 0% cross-process hit rate).
A block hash is 32 raw bytes; `.hex()` it for logs and JSON.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from hashlib import sha256

BlockHash = bytes

# Fixed, documented root: the parent of block 0. Changing it (or the encoding) changes every hash,
# so it carries a version.
HASH_SEED = b"pdserve-block-hash-v1"
ROOT_HASH: BlockHash = hashlib.sha256(HASH_SEED).digest()
_BIG_ENDIAN = sys.byteorder == "big"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(ROOT_HASH if parent is None else parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    parent: BlockHash | None = None,
    start_block: int = 0,
    items: Sequence[tuple[int, int, bytes]] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`.

    `extra_keys` apply to every block (a LoRA or a cache salt changes the KV of the whole sequence).
    `items` (offset, length, digest): inputs whose embeddings replace those of tokens [offset,
    offset + length) (an image's placeholder tokens, records/multimodal.py); a block holding any of
    their tokens also keys on their digests, so two prompts alike but for an image part at the
    first block that holds it. A trailing partial block is not hashed. (`hash_block`'s values,
    with the tokens packed once.)
    """
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    if items:
        hashes = []
        for b in range(start_block, num_full):
            lo, hi = b * block_size, (b + 1) * block_size
            keys = tuple(extra_keys) + tuple(digest.hex() for offset, length, digest in items
                                             if offset < hi and lo < offset + length)
            parent = hash_block(parent, token_ids[lo:hi], keys)
            hashes.append(parent)
        return hashes
    packed = array("q", token_ids[start_block * block_size:num_full * block_size])
    if _BIG_ENDIAN:
        packed.byteswap()
    data = memoryview(packed.tobytes())
    extra = repr(tuple(extra_keys)).encode() if extra_keys else b""
    step = block_size * 8
    hashes: list[BlockHash] = []
    for offset in range(0, len(data), step):
        h = sha256(ROOT_HASH if parent is None else parent)
        h.update(data[offset:offset + step])
        if extra:
            h.update(extra)
        parent = h.digest()
        hashes.append(parent)
    return hashes
