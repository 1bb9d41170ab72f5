// A bf16 GEMM on AVX512-BF16's dot products (vdpbf16ps) for the dense linear layers: y = x W^T (+ b).
//
// oneDNN's bf16 brgemm, which torch calls, runs a decode step's few-row products at 35-65% of the
// dot products' rate on a Zen 5 EPYC (docs/perf/journal.md §45): 31-37 GB/s of weights at one row
// where the cores read 65, ~600 GFLOP/s at 32 rows where they compute ~1,000. This one is the plain
// register-blocked kernel: the weight is packed once into panels of 64 output columns
// ([N/64][K/2][64][2]: each K pair of 64 columns is four registers), and each block of up to six rows
// keeps 6 x 4 fp32 accumulators in registers over the whole of K, one broadcast pair of x against the
// four weight registers per step. Every output is the same sum in the same order whatever the number
// of rows, their block or the thread, so a row's result does not depend on the batch it is in.
// Products of bf16 pairs are exact in fp32; each pair's sum and the running sum round to fp32 (as
// oneDNN's kernel); bias (fp32) is added before the one rounding to bf16 (nearest even, as torch).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 64;   // output columns a panel holds: four registers of sixteen fp32 lanes
constexpr int kRowsMax = 6;      // rows a block keeps in registers: 24 accumulators of the 32

// W [N, K] bf16 -> panels [ceil(N/64), ceil(K/2), 64, 2], zero-padded past N and K.
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "bf16_pack: the weight must be a 2-D bf16 tensor; got ", weight.dim(), "-D ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  at::Tensor out = at::zeros({panels, pairs, kPanel, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint16_t* col = dst + (n / kPanel) * pairs * kPanel * 2 + (n % kPanel) * 2;
      for (int64_t k = 0; k < K; ++k) col[(k / 2) * kPanel * 2 + (k % 2)] = src[n * K + k];
    }
  });
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Rows [0, R) of x (pairs of bf16 as uint32, row stride `ld` pairs) against one panel: out[r][0, cols).
// PF: prefetch the panel this many K pairs ahead (the first row block streams it from memory; the
// others find it in L1/L2).
template <int R, int PF>
inline void panel_rows(const uint32_t* x, int64_t ld, const uint16_t* panel, int64_t pairs, const float* bias,
                       uint16_t* out, int64_t ldo, int cols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = panel + p * kPanel * 2;
    if constexpr (PF > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + PF * kPanel * 2);
      for (int line = 0; line < 256; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ld + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, w3);
    }
  }
  for (int j = 0; j < 4 && j * 16 < cols; ++j) {
    const int n = j * 16;
    const __mmask16 mask = cols - n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (cols - n)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(out + r * ldo + n, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b)));
  }
}

template <int R>
inline void tail_rows(int rows, const uint32_t* x, int64_t ld, const uint16_t* panel, int64_t pairs,
                      const float* bias, uint16_t* out, int64_t ldo, int cols) {
  if constexpr (R > 0) {
    if (rows != R) return tail_rows<R - 1>(rows, x, ld, panel, pairs, bias, out, ldo, cols);
    panel_rows<R, 16>(x, ld, panel, pairs, bias, out, ldo, cols);
  }
}

// Rows [m0, m1) against panel `pn`: blocks of kRowsMax rows, the first prefetching.
void panel_block(const uint32_t* x, int64_t ld, int64_t m0, int64_t m1, const uint16_t* panels, int64_t pairs,
                 int64_t pn, const float* bias, uint16_t* out, int64_t N) {
  const uint16_t* panel = panels + pn * pairs * kPanel * 2;
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - pn * kPanel));
  const float* b = bias ? bias + pn * kPanel : nullptr;
  int64_t m = m0;
  if (m + kRowsMax <= m1) {
    panel_rows<kRowsMax, 16>(x + m * ld, ld, panel, pairs, b, out + m * N + pn * kPanel, N, cols);
    for (m += kRowsMax; m + kRowsMax <= m1; m += kRowsMax)
      panel_rows<kRowsMax, 0>(x + m * ld, ld, panel, pairs, b, out + m * N + pn * kPanel, N, cols);
  }
  if (m < m1) tail_rows<kRowsMax - 1>(static_cast<int>(m1 - m), x + m * ld, ld, panel, pairs, b, out + m * N + pn * kPanel, N, cols);
}
#endif

// x [..., K] bf16, panels from bf16_pack of a [n, K] weight, bias [n] or None -> [..., n] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 && panels.dim() == 4 &&
                  panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous(),
              "bf16_linear: x and the panels (from bf16_pack) must be bf16");
  const int64_t K = x.size(-1), pairs = panels.size(1);
  TORCH_CHECK(pairs == (K + 1) / 2 && n > 0 && (n + kPanel - 1) / kPanel == panels.size(0),
              "bf16_linear: the panels hold a [", panels.size(0) * kPanel, ", ", 2 * pairs, "] weight; x has ", K,
              " features and n is ", n);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "bf16_linear: bias must have ", n, " elements");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  at::Tensor rows = x.reshape({-1, K}).contiguous();
  if (K % 2) rows = at::constant_pad_nd(rows, {0, 1});     // the pairs' zero; the panels' padding is zero too
  const int64_t M = rows.size(0);
  if (M == 0) return out;
  const at::Tensor b32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(rows.const_data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.const_data_ptr<at::BFloat16>());
  const float* bp = bias ? b32.const_data_ptr<float>() : nullptr;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  // Work: (panel, row group) pairs, panel-major. Few panels (a 576-wide output has nine) split
  // unevenly over the threads, so their rows are cut in groups until the units divide evenly or
  // are many; a thread then streams about the same share of the weight as before.
  const int64_t nP = panels.size(0), threads = at::get_num_threads();
  const int64_t max_groups = std::max<int64_t>(1, std::min<int64_t>(4, M / kRowsMax));
  int64_t groups = 1;
  while (groups < max_groups && (nP * groups) % threads != 0 && nP * groups < 8 * threads) ++groups;
  const int64_t group_rows = (M + groups - 1) / groups;
  at::parallel_for(0, nP * groups, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m0 = (u % groups) * group_rows, m1 = std::min(M, m0 + group_rows);
      if (m0 < m1) panel_block(xp, rows.size(1) / 2, m0, m1, wp, pairs, u / groups, bp, op, n);
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear: this build of the CPU kernels has no AVX512-BF16 (the CPU lacks it)");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
}
