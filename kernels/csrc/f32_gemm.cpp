// An fp32 GEMM on fused multiply-adds for the dense linear layers: y = x W^T (+ b), for fp32 weights
// on CPUs without bf16 arithmetic (AVX2-only EPYCs and Xeons, AVX-512 ones without AVX512-BF16) and
// anywhere a user serves fp32.
//
// oneDNN's prepacked fp32 GEMM, which linear() called before, runs a decode step's few-row products
// at 50-60% of the FMA rate on a 2-core Zen 3 EPYC (docs/perf/journal.md §46): ~100-115 GFLOP/s at 32
// rows where 256 rows reach ~150, and streams a one-row product's weights at 15-29 GB/s. This is the
// register-blocked kernel of bf16_gemm.cpp with fp32 operands: the weight is packed once into panels
// of kVecs registers' worth of output columns ([N/P][K][P]: one K step of a panel is kVecs
// registers), and each block of up to six rows keeps 6 x kVecs accumulators in registers over the
// whole of K (AVX2: 6 x 2 of sixteen registers, AVX-512: 6 x 4 of thirty-two), one broadcast x
// element against the panel's registers per step. A row's blocks are as even as six allows (32 rows:
// 6, 6, 5, 5, 5, 5, not five sixes and a two whose K loop would wait on the panel's loads). Every
// output is one fused multiply-add per K step in K order whatever the number of rows, their block or
// the thread, so a row's result does not depend on the batch it is in.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__FMA__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#define PDSERVE_F32_GEMM 1
#endif

namespace {

constexpr int kRowsMax = 6;   // rows a block keeps in registers
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kVecs = 4;      // 24 accumulators of the 32 registers
constexpr int kWidth = 16;
#else
#if defined(PDSERVE_F32_GEMM)
using Vec = __m256;
#endif
constexpr int kVecs = 2;      // 12 accumulators of the 16 registers, two for the panel, one for x
constexpr int kWidth = 8;
#endif
constexpr int64_t kPanel = kVecs * kWidth;   // output columns a panel holds
// How far ahead the first row block prefetches the panel, in K steps (1 KB with AVX2, 4 KB with
// AVX-512; 1 and 4 KB with AVX2 timed level with it on a Zen 3 EPYC).
constexpr int kPrefetchSteps = 16;

#if defined(PDSERVE_F32_GEMM)
#if defined(__AVX512F__)
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#else
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#endif
#endif

// W [N, K] fp32 -> panels [ceil(N/P), K, P], zero-padded past N.
at::Tensor f32_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "f32_pack: the weight must be a 2-D fp32 tensor; got ", weight.dim(), "-D ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* col = dst + (n / kPanel) * K * kPanel + (n % kPanel);
      for (int64_t k = 0; k < K; ++k) col[k * kPanel] = src[n * K + k];
    }
  });
  return out;
}

#if defined(PDSERVE_F32_GEMM)
// Rows [0, R) of x (row stride ld) against one panel: out[r][0, cols). bias: kPanel values (zero past
// N) or null. PF: prefetch the panel this many K steps ahead (the first row block streams it from
// memory; the others find it in L1/L2).
template <int R, int PF>
inline void panel_rows(const float* x, int64_t ld, const float* panel, int64_t K, const float* bias, float* out,
                       int64_t ldo, int cols) {
  // Every loop over r and j unrolled: an accumulator indexed at run time would live on the stack.
  Vec acc[R][kVecs];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) acc[r][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    if constexpr (PF > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + PF * kPanel);
      for (int line = 0; line < kPanel * 4; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    Vec wv[kVecs];
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) wv[j] = vload(w + j * kWidth);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const Vec b = vbroadcast(x + r * ld + k);
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) acc[r][j] = vfma(b, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    if (bias)
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) acc[r][j] = vadd(acc[r][j], vload(bias + j * kWidth));
    if (cols == kPanel) {
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) vstore(out + r * ldo + j * kWidth, acc[r][j]);
    } else {   // the last panel of an N that is not a multiple of kPanel
      alignas(64) float row[kPanel];
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) vstore(row + j * kWidth, acc[r][j]);
      std::memcpy(out + r * ldo, row, sizeof(float) * cols);
    }
  }
}

template <int R, int PF>
inline void block_rows(int rows, const float* x, int64_t ld, const float* panel, int64_t K, const float* bias,
                       float* out, int64_t ldo, int cols) {
  if constexpr (R > 0) {
    if (rows != R) return block_rows<R - 1, PF>(rows, x, ld, panel, K, bias, out, ldo, cols);
    panel_rows<R, PF>(x, ld, panel, K, bias, out, ldo, cols);
  }
}

// Rows [m0, m1) against panel `pn`: ceil(rows / 6) blocks as even as they divide, the first prefetching.
void panel_block(const float* x, int64_t ld, int64_t m0, int64_t m1, const float* panels, int64_t K, int64_t pn,
                 const float* bias, float* out, int64_t N) {
  const float* panel = panels + pn * K * kPanel;
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - pn * kPanel));
  const float* b = bias ? bias + pn * kPanel : nullptr;
  const int64_t rows = m1 - m0, blocks = (rows + kRowsMax - 1) / kRowsMax;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = m0 + rows * i / blocks, r1 = m0 + rows * (i + 1) / blocks;
    const int count = static_cast<int>(r1 - r0);
    if (i == 0)
      block_rows<kRowsMax, kPrefetchSteps>(count, x + r0 * ld, ld, panel, K, b, out + r0 * N + pn * kPanel, N, cols);
    else
      block_rows<kRowsMax, 0>(count, x + r0 * ld, ld, panel, K, b, out + r0 * N + pn * kPanel, N, cols);
  }
}
#endif

// x [..., K] fp32, panels from f32_pack of a [n, K] weight, bias [n] or None -> [..., n] fp32.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == kPanel && panels.is_contiguous(),
              "f32_linear: x and the panels (from f32_pack) must be fp32");
  const int64_t K = x.size(-1);
  TORCH_CHECK(panels.size(1) == K && n > 0 && (n + kPanel - 1) / kPanel == panels.size(0),
              "f32_linear: the panels hold a [", panels.size(0) * kPanel, ", ", panels.size(1), "] weight; x has ", K,
              " features and n is ", n);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "f32_linear: bias must have ", n, " elements");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
#if defined(PDSERVE_F32_GEMM)
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0), nP = panels.size(0);
  if (M == 0) return out;
  // bias padded to whole panels, so that every panel adds full registers
  const at::Tensor b32 = bias ? at::constant_pad_nd(bias->to(at::kFloat), {0, nP * kPanel - n}).contiguous() : at::Tensor();
  const float* xp = rows.const_data_ptr<float>();
  const float* wp = panels.const_data_ptr<float>();
  const float* bp = bias ? b32.const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  // Work: (panel, row group) pairs, panel-major, as bf16_linear: few panels split unevenly over the
  // threads, so their rows are cut in groups until the units divide evenly or are many.
  const int64_t threads = at::get_num_threads();
  const int64_t max_groups = std::max<int64_t>(1, std::min<int64_t>(4, M / kRowsMax));
  int64_t groups = 1;
  while (groups < max_groups && (nP * groups) % threads != 0 && nP * groups < 8 * threads) ++groups;
  at::parallel_for(0, nP * groups, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u % groups, m0 = M * g / groups, m1 = M * (g + 1) / groups;
      if (m0 < m1) panel_block(xp, K, m0, m1, wp, K, u / groups, bp, op, n);
    }
  });
#else
  TORCH_CHECK(false, "f32_linear: this build of the CPU kernels has no AVX2 / AVX-512 fused multiply-add (the CPU lacks it)");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("f32_pack(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("f32_pack", &f32_pack);
  m.impl("f32_linear", &f32_linear);
}
