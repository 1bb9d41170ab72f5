// The sampler's kernel (engine/sample/nucleus.py), kernels.reference.softmax_topk's contract: each row's
// k largest logits as probabilities under the row's softmax, descending (equal values: the earlier
// index first), with their indices.
//
// Two passes over a row and no [rows, n] output: the chunks' maxima bound the selection (below), then
// the softmax's normalizer is summed in lanes. torch's softmax and
// topk read the row three times and write it once: 1.3-1.6 ms for 32 rows of a 49k vocabulary on two
// threads, a sixth of a sampled decode step of SmolLM2 (docs/perf/journal.md §66).
//
// A row with a NaN, a +inf, or only -inf has no distribution: its probabilities are NaN, as torch's
// softmax makes them (the sampler then keeps the row's argmax).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "common.h"
#include "work_split.h"

namespace {

struct Entry {
  float v;
  int64_t i;
};

// a before b in the output: the larger value, or the same value at the earlier index.
inline bool before(const Entry& a, const Entry& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// Scratch a thread reuses across rows.
struct Scratch {
  std::vector<float> maxima, order;
  std::vector<Entry> found;
};

// Row x[0, n) -> vals[0, k), ids[0, k) (k <= n). The k-th largest of the kLanes-wide chunks' maxima
// bounds the k-th largest entry from below (those k maxima are k distinct entries), so only entries
// at least that large are candidates: a few hundred of a 49k row. (A heap offered every entry that
// beat its worst took ~490 insertions a row of random logits, 0.9 ms for 32 rows on two threads.)
void softmax_topk_row(const float* x, int64_t n, int64_t k, float* vals, int64_t* ids, Scratch& s) {
  const int64_t chunks = n / kLanes;
  s.maxima.resize(static_cast<size_t>(chunks));
  for (int64_t c = 0; c < chunks; ++c) {
    const float m = hmax(load_lanes(x + c * kLanes));
    s.maxima[c] = m == m ? m : -INFINITY;       // (a NaN sorts nowhere; the normalizer below finds it)
  }
  float bound = -INFINITY;
  if (chunks >= k) {
    s.order.assign(s.maxima.begin(), s.maxima.end());
    std::nth_element(s.order.begin(), s.order.begin() + (k - 1), s.order.end(), std::greater<float>());
    bound = s.order[k - 1];
  }
  s.found.clear();
  for (int64_t c = 0; c < chunks; ++c)
    if (s.maxima[c] >= bound)
      for (int64_t j = c * kLanes; j < (c + 1) * kLanes; ++j)
        if (x[j] >= bound) s.found.push_back({x[j], j});
  for (int64_t j = chunks * kLanes; j < n; ++j)
    if (x[j] >= bound) s.found.push_back({x[j], j});
  const int64_t have = std::min<int64_t>(k, static_cast<int64_t>(s.found.size()));
  std::partial_sort(s.found.begin(), s.found.begin() + have, s.found.end(), before);
  const float top = have > 0 ? s.found[0].v : NAN;
  // The normalizer: sum of e^(x - top) in lanes, the tail padded with -inf (e^-inf = 0). A NaN
  // anywhere in the row makes it NaN.
  Lanes acc{};
  int64_t m = 0;
  for (; m + kLanes <= n; m += kLanes) acc += exp_approx(load_lanes(x + m) - top);
  Lanes tail = Lanes{} - INFINITY;
  for (int l = 0; m + l < n; ++l) tail[l] = x[m + l];
  acc += exp_approx(tail - top);
  const float z = hsum(acc);
  const bool none = !std::isfinite(top) || !(z > 0) || !std::isfinite(z);
  for (int64_t t = 0; t < k; ++t) {
    vals[t] = none || t >= have ? NAN : std::exp(s.found[t].v - top) / z;
    ids[t] = t < have ? s.found[t].i : 0;
  }
}

std::tuple<at::Tensor, at::Tensor> softmax_topk(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "softmax_topk: x must be [rows, n] float32 with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(k >= 1 && k <= n, "softmax_topk: k must be in [1, n]; got k=", k, ", n=", n);
  at::Tensor vals = at::empty({rows, k}, x.options());
  at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* p = x.const_data_ptr<float>();
  float* v = vals.mutable_data_ptr<float>();
  int64_t* o = ids.mutable_data_ptr<int64_t>();
  parallel_ranges(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t r = first; r < last; ++r) softmax_topk_row(p + r * stride, n, k, v + r * k, o + r * k, scratch);
  });
  return {vals, ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) { m.def("softmax_topk(Tensor x, int k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("softmax_topk", &softmax_topk); }
