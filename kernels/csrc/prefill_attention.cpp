// pdserve CPU prefill attention: causal attention of variable-length query segments against paged
// K/V, read straight from the block table, the contract of kernels.reference.prefill_attention (full
// prefill, chunked prefill and prefix hits alike). Flash-attention style, in fp32, one pass over
// K/V with an online softmax.
//
// A work item is (segment, KV head, up to two, four or eight tiles of L query positions: f32_tiles,
// item_tiles), L the lanes of one vector register: 16 with AVX-512, 8 elsewhere. Its rows are the
// query heads that share the KV head, each held transposed: one vector per head dimension with a
// lane per position. Then the scores of L keys are L FMAs per head dimension with the key's element
// broadcast, and the online softmax (causal mask, max, exp, denominator) is elementwise across
// lanes, with no horizontal reductions. A chunk of L keys and values is converted to fp32 once and
// shared by the item's tiles and heads, and the next chunk's rows are prefetched while it is
// computed. Items go to ATen's threads longest first. The inner loops keep L accumulators and two
// more vectors live: 18 of AVX-512's 32 registers at L = 16 (at L = 16 on AVX2, every vector is two
// registers and the accumulators spill: on a Zen 1 the kernel ran at 0.2-0.5x torch's SDPA). On
// AVX2 (L = 8) the loops take up to three of a tile's query heads at once, register-blocked
// (chunk_scores_heads, chunk_values_heads: 12 accumulators of 16 registers), with the same sums in
// the same order.
// With bf16 query and cache on a CPU with AVX512-BF16 the same items run on bf16 dot products
// (prefill_bf16_dot, below), and on one with AMX-BF16 on its tiles (prefill_bf16_dot<D, true>).
//
// KV cache layout (per layer): [2, num_blocks, block_size, num_kv_heads, head_dim].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common.h"
#include "work_split.h"

namespace {

// kLanes (common.h): query positions per item, and keys per chunk.

// Scores of one head's kLanes positions (q: [D] vectors, lane = position) against a chunk of
// kLanes keys (k: [kLanes][D] fp32): s[j] = the positions' dot products with key j.
template <int D>
inline void chunk_scores(const Lanes* q, const float* k, Lanes* s) {
  Lanes acc[kLanes] = {};
  for (int d = 0; d < D; ++d) {
    const Lanes qd = q[d];
    for (int j = 0; j < kLanes; ++j) acc[j] += k[j * D + d] * qd;
  }
  for (int j = 0; j < kLanes; ++j) s[j] = acc[j];
}

// o ([D] vectors, lane = position) = o * alpha + sum over the chunk's keys j < count of e[j] * v[j],
// kLanes head dimensions at a time.
template <int D>
inline void chunk_values(const float* v, const Lanes* e, int64_t count, Lanes alpha, Lanes* o) {
  static_assert(D % kLanes == 0);
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    Lanes acc[kLanes];
    for (int i = 0; i < kLanes; ++i) acc[i] = o[d0 + i] * alpha;
    for (int64_t j = 0; j < count; ++j)
      for (int i = 0; i < kLanes; ++i) acc[i] += v[j * D + d0 + i] * e[j];
    for (int i = 0; i < kLanes; ++i) o[d0 + i] = acc[i];
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 (16 registers of 8 lanes): the score and value loops of up to three query heads of a tile at
// once, register-blocked as a GEMM's micro-kernel. Scores: 4 keys x H heads of accumulators, each
// key's element broadcast once for the H heads (the heads' query vectors held in registers: H + 4
// loads per 4H FMAs, against the single-head loop's 9 per 8). Values: 4 head dimensions x H heads,
// each value element broadcast once for the H heads' weights. At H = 3 that is 12 accumulators, the
// H query or weight vectors and one broadcast: AVX2's 16 registers.
constexpr int kHeadBlock = 3;

// Keeps v in a register from here on: GCC would otherwise fold its load into every FMA that reads it
// (one load per FMA instead of one per H).
template <typename V>
inline void in_register(V& v) {
  asm volatile("" : "+x"(v));
}

// s[u][j] = the scores of head u's kLanes positions (q + u * D: [D] vectors, lane = position) against
// key j of the chunk (k: [kLanes][D] fp32), for the H heads from q.
template <int D, int H>
inline void chunk_scores_heads(const Lanes* q, const float* k, Lanes (*s)[kLanes]) {
  static_assert(kLanes % 4 == 0);
  for (int j0 = 0; j0 < kLanes; j0 += 4) {
    Lanes acc[H][4] = {};
    for (int d = 0; d < D; ++d) {
      Lanes qd[H];
#pragma GCC unroll 4
      for (int u = 0; u < H; ++u) {
        qd[u] = q[u * D + d];
        in_register(qd[u]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const float kj = k[(j0 + j) * D + d];
#pragma GCC unroll 4
        for (int u = 0; u < H; ++u) acc[u][j] += kj * qd[u];
      }
    }
    for (int u = 0; u < H; ++u)
      for (int j = 0; j < 4; ++j) s[u][j0 + j] = acc[u][j];
  }
}

// o + u * D ([D] vectors, lane = position) = that * alpha[u] + sum over the chunk's keys j < count of
// e[u][j] * v[j], for the H heads from o, four head dimensions at a time.
template <int D, int H>
inline void chunk_values_heads(const float* v, const Lanes (*e)[kLanes], int64_t count, const Lanes* alpha,
                               Lanes* o) {
  static_assert(D % 4 == 0);
  for (int d0 = 0; d0 < D; d0 += 4) {
    Lanes acc[H][4];
    for (int u = 0; u < H; ++u)
      for (int i = 0; i < 4; ++i) acc[u][i] = o[u * D + d0 + i] * alpha[u];
    for (int64_t j = 0; j < count; ++j) {
      Lanes ej[H];
#pragma GCC unroll 4
      for (int u = 0; u < H; ++u) {
        ej[u] = e[u][j];
        in_register(ej[u]);
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const float vi = v[j * D + d0 + i];
#pragma GCC unroll 4
        for (int u = 0; u < H; ++u) acc[u][i] += vi * ej[u];
      }
    }
    for (int u = 0; u < H; ++u)
      for (int i = 0; i < 4; ++i) o[u * D + d0 + i] = acc[u][i];
  }
}
#else
// Elsewhere heads go one at a time (kHeadBlock 1): these are instantiated, never called.
constexpr int kHeadBlock = 1;
template <int D, int H>
inline void chunk_scores_heads(const Lanes* q, const float* k, Lanes (*s)[kLanes]) {
  for (int u = 0; u < H; ++u) chunk_scores<D>(q + u * D, k, s[u]);
}
template <int D, int H>
inline void chunk_values_heads(const float* v, const Lanes (*e)[kLanes], int64_t count, const Lanes* alpha,
                               Lanes* o) {
  for (int u = 0; u < H; ++u) chunk_values<D>(v, e[u], count, alpha[u], o + u * D);
}
#endif

// The query heads of a tile taken together from head g (of `group`): three at a time, and two and two
// where four are left (a lone head would run the single-head loops, 9 loads per 8 FMAs).
inline int64_t heads_from(int64_t g, int64_t group) {
  const int64_t left = group - g;
  return left == 4 && kHeadBlock == 3 ? 2 : std::min<int64_t>(kHeadBlock, left);
}

// Per-thread working memory, reused across items.
template <int D>
struct PrefillScratch {
  std::vector<Lanes> q, o;     // [tiles * group][D]: scaled queries and unnormalized outputs, transposed
  std::vector<Lanes> max, denom;   // [tiles * group]: online-softmax state per lane
  std::vector<float> k, v;      // [kLanes][D]: the current chunk in fp32
};

// Tiles of kLanes query rows per work item: each chunk of K/V is read from the cache and converted
// once for the tiles' query heads. On a Zen 3 (AVX2, one thread, docs/perf/journal.md §48) two tiles
// ran SmolLM2's 9/3 heads of 64 at 1.08-1.11x one tile and four at 0.81-0.83x, while Llama-3-8B's
// 32/8 heads of 128 ran at 0.83-1.01x with two and 1.11-1.39x with four. With AVX-512 (L = 16) heads
// under 128 take up to eight (item_tiles; on a Zen 5, SmolLM2's shape, 1.04-1.24x two: §54), 128 and
// up four (eight: level). f32_tiles is the most an item takes, f32_min_tiles the fewest item_tiles
// may choose: the eight come down to two on small steps, the tuned counts stay fixed.
constexpr int f32_tiles(int head_dim) { return head_dim >= 128 ? 4 : kLanes == 16 ? 8 : 2; }
constexpr int f32_min_tiles(int head_dim) { return f32_tiles(head_dim) == 8 ? 2 : f32_tiles(head_dim); }

// Tiles per item for these segments: the most of max_tiles, halved down to min_tiles, that still
// gives every thread at least four items to balance, where more tiles share each chunk's copy among
// more query rows but cut a step's rows into fewer items.
inline int64_t item_tiles(const at::Tensor& query_lens, int64_t num_kv_heads, int64_t max_tiles, int64_t min_tiles) {
  const int64_t* qlen = query_lens.const_data_ptr<int64_t>();
  for (int64_t tiles = max_tiles; tiles > min_tiles; tiles /= 2) {
    int64_t items = 0;
    for (int64_t s = 0; s < query_lens.size(0); ++s) items += (qlen[s] + tiles * kLanes - 1) / (tiles * kLanes);
    if (items * num_kv_heads >= 4 * at::get_num_threads()) return tiles;
  }
  return min_tiles;
}

#if defined(__AVX512F__)
// r[i][k] <-> r[k][i]: a 16 x 16 fp32 transpose in registers (pairs, then quads within 128-bit lanes,
// then the lanes across rows four and eight apart).
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // r[4i + j], 128-bit lane k: column 4k + j of rows 4i..4i+3
    r[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
    r[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
    r[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
    r[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
  }
}
#endif

// Rows of a tile's output for one head: o ([D] vectors, lane = position) times inv, lane i to row i
// (rows of them, `stride` elements apart), transposed through fp32 and stored a vector at a time.
// With AVX-512 sixteen head dims at a time in registers (transpose16: the same bits, 1.03-1.09x a
// 1,024-token prompt's attention on AMX tiles against lane by lane through memory, perf/journal.md §57).
template <typename T>
inline void store_rows(const Lanes* o, Lanes inv, int D, int64_t rows, T* out, int64_t stride) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int k = 0; k < 16; ++k) r[k] = (__m512)(o[d0 + k] * inv);
      transpose16(r);
      for (int64_t i = 0; i < rows; ++i) store_v(out + i * stride + d0, (Lanes)r[i]);
    }
    return;
  }
#endif
  alignas(64) float t[kLanes][256];   // [position][head dim]: D <= 256
  for (int d = 0; d < D; ++d) {
    const Lanes x = o[d] * inv;
    for (int i = 0; i < kLanes; ++i) t[i][d] = x[i];
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int d = 0; d < D; d += kLanes) store_v(out + i * stride + d, *reinterpret_cast<const Lanes*>(&t[i][d]));
}

// The online softmax of one head's chunk of N keys from c0 (sc: the scaled scores, lane = position):
// soft cap, the causal and window mask (skipped where `masked` is false: every key of the chunk is
// visible to every lane), the running max and denominator. Leaves the chunk's weights in e and
// returns the factor that rescales the head's output so far. exp_fn: e^x lane by lane.
template <int N, typename Exp>
inline Lanes softmax_chunk(Lanes* sc, int64_t c0, bool masked, Lanes limit, Lanes floor_pos, float cap, Lanes& max,
                           Lanes& denom, Lanes* e, Exp exp_fn) {
  Lanes m = max;
  for (int j = 0; j < N; ++j) {
    if (cap > 0.f) sc[j] = soft_cap(sc[j], cap);
    if (masked) {
      const float key = static_cast<float>(c0 + j);
      sc[j] = key <= limit && key > floor_pos ? sc[j] : Lanes{} - INFINITY;   // causal, windowed
    }
    m = m > sc[j] ? m : sc[j];
  }
  // Without a window key 0 is in every lane's range, so after the first chunk m is finite; with one
  // a lane may see no key of a chunk yet: its max stays -inf, and 0 stands in for it so that alpha
  // and the weights come out 0 rather than NaN.
  const Lanes m_safe = m == Lanes{} - INFINITY ? Lanes{} : m;
  const Lanes alpha = exp_fn(max - m_safe);
  Lanes sum = {};
  for (int j = 0; j < N; ++j) {
    e[j] = exp_fn(sc[j] - m_safe);
    sum += e[j];
  }
  denom = denom * alpha + sum;
  max = m;
  return alpha;
}

// One work item: a tile of up to kLanes query rows of a segment against one KV head.
struct Item {
  int64_t first_row;       // the tile's first row in `query` / `out`
  int64_t rows;            // its rows (lanes past them repeat the last row; their results are dropped)
  int64_t pos0;            // the first row's position in its sequence
  int64_t begin, end;      // the keys any lane may see: [begin, end)
  int64_t head;            // the KV head
  const int64_t* table;    // the segment's block table
  Lanes limit, floor_pos;  // lane i sees keys in (floor_pos[i], limit[i]]
  // Whether the n keys from c0 need the mask: some key is past the first lane's position or (with a
  // window) before the last lane's window.
  bool masked(int64_t c0, int64_t n, int64_t window) const {
    return c0 + n - 1 > pos0 || (window > 0 && c0 <= pos0 + rows - 1 - window);
  }
};

// Runs body(scratch, items, n) for every work item: n <= tiles (<= kMaxTiles) consecutive tiles of
// kLanes query rows of one segment (items[0..n)), against one KV head. Items go to ATen's threads
// longest first, a thread done with its own taking the rest of another's (for_each_longest_first);
// each thread has its scratch from make_scratch().
template <int kMaxTiles, typename MakeScratch, typename Body>
void for_each_item(const at::Tensor& tables, const at::Tensor& query_lens, const at::Tensor& seq_lens,
                   int64_t num_kv_heads, int64_t window, int64_t tiles, MakeScratch&& make_scratch, Body&& body) {
  const int64_t num_segments = query_lens.size(0), max_blocks = tables.size(1);
  const int64_t* table_ptr = tables.const_data_ptr<int64_t>();
  const int64_t* qlen_ptr = query_lens.const_data_ptr<int64_t>();
  const int64_t* slen_ptr = seq_lens.const_data_ptr<int64_t>();
  TORCH_CHECK(tiles >= 1 && tiles <= kMaxTiles, "paged_prefill: tiles per item out of range");
  const int64_t item_rows = tiles * kLanes;   // query rows per item
  struct Group {
    int64_t segment, row0, first_row_of_segment;
  };
  std::vector<Group> groups;
  for (int64_t s = 0, start = 0; s < num_segments; start += qlen_ptr[s], ++s)
    for (int64_t r = 0; r < qlen_ptr[s]; r += item_rows) groups.push_back({s, r, start});
  auto keys_end = [&](const Group& g, int64_t row0) {   // keys the tile from row0's last position sees
    const int64_t s = g.segment, ctx = slen_ptr[s] - qlen_ptr[s];
    return ctx + std::min(qlen_ptr[s], row0 + kLanes);
  };
  auto cost = [&](const Group& g) {
    int64_t keys = 0;
    for (int64_t r = g.row0; r < std::min(qlen_ptr[g.segment], g.row0 + item_rows); r += kLanes) keys += keys_end(g, r);
    return keys + kLanes;
  };
  const int64_t num_items = static_cast<int64_t>(groups.size()) * num_kv_heads;
  Lanes lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
  auto run = [&](auto& scratch, int64_t index) {
    const Group& group = groups[index / num_kv_heads];
    const int64_t s = group.segment;
    Item items[kMaxTiles];
    int n = 0;
    for (int64_t row0 = group.row0; row0 < std::min(qlen_ptr[s], group.row0 + item_rows); row0 += kLanes, ++n) {
      Item& it = items[n];
      it.first_row = group.first_row_of_segment + row0;
      it.rows = std::min<int64_t>(kLanes, qlen_ptr[s] - row0);
      it.pos0 = slen_ptr[s] - qlen_ptr[s] + row0;
      it.end = keys_end(group, row0);
      it.head = index % num_kv_heads;
      it.table = table_ptr + s * max_blocks;
      // Lane i is position pos0 + i and sees keys up to it; lanes past the segment's end repeat
      // its last row.
      it.limit = (lane < static_cast<float>(it.rows) ? lane : Lanes{} + static_cast<float>(it.rows - 1)) +
                 static_cast<float>(it.pos0);
      // A sliding window: lane i sees keys in (limit - window, limit]; chunks wholly before the
      // first row's window are skipped.
      it.floor_pos = window > 0 ? it.limit - static_cast<float>(window) : Lanes{} - 1.f;
      it.begin = window > 0 ? std::max<int64_t>(0, it.pos0 - window + 1) / kLanes * kLanes : 0;
    }
    body(scratch, items, n);
  };
  auto item_cost = [&](int64_t item) { return cost(groups[item / num_kv_heads]); };
  for_each_longest_first(num_items, item_cost, make_scratch, run);
}

// T: the query's dtype; C: the cache's element type (T, or fp8 e4m3 read at k_scale / v_scale,
// folded into the query's scale and the output's normalization).
template <typename T, typename C, int D, int kTiles = f32_tiles(D)>
void prefill_impl(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& tables,
                  const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale, double k_scale,
                  double v_scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t num_heads = query.size(1);
  const PagedKV<C> kv(kv_cache);
  const int64_t group = num_heads / kv.num_kv_heads;
  const T* q_ptr = query.const_data_ptr<T>();
  const int64_t q_stride = query.stride(0);
  T* out_ptr = out.mutable_data_ptr<T>();
  const float cap = static_cast<float>(softcap);
  const int64_t tiles = item_tiles(query_lens, kv.num_kv_heads, kTiles, f32_min_tiles(D));
  auto make_scratch = [&] {
    PrefillScratch<D> w;
    w.q.resize(static_cast<size_t>(tiles * group * D));
    w.o.resize(static_cast<size_t>(tiles * group * D));
    w.k.resize(static_cast<size_t>(kLanes * D));
    w.v.resize(static_cast<size_t>(kLanes * D));
    return w;
  };
  // Query head u = t * group + g: tile t's head g.
  auto body = [&](PrefillScratch<D>& w, const Item* items, int n) {
    const int64_t h = items[0].head;
    for (int t = 0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        float* qf = reinterpret_cast<float*>(w.q.data() + (t * group + g) * D);     // [D][kLanes]
        for (int64_t i = 0; i < kLanes; ++i) {
          const T* row =
              q_ptr + (items[t].first_row + std::min(i, items[t].rows - 1)) * q_stride + (h * group + g) * D;
          for (int d = 0; d < D; ++d) qf[d * kLanes + i] = to_float(row[d]) * static_cast<float>(scale * k_scale);
        }
      }
    std::fill(w.o.begin(), w.o.end(), Lanes{});
    w.max.assign(static_cast<size_t>(n * group), Lanes{} - INFINITY);
    w.denom.assign(static_cast<size_t>(n * group), Lanes{});
    const Item& last = items[n - 1];   // its keys end last; the first tile's begin first
    for (int64_t c0 = items[0].begin; c0 < last.end; c0 += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, last.end - c0);
      // The chunk's keys and values in fp32, once for the item's tiles and heads. Rows past the keys:
      // zeros, never weighted.
      for (int64_t j = count; j < kLanes; ++j) {
        std::fill(w.k.data() + j * D, w.k.data() + (j + 1) * D, 0.f);
        std::fill(w.v.data() + j * D, w.v.data() + (j + 1) * D, 0.f);
      }
      kv.for_rows(last.table, c0, count, [&](int64_t j, int64_t row) {
        for (int d0 = 0; d0 < D; d0 += 16) {
          const f32x16 kx = load16(kv.k + row + h * D + d0), vv = load16(kv.v + row + h * D + d0);
          std::memcpy(w.k.data() + j * D + d0, &kx, sizeof kx);
          std::memcpy(w.v.data() + j * D + d0, &vv, sizeof vv);
        }
      });
      // The next chunk's rows, fetched while this one is computed: a head's consecutive keys lie a
      // token's row apart (all KV heads: 4 KB at Llama-3-8B's shape), a page each, where the hardware
      // prefetchers do not follow.
      if (c0 + kLanes < last.end)
        kv.prefetch_rows(last.table, c0 + kLanes, std::min<int64_t>(kLanes, last.end - c0 - kLanes), h * D, D);
      for (int t = 0; t < n; ++t) {
        const Item& it = items[t];
        // Chunks past a tile's keys or wholly before its window leave its state as it is: skipped.
        if (c0 >= it.end || c0 + kLanes <= it.begin) continue;
        const bool masked = it.masked(c0, kLanes, window);
        // Heads u0 .. u0 + H - 1 of the tile: scores, online softmax, values.
        auto heads = [&](auto num_heads_tag, int64_t u0) {
          constexpr int H = decltype(num_heads_tag)::value;
          Lanes sc[H][kLanes], e[H][kLanes], alpha[H];
          if constexpr (H == 1) {
            chunk_scores<D>(w.q.data() + u0 * D, w.k.data(), sc[0]);
          } else {
            chunk_scores_heads<D, H>(w.q.data() + u0 * D, w.k.data(), sc);
          }
          for (int u = 0; u < H; ++u)
            alpha[u] = softmax_chunk<kLanes>(sc[u], c0, masked, it.limit, it.floor_pos, cap, w.max[u0 + u],
                                             w.denom[u0 + u], e[u], [](Lanes x) { return exp_approx(x); });
          if constexpr (H == 1) {
            chunk_values<D>(w.v.data(), e[0], count, alpha[0], w.o.data() + u0 * D);
          } else {
            chunk_values_heads<D, H>(w.v.data(), e, count, alpha, w.o.data() + u0 * D);
          }
        };
        for (int64_t g = 0, step; g < group; g += step) {
          step = heads_from(g, group);
          const int64_t u0 = t * group + g;
          if (step == 3) {
            heads(std::integral_constant<int, 3>{}, u0);
          } else if (step == 2) {
            heads(std::integral_constant<int, 2>{}, u0);
          } else {
            heads(std::integral_constant<int, 1>{}, u0);
          }
        }
      }
    }
    for (int t = 0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t u = t * group + g;
        store_rows(w.o.data() + u * D, static_cast<float>(v_scale) / w.denom[u], D, items[t].rows,
                   out_ptr + (items[t].first_row * num_heads + h * group + g) * D, num_heads * D);
      }
  };
  for_each_item<kTiles>(tables, query_lens, seq_lens, kv.num_kv_heads, window, tiles, make_scratch, body);
}

#if defined(__AVX512BF16__)
// PDSERVE_CPU_BF16_DOT=0 runs bf16 through the fp32 kernel instead: the kernel every CPU without
// AVX512-BF16 runs, forced here to test it and to compare the two (benchmarks/cpu_attention.py).
inline bool bf16_dot_enabled() {
  const char* value = std::getenv("PDSERVE_CPU_BF16_DOT");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// bf16 queries against a bf16 cache with AVX512-BF16's dot products (vdpbf16ps: each fp32 lane adds
// the products of a pair of bf16s, exactly, to its sum): half the instructions of the fp32 FMAs per
// multiply-add, and no conversion of K. Lanes are positions as in the fp32 kernel, so the pairs run
// along the reduced dimension: head dims (d, d+1) for the scores, keys (j, j+1) for the values.
// Q stays bf16 and the scale is applied to the fp32 scores; the softmax runs in fp32 and its weights
// are rounded to bf16 for the product with V, as torch's CPU flash attention does for bf16. Chunks
// are of 2 x kLanes keys: the softmax's per-chunk work (the rescale of the output so far, its loads
// and stores) is then spread over twice the multiply-adds.
constexpr int kBf16Chunk = 2 * kLanes;
// Tiles of kLanes query rows per work item: each chunk's keys are copied and its values interleaved
// once for all of them, and its rows read from memory once. Up to eight (per layer 1.04-1.08x two
// tiles at 768-4,096 tokens on a Zen 5, SmolLM2's and Llama-3-8B's shapes; perf/journal.md §54),
// fewer where a step's rows would leave a thread without items (item_tiles).
constexpr int kBf16MaxTiles = 8;

struct Bf16Scratch {
  std::vector<__m512i> q;          // [tiles * group][D/2]: lane i = the pair (d, d+1) of position i's query
  std::vector<Lanes> o;            // [tiles * group][D]: unnormalized outputs, transposed (lane = position)
  std::vector<Lanes> max, denom;   // [tiles * group]
  std::vector<uint16_t> k;         // [kBf16Chunk][D]: the chunk's keys, zero rows past its count
  std::vector<uint32_t> v;         // [kBf16Chunk / 2][D]: pairs (v[2j][d], v[2j+1][d])
  std::vector<uint16_t> vt;        // with AMX, [D][kBf16Chunk]: the chunk's values transposed
};

// Scores of one head's positions (q: [D/2] pair vectors) against kLanes keys ([kLanes][D] bf16):
// s[j] = the positions' dot products with key j.
template <int D>
inline void chunk_scores_bf16(const __m512i* q, const uint16_t* k, Lanes* s) {
  const uint32_t* kp = reinterpret_cast<const uint32_t*>(k);
  __m512 acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
  for (int d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh qd = (__m512bh)q[d2];
    for (int j = 0; j < kLanes; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qd, (__m512bh)_mm512_set1_epi32(static_cast<int>(kp[j * D / 2 + d2])));
  }
  for (int j = 0; j < kLanes; ++j) s[j] = (Lanes)acc[j];
}

// e^x for the softmax's x <= 0 (-inf and anything below -87.3: 0), to ~1e-7: 2^(x log2 e) as vscalefps
// of exp2_taylor (common.h) of the fraction, by the rounded power. About half exp_approx's
// operations: no clamps above, no exponent-bit arithmetic; its weights are rounded to bf16 next.
inline Lanes exp_nonpositive(Lanes x) {
  const __m512 xv = (__m512)x;
  const __mmask16 live = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(xv, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (Lanes)_mm512_maskz_scalef_ps(live, exp2_taylor(_mm512_sub_ps(t, n)), n);
}

// Lane i: the pair (a[i], b[i]) rounded to bf16 (nearest even).
inline __m512i bf16_pairs(Lanes a, Lanes b) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a);   // words: a's 16, then b's 16
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}

// o ([D] vectors, lane = position) = o * alpha + sum over the chunk's keys of e[j] * v[j], the keys
// in pairs (ep: pairs of weights, v: [pairs][D] pairs of values).
template <int D>
inline void chunk_values_bf16(const uint32_t* v, const __m512i* ep, int pairs, Lanes alpha, Lanes* o) {
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    __m512 acc[kLanes];
    for (int i = 0; i < kLanes; ++i) acc[i] = (__m512)(o[d0 + i] * alpha);
    for (int j2 = 0; j2 < pairs; ++j2) {
      const __m512bh e = (__m512bh)ep[j2];
      for (int i = 0; i < kLanes; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], e, (__m512bh)_mm512_set1_epi32(static_cast<int>(v[j2 * D + d0 + i])));
    }
    for (int i = 0; i < kLanes; ++i) o[d0 + i] = (Lanes)acc[i];
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Sapphire Rapids and later Xeons): the same items and chunks, with both products on tiles.
// One tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one (pairs along the reduced dimension)
// into a 16 x 16 fp32 tile: 8,192 multiply-adds, against 32 for one vdpbf16ps. The kernel keeps its
// lanes-are-positions layout, so each product is taken transposed:
// - scores: S^T [keys x positions] = K [keys x D] . Q^T, the keys' rows an A tile as copied (w.k),
//   the query's pairs (w.q: [D/2][16 positions]) the B tile as they are; a C tile row is then one
//   key's scores over the positions, the `sc[j]` vector the online softmax reads.
// - values: O^T [D x positions] += V^T [D x keys] . P^T, the weights' key pairs (ep) the B tile as
//   they are, and V^T (w.vt, [D][32 keys]) the A tile, transposed once a chunk for every tile and
//   head of the item; a C tile is 16 of the output's `o[d]` vectors, loaded, added to and stored.
// Both sum in fp32 as the dot-product kernel does, in another order; the weights are rounded to
// bf16 the same way, and the softmax runs in base 2 with the scale folded in (softmax_chunk_exp2:
// with the products on tiles, it is most of the time). Tiles need the kernel's permission once a
// process (arch_prctl) and each thread's palette loaded before use (AmxTiles, once a work item).
// Items of two or more query heads go two at a time (amx_scores2, amx_values2).
// PDSERVE_CPU_AMX_ATTENTION=0 runs the dot-product kernel instead.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;   // asm/prctl.h, the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

inline bool amx_attention_enabled() {
  const char* value = std::getenv("PDSERVE_CPU_AMX_ATTENTION");
  return amx_permitted() && (value == nullptr || std::strcmp(value, "0") != 0);
}

// Every tile 16 rows of 64 bytes: A (16 x 32 bf16), B (16 pairs x 16) and C (16 x 16 fp32) alike.
// Loaded for a work item's duration and released after it, so that a thread between items (or in
// another library's code) carries no tile state. For as long, results that underflow flush to zero:
// masked keys' weights underflow through the subnormals (exp2_nonpositive's floor, 2^-200), each
// otherwise a microcode assist (8% of a 4,096-token prompt's attention without it).
struct AmxTiles {
  const unsigned csr = _mm_getcsr();
  AmxTiles() {
    _mm_setcsr(csr | _MM_FLUSH_ZERO_ON);
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
      uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
    } config;
    _tile_loadconfig(&config);
  }
  ~AmxTiles() {
    _tile_release();
    _mm_setcsr(csr);
  }
};

// sc[j] (j < 32) = the scores of key j (k: [32][D] bf16) against one head's 16 positions (q: [D/2]
// pair vectors, lane = position), unscaled.
template <int D>
inline void amx_scores(const __m512i* q, const uint16_t* k, Lanes* sc) {
  _tile_zero(0);
  _tile_zero(1);
  for (int d0 = 0; d0 < D; d0 += 32) {
    _tile_loadd(2, k + d0, D * 2);                  // keys 0-15, head dims d0..d0+31
    _tile_loadd(3, k + 16 * D + d0, D * 2);         // keys 16-31
    _tile_loadd(4, q + d0 / 2, 64);                 // the positions' pairs d0/2..d0/2+15
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  _tile_stored(0, sc, 64);
  _tile_stored(1, sc + 16, 64);
}

// o ([D] vectors) *= alpha, skipped where every factor is exactly 1 (the running max did not move).
inline void rescale(Lanes* o, int D, Lanes alpha) {
  if (_mm512_cmp_ps_mask((__m512)alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0)
    for (int d = 0; d < D; ++d) o[d] *= alpha;
}

// o ([D] vectors, lane = position) = o * alpha + the chunk's 32 keys' values weighted by ep (pairs
// of weights, lane = position; 0 past the chunk's keys), vt: the values transposed ([D][32] bf16).
template <int D>
inline void amx_values(const uint16_t* vt, const __m512i* ep, Lanes alpha, Lanes* o) {
  rescale(o, D, alpha);
  _tile_loadd(7, ep, 64);
  for (int d0 = 0; d0 < D; d0 += 16) {
    _tile_loadd(5, o + d0, 64);
    _tile_loadd(6, vt + d0 * 32, 64);
    _tile_dpbf16ps(5, 6, 7);
    _tile_stored(5, o + d0, 64);
  }
}

// The two above for two heads' positions at once (u0, u1: tiles of the same item, or query heads
// of the same tile), each key or value tile loaded once for both: four independent accumulators (2
// A x 2 B -> 4 C, the tiles' whole register file), where one head alone chains each of its two.
template <int D>
inline void amx_scores2(const __m512i* q0, const __m512i* q1, const uint16_t* k, Lanes* sc0, Lanes* sc1) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int d0 = 0; d0 < D; d0 += 32) {
    _tile_loadd(4, k + d0, D * 2);
    _tile_loadd(5, k + 16 * D + d0, D * 2);
    _tile_loadd(6, q0 + d0 / 2, 64);
    _tile_loadd(7, q1 + d0 / 2, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sc0, 64);
  _tile_stored(1, sc0 + 16, 64);
  _tile_stored(2, sc1, 64);
  _tile_stored(3, sc1 + 16, 64);
}

template <int D>
inline void amx_values2(const uint16_t* vt, const __m512i* ep0, const __m512i* ep1, Lanes alpha0, Lanes alpha1,
                        Lanes* o0, Lanes* o1) {
  rescale(o0, D, alpha0);
  rescale(o1, D, alpha1);
  _tile_loadd(6, ep0, 64);
  _tile_loadd(7, ep1, 64);
  for (int d0 = 0; d0 < D; d0 += 32) {
    _tile_loadd(0, o0 + d0, 64);
    _tile_loadd(1, o0 + d0 + 16, 64);
    _tile_loadd(2, o1 + d0, 64);
    _tile_loadd(3, o1 + d0 + 16, 64);
    _tile_loadd(4, vt + d0 * 32, 64);
    _tile_loadd(5, vt + (d0 + 16) * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, o0 + d0, 64);
    _tile_stored(1, o0 + d0 + 16, 64);
    _tile_stored(2, o1 + d0, 64);
    _tile_stored(3, o1 + d0 + 16, 64);
  }
}

// 2^t for the softmax's t <= 0, to 2.9e-6 (a degree-4 fit on [-1/2, 1/2] where exp_nonpositive takes
// 1e-7 in six: its weights are rounded to bf16 next, and the denominators sum them at 1e-6); below
// -200 (-inf and NaN included) 0, through vscalefps's underflow, with no mask.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-200.f));       // a NaN t gives the second operand
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.582852944731712e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5906426161527634e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024099111557007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241750717163e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// softmax_chunk's online softmax in base 2 on the raw scores, for the AMX kernel, where it is most
// of an item's time: the scale is folded with log2 e into one multiply-add a weight (the running
// max stays in raw units; without a soft cap the scale's sign is all the order needs), and masked
// keys (-inf) come out 0 from exp2_nonpositive's floor.
template <int N>
inline Lanes softmax_chunk_exp2(Lanes* sc, int64_t c0, bool masked, Lanes limit, Lanes floor_pos, float cap,
                                float scale, Lanes& max, Lanes& denom, Lanes* e) {
  float c = scale * 1.4426950408889634f;
  if (cap > 0.f) {
    for (int j = 0; j < N; ++j) sc[j] = soft_cap(sc[j] * scale, cap);
    c = 1.4426950408889634f;
  }
  // Four running maxima and sums: one chain through the chunk's keys would wait on each max's and
  // add's latency.
  static_assert(N % 4 == 0);
  Lanes m4[4] = {max, max, max, max};
  for (int j = 0; j < N; ++j) {
    if (masked) {
      const float key = static_cast<float>(c0 + j);
      sc[j] = key <= limit && key > floor_pos ? sc[j] : Lanes{} - INFINITY;   // causal, windowed
    }
    m4[j % 4] = m4[j % 4] > sc[j] ? m4[j % 4] : sc[j];
  }
  const Lanes m01 = m4[0] > m4[1] ? m4[0] : m4[1], m23 = m4[2] > m4[3] ? m4[2] : m4[3];
  const Lanes m = m01 > m23 ? m01 : m23;
  const Lanes m_safe = m == Lanes{} - INFINITY ? Lanes{} : m;   // as in softmax_chunk
  const __m512 cv = _mm512_set1_ps(c), mc = (__m512)(m_safe * -c);
  const Lanes alpha = (Lanes)exp2_nonpositive((__m512)((max - m_safe) * c));
  __m512 sum4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int j = 0; j < N; ++j) {
    const __m512 x = exp2_nonpositive(_mm512_fmadd_ps((__m512)sc[j], cv, mc));
    e[j] = (Lanes)x;
    sum4[j % 4] = _mm512_add_ps(sum4[j % 4], x);
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(sum4[0], sum4[1]), _mm512_add_ps(sum4[2], sum4[3]));
  denom = denom * alpha + (Lanes)sum;
  max = m;
  return alpha;
}

// vt ([D][32] bf16) = the transpose of the chunk's value pairs (v: [16 pairs][D], pair j2 at head
// dim d = (v[2 j2][d], v[2 j2 + 1][d])): row d holds the 32 keys' values at d in key order.
template <int D>
inline void transpose_value_pairs(const uint32_t* v, uint16_t* vt) {
  uint32_t* out = reinterpret_cast<uint32_t*>(vt);
  for (int j2 = 0; j2 < 16; ++j2)
    for (int d = 0; d < D; ++d) out[d * 16 + j2] = v[j2 * D + d];
}
#endif

template <int D, bool kAmx>
void prefill_bf16_dot(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& tables,
                      const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale, int64_t window,
                      double softcap, at::Tensor& out) {
  static_assert(kLanes == 16 && D % 2 == 0);
  const int64_t num_heads = query.size(1);
  const PagedKV<c10::BFloat16> kv(kv_cache);
  const int64_t group = num_heads / kv.num_kv_heads;
  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(query.const_data_ptr<c10::BFloat16>());
  const int64_t q_stride = query.stride(0);
  const uint16_t* k_ptr = reinterpret_cast<const uint16_t*>(kv.k);
  const uint16_t* v_ptr = reinterpret_cast<const uint16_t*>(kv.v);
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  const float cap = static_cast<float>(softcap), scalef = static_cast<float>(scale);
  const int64_t tiles = item_tiles(query_lens, kv.num_kv_heads, kBf16MaxTiles, 2);
  auto make_scratch = [&] {
    Bf16Scratch w;
    w.q.resize(static_cast<size_t>(tiles * group * D / 2));
    w.o.resize(static_cast<size_t>(tiles * group * D));
    w.k.resize(static_cast<size_t>(kBf16Chunk * D));
    w.v.resize(static_cast<size_t>(kBf16Chunk / 2 * D));
    if (kAmx) w.vt.resize(static_cast<size_t>(D * kBf16Chunk));
    return w;
  };
  // Query head u = t * group + g: tile t's head g.
  auto body = [&](Bf16Scratch& w, const Item* items, int n) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::optional<AmxTiles> amx;
    if constexpr (kAmx) amx.emplace();
#endif
    const int64_t h = items[0].head;
    for (int t = 0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        uint32_t* qw = reinterpret_cast<uint32_t*>(w.q.data() + (t * group + g) * D / 2);   // [D/2][kLanes]
        for (int64_t i = 0; i < kLanes; ++i) {
          const uint32_t* row = reinterpret_cast<const uint32_t*>(
              q_ptr + (items[t].first_row + std::min(i, items[t].rows - 1)) * q_stride + (h * group + g) * D);
          for (int d2 = 0; d2 < D / 2; ++d2) qw[d2 * kLanes + i] = row[d2];
        }
      }
    std::fill(w.o.begin(), w.o.end(), Lanes{});
    w.max.assign(static_cast<size_t>(n * group), Lanes{} - INFINITY);
    w.denom.assign(static_cast<size_t>(n * group), Lanes{});
    Lanes e[kBf16Chunk];
    __m512i ep[kBf16Chunk / 2];
    const Item& last = items[n - 1];   // its keys end last; the first tile's begin first
    for (int64_t c0 = items[0].begin; c0 < last.end; c0 += kBf16Chunk) {
      const int64_t count = std::min<int64_t>(kBf16Chunk, last.end - c0);
      const int pairs = static_cast<int>((count + 1) / 2);
      // The chunk's keys copied side by side and its values interleaved in pairs of keys, once for
      // the item's tiles and query heads; rows past the keys are zeros (their weights are 0, and 0 *
      // a stale NaN would not be).
      for (int64_t j = 0; j < kBf16Chunk; j += 2) {
        const uint16_t* vr[2] = {nullptr, nullptr};
        for (int64_t a = 0; a < 2; ++a) {
          uint16_t* kd = w.k.data() + (j + a) * D;
          if (j + a < count) {
            const int64_t row = kv.row(last.table, c0 + j + a) + h * D;
            std::memcpy(kd, k_ptr + row, D * sizeof(uint16_t));
            vr[a] = v_ptr + row;
          } else {
            std::fill(kd, kd + D, uint16_t{0});
          }
        }
        uint32_t* vd = w.v.data() + j / 2 * D;
        if (j >= count) {                            // pairs past `pairs` are read only by AMX's tiles
          if (kAmx) std::fill(vd, vd + D, 0u);
          continue;
        }
        for (int d = 0; d < D; d += 16) {
          const u32x16 a = __builtin_convertvector(*reinterpret_cast<const u16x16*>(vr[0] + d), u32x16);
          const u32x16 b = vr[1] ? __builtin_convertvector(*reinterpret_cast<const u16x16*>(vr[1] + d), u32x16)
                                 : u32x16{};
          const u32x16 pair = a | b << 16;
          std::memcpy(vd + d, &pair, sizeof pair);
        }
      }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (kAmx) {
        transpose_value_pairs<D>(w.v.data(), w.vt.data());
        // The heads of the tiles this chunk reaches, two at a time: tiles end in order and begin in
        // order, so those are a run [first, last] of them.
        int first = 0, last_live = n - 1;
        while (first < n && c0 >= items[first].end) ++first;
        while (last_live >= first && c0 + kBf16Chunk <= items[last_live].begin) --last_live;
        const int64_t u_end = (last_live + 1) * group;
        for (int64_t u0 = first * group; u0 < u_end; u0 += 2) {
          const int64_t u1 = u0 + 1 < u_end ? u0 + 1 : -1;
          alignas(64) Lanes sc[2][kBf16Chunk];
          alignas(64) __m512i eps[2][kBf16Chunk / 2];
          Lanes alpha[2];
          if (u1 >= 0)
            amx_scores2<D>(w.q.data() + u0 * D / 2, w.q.data() + u1 * D / 2, w.k.data(), sc[0], sc[1]);
          else
            amx_scores<D>(w.q.data() + u0 * D / 2, w.k.data(), sc[0]);
          for (int a = 0; a < (u1 >= 0 ? 2 : 1); ++a) {
            const int64_t u = a ? u1 : u0;
            const Item& it = items[u / group];
            alpha[a] = softmax_chunk_exp2<kBf16Chunk>(sc[a], c0, it.masked(c0, kBf16Chunk, window), it.limit,
                                                      it.floor_pos, cap, scalef, w.max[u], w.denom[u], e);
            // The tiles read all the chunk's pairs (the weights past its keys are masked to 0).
            for (int j2 = 0; j2 < kBf16Chunk / 2; ++j2) eps[a][j2] = bf16_pairs(e[2 * j2], e[2 * j2 + 1]);
          }
          if (u1 >= 0)
            amx_values2<D>(w.vt.data(), eps[0], eps[1], alpha[0], alpha[1], w.o.data() + u0 * D,
                           w.o.data() + u1 * D);
          else
            amx_values<D>(w.vt.data(), eps[0], alpha[0], w.o.data() + u0 * D);
        }
        continue;
      }
#endif
      for (int t = 0; t < n; ++t) {
        const Item& it = items[t];
        // Chunks past a tile's keys or wholly before its window leave its state as it is (every
        // weight 0, the rescale 1): skipped.
        if (c0 >= it.end || c0 + kBf16Chunk <= it.begin) continue;
        const bool masked = it.masked(c0, kBf16Chunk, window);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t u = t * group + g;
          alignas(64) Lanes sc[kBf16Chunk];
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          if constexpr (kAmx) amx_scores<D>(w.q.data() + u * D / 2, w.k.data(), sc);
#endif
          if constexpr (!kAmx) {
            chunk_scores_bf16<D>(w.q.data() + u * D / 2, w.k.data(), sc);
            chunk_scores_bf16<D>(w.q.data() + u * D / 2, w.k.data() + kLanes * D, sc + kLanes);
          }
          for (int j = 0; j < kBf16Chunk; ++j) sc[j] *= scalef;
          const Lanes alpha = softmax_chunk<kBf16Chunk>(sc, c0, masked, it.limit, it.floor_pos, cap, w.max[u],
                                                        w.denom[u], e, exp_nonpositive);
          // AMX's tile reads all the chunk's pairs (the weights past its keys are masked to 0).
          const int weight_pairs = kAmx ? kBf16Chunk / 2 : pairs;
          for (int j2 = 0; j2 < weight_pairs; ++j2) ep[j2] = bf16_pairs(e[2 * j2], e[2 * j2 + 1]);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          if constexpr (kAmx) amx_values<D>(w.vt.data(), ep, alpha, w.o.data() + u * D);
#endif
          if constexpr (!kAmx) chunk_values_bf16<D>(w.v.data(), ep, pairs, alpha, w.o.data() + u * D);
        }
      }
    }
    for (int t = 0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t u = t * group + g;
        store_rows(w.o.data() + u * D, 1.f / w.denom[u], D, items[t].rows,
                   out_ptr + (items[t].first_row * num_heads + h * group + g) * D, num_heads * D);
      }
  };
  for_each_item<kBf16MaxTiles>(tables, query_lens, seq_lens, kv.num_kv_heads, window, tiles, make_scratch, body);
}
#endif

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                         const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale, double k_scale,
                         double v_scale, int64_t window, double softcap) {
  check_attention_inputs("paged_prefill", query, kv_cache);
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_prefill: window and softcap must be >= 0 (0: none)");
  // Rows may be strided (q a view of the QKV projection's output, rotated in place: cpu_ops.rotary_),
  // each row's heads contiguous; the bf16 kernel reads a row in pairs, so an even row stride.
  const bool rows_ok = query.stride(2) == 1 && query.stride(1) == query.size(2) && query.stride(0) % 2 == 0;
  const at::Tensor q = rows_ok ? query : query.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor qlens = query_lens.to(at::kLong).contiguous();
  const at::Tensor slens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == qlens.size(0) && slens.size(0) == qlens.size(0),
              "paged_prefill: block_tables, query_lens and seq_lens must have one row per segment");
  int64_t total = 0;
  for (int64_t s = 0; s < qlens.size(0); ++s) {
    const int64_t ql = qlens.const_data_ptr<int64_t>()[s], sl = slens.const_data_ptr<int64_t>()[s];
    TORCH_CHECK(ql >= 0 && ql <= sl, "paged_prefill: query_len ", ql, " of segment ", s, " must be in [0, seq_len ",
                sl, "]");
    total += ql;
  }
  TORCH_CHECK(total == q.size(0), "paged_prefill: query_lens sum to ", total, " but query has ", q.size(0), " rows");
  check_block_tables("paged_prefill", tables, slens, kv_cache.size(2), kv_cache.size(1));
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  if (q.size(0) == 0) return out;
  dispatch_dtype_and_head_dim("paged_prefill", q, kv_cache, [&](auto type, auto cache, auto dim) {
#if defined(__AVX512BF16__)
    using Q = typename decltype(type)::type;
    if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<typename decltype(cache)::type, Q>) {
      constexpr int D = decltype(dim)::value;
      if (bf16_dot_enabled()) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if constexpr (D % 32 == 0) {
          if (amx_attention_enabled()) {
            prefill_bf16_dot<D, true>(q, kv_cache, tables, qlens, slens, scale, window, softcap, out);
            return;
          }
        }
#endif
        prefill_bf16_dot<D, false>(q, kv_cache, tables, qlens, slens, scale, window, softcap, out);
        return;
      }
    }
#endif
    prefill_impl<typename decltype(type)::type, typename decltype(cache)::type, decltype(dim)::value>(
        q, kv_cache, tables, qlens, slens, scale, k_scale, v_scale, window, softcap, out);
  });
  return out;
}

// Whether this build runs bf16 prefill on AMX tiles (built for a CPU with AMX-BF16, and the kernel
// lets this process use them), before the switches: kernels.cpu_ops.amx_prefill reads those.
bool prefill_amx_built() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("prefill_amx_built() -> bool");
  m.def("paged_prefill(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor query_lens, Tensor seq_lens, "
        "float scale, float k_scale, float v_scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("prefill_amx_built", &prefill_amx_built); }
