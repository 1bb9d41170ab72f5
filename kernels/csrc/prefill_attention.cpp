// pdserve CPU prefill attention: causal attention of variable-length query segments against paged
// K/V, read straight from the block table, the contract of kernels.reference.prefill_attention (full
// prefill, chunked prefill and prefix hits alike). Flash-attention style, in fp32, one pass over
// K/V with an online softmax.
//
// A work item is (segment, KV head, tile of L query positions), L the lanes of one vector register:
// 16 with AVX-512, 8 elsewhere. Its rows are the query heads that share the KV head, each held
// transposed: one vector per head dimension with a lane per position. Then the scores of L keys are
// L FMAs per head dimension with the key's element broadcast, and the online softmax (causal mask,
// max, exp, denominator) is elementwise across lanes, with no horizontal reductions. A chunk of L
// keys and values is converted to fp32 once and shared by the item's heads. Items go to ATen's
// threads longest first. The inner loops keep L accumulators and two more vectors live: 18 of
// AVX-512's 32 registers at L = 16, 10 of AVX2's 16 at L = 8 (at L = 16 on AVX2, every vector is two
// registers and the accumulators spill: on a Zen 1 the kernel ran at 0.2-0.5x torch's SDPA).
//
// KV cache layout (per layer): [2, num_blocks, block_size, num_kv_heads, head_dim].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common.h"

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

// Per-thread working memory, reused across items.
template <int D>
struct PrefillScratch {
  std::vector<Lanes> q, o;     // [group][D]: scaled queries and unnormalized outputs, transposed
  std::vector<Lanes> max, denom;   // [group]: online-softmax state per lane
  std::vector<float> k, v;      // [kLanes][D]: the current chunk in fp32
};

// T: the query's dtype; C: the cache's element type (T, or fp8 e4m3 read at k_scale / v_scale,
// folded into the query's scale and the output's normalization).
template <typename T, typename C, int D>
void prefill_impl(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& tables,
                  const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale, double k_scale,
                  double v_scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t num_heads = query.size(1), num_segments = query_lens.size(0);
  const PagedKV<C> kv(kv_cache);
  const int64_t num_kv_heads = kv.num_kv_heads, group = num_heads / num_kv_heads, max_blocks = tables.size(1);
  const T* q_ptr = query.const_data_ptr<T>();
  const int64_t* table_ptr = tables.const_data_ptr<int64_t>();
  const int64_t* qlen_ptr = query_lens.const_data_ptr<int64_t>();
  const int64_t* slen_ptr = seq_lens.const_data_ptr<int64_t>();
  T* out_ptr = out.mutable_data_ptr<T>();

  // Work items: tiles of up to kLanes query rows of a segment (the segment, the tile's first row within
  // it, the segment's first row in `query`) x KV heads.
  struct Tile {
    int64_t segment, row0, first_row_of_segment;
  };
  std::vector<Tile> tiles;
  for (int64_t s = 0, start = 0; s < num_segments; start += qlen_ptr[s], ++s)
    for (int64_t r = 0; r < qlen_ptr[s]; r += kLanes) tiles.push_back({s, r, start});
  auto keys_end = [&](const Tile& t) {   // keys the tile's last position sees
    const int64_t s = t.segment, ctx = slen_ptr[s] - qlen_ptr[s];
    return ctx + std::min(qlen_ptr[s], t.row0 + kLanes);
  };
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  const auto assigned = assign_longest_first(
      num_items, at::get_num_threads(), [&](int64_t item) { return keys_end(tiles[item / num_kv_heads]) + kLanes; });

  at::parallel_for(0, static_cast<int64_t>(assigned.size()), 1, [&](int64_t first, int64_t last) {
    PrefillScratch<D> w;
    w.q.resize(static_cast<size_t>(group * D));
    w.o.resize(static_cast<size_t>(group * D));
    w.k.resize(static_cast<size_t>(kLanes * D));
    w.v.resize(static_cast<size_t>(kLanes * D));
    Lanes e[kLanes];
    Lanes lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
    for (int64_t t = first; t < last; ++t)
      for (const int64_t item : assigned[t]) {
        const Tile& tile = tiles[item / num_kv_heads];
        const int64_t h = item % num_kv_heads, s = tile.segment;
        const int64_t rows = std::min<int64_t>(kLanes, qlen_ptr[s] - tile.row0);
        const int64_t pos0 = slen_ptr[s] - qlen_ptr[s] + tile.row0, end = keys_end(tile);
        const int64_t* table = table_ptr + s * max_blocks;
        // Lane i is position pos0 + i and sees keys up to it; lanes past the segment's end repeat its
        // last row (their results are not written).
        const Lanes limit = (lane < static_cast<float>(rows) ? lane : Lanes{} + static_cast<float>(rows - 1)) +
                             static_cast<float>(pos0);
        // A sliding window: lane i sees keys in (limit - window, limit]; chunks wholly before the
        // first row's window are skipped.
        const Lanes floor_pos = window > 0 ? limit - static_cast<float>(window) : Lanes{} - 1.f;
        const int64_t begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) / kLanes * kLanes : 0;
        const float cap = static_cast<float>(softcap);
        for (int64_t g = 0; g < group; ++g) {
          float* qf = reinterpret_cast<float*>(w.q.data() + g * D);     // [D][kLanes]
          for (int64_t i = 0; i < kLanes; ++i) {
            const T* row = q_ptr + ((tile.first_row_of_segment + tile.row0 + std::min(i, rows - 1)) * num_heads +
                                    h * group + g) * D;
            for (int d = 0; d < D; ++d) qf[d * kLanes + i] = to_float(row[d]) * static_cast<float>(scale * k_scale);
          }
        }
        std::fill(w.o.begin(), w.o.end(), Lanes{});
        w.max.assign(static_cast<size_t>(group), Lanes{} - INFINITY);
        w.denom.assign(static_cast<size_t>(group), Lanes{});
        for (int64_t c0 = begin; c0 < end; c0 += kLanes) {
          const int64_t count = std::min<int64_t>(kLanes, end - c0);
          for (int64_t j = 0; j < kLanes; ++j) {
            float* kd = w.k.data() + j * D;
            float* vd = w.v.data() + j * D;
            if (j >= count) {                           // past the keys: zeros, never weighted
              std::fill(kd, kd + D, 0.f);
              std::fill(vd, vd + D, 0.f);
              continue;
            }
            const int64_t row = kv.row(table, c0 + j) + h * D;
            const C* kr = kv.k + row;
            const C* vr = kv.v + row;
            for (int d0 = 0; d0 < D; d0 += 16) {
              const f32x16 kx = load16(kr + d0), vv = load16(vr + d0);
              std::memcpy(kd + d0, &kx, sizeof kx);
              std::memcpy(vd + d0, &vv, sizeof vv);
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            Lanes sc[kLanes];
            chunk_scores<D>(w.q.data() + g * D, w.k.data(), sc);
            Lanes m = w.max[g];
            for (int j = 0; j < kLanes; ++j) {
              if (cap > 0.f) sc[j] = soft_cap(sc[j], cap);
              const float key = static_cast<float>(c0 + j);
              sc[j] = key <= limit && key > floor_pos ? sc[j] : Lanes{} - INFINITY;   // causal, windowed
              m = m > sc[j] ? m : sc[j];
            }
            // Without a window key 0 is in every lane's range, so after the first chunk m is finite;
            // with one a lane may see no key of a chunk yet: its max stays -inf, and 0 stands in for
            // it so that alpha and the weights come out 0 rather than NaN.
            const Lanes m_safe = m == Lanes{} - INFINITY ? Lanes{} : m;
            const Lanes alpha = exp_approx(w.max[g] - m_safe);
            Lanes sum = {};
            for (int j = 0; j < kLanes; ++j) {
              e[j] = exp_approx(sc[j] - m_safe);
              sum += e[j];
            }
            w.denom[g] = w.denom[g] * alpha + sum;
            w.max[g] = m;
            chunk_values<D>(w.v.data(), e, count, alpha, w.o.data() + g * D);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const Lanes inv = static_cast<float>(v_scale) / w.denom[g];
          const float* of = reinterpret_cast<const float*>(w.o.data() + g * D);
          for (int64_t i = 0; i < rows; ++i) {
            T* o = out_ptr + ((tile.first_row_of_segment + tile.row0 + i) * num_heads + h * group + g) * D;
            for (int d = 0; d < D; ++d) o[d] = static_cast<T>(of[d * kLanes + i] * inv[i]);
          }
        }
      }
  });
}

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                         const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale, double k_scale,
                         double v_scale, int64_t window, double softcap) {
  check_attention_inputs("paged_prefill", query, kv_cache);
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_prefill: window and softcap must be >= 0 (0: none)");
  const at::Tensor q = query.contiguous();
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
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  dispatch_dtype_and_head_dim("paged_prefill", q, kv_cache, [&](auto type, auto cache, auto dim) {
    prefill_impl<typename decltype(type)::type, typename decltype(cache)::type, decltype(dim)::value>(
        q, kv_cache, tables, qlens, slens, scale, k_scale, v_scale, window, softcap, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("paged_prefill(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor query_lens, Tensor seq_lens, "
        "float scale, float k_scale, float v_scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
