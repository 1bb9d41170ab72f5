// pdserve CPU kernels: paged decode attention that reads K/V straight from the block table (no
// gather, no padding to the batch's longest context), and RMSNorm, rotary, silu-and-mul and the K/V
// slot write in one pass each; vectorized through GCC vector types (-O3 -march=native) and threaded
// with ATen's pool. Built on first use by kernels/cpu_ops.py; the pure-torch kernels/reference.py is
// the oracle they are tested against.
//
// KV cache layout (per layer): [2, num_blocks, block_size, num_kv_heads, head_dim].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common.h"
#include "work_split.h"

namespace {

// Running state of one query head over the token ranges seen so far (online softmax).
struct Row {
  float max, denom;
};

// The fold tree of chunk_rows below over the chunk's tokens [t0, t0 + Tokens): out[r] holds row r's
// scores of those tokens, token t0 + bitrev(j) in lane j of each Tokens-lane group. leaf(t, d) makes
// the R rows' dot-product vectors of token t. Depth first, so that each row keeps at most one partial
// vector per level live (log2(kLanes) + 1), not kLanes.
template <int R, int Tokens, typename Leaf>
__attribute__((always_inline)) inline void score_tree(int t0, const Leaf& leaf, Lanes (&out)[R]) {
  if constexpr (Tokens == 1) {
    leaf(t0, out);
  } else {
    Lanes a[R], b[R];
    score_tree<R, Tokens / 2>(t0, leaf, a);
    score_tree<R, Tokens / 2>(t0 + Tokens / 2, leaf, b);
    for (int r = 0; r < R; ++r) out[r] = fold<kLanes / Tokens>(a[r], b[r]);
  }
}

// How chunk_rows tiles its work, by head size D: rows (query heads) per call, and how many of the
// D / kLanes vectors of a K row (k_block) and of each output row (v_block) are held in registers at
// once. With AVX-512's 32 registers a row tile's whole K row and outputs fit; AVX2 has 16, and holding
// them whole spilled to the stack on every token (tiles of 1-4 rows and blocks of 1-8 vectors all
// measured alike there: docs/perf/journal.md §7k).
template <int D>
struct DecodeTiling {
  static constexpr int V = D / kLanes;
#ifdef __AVX512F__
  static constexpr int rows = V <= 4 ? 4 : V <= 8 ? 2 : 1;
  static constexpr int k_block = V, v_block = V;
#else
  static constexpr int rows = 3;
  static constexpr int k_block = V < 2 ? V : 2, v_block = V < 2 ? V : 2;
#endif
};

// R query heads (rows) of one KV head against a chunk of up to kLanes tokens (k, v: `count` token
// rows, `stride` elements apart, the KV head at `head_offset` in each): scores, then the
// online-softmax update of each row's max, denominator and unnormalized output `acc` ([R][D/kLanes]).
// Templated on R so that the rows' query and output vectors stay in registers.
template <typename T, int D, int R>
inline void chunk_rows(const T* k, const T* v, int64_t stride, int64_t count, int64_t head_offset,
                       const Lanes* q, Row* rows, Lanes* acc, float softcap) {
  using Tiling = DecodeTiling<D>;
  constexpr int V = Tiling::V, KB = Tiling::k_block, VB = Tiling::v_block;
  constexpr int bits = __builtin_ctz(kLanes);
  // Each row's scores: the tokens' dot-product vectors go through the transpose-and-add tree as they are
  // made. Token t lands in lane bitrev(t) (and lane j holds token bitrev(j)).
  auto leaf = [&](int t, Lanes (&d)[R]) __attribute__((always_inline)) {
    const T* kt = k + (t < count ? t : 0) * stride + head_offset;   // padding tokens (t >= count): token 0
    for (int r = 0; r < R; ++r) d[r] = Lanes{};
#pragma GCC unroll 16
    for (int i0 = 0; i0 < V; i0 += KB) {
      Lanes kv[KB];
#pragma GCC unroll 16
      for (int i = 0; i < KB; ++i) kv[i] = load_lanes(kt + (i0 + i) * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) d[r] += q[r * V + i0 + i] * kv[i];
    }
  };
  Lanes scores[R];
  score_tree<R, kLanes>(0, leaf, scores);
  Lanes token;
  for (int j = 0; j < kLanes; ++j) token[j] = static_cast<float>(bitrev(j, bits));
  const auto valid = token < static_cast<float>(count);
  float p[R][kLanes];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const Lanes s = valid ? (softcap > 0.f ? soft_cap(scores[r], softcap) : scores[r]) : Lanes{} - INFINITY;
    const float m = std::max(rows[r].max, hmax(s));
    const Lanes e = valid ? exp_approx(s - m) : Lanes{};
    alpha[r] = rows[r].max == m ? 1.f : rows[r].max == -INFINITY ? 0.f : std::exp(rows[r].max - m);
    rows[r].denom = rows[r].denom * alpha[r] + hsum(e);
    rows[r].max = m;
    std::memcpy(p[r], &e, sizeof e);
  }
#pragma GCC unroll 16
  for (int i0 = 0; i0 < V; i0 += VB) {
    Lanes out[R][VB];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < VB; ++i) out[r][i] = acc[r * V + i0 + i] * alpha[r];
    for (int64_t t = 0; t < count; ++t) {
      const T* vt = v + t * stride + head_offset + i0 * kLanes;
      Lanes vv[VB];
      for (int i = 0; i < VB; ++i) vv[i] = load_lanes(vt + i * kLanes);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < VB; ++i) out[r][i] += p[r][bitrev(t, bits)] * vv[i];
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < VB; ++i) acc[r * V + i0 + i] = out[r][i];
  }
}

template <typename T, int D>
void chunk_group(const T* k, const T* v, int64_t stride, int64_t count, int64_t head_offset,
                 const Lanes* q, Row* rows, Lanes* acc, int64_t group, float softcap) {
  constexpr int V = D / kLanes;
  for (int64_t r = 0; r < group;) {
    const int64_t tile = std::min<int64_t>(DecodeTiling<D>::rows, group - r);
    const Lanes* qr = q + r * V;
    Lanes* ar = acc + r * V;
    switch (tile) {
      case 4: chunk_rows<T, D, 4>(k, v, stride, count, head_offset, qr, rows + r, ar, softcap); break;
      case 3: chunk_rows<T, D, 3>(k, v, stride, count, head_offset, qr, rows + r, ar, softcap); break;
      case 2: chunk_rows<T, D, 2>(k, v, stride, count, head_offset, qr, rows + r, ar, softcap); break;
      default: chunk_rows<T, D, 1>(k, v, stride, count, head_offset, qr, rows + r, ar, softcap); break;
    }
    r += tile;
  }
}

// Per-thread working memory of decode_range, reused across work items.
template <typename T>
struct Scratch {
  std::vector<Lanes> q, acc;   // [H][D/kLanes] each
  std::vector<Row> rows;       // [H]
  std::vector<T> k, v;         // one chunk's K and V rows, [kLanes][token_stride] each
};

// Tokens [begin, end) of the sequence with block table `table` (a work item's; table null: none).
struct TokenRange {
  const int64_t* table = nullptr;
  int64_t begin = 0, end = 0;
};

// Decode attention of one sequence over tokens [begin, end), all heads, in one pass over K/V, kLanes
// tokens at a time. Each chunk's K and V rows (all KV heads of a token, contiguous in the cache) are
// first copied in token order into w.k and w.v, so that the cache is read front to back, block by
// block, which the hardware prefetchers follow; the heads then read their strided slices from L1 (L2
// for chunks over 32 KB). Read in place, head by head, the walk across a block's rows took 15-30%
// longer whenever K/V came from memory rather than cache, as they do when a step reads every layer's
// cache. The next chunk's rows are prefetched while this one's heads are computed, a KV head's share
// before each head: the copy then finds them in cache (from memory, 1.33-1.47x the read rate of no
// prefetch; all of them at once before the first head 1.25x, two chunks ahead no better than one:
// docs/perf/journal.md §70). w.q holds the query rows ([H][D], scaled, fp32). Writes each head's max,
// softmax denominator and unnormalized output to `part`, laid out [H][D + 2]; the caller merges ranges.
// `after`: the item its thread takes next, whose first chunk the last one prefetches.
template <typename C, int D>
void decode_range(const PagedKV<C>& kv, const int64_t* table, int64_t begin, int64_t end, int64_t num_heads,
                  int64_t group, float softcap, float* part, Scratch<C>& w, const TokenRange& after) {
  constexpr int V = D / kLanes;
  const int64_t stride = kv.token_stride;
  w.acc.assign(static_cast<size_t>(num_heads * V), Lanes{});
  w.rows.assign(static_cast<size_t>(num_heads), Row{-INFINITY, 0.f});
  w.k.resize(static_cast<size_t>(kLanes * stride));
  w.v.resize(static_cast<size_t>(kLanes * stride));
  for (int64_t c0 = begin; c0 < end; c0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, end - c0);
    kv.for_rows(table, c0, count, [&](int64_t t, int64_t row) {
      std::memcpy(w.k.data() + t * stride, kv.k + row, stride * sizeof(C));
    });
    kv.for_rows(table, c0, count, [&](int64_t t, int64_t row) {
      std::memcpy(w.v.data() + t * stride, kv.v + row, stride * sizeof(C));
    });
    // The next chunk: this range's, or after its last, the first of the item that follows it.
    const bool last = c0 + kLanes >= end;
    const int64_t* next_table = last ? after.table : table;
    const int64_t next = last ? after.begin : c0 + kLanes;
    const int64_t ahead = next_table == nullptr ? 0 : std::clamp<int64_t>((last ? after.end : end) - next, 0, kLanes);
    const int64_t heads = kv.num_kv_heads;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t from = h * ahead / heads, to = (h + 1) * ahead / heads;
      kv.prefetch_rows(next_table, next + from, to - from, 0, stride);
      chunk_group<C, D>(w.k.data(), w.v.data(), stride, count, h * D, w.q.data() + h * group * V,
                        w.rows.data() + h * group, w.acc.data() + h * group * V, group, softcap);
    }
  }
  for (int64_t r = 0; r < num_heads; ++r) {
    std::memcpy(part + r * (D + 2), w.acc.data() + r * V, sizeof(Lanes) * V);
    part[r * (D + 2) + D] = w.rows[r].max;
    part[r * (D + 2) + D + 1] = w.rows[r].denom;
  }
}

// T: the query's dtype; C: the cache's element type (T, or fp8 e4m3 read at k_scale / v_scale: the
// K scale is folded into the query's, the V scale into the output's normalization).
template <typename T, typename C, int D>
void decode_impl(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& tables,
                 const at::Tensor& lens, double scale, double k_scale, double v_scale, int64_t window,
                 double softcap, at::Tensor& out) {
  constexpr int V = D / kLanes;
  const int64_t batch = query.size(0), num_heads = query.size(1);
  const PagedKV<C> kv(kv_cache);
  const int64_t group = num_heads / kv.num_kv_heads, max_blocks = tables.size(1);
  const T* q_ptr = query.const_data_ptr<T>();
  const int64_t* table_ptr = tables.const_data_ptr<int64_t>();
  const int64_t* len_ptr = lens.const_data_ptr<int64_t>();
  T* out_ptr = out.mutable_data_ptr<T>();

  // Split long contexts into token ranges when sequences alone would leave threads idle; the ranges
  // are merged below by their softmax statistics.
  // A sliding window (window > 0) reads only a sequence's last `window` keys, [window_start(b), len).
  auto window_start = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, len_ptr[b] - window) : int64_t{0}; };
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, len_ptr[b] - window_start(b));
  const int64_t want = 4 * at::get_num_threads();
  int64_t splits = batch >= want ? 1 : (want + batch - 1) / batch;
  const int64_t range = std::max<int64_t>(256, (max_len + splits - 1) / splits);
  splits = std::max<int64_t>(1, (max_len + range - 1) / range);
  const int64_t part_size = num_heads * (D + 2);
  std::vector<float> parts(static_cast<size_t>(batch * splits * part_size));

  // Work items (sequence, token range) go to threads longest first, each to the least loaded (and a
  // thread done with its own takes the rest of another's): a decode batch comes sorted by length, and
  // contiguous shares would give one thread all the long ones.
  const int64_t num_items = batch * splits;
  auto tokens = [&](int64_t item) {
    const int64_t b = item / splits, begin = window_start(b) + item % splits * range;
    return TokenRange{table_ptr + b * max_blocks, begin, std::min(len_ptr[b], begin + range)};
  };
  auto cost = [&](int64_t item) {
    const TokenRange r = tokens(item);
    return std::max<int64_t>(0, r.end - r.begin) + 16;   // + a fixed cost per item
  };
  auto scratch = [&] {
    Scratch<C> w;
    w.q.resize(static_cast<size_t>(num_heads * V));
    return w;
  };
  auto run = [&](Scratch<C>& w, int64_t item, int64_t next_item) {
    const int64_t b = item / splits;
    const auto [table, begin, end] = tokens(item);
    float* part = parts.data() + item * part_size;
    if (begin >= end) {
      for (int64_t r = 0; r < num_heads; ++r) part[r * (D + 2) + D + 1] = 0.f;  // empty range
      return;
    }
    const T* qb = q_ptr + b * num_heads * D;
    float* qf = reinterpret_cast<float*>(w.q.data());
    const float q_scale = static_cast<float>(scale * k_scale);
    for (int64_t j = 0; j < num_heads * D; ++j) qf[j] = to_float(qb[j]) * q_scale;
    decode_range<C, D>(kv, table, begin, end, num_heads, group, static_cast<float>(softcap), part, w,
                       next_item >= 0 ? tokens(next_item) : TokenRange{});
  };
  for_each_longest_first(num_items, cost, scratch, run);

  parallel_ranges(0, batch, 1, [&](int64_t first, int64_t last) {
    float acc[D];
    for (int64_t b = first; b < last; ++b) {
      for (int64_t r = 0; r < num_heads; ++r) {
        const float* p0 = parts.data() + b * splits * part_size + r * (D + 2);
        float m = -INFINITY;
        for (int64_t s = 0; s < splits; ++s)
          if (p0[s * part_size + D + 1] > 0.f) m = std::max(m, p0[s * part_size + D]);
        std::fill(acc, acc + D, 0.f);
        float denom = 0.f;
        for (int64_t s = 0; s < splits; ++s) {
          const float* p = p0 + s * part_size;
          if (p[D + 1] <= 0.f) continue;
          const float scale_s = std::exp(p[D] - m);
          denom += scale_s * p[D + 1];
          for (int j = 0; j < D; ++j) acc[j] += scale_s * p[j];
        }
        T* o = out_ptr + (b * num_heads + r) * D;
        const float inv = denom > 0.f ? static_cast<float>(v_scale) / denom : 0.f;    // length 0: zeros
        for (int j = 0; j < D; ++j) o[j] = static_cast<T>(acc[j] * inv);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, double k_scale, double v_scale, int64_t window,
                        double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window and softcap must be >= 0 (0: none)");
  check_attention_inputs("paged_decode", query, kv_cache);
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "paged_decode: batch sizes differ");
  check_block_tables("paged_decode", tables, lens, kv_cache.size(2), kv_cache.size(1));
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  dispatch_dtype_and_head_dim("paged_decode", q, kv_cache, [&](auto type, auto cache, auto dim) {
    decode_impl<typename decltype(type)::type, typename decltype(cache)::type, decltype(dim)::value>(
        q, kv_cache, tables, lens, scale, k_scale, v_scale, window, softcap, out);
  });
  return out;
}

// ---- Elementwise layers, each one pass instead of several torch ops --------------------------------
// The arithmetic follows kernels/reference.py op by op, rounding to the activations' dtype where torch
// does and never fusing a multiply-add (fp-contract off here): rotary matches it bit for bit in every
// dtype, silu-and-mul in bf16/fp16 (in fp32 its exp is within a bit of torch's), RMSNorm to rounding
// (its sum of squares is reduced in another order).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// The elementwise kernels below work on `Lanes` (one register: 16 lanes with AVX-512, 8 with
// AVX2). On 16-lane vectors an AVX2 build lowered their compares and selects lane by lane (scalar
// vcmpss and vcomiss in silu's exp): silu-and-mul and RMSNorm of one row took 8 and 6 us, argmax
// over a 49k vocabulary 3x torch's (docs/perf/journal.md §7l).

// (x + residual) normalized times weight, and x + residual; rows of `hidden` elements. The sum of
// squares is kept in sixteen lanes whatever the build (two vectors of eight on AVX2, added as
// hsum(f32x16) adds its halves), so that both builds give the same bits.
template <typename T>
void rms_norm_impl(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const T* weight, T* out,
                   T* res_out, int64_t rows, int64_t hidden, float eps) {
  constexpr int kParts = 16 / kLanes;
  parallel_ranges(0, rows, std::max<int64_t>(1, 32768 / hidden), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const T* xr = x + row * x_stride;
      const T* src = xr;
      if (res != nullptr) {                                   // the sum, rounded to T, is the new residual
        const T* rr = res + row * res_stride;
        T* ro = res_out + row * hidden;
        for (int64_t i = 0; i < hidden; i += kLanes) {
          const int64_t n = std::min<int64_t>(kLanes, hidden - i);
          store_upto(ro + i, load_upto<Lanes>(xr + i, n) + load_upto<Lanes>(rr + i, n), n);
        }
        src = ro;
      }
      Lanes squares[kParts] = {};
      for (int64_t i = 0; i < hidden; i += 16) {
        for (int p = 0; p < kParts; ++p) {
          const int64_t n = std::min<int64_t>(kLanes, hidden - i - p * kLanes);
          if (n <= 0) break;
          const Lanes v = load_upto<Lanes>(src + i + p * kLanes, n);
          squares[p] += v * v;
        }
      }
      float sum;
      if constexpr (kParts == 1)
        sum = hsum(squares[0]);
      else
        sum = hsum(squares[0] + squares[1]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + row * hidden;
      for (int64_t i = 0; i < hidden; i += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, hidden - i);
        const Lanes v = load_upto<Lanes>(src + i, n), w = load_upto<Lanes>(weight + i, n);
        store_upto(o + i, round_as<T>(w * round_as<T>(v * inv)), n);
      }
    }
  });
}

// Neox rotary of one head row x (d elements, halves rotated) into o: x * cos + rotate_half(x) * sin.
template <typename T>
inline void rotate_row(const T* x, const T* cos, const T* sin, T* o, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, half - i);
    auto load = [n](const T* p) { return load_upto<Lanes>(p, n); };
    const Lanes x1 = load(x + i), x2 = load(x + half + i);
    const Lanes lo = round_as<T>(round_as<T>(x1 * load(cos + i)) + round_as<T>(-x2 * load(sin + i)));
    const Lanes hi = round_as<T>(round_as<T>(x2 * load(cos + half + i)) + round_as<T>(x1 * load(sin + half + i)));
    store_upto(o + i, lo, n);
    store_upto(o + half + i, hi, n);
  }
}

template <typename T>
void rotary_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& q_out, at::Tensor& k_out) {
  const int64_t tokens = q.size(0), d = q.size(2);
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  T* qo = q_out.mutable_data_ptr<T>();
  T* ko = k_out.mutable_data_ptr<T>();
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  parallel_ranges(0, tokens, std::max<int64_t>(1, 8192 / (d * (heads + kv_heads))), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t h = 0; h < heads; ++h)
        rotate_row(qp + t * q.stride(0) + h * q.stride(1), cp + t * d, sp + t * d,
                   qo + t * q_out.stride(0) + h * q_out.stride(1), d);
      for (int64_t h = 0; h < kv_heads; ++h)
        rotate_row(kp + t * k.stride(0) + h * k.stride(1), cp + t * d, sp + t * d,
                   ko + t * k_out.stride(0) + h * k_out.stride(1), d);
    }
  });
}

// silu(gate) * up for x = [gate | up] rows of 2 * inter elements: the silu rounded to T, then the product.
template <typename T>
void silu_and_mul_impl(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t inter) {
  parallel_ranges(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const T* g = x + row * x_stride;
      const T* u = g + inter;
      T* o = out + row * inter;
      auto silu_mul = silu_times<T>;
      // Four independent vectors per iteration: one vector's chain (exp, division, two roundings) is
      // ~60 cycles long, and one at a time the loop ran at its latency, ~40 cycles a vector
      // (perf/journal.md §34).
      constexpr int64_t kUnroll = 4;
      int64_t i = 0;
      for (; i + kUnroll * kLanes <= inter; i += kUnroll * kLanes) {
        Lanes r[kUnroll];
        for (int64_t k = 0; k < kUnroll; ++k)
          r[k] = silu_mul(load_lanes(g + i + k * kLanes), load_lanes(u + i + k * kLanes));
        for (int64_t k = 0; k < kUnroll; ++k) store_v(o + i + k * kLanes, r[k]);
      }
      for (; i < inter; i += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, inter - i);
        store_upto(o + i, silu_mul(load_upto<Lanes>(g + i, n), load_upto<Lanes>(u + i, n)), n);
      }
    }
  });
}

#pragma GCC pop_options

bool row_major_last(const at::Tensor& t) { return t.stride(-1) == 1; }

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [hidden] in the activations' dtype");
  const at::Tensor x2 = row_major_last(x) && x.dim() == 2 ? x : x.reshape({-1, hidden}).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({x2.size(0), hidden}, x2.options());
  at::Tensor res_out = x;                                   // without a residual, x itself (as the reference)
  at::Tensor r2;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    r2 = row_major_last(*residual) && residual->dim() == 2 ? *residual : residual->reshape({-1, hidden}).contiguous();
    res_out = at::empty({x2.size(0), hidden}, x2.options());
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x2.const_data_ptr<T>(), x2.stride(0), r2.defined() ? r2.const_data_ptr<T>() : nullptr,
                     r2.defined() ? r2.stride(0) : 0, w.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                     r2.defined() ? res_out.mutable_data_ptr<T>() : nullptr, x2.size(0), hidden,
                     static_cast<float>(eps));
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "rms_norm: dtype must be float32, bfloat16 or float16");
  }
  return {out.view(x.sizes()), residual.has_value() ? res_out.view(x.sizes()) : res_out};
}

std::tuple<at::Tensor, at::Tensor> rotary_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                               const at::Tensor& sin, bool in_place) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary: q [T, H, d] and k [T, kvh, d] with an even d");
  TORCH_CHECK(row_major_last(q) && row_major_last(k), "rotary: q and k need a contiguous last dim");
  const int64_t d = q.size(2);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.dim() == 2 && c.size(0) == q.size(0) && c.size(1) == d && s.sizes() == c.sizes(),
              "rotary: cos and sin must be [T, d]");
  TORCH_CHECK(c.scalar_type() == q.scalar_type() && s.scalar_type() == q.scalar_type() &&
              k.scalar_type() == q.scalar_type(), "rotary: q, k, cos and sin must share a dtype");
  at::Tensor q_out = in_place ? q : at::empty(q.sizes(), q.options());
  at::Tensor k_out = in_place ? k : at::empty(k.sizes(), k.options());
  switch (q.scalar_type()) {
    case at::kFloat: rotary_impl<float>(q, k, c, s, q_out, k_out); break;
    case at::kBFloat16: rotary_impl<c10::BFloat16>(q, k, c, s, q_out, k_out); break;
    case at::kHalf: rotary_impl<c10::Half>(q, k, c, s, q_out, k_out); break;
    default: TORCH_CHECK(false, "rotary: dtype must be float32, bfloat16 or float16");
  }
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  return rotary_into(q, k, cos, sin, false);
}

// Rotary written back into q and k (views of the QKV projection's output, whose unrotated q and k
// nothing reads again): no fresh [T, H, d] outputs for the first writes to fill (perf/journal.md §55).
void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  rotary_into(q, k, cos, sin, true);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t inter = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_and_mul: the last dim holds [gate | up]");
  const at::Tensor x2 = row_major_last(x) && x.dim() == 2 ? x : x.reshape({-1, 2 * inter}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      silu_and_mul_impl<float>(x2.const_data_ptr<float>(), x2.stride(0), out.mutable_data_ptr<float>(), x2.size(0),
                               inter);
      break;
    case at::kBFloat16:
      silu_and_mul_impl<c10::BFloat16>(x2.const_data_ptr<c10::BFloat16>(), x2.stride(0),
                                       out.mutable_data_ptr<c10::BFloat16>(), x2.size(0), inter);
      break;
    case at::kHalf:
      silu_and_mul_impl<c10::Half>(x2.const_data_ptr<c10::Half>(), x2.stride(0), out.mutable_data_ptr<c10::Half>(),
                                   x2.size(0), inter);
      break;
    default: TORCH_CHECK(false, "silu_and_mul: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

// K/V rows into their slots (slot < 0: a padding row, skipped). key/value: [T, kvh, d] with each
// token's heads contiguous (views of the fused QKV projection qualify).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "write_kv: kv_cache must be contiguous 5-D");
  const int64_t row = kv_cache.size(3) * kv_cache.size(4), slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) * t->size(2) == row && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                t->scalar_type() == kv_cache.scalar_type(),
                "write_kv: key/value must be [T, kvh, d] rows of the cache's dtype");
  const at::Tensor slot_map = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slot_map.const_data_ptr<int64_t>();
  const int64_t bytes = row * kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.const_data_ptr());
  const char* v = static_cast<const char*>(value.const_data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < slot_map.size(0); ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots, "write_kv: slot ", slot, " is outside the cache's ", slots, " slots");
    std::memcpy(cache + slot * bytes, k + t * ks, bytes);
    std::memcpy(cache + (slots + slot) * bytes, v + t * vs, bytes);
  }
}

// A decode layer's attention from its fused QKV projection's output [T, (H + 2 kvh) d]: rotary on the
// q and k views, k and v into their slots, paged decode attention; [T, H d] out. The same calls the CPU
// decode plan made one by one from Python (split, three views, rotary, write_kv, paged_decode, a view),
// where the calls cost ~20 us a layer against ~4 for this one (docs/perf/journal.md §7l). A cache in
// the activations' dtype only: an fp8 cache's write quantizes in Python (kernels/cpu_ops.py).
at::Tensor decode_attention_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double scale,
                                double k_scale, double v_scale, int64_t window, double softcap) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(3) == num_kv_heads && kv_cache.scalar_type() == qkv.scalar_type(),
              "decode_attention_qkv: kv_cache must be [2, blocks, block_size, num_kv_heads, d] of qkv's dtype");
  const int64_t tokens = qkv.size(0), d = kv_cache.size(4);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "decode_attention_qkv: qkv must be [T, (num_heads + 2 num_kv_heads) d] with contiguous rows");
  const at::Tensor q = qkv.narrow(1, 0, num_heads * d).view({tokens, num_heads, d});
  const at::Tensor k = qkv.narrow(1, num_heads * d, num_kv_heads * d).view({tokens, num_kv_heads, d});
  const at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d).view({tokens, num_kv_heads, d});
  const auto [q_rot, k_rot] = rotary(q, k, cos, sin);
  write_kv(k_rot, v, kv_cache, slot_mapping);
  return paged_decode(q_rot, kv_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, softcap)
      .view({tokens, num_heads * d});
}

// Each row's argmax: the first maximum, or the first NaN where a row has one (torch's max(dim)).
// Each lane keeps its own best value and its first index; the lanes are merged at the end.
// torch's CPU max over bfloat16 converts element by element: this reads the row once at memory speed
// (greedy ids from bf16 logits of a 49k vocabulary, benchmarks/step_overhead.py).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  using I = IntLanes<Lanes>::type;
  Lanes best = Lanes{} - INFINITY;
  I best_idx{}, lane_idx;
  for (int i = 0; i < kLanes; ++i) lane_idx[i] = i;
  I nan_seen{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes v = load_lanes(x + j);
    nan_seen |= v != v;
    const I better = v > best;
    best = better ? v : best;
    best_idx = better ? lane_idx : best_idx;
    lane_idx += kLanes;
  }
  for (int i = 0; i < kLanes; ++i)
    if (nan_seen[i]) {                         // a NaN: the first one wins (found again, rarely)
      for (int64_t k = 0; k < n; ++k)
        if (to_float(x[k]) != to_float(x[k])) return k;
    }
  float top = -INFINITY;
  int64_t top_idx = 0;
  for (int i = 0; i < kLanes; ++i)
    if (j > 0 && (best[i] > top || (best[i] == top && best_idx[i] < top_idx))) top = best[i], top_idx = best_idx[i];
  for (; j < n; ++j) {
    const float v = to_float(x[j]);
    if (v != v) return j;
    if (v > top || (j == 0)) top = v, top_idx = j;
  }
  return top_idx;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "argmax_rows: x must be [rows, n > 0] with contiguous rows");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows longer than 2**31 - 1");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.mutable_data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.const_data_ptr<T>();
    parallel_ranges(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) o[r] = argmax_row<T>(p + r * stride, n);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "argmax_rows: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "float k_scale, float v_scale, int window, float softcap) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("decode_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, float k_scale, "
        "float v_scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv", &write_kv);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decode_attention_qkv", &decode_attention_qkv);
}
