"""Pure-torch kernels: the CPU path of the engine and the oracle every Triton kernel is tested against.

KV cache layout (per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`; the slot of token i
of a sequence is `block_table[i // block_size] * block_size + i % block_size`.

An fp8 cache (`torch.float8_e4m3fn`, kv_cache_dtype="fp8") stores K / k_scale and V / v_scale,
saturated to e4m3's +-448 and rounded to nearest even (`quantize_kv`); attention reads K as the
stored value times k_scale (`dequantize_kv`) and likewise V. The attention and write kernels take
the layer's scales as `k_scale` / `v_scale` (1.0, and ignored, for a cache in the model's dtype).

Both attention kernels take a layer's `window` (a sliding window: the query at position p sees keys
p - window + 1 .. p, transformers' `sliding_window`; 0: the whole context) and `softcap` (Gemma 2's
logit soft-capping: scores become softcap * tanh(score / softcap) before the mask; 0: none). A
windowed sequence's block table may point anywhere before its window (its freed blocks): those
positions are masked, never weighted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gguf_format import GGUF_BLOCK, GGUF_BLOCK_BYTES, dequantize_gguf

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0             # e4m3fn's largest finite value


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as fp8 e4m3 (computed in fp32, saturated to +-FP8_MAX, rounded to nearest even):
    what an fp8 cache stores. Every kernel set writes through this."""
    x = x.float()
    if scale != 1.0:
        x = x / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_kv_rows(key: torch.Tensor, value: torch.Tensor, k_scale: float, v_scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's K and V rows as an fp8 cache stores them, viewed as bytes (what every kernel set's
    slot write copies into an fp8 cache's uint8 view)."""
    return quantize_kv(key, k_scale).view(torch.uint8), quantize_kv(value, v_scale).view(torch.uint8)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values as `dtype` (fp8: times the layer's scale; exact in fp32/bf16/fp16 at scale 1)."""
    if x.dtype != FP8_DTYPE:
        return x.to(dtype)
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x


def raw(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as bytes where it is fp8 (torch lacks index_copy_ and friends for fp8), else itself."""
    return kv_cache.view(torch.uint8) if kv_cache.dtype == FP8_DTYPE else kv_cache


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new K/V rows into their slots. key/value: [num_tokens, num_kv_heads, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.dtype == FP8_DTYPE:
        key, value = quantize_kv_rows(key, value, k_scale, v_scale)
    flat = raw(kv_cache).view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of the cache: [2, len(block_ids), block_size, num_kv_heads, head_dim].

    Row-wise index_select over a [2 * num_blocks, block_bytes] view: each block is one contiguous
    row, which copies several times faster than element-wise advanced indexing (6x for bf16 here).
    """
    num_blocks = kv_cache.shape[1]
    flat = kv_cache.view(2 * num_blocks, -1)
    rows = flat.index_select(0, torch.cat([block_ids, block_ids + num_blocks]))
    return rows.view(2, block_ids.numel(), *kv_cache.shape[2:])


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `num_tokens` tokens: two [num_tokens, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_tokens // block_size)
    kv = gather_blocks(kv_cache, block_table[:num_blocks])  # [2, n, block_size, kvh, d]
    kv = kv.flatten(1, 2)[:, :num_tokens]
    return kv[0], kv[1]


def pack_prefill(block_tables: list[torch.Tensor], query_lens: list[int], seq_lens: list[int],
                 device: torch.device) -> None:
    """A step's prefill segments in the form this kernel set's `prefill_attention` reads them,
    built once per step (engine/model/layers/attention.py: AttentionBackend) and passed to every layer
    as `packed`. The reference reads the lists themselves: nothing to build."""
    return None


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: list[torch.Tensor],
                      query_lens: list[int], seq_lens: list[int], scale: float, packed: object = None,
                      k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0, softcap: float = 0.0,
                      spans: list[list[tuple[int, int]]] | None = None) -> torch.Tensor:
    """Causal attention of variable-length query segments against paged K/V.

    query: [num_tokens, num_heads, head_dim], the segments laid end to end. Segment i holds the last
    `query_lens[i]` of its sequence's `seq_lens[i]` tokens, whose K/V are already in the cache
    (cached prefix + this chunk), so one call serves full prefill, chunked prefill and prefix hits.
    `packed`: what the kernel set's `pack_prefill` made of the same segments (or None: made here).
    `spans` (this reference only): segment i's position ranges [a, b) whose tokens also see one
    another's later keys (an image's tokens in Gemma 3; the window still bounds them).
    Returns [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    # On CPU, SDPA's flash kernel runs ~2x faster in fp32 than in bf16 for prefill-sized blocks
    # (its bf16 path accumulates in fp32 anyway, so upcasting changes rounding only at the output).
    compute_dtype = torch.float32 if query.device.type == "cpu" else query.dtype
    start = 0
    for i, (block_table, q_len, seq_len) in enumerate(zip(block_tables, query_lens, seq_lens)):
        both_ways = spans[i] if spans else ()
        q = query[start:start + q_len].transpose(0, 1).to(compute_dtype)    # [H, q_len, d]
        k, v = gather_kv(kv_cache, block_table, seq_len)  # [seq_len, kvh, d]
        k = dequantize_kv(k.transpose(0, 1)[None], k_scale, compute_dtype)    # [1, kvh, seq_len, d]
        v = dequantize_kv(v.transpose(0, 1)[None], v_scale, compute_dtype)
        # 4-D inputs: 3-D ones fall back to SDPA's slow math kernel on CPU.
        if q_len == seq_len and not window and not softcap and not both_ways:
            o = F.scaled_dot_product_attention(q[None], k, v, is_causal=True, scale=scale, enable_gqa=True)[0]
        else:
            # Query row r sits at position seq_len - q_len + r and sees keys up to it (and, with a
            # window, from p - window + 1). With a mask, enable_gqa is ~40x slower on CPU, so the
            # query heads sharing a KV head are stacked into one [group * q_len] row block instead
            # (no copy of K/V).
            rows = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            keys = torch.arange(seq_len, device=q.device)[None, :]
            mask = keys <= rows                                                 # [q_len, seq_len]
            for a, b in both_ways:
                mask = mask | ((rows >= a) & (rows < b) & (keys >= a) & (keys < b))
            if window:
                mask = mask & (keys > rows - window)
            qg = q.reshape(num_kv_heads, group * q_len, head_dim)[None]
            o = _attend(qg, k, v, mask.repeat(group, 1), scale, softcap)
            o = o.reshape(num_heads, q_len, head_dim)      # (CUDA SDPA returns it strided)
        out[start:start + q_len] = o.transpose(0, 1)     # (cast back to the activations' dtype)
        start += q_len
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float) -> torch.Tensor:
    """Masked attention (mask True: attend), by SDPA, or with soft-capped scores as transformers'
    eager Gemma 2 computes them (SDPA has no soft-capping)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence against its paged K/V.

    query: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks] (padded with any valid
    id); seq_lens: [batch] (the query's own K/V included). Returns [batch, num_heads, head_dim].

    Each row is computed over the batch's longest context, masked. When the rows come sorted by
    length (the model runner orders them so) and that padding is large, a CPU batch is cut into
    groups of similar length, each padded only to its own longest.
    """
    batch = query.shape[0]
    extra = (scale, k_scale, v_scale, window, softcap)
    if batch < DECODE_GROUP_MIN_BATCH or query.device.type != "cpu":    # (no host sync on a GPU)
        return _decode_padded(query, kv_cache, block_tables, seq_lens, *extra)
    bounds = _decode_groups(seq_lens.tolist(), kv_cache.shape[2])
    if len(bounds) == 1:
        return _decode_padded(query, kv_cache, block_tables, seq_lens, *extra)
    out = torch.empty_like(query)
    for start, end, num_blocks in bounds:
        out[start:end] = _decode_padded(query[start:end], kv_cache, block_tables[start:end, :num_blocks],
                                        seq_lens[start:end], *extra)
    return out


# Groups for a length-sorted decode batch of DECODE_GROUP_MIN_BATCH rows or more (at 16 rows they
# gained nothing here): at least DECODE_GROUP_MIN_ROWS rows each, at most DECODE_MAX_GROUPS, and only
# where they save at least DECODE_MIN_SAVING of the padded K/V (each costs a few small ops per layer).
DECODE_GROUP_MIN_BATCH = 32
DECODE_GROUP_MIN_ROWS = 8
DECODE_MAX_GROUPS = 8
DECODE_MIN_SAVING = 0.2


def _decode_groups(lens: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """[(start, end, blocks)] row ranges of a decode batch: one range, or several where `lens` is
    sorted ascending and splitting it cuts the gathered blocks by DECODE_MIN_SAVING."""
    batch = len(lens)
    blocks = [-(-n // block_size) for n in lens]
    whole = [(0, batch, max(blocks))]
    if any(a > b for a, b in zip(lens, lens[1:])):
        return whole
    num = min(DECODE_MAX_GROUPS, batch // DECODE_GROUP_MIN_ROWS)
    cuts = [batch * i // num for i in range(num + 1)]
    groups = [(a, b, blocks[b - 1]) for a, b in zip(cuts, cuts[1:])]
    grouped = sum((b - a) * w for a, b, w in groups)
    return groups if grouped <= (1 - DECODE_MIN_SAVING) * batch * max(blocks) else whole


def _decode_padded(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, k_scale: float, v_scale: float, window: int = 0,
                   softcap: float = 0.0) -> torch.Tensor:
    batch, max_blocks = block_tables.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = query.shape[1] // num_kv_heads
    kv = gather_blocks(kv_cache, block_tables.flatten())
    kv = kv.view(2, batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(2, 3)  # [2, B, kvh, L, d]
    max_len = max_blocks * block_size
    keys = torch.arange(max_len, device=query.device)[None, :]
    mask = keys < seq_lens[:, None]                                                  # [B, max_len]
    if window:
        mask &= keys >= seq_lens[:, None] - window
    # The `group` query heads sharing a KV head are that head's rows: [B, kvh, group, d]. SDPA with
    # a mask and enable_gqa instead is 4-6x slower on CPU in bf16.
    k, v = dequantize_kv(kv[0], k_scale, query.dtype), dequantize_kv(kv[1], v_scale, query.dtype)
    out = _attend(query.view(batch, num_kv_heads, group, head_dim), k, v, mask[:, None, None, :], scale,
                  softcap)                                # [B, kvh, group, d]
    return out.reshape(batch, num_kv_heads * group, head_dim)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              expert_start: int = 0) -> torch.Tensor:
    """A mixture of SiLU-gated experts: out[t] = sum over its k experts e of weights[t, j] *
    w2[e] (silu(w1[e] x) * (w3[e] x)), experts in ascending order (transformers' order of sums).

    x: [T, H]; w13: [E_local, 2 I, H] (w1's rows, then w3's); w2: [E_local, H, I]; weights: [T, k]
    (float32); ids: [T, k] global expert ids, of which this call holds [expert_start, + E_local)
    (expert parallelism: the others contribute nothing here). Returns [T, H] in x's dtype.
    """
    out = torch.zeros(x.shape, dtype=torch.float32 if x.dtype != torch.float32 else x.dtype, device=x.device)
    local = ids - expert_start
    for e in torch.unique(local[(local >= 0) & (local < w13.shape[0])]).tolist():
        token, slot = torch.where(local == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out.to(x.dtype)


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=kv_caches[0].device)
    dst = torch.tensor([d for _, d in pairs], device=kv_caches[0].device)
    for kv_cache in kv_caches:
        kv_cache = raw(kv_cache)
        kv_cache[:, dst] = kv_cache[:, src]


def swap_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
    """Copy blocks between two pools (device <-> CPU) in every layer: src_caches[l][:, s] -> dst[l][:, d]."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
        src_cache, dst_cache = raw(src_cache), raw(dst_cache)
        moved = src_cache[:, src.to(src_cache.device)].to(dst_cache.device, non_blocking=True)
        dst_cache[:, dst.to(dst_cache.device)] = moved


def softmax_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest entries of x [rows, n] float32 as probabilities under the row's softmax,
    descending, and their indices [rows, k] (the order of equal values is topk's; the C++ kernel
    puts the earlier index first). A row without a distribution (a NaN, a +inf, only -inf) has NaN
    probabilities, as softmax makes them."""
    return x.softmax(dim=-1).topk(k, dim=-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of a [rows, n] tensor: the first maximum (the first NaN in a row with one).
    `max(dim)`, not `argmax`: the same result, 4x faster on CPU (torch 2.13)."""
    return x.max(dim=-1).indices


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalized, and the new residual; computed in fp32 like transformers."""
    if residual is not None:
        x = x + residual
    residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2 * inter] holding [gate | up] (the fused gate/up projection)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves), as transformers' Llama.

    query: [T, H, d], key: [T, kvh, d]; cos/sin: [T, d] already in the activations' dtype.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --- GGUF quantized weights (their format: kernels/gguf_format.py) ----------------------------------
def pack_gguf(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """A kernel set's own form of a weight's GGUF blocks, made once at load; every set's
    `gguf_linear` takes what its `pack_gguf` returned. Here (and in the C++ set): the file's blocks."""
    return blocks


def unpack_gguf(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """`pack_gguf`'s inverse: the file's blocks again (before a weight update rewrites some rows)."""
    return packed


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [M, in_features] times the GGUF weight's transpose, in fp32 (the weight dequantized exactly
    as llama.cpp does, x widened), rounded to x's dtype: the oracle of the compiled kernels."""
    return F.linear(x.float(), dequantize_gguf(blocks, qtype)).to(x.dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) quantized per block of 32 features, as llama.cpp quantizes
    activations for its integer dot products: dx = max|x| / 127, q = round-half-even(x * (1 / dx))
    (0 for an all-zero block). Returns q int8 [M, K / 32, 32] and dx fp32 [M, K / 32, 1]."""
    xb = x.float().reshape(x.shape[0], -1, GGUF_BLOCK)
    dx = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(xb * inv).to(torch.int8), dx


def gguf_linear_int8(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """`quantize_activations`: x [M, in_features] quantized per block of 32 features
    (`quantize_rows_int8`) times the GGUF weight's integers, per block exactly in integers, then
    scaled in fp32: sum_b dw_b dx_b sum_j q_bj qx_bj (+ Q4_1's m_b times the block's exact sum of x),
    rounded to x's dtype. The oracle of the compiled kernel; lossy against `gguf_linear` by the
    activations' rounding (about 0.4% of a block's largest value)."""
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type must be one of {sorted(GGUF_BLOCK_BYTES)}; got {qtype!r}")
    qx, dx = quantize_rows_int8(x)                                           # [M, n, 32], [M, n, 1]
    b = blocks.view(blocks.shape[0], -1, GGUF_BLOCK_BYTES[qtype])            # [N, n, bytes]
    dw = b[..., 0:2].contiguous().view(torch.float16).float()                # [N, n, 1]
    if qtype == "Q8_0":
        qw = b[..., 2:].contiguous().view(torch.int8).long()
    else:
        qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
        qw = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long() - (8 if qtype == "Q4_0" else 0)
    dots = torch.einsum("mbj,nbj->mnb", qx.long(), qw)                      # exact integers [M, N, n]
    out = (dw[..., 0].unsqueeze(0) * dx[..., 0].unsqueeze(1) * dots.float()).sum(-1)
    if qtype == "Q4_1":
        mins = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]     # [N, n]
        out = out + x.float().reshape(x.shape[0], -1, GGUF_BLOCK).sum(-1) @ mins.T
    return out.to(x.dtype)


# --- fp8 weights --------------------------------------------------------------------------------
# An fp8 linear holds its weight [out_features, in_features] as e4m3 with an fp32 scale per output
# feature (w = q * scale). Its input is quantized per row at run time: each row of x divided by its
# amax / 448 (`quantize_fp8_rows`), so that a row with outliers does not flatten the others.

def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 with an fp32 scale per row [M, 1] (amax / 448; tiny for an all-zero row)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times an e4m3 weight [N, K] (fp32 scales [N]): x quantized per row, the product of
    the dequantized operands in fp32, rounded to x's dtype. The oracle of `fp8_linear_scaled_mm`."""
    xq, x_scale = quantize_fp8_rows(x)
    return F.linear(xq.float() * x_scale, weight.float() * scale.reshape(-1, 1)).to(x.dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         quantize_rows=quantize_fp8_rows) -> torch.Tensor:
    """`fp8_linear` on torch._scaled_mm: an fp8 x fp8 GEMM with fp32 accumulation and the row and
    column scales applied to its output (cuBLASLt on CUDA with compute capability 8.9 or more,
    oneDNN on CPU). Row-wise scales need a bf16 output on CUDA; it is rounded to x's dtype.
    `quantize_rows` (quantize_fp8_rows' contract) lets a kernel set quantize x its own way."""
    xq, x_scale = quantize_rows(x)
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1).float(),
                            out_dtype=out_dtype).to(x.dtype)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor,
             starts: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, sub_offsets: torch.Tensor
             ) -> torch.Tensor:
    """Batched LoRA, in place: out[t] += B_s A_s x[t] for every row t of every adapter group.

    x [T, in], out [T, out]; `a` [slots, max_rank, subs, in] holds each slot's A per fused output
    (rank j of output i is row (j, i)), `bt` [slots, max_rank, out] each slot's B transposed (and
    scaled), zero beyond the adapter's rank. Group g is rows[starts[g]:starts[g + 1]] (indices into
    x and out, on x's device) under slot slots[g] of rank ranks[g]; `sub_offsets` [subs + 1] splits
    out's features into the fused outputs. starts, slots, ranks and sub_offsets are int64 CPU
    tensors. Rows in no group are left as they are. Two matmuls per group and fused output (the
    shrink, rounded to x's dtype, then the expand): the oracle of every kernel set's lora_add.
    """
    offsets, subs = sub_offsets.tolist(), a.shape[2]
    bounds = starts.tolist()
    for g, (slot, rank) in enumerate(zip(slots.tolist(), ranks.tolist())):
        idx = rows[bounds[g]:bounds[g + 1]]
        shrunk = x.index_select(0, idx) @ a[slot, :rank].reshape(rank * subs, -1).t()
        delta = torch.cat([shrunk[:, i::subs] @ bt[slot, :rank, offsets[i]:offsets[i + 1]] for i in range(subs)],
                          dim=1)
        out.index_add_(0, idx, delta)
    return out
