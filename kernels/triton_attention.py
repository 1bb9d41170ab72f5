"""Triton paged attention: flash-decoding for decode steps and a tiled prefill/extend kernel.

Both read K/V straight from the paged cache (`[2, num_blocks, block_size, num_kv_heads, head_dim]`,
the layout of kernels/reference.py) through the block tables, one tile of tokens at a time, and keep
the online-softmax statistics (running max m, running sum l, unnormalized output) in registers; no
T x T score matrix is ever materialized. Scores and statistics are fp32 whatever the cache dtype.

Decode: each program takes one sequence, one KV head and every query head of that head's group
(GQA/MQA: K/V are read once per group, not once per query head) over one partition of the context.
When batch x KV heads leaves the GPU's multiprocessors idle the context is split over several
partitions and a second kernel merges their statistics (flash-decoding), so a single sequence with a
32k context still fills the chip. The number of partitions depends only on the batch size and the
block table's width, never on the lengths, so a decode step can be captured in a CUDA graph.

Prefill/extend: each program takes BLOCK_M query rows of one segment and one head and walks the
segment's K/V (cached prefix, then this chunk) up to its causal limit.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE, raw

# Context tokens per decode program at the least; below this a partition's fixed cost dominates.
MIN_PARTITION_TOKENS = 256
PROGRAMS_PER_SM = 2         # decode splits the context until about this many programs per SM
TILE_TOKENS = 64            # tokens per inner step of both kernels (several pages at block size 16)
PREFILL_BLOCK_M = 64
# Launch options (Triton's warps per program and software-pipelining depth); benchmarks/kernels.py
# --sweep measures the alternatives.
DECODE_LAUNCH = {"num_warps": 4, "num_stages": 3}
PREFILL_LAUNCH = {"num_warps": 4, "num_stages": 2}
# An fp8 cache's decode, where the context is not split (enough sequences to fill the GPU), reads
# twice the tokens per step (the same bytes as a bf16 tile), with its own launch
# (benchmarks/fp8_kv_variants.py on an H200: 0.7-0.8x bf16's speed at 64 sequences with the bf16
# settings, 1.1x with these; split launches, fewer tiles each, kept the bf16 settings' lead).
FP8_DECODE_TILE_TOKENS = 128
FP8_DECODE_LAUNCH = {"num_warps": 4, "num_stages": 2}
# How an fp8 cache's bytes are widened: None picks the GPU's own e4m3 conversion where it has one
# (sm_89 and later) and bit arithmetic elsewhere; True / False force one (benchmarks and tests).
HARDWARE_FP8: bool | None = None


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """(Asked once per device: decode_partitions runs in every layer of every decode step.)"""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4        # the interpreter: small, so CPU tests exercise the split path


@functools.lru_cache(maxsize=None)
def _has_fp8_conversion(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 itself (sm_89 and later); older ones keep the bit arithmetic."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs: full fp32 products (Triton's default for fp32 is tf32, ~3e-4 relative error,
    # which would break token-identity with transformers in fp32).
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)



@triton.jit
def _load_kv(ptr, mask, like, FP8: tl.constexpr):
    """Cache values as `like`'s dtype; an fp8 cache (read as bytes; its scale is applied by the
    caller) widened exactly, both ways giving the same values: FP8 == 2 by the GPU's e4m3 -> fp16
    conversion (one instruction per two values), FP8 == 1 as the C++ kernels do it: e4m3's bits
    under fp16's, converted, times 2^8 (some ten integer and float operations per value, which
    bounded the kernels at long contexts on an H200)."""
    # One return after the branch: compiled Triton checks every return's type, including those of
    # the branch a constexpr leaves out (the interpreter does not, so only a GPU caught this).
    if FP8 == 2:
        b = tl.load(ptr, mask=mask, other=0)
        out = b.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(like.dtype)
    elif FP8 == 1:
        b = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        out = (h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(like.dtype)
    else:
        out = tl.load(ptr, mask=mask, other=0.0)
    return out


@triton.jit
def _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row_ptr, t, seq_len, q_pos, kvh, d, dmask,
                 stride_kb, stride_ks, stride_kh, scale, window, softcap, BLOCK_SIZE: tl.constexpr,
                 TILE: tl.constexpr, BOUNDED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                 FP8: tl.constexpr, WINDOWED: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    """One online-softmax step over the TILE tokens from position t: scores of q against their
    keys, running max m and sum l rescaled, values accumulated. BOUNDED masks positions >= seq_len,
    CAUSAL positions after each query row's q_pos; a tile with neither needs no mask at all.
    WINDOWED also masks positions at or before q_pos - window (a row may then see none of the
    tile: its max stays -inf and 0 stands in for it); SOFTCAP caps the scores at +-softcap (tanh)."""
    pos = t + tl.arange(0, TILE)
    if BOUNDED:
        pmask = pos < seq_len
        page = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pmask, other=0)
        kv_mask = pmask[:, None] & dmask[None, :]
    else:
        page = tl.load(table_row_ptr + pos // BLOCK_SIZE)
        kv_mask = dmask[None, :]
    off = page.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    k = _load_kv(k_ptr + off[:, None] + d[None, :], kv_mask, q, FP8)
    s = _dot(q, tl.trans(k), IEEE).to(tl.float32) * scale
    if SOFTCAP:     # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    if CAUSAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pmask[None, :], s, float("-inf"))
    elif BOUNDED:
        s = tl.where(pmask[None, :], s, float("-inf"))
    if WINDOWED:
        s = tl.where(pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if WINDOWED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    v = _load_kv(v_ptr + off[:, None] + d[None, :], kv_mask, q, FP8)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE).to(tl.float32)
    return m_new, l, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_tb, scale, v_scale,
                   num_heads, num_splits, tiles_per_split, window, softcap,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                   WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    start = split * tiles_per_split * TILE
    end = tl.minimum(seq_len, start + tiles_per_split * TILE)
    q_pos = 0
    if WINDOWED:        # only the last `window` keys: the tiles before them are skipped
        q_pos = tl.full([GROUP_PAD], 0, tl.int32) + seq_len - 1
        start = tl.maximum(start, tl.maximum(seq_len - window, 0) // TILE * TILE)
    for t in range(start, end, TILE):
        m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_ptr + b * stride_tb, t, seq_len, q_pos, kvh,
                                 d, dmask, stride_kb, stride_ks, stride_kh, scale, window, softcap, BLOCK_SIZE,
                                 TILE, True, False, IEEE, FP8, WINDOWED, SOFTCAP)
    acc = acc * v_scale                 # an fp8 cache's V scale (1.0 otherwise)
    if SPLIT:
        # Unnormalized partial output and its (m, l): [batch, heads, splits, ...].
        row = (b * num_heads + heads) * num_splits + split      # (b, head, split)
        tl.store(part_o_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=gmask)
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]      # l == 0: a padded row (seq_len 0)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_reduce_kernel(part_o_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                          num_splits, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    smask = s < num_splits
    row = (b * num_heads + h) * num_splits + s
    m = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)            # every split empty (padding)
    w = tl.where(smask & (l > 0), tl.exp(m - m_max), 0.0)
    d = tl.arange(0, D_PAD)
    o = tl.load(part_o_ptr + row[:, None] * D_PAD + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w * l, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def _tile(block_size: int, tokens: int = TILE_TOKENS) -> int:
    """Tokens per inner step of both kernels: `tokens`, or one block where blocks are larger."""
    return max(tokens, block_size)


def decode_partitions(batch: int, num_kv_heads: int, max_len: int, block_size: int, device: torch.device,
                      fp8: bool = False) -> tuple[int, int, int]:
    """(partitions, tiles per partition, tokens per tile) for a decode launch (over an fp8 cache if
    `fp8`): split only while programs are fewer than about PROGRAMS_PER_SM per multiprocessor, and
    keep each partition at least MIN_PARTITION_TOKENS."""
    tile = _tile(block_size)
    tiles = max(1, triton.cdiv(max_len, tile))
    want = triton.cdiv(PROGRAMS_PER_SM * _num_sms(device), batch * num_kv_heads)
    splits = max(1, min(want, triton.cdiv(max_len, MIN_PARTITION_TOKENS), tiles))
    if splits == 1 and fp8:
        tile = _tile(block_size, FP8_DECODE_TILE_TOKENS)
        return 1, max(1, triton.cdiv(max_len, tile)), tile
    per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per_split), per_split, tile


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V pools as the kernels read them (an fp8 cache as bytes), and `_load_kv`'s FP8: 0 for
    a cache in the model's dtype, else how its bytes are widened (HARDWARE_FP8)."""
    cache = raw(kv_cache)
    fp8 = 0
    if kv_cache.dtype == FP8_DTYPE:
        hardware = _has_fp8_conversion(kv_cache.device) if HARDWARE_FP8 is None else HARDWARE_FP8
        fp8 = 2 if hardware else 1
    return cache[0], cache[1], fp8


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as kernels.reference.decode_attention; a seq_len of 0 gives a zero row."""
    batch, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    max_len = block_tables.shape[1] * block_size
    k_cache, v_cache, fp8 = cache_views(kv_cache)
    splits, per_split, tile = decode_partitions(batch, num_kv_heads, max_len, block_size, query.device, fp8 > 0)
    if splits > 1:
        part_o = torch.empty(batch * num_heads * splits * d_pad, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=query.device)
    else:
        part_o = part_ml = out      # unused
    common = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                  D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=tile,
                  IEEE=query.dtype == torch.float32, FP8=fp8)
    _decode_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), scale * k_scale, v_scale,
        num_heads, splits, per_split, int(window), float(softcap), SPLIT=splits > 1, WINDOWED=window > 0,
        SOFTCAP=softcap > 0, **common,
        **(FP8_DECODE_LAUNCH if fp8 and splits == 1 else DECODE_LAUNCH))     # decode_partitions' rule
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_o, part_ml, out, out.stride(0), out.stride(1), num_heads, splits,
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_tb, scale, v_scale, window, softcap,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                    IEEE: tl.constexpr, FP8: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seg)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + seg)
    seq_len = tl.load(seq_len_ptr + seg)
    ctx = seq_len - q_len                       # tokens before this segment (cached prefix)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    q_pos = ctx + rows
    kvh = h // GROUP
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Keys before the tile's first row are visible to every row: those tiles need no mask. The
    # rest, up to the last row's position, are masked causally.
    full_end = (ctx + tile * BLOCK_M) // TILE * TILE
    table_row = table_ptr + seg * stride_tb
    hi = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
    if WINDOWED:
        # From the first row's window on, every tile masked (each row's window starts elsewhere).
        for t in range(tl.maximum(ctx + tile * BLOCK_M - window + 1, 0) // TILE * TILE, hi, TILE):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t, seq_len, q_pos, kvh, d, dmask,
                                     stride_kb, stride_ks, stride_kh, scale, window, softcap, BLOCK_SIZE, TILE,
                                     True, True, IEEE, FP8, True, SOFTCAP)
    else:
        for t in range(0, full_end, TILE):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t, seq_len, q_pos, kvh, d, dmask,
                                     stride_kb, stride_ks, stride_kh, scale, window, softcap, BLOCK_SIZE, TILE,
                                     False, False, IEEE, FP8, False, SOFTCAP)
        for t in range(full_end, hi, TILE):
            m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_row, t, seq_len, q_pos, kvh, d, dmask,
                                     stride_kb, stride_ks, stride_kh, scale, window, softcap, BLOCK_SIZE, TILE,
                                     True, True, IEEE, FP8, False, SOFTCAP)
    out = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


class PackedPrefill:
    """The step's prefill segments as device tensors, built once per step (`pack_prefill`) and read
    by every layer."""

    def __init__(self, block_tables: list[torch.Tensor], query_lens: list[int], seq_lens: list[int],
                 device: torch.device) -> None:
        width = max(t.numel() for t in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32, device=device)
        for i, t in enumerate(block_tables):
            tables[i, :t.numel()] = t
        starts = [0]
        for n in query_lens[:-1]:
            starts.append(starts[-1] + n)
        self.tables = tables
        self.q_starts = torch.tensor(starts, dtype=torch.int32, device=device)
        self.q_lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.max_q_len = max(query_lens)


def pack_prefill(block_tables: list[torch.Tensor], query_lens: list[int], seq_lens: list[int],
                 device: torch.device) -> PackedPrefill | None:
    """kernels.reference.pack_prefill's contract."""
    return PackedPrefill(block_tables, query_lens, seq_lens, device) if query_lens else None


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: list[torch.Tensor],
                      query_lens: list[int], seq_lens: list[int], scale: float,
                      packed: PackedPrefill | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                      window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as kernels.reference.prefill_attention."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    if not query_lens:
        return out
    pk = packed or PackedPrefill(block_tables, query_lens, seq_lens, query.device)
    k_cache, v_cache, fp8 = cache_views(kv_cache)
    grid = (triton.cdiv(pk.max_q_len, PREFILL_BLOCK_M), len(query_lens), num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, pk.tables, pk.q_starts, pk.q_lens, pk.seq_lens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pk.tables.stride(0), scale * k_scale, v_scale,
        int(window), float(softcap), WINDOWED=window > 0, SOFTCAP=softcap > 0, GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M, TILE=_tile(block_size),
        IEEE=query.dtype == torch.float32, FP8=fp8, **PREFILL_LAUNCH)
    return out
