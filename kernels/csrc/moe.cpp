// pdserve CPU fused mixture of experts, kernels.reference.fused_moe's contract: out[t] = sum over its
// top-k experts e (ascending) of weight * w2[e] (silu(w1[e] x_t) * (w3[e] x_t)).
//
// One call per layer instead of a Python loop of ~8 torch calls per active expert: the (token, slot)
// pairs are bucketed by expert with a counting sort, then each expert that has tokens runs as two
// GEMMs over its gathered rows (ATen's CPU GEMM: oneDNN / MKL, threaded inside), its SiLU-gated
// product between them, and its rows are added into an fp32 accumulator with their routing weights,
// experts in ascending order as the reference sums them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace {

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
                     const at::Tensor& ids, int64_t expert_start) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t num_tokens = x.size(0), hidden = x.size(1), experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(0) == experts && w2.size(1) == hidden,
              "fused_moe: w13 must be [E, 2I, H] and w2 [E, H, I] for x's H");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == num_tokens && weights.sizes() == ids.sizes(),
              "fused_moe: ids and weights must both be [T, k]");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(),
              "fused_moe: x, w13 and w2 must share a dtype");
  const at::Tensor id = ids.to(at::kLong).contiguous();
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  const int64_t top_k = id.size(1);
  const int64_t* id_ptr = id.const_data_ptr<int64_t>();
  const float* w_ptr = w.const_data_ptr<float>();

  // Counting sort of the (token, slot) pairs by local expert.
  std::vector<int64_t> count(static_cast<size_t>(experts + 1), 0);
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    const int64_t e = id_ptr[i] - expert_start;
    if (e >= 0 && e < experts) ++count[static_cast<size_t>(e + 1)];
  }
  for (int64_t e = 0; e < experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> pairs(static_cast<size_t>(count[experts]));
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    const int64_t e = id_ptr[i] - expert_start;
    if (e >= 0 && e < experts) pairs[static_cast<size_t>(fill[e]++)] = i;
  }

  at::Tensor acc = at::zeros({num_tokens, hidden}, x.options().dtype(at::kFloat));
  float* acc_ptr = acc.mutable_data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = count[e], n = count[e + 1] - begin;
    if (n == 0) continue;
    at::Tensor rows = at::empty({n}, id.options());
    int64_t* row_ptr = rows.mutable_data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) row_ptr[r] = pairs[static_cast<size_t>(begin + r)] / top_k;
    const at::Tensor h = at::mm(xc.index_select(0, rows), w13[e].t());         // [n, 2I]
    const at::Tensor act = at::silu(h.narrow(1, 0, inter)) * h.narrow(1, inter, inter);
    const at::Tensor out = at::mm(act, w2[e].t()).to(at::kFloat).contiguous();   // [n, H]
    const float* out_ptr = out.const_data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const int64_t pair = pairs[static_cast<size_t>(begin + r)];
      const float weight = w_ptr[pair];
      float* dst = acc_ptr + (pair / top_k) * hidden;
      const float* src = out_ptr + r * hidden;
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) dst[j] += src[j] * weight;
    }
  }
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, int expert_start) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("fused_moe", &fused_moe); }
