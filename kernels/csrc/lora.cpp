// Batched LoRA for one linear layer (kernels.reference.lora_add's contract): out[t] += B_s (A_s x[t])
// for every token t of an adapter group, with s the group's slot, in two passes over all groups.
//
// Shrink: one work item per (group, row k of A_s) computes that row's dot product with each of the
// group's tokens (A's row is read once for all of them). Expand: one work item per (group, block of
// up to 64 output features inside one fused output) adds sum_j shrunk[j] * B^T_s[j] to those
// features of each of the group's tokens, sixteen lanes of outputs at a time. Both passes spread
// their items over ATen's threads; no two items write the same output. The shrunk values are
// rounded to the model's dtype between the passes, as the reference's two matmuls round.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "work_split.h"

namespace {

constexpr int64_t kExpandBlock = 64;   // output features per expand item (four vectors)

// The dot products of one row `a` with four rows x[0..3], in fp32.
template <typename T>
inline void dot_rows4(const T* __restrict a, const T* const* x, int64_t n, float* out) {
  const T* __restrict x0 = x[0];
  const T* __restrict x1 = x[1];
  const T* __restrict x2 = x[2];
  const T* __restrict x3 = x[3];
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    const float ai = to_float(a[i]);
    s0 += ai * to_float(x0[i]);
    s1 += ai * to_float(x1[i]);
    s2 += ai * to_float(x2[i]);
    s3 += ai * to_float(x3[i]);
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

template <typename T>
inline float rounded(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void lora_add_impl(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& bt,
                   const std::vector<int64_t>& rows, const std::vector<int64_t>& starts,
                   const std::vector<int64_t>& slots, const std::vector<int64_t>& ranks,
                   const std::vector<int64_t>& sub_offsets) {
  const int64_t groups = static_cast<int64_t>(slots.size());
  const int64_t subs = static_cast<int64_t>(sub_offsets.size()) - 1;
  const int64_t in = x.size(1), max_rank = a.size(1), out_total = bt.size(2);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* ap = a.const_data_ptr<T>();
  const T* bp = bt.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t width = max_rank * subs;                        // shrunk values per token
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  std::vector<float> shrunk(static_cast<size_t>(num_rows * width + 16));

  // Shrink items: group g covers ranks[g] * subs rows of A_s (rank j, fused output i: row j * subs + i),
  // sixteen rows an item, so that two threads never write the same cache line of `shrunk`.
  constexpr int64_t kRows = 16;
  std::vector<int64_t> first_item(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) first_item[g + 1] = first_item[g] + (ranks[g] * subs + kRows - 1) / kRows;
  parallel_ranges(0, first_item[groups], 1, [&](int64_t begin, int64_t end) {
    int64_t g = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[g + 1]) ++g;
      const int64_t k0 = (item - first_item[g]) * kRows, k1 = std::min(k0 + kRows, ranks[g] * subs);
      // Four tokens at a time against each row of A: the row is read once for the four.
      for (int64_t n0 = starts[g]; n0 < starts[g + 1]; n0 += 4) {
        const int64_t count = std::min<int64_t>(4, starts[g + 1] - n0);
        const T* xr[4];
        for (int64_t t = 0; t < 4; ++t) xr[t] = xp + rows[n0 + std::min(t, count - 1)] * x_stride;
        for (int64_t k = k0; k < k1; ++k) {
          float dots[4];
          dot_rows4(ap + (slots[g] * width + k) * in, xr, in, dots);
          for (int64_t t = 0; t < count; ++t) shrunk[(n0 + t) * width + k] = rounded<T>(dots[t]);
        }
      }
    }
  });

  // Expand items: (group, block of <= 64 features inside one fused output).
  std::vector<std::pair<int64_t, int64_t>> blocks;              // (sub, first feature)
  for (int64_t i = 0; i < subs; ++i)
    for (int64_t o = sub_offsets[i]; o < sub_offsets[i + 1]; o += kExpandBlock) blocks.emplace_back(i, o);
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  parallel_ranges(0, groups * num_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / num_blocks;
      const auto [sub, o0] = blocks[item % num_blocks];
      const int64_t len = std::min(kExpandBlock, sub_offsets[sub + 1] - o0);
      const T* bslot = bp + slots[g] * max_rank * out_total + o0;
      for (int64_t n = starts[g]; n < starts[g + 1]; ++n) {
        const float* s = shrunk.data() + n * width + sub;
        T* orow = op + rows[n] * out_stride + o0;
        float acc[kExpandBlock] = {};
        for (int64_t j = 0; j < ranks[g]; ++j) {
          const float sj = s[j * subs];
          const T* __restrict brow = bslot + j * out_total;
#pragma omp simd
          for (int64_t v = 0; v < len; ++v) acc[v] += sj * to_float(brow[v]);
        }
        for (int64_t v = 0; v < len; ++v) orow[v] = static_cast<T>(to_float(orow[v]) + rounded<T>(acc[v]));
      }
    }
  });
}

std::vector<int64_t> to_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.device().is_cpu(),
              "lora_add: ", name, " must be a 1-D int64 CPU tensor");
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel());
}

void lora_add(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& rows_t, const at::Tensor& starts_t, const at::Tensor& slots_t,
              const at::Tensor& ranks_t, const at::Tensor& sub_offsets_t) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_add: x [T, in] and out [T, out] need contiguous rows");
  TORCH_CHECK(a.dim() == 4 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0)
                  && a.size(1) == bt.size(1) && a.size(3) == x.size(1) && bt.size(2) == out.size(1),
              "lora_add: a must be [slots, rank, subs, in] and bt [slots, rank, out], contiguous");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == a.scalar_type()
                  && x.scalar_type() == bt.scalar_type(), "lora_add: x, out, a and bt must share a dtype");
  const auto rows = to_vector(rows_t, "rows"), starts = to_vector(starts_t, "starts");
  const auto slots = to_vector(slots_t, "slots"), ranks = to_vector(ranks_t, "ranks");
  const auto sub_offsets = to_vector(sub_offsets_t, "sub_offsets");
  const int64_t groups = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == groups + 1 && static_cast<int64_t>(ranks.size()) == groups
                  && starts.front() == 0 && starts.back() == static_cast<int64_t>(rows.size()),
              "lora_add: starts must be [groups + 1] offsets into rows, ranks [groups]");
  TORCH_CHECK(static_cast<int64_t>(sub_offsets.size()) == a.size(2) + 1 && sub_offsets.front() == 0
                  && sub_offsets.back() == out.size(1), "lora_add: sub_offsets must split out's features");
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(0 <= slots[g] && slots[g] < a.size(0) && 0 < ranks[g] && ranks[g] <= a.size(1)
                    && starts[g] <= starts[g + 1], "lora_add: group ", g, " has a bad slot, rank or range");
  }
  for (const int64_t r : rows) TORCH_CHECK(0 <= r && r < x.size(0), "lora_add: row ", r, " out of range");
  switch (x.scalar_type()) {
    case at::kFloat: lora_add_impl<float>(x, out, a, bt, rows, starts, slots, ranks, sub_offsets); break;
    case at::kBFloat16: lora_add_impl<c10::BFloat16>(x, out, a, bt, rows, starts, slots, ranks, sub_offsets); break;
    case at::kHalf: lora_add_impl<c10::Half>(x, out, a, bt, rows, starts, slots, ranks, sub_offsets); break;
    default: TORCH_CHECK(false, "lora_add: dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("lora_add(Tensor x, Tensor(a!) out, Tensor a, Tensor bt, Tensor rows, Tensor starts, Tensor slots, "
        "Tensor ranks, Tensor sub_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("lora_add", &lora_add); }
