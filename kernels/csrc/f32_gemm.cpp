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

#include "common.h"
#include "work_split.h"
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
  parallel_ranges(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* col = dst + (n / kPanel) * K * kPanel + (n % kPanel);
      for (int64_t k = 0; k < K; ++k) col[k * kPanel] = src[n * K + k];
    }
  });
  return out;
}

#if defined(PDSERVE_F32_GEMM)
// The epilogues' arithmetic is silu_and_mul's, which cpu_ops.cpp compiles without contracting a
// multiply and an add into one rounding: so here too (the K loop's multiply-adds are explicit).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

constexpr int kHalf = kVecs / 2;              // registers a half-panel holds a K step

// Epilogues: the sums, bias added (`Plain`: out[r][0, cols)); or silu(gate) * up of the block's
// kPanel / 2 gate and up columns (`Silu`: out[r][0, kPanel / 2)), silu_and_mul's arithmetic.
enum class Epilogue { Plain, Silu };

// Rows [0, R) of x (row stride ld) against one block of kPanel columns, the panel `w` (its first K
// step; one step's kPanel values a step): its two halves of kPanel / 2 columns are a plain product's
// columns, or a SwiGLU's gate columns then their up columns (`f32_linear_silu`). bias_lo / bias_hi:
// the halves' biases (a plain product's bias is kPanel values, zero past N, at bias_lo) or null. PF:
// prefetch the weight this many K steps ahead (the first row block streams it from memory; the
// others find it in L1/L2).
template <int R, int PF, Epilogue E>
inline void panel_rows(const float* x, int64_t ld, const float* w, int64_t K, const float* bias_lo,
                       const float* bias_hi, float* out, int64_t ldo, int cols) {
  // Every loop over r and j unrolled: an accumulator indexed at run time would live on the stack.
  Vec acc[R][kVecs];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) acc[r][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const float* lo = w + k * kPanel;
    const float* hi = lo + kPanel / 2;
    if constexpr (PF > 0) {
      for (const float* half : {lo, hi}) {
        const char* ahead = reinterpret_cast<const char*>(half + PF * kPanel);
        for (int line = 0; line < kPanel * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
    }
    Vec wv[kVecs];
#pragma GCC unroll 2
    for (int j = 0; j < kHalf; ++j) {
      wv[j] = vload(lo + j * kWidth);
      wv[kHalf + j] = vload(hi + j * kWidth);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const Vec b = vbroadcast(x + r * ld + k);
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) acc[r][j] = vfma(b, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    if constexpr (E == Epilogue::Silu) {
#pragma GCC unroll 2
      for (int j = 0; j < kHalf; ++j) {
        const Vec g = bias_lo ? vadd(acc[r][j], vload(bias_lo + j * kWidth)) : acc[r][j];
        const Vec u = bias_hi ? vadd(acc[r][kHalf + j], vload(bias_hi + j * kWidth)) : acc[r][kHalf + j];
        vstore(out + r * ldo + j * kWidth, (Vec)silu_times<float>((Lanes)g, (Lanes)u));
      }
    } else {
      if (bias_lo)
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) acc[r][j] = vadd(acc[r][j], vload(bias_lo + j * kWidth));
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
}

template <int R, int PF, Epilogue E>
inline void block_rows(int rows, const float* x, int64_t ld, const float* w, int64_t K, const float* bias_lo,
                       const float* bias_hi, float* out, int64_t ldo, int cols) {
  if constexpr (R > 0) {
    if (rows != R) return block_rows<R - 1, PF, E>(rows, x, ld, w, K, bias_lo, bias_hi, out, ldo, cols);
    panel_rows<R, PF, E>(x, ld, w, K, bias_lo, bias_hi, out, ldo, cols);
  }
}

// Rows [m0, m1) against one block of columns: ceil(rows / 6) blocks as even as they divide, the first
// prefetching. `out` and the biases point at the block's first column.
template <Epilogue E>
void rows_block(const float* x, int64_t ld, int64_t m0, int64_t m1, const float* w, int64_t K, const float* bias_lo,
                const float* bias_hi, float* out, int64_t ldo, int cols) {
  const int64_t rows = m1 - m0, blocks = (rows + kRowsMax - 1) / kRowsMax;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = m0 + rows * i / blocks, r1 = m0 + rows * (i + 1) / blocks;
    const int count = static_cast<int>(r1 - r0);
    if (i == 0)
      block_rows<kRowsMax, kPrefetchSteps, E>(count, x + r0 * ld, ld, w, K, bias_lo, bias_hi, out + r0 * ldo, ldo,
                                              cols);
    else
      block_rows<kRowsMax, 0, E>(count, x + r0 * ld, ld, w, K, bias_lo, bias_hi, out + r0 * ldo, ldo, cols);
  }
}
#pragma GCC pop_options

// Panel `index`'s first K step.
inline const float* panel_at(const float* panels, int64_t K, int64_t index) {
  return panels + index * K * kPanel;
}

#endif

// x's rows (contiguous) and the checks both products share.
at::Tensor x_rows(const at::Tensor& x, const at::Tensor& panels, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == kPanel && panels.is_contiguous(),
              op, ": x and the panels (from f32_pack) must be fp32");
  const int64_t K = x.size(-1);
  TORCH_CHECK(panels.size(1) == K, op, ": the panels hold a weight of ", panels.size(1), " input features; x has ", K);
  return x.reshape({-1, K}).contiguous();
}

// The product's output [..., n_out] over `blocks` blocks of columns, `block(x, w, bias, out, b, m0,
// m1)` computing rows [m0, m1) of block b; rows: x_rows(x); bias: fp32, padded to `bias_len`.
template <typename Block>
at::Tensor run_blocks(const char* op, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& panels,
                      const std::optional<at::Tensor>& bias, int64_t bias_len, int64_t n_out, int64_t blocks,
                      Block block) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  at::Tensor out = at::empty(shape, x.options());
#if defined(PDSERVE_F32_GEMM)
  const int64_t M = rows.size(0);
  if (M == 0) return out;
  const at::Tensor b32 =
      bias ? at::constant_pad_nd(bias->to(at::kFloat), {0, bias_len - bias->size(0)}).contiguous() : at::Tensor();
  const float* xp = rows.const_data_ptr<float>();
  const float* wp = panels.const_data_ptr<float>();
  const float* bp = bias ? b32.const_data_ptr<float>() : nullptr;
  float* yp = out.mutable_data_ptr<float>();
  for_each_gemm_unit(blocks, M, kRowsMax,
                     [&](int64_t b, int64_t m0, int64_t m1) { block(xp, wp, bp, yp, b, m0, m1); });
#else
  TORCH_CHECK(false, op, ": this build of the CPU kernels has no AVX2 / AVX-512 fused multiply-add (the CPU lacks it)");
#endif
  return out;
}

// x [..., K] fp32, panels from f32_pack of a [n, K] weight, bias [n] or None -> [..., n] fp32.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const std::optional<at::Tensor>& bias) {
  const at::Tensor rows = x_rows(x, panels, "f32_linear");
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == panels.size(0), "f32_linear: the panels hold ",
              panels.size(0) * kPanel, " output features (padded to ", kPanel, "); n is ", n);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "f32_linear: bias must have ", n, " elements");
  const int64_t K = rows.size(1);
  // bias padded to whole panels, so that every panel adds full registers
  return run_blocks("f32_linear", x, rows, panels, bias, panels.size(0) * kPanel, n, panels.size(0),
                    [n, K](const float* x, const float* w, const float* bias, float* out, int64_t pn, int64_t m0,
                           int64_t m1) {
#if defined(PDSERVE_F32_GEMM)
                      const int64_t col = pn * kPanel;
                      rows_block<Epilogue::Plain>(x, K, m0, m1, panel_at(w, K, pn), K,
                                                  bias ? bias + col : nullptr, nullptr, out + col, n,
                                                  static_cast<int>(std::min<int64_t>(kPanel, n - col)));
#endif
                    });
}

// silu(x Wg^T + bg) * (x Wu^T + bu) for panels from f32_pack of a fused [2 inter, K] gate/up weight
// whose rows were interleaved by kPanel / 2 (a block's gate rows, then its up rows: each panel one
// block's gate and up columns, as bf16_linear_silu's), bias [2 inter] (gate first, not interleaved) or
// None -> [..., inter] fp32: f32_linear then silu_and_mul, bit for bit, in one pass that never writes
// the [..., 2 inter] product. inter must be a multiple of kPanel / 2 (8 with AVX2, 32 with AVX-512).
at::Tensor f32_linear_silu(const at::Tensor& x, const at::Tensor& panels, int64_t inter,
                           const std::optional<at::Tensor>& bias) {
  const at::Tensor rows = x_rows(x, panels, "f32_linear_silu");
  constexpr int64_t half = kPanel / 2;
  TORCH_CHECK(inter > 0 && inter % half == 0 && (2 * inter + kPanel - 1) / kPanel == panels.size(0),
              "f32_linear_silu: inter must be a multiple of ", half, " and the panels hold a [2 inter, K] weight; "
              "inter is ", inter, ", the panels hold ", panels.size(0) * kPanel, " output features");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == 2 * inter), "f32_linear_silu: bias must have ",
              2 * inter, " elements");
  const int64_t K = rows.size(1);
  return run_blocks("f32_linear_silu", x, rows, panels, bias, 2 * inter, inter, inter / half,
                    [inter, K](const float* x, const float* w, const float* bias, float* out, int64_t blk,
                               int64_t m0, int64_t m1) {
#if defined(PDSERVE_F32_GEMM)
                      const int64_t col = blk * half;
                      rows_block<Epilogue::Silu>(x, K, m0, m1, panel_at(w, K, blk),
                                                 K, bias ? bias + col : nullptr, bias ? bias + inter + col : nullptr,
                                                 out + col, inter, static_cast<int>(half));
#endif
                    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("f32_pack(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("f32_linear_silu(Tensor x, Tensor panels, int inter, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("f32_pack", &f32_pack);
  m.impl("f32_linear", &f32_linear);
  m.impl("f32_linear_silu", &f32_linear_silu);
}
