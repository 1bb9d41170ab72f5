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

#include "common.h"
#include "work_split.h"
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
  parallel_ranges(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint16_t* col = dst + (n / kPanel) * pairs * kPanel * 2 + (n % kPanel) * 2;
      for (int64_t k = 0; k < K; ++k) col[(k / 2) * kPanel * 2 + (k % 2)] = src[n * K + k];
    }
  });
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Epilogues: the 6 x 4 sums of a block of rows, bias added, rounded to bf16 once (`Plain`: out[r][0,
// cols)); or silu(gate) * up of its 32 gate and 32 up columns (`Silu`: out[r][0, 32)), with the
// arithmetic of silu_and_mul over the plain product's bf16 output, so that the fused layer's bits
// are the two passes' bits.
enum class Epilogue { Plain, Silu };

// Rows [0, R) of x (pairs of bf16 as uint32, row stride `ld` pairs) against one block of 64 columns,
// the panel `w` (its first K pair; a K pair's 64 x 2 values a step): its two halves of 32 columns
// are a plain product's columns, or a SwiGLU's 32 gate columns then their 32 up columns
// (`bf16_linear_silu`).
// PF: prefetch the weight this many K pairs ahead (the first row block streams it from memory; the
// others find it in L1/L2).
template <int R, int PF, Epilogue E>
inline void panel_rows(const uint32_t* x, int64_t ld, const uint16_t* w, int64_t pairs, const float* bias_lo,
                       const float* bias_hi, uint16_t* out, int64_t ldo, int cols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* lo = w + p * kPanel * 2;
    const uint16_t* hi = lo + kPanel;
    if constexpr (PF > 0) {
      for (const uint16_t* half : {lo, hi}) {
        const char* ahead = reinterpret_cast<const char*>(half + PF * kPanel * 2);
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
      }
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(lo), w1 = (__m512bh)_mm512_loadu_si512(lo + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(hi), w3 = (__m512bh)_mm512_loadu_si512(hi + 32);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ld + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, w3);
    }
  }
  if constexpr (E == Epilogue::Silu) {
    for (int j = 0; j < 2; ++j) {
      const __m512 bg = bias_lo ? _mm512_loadu_ps(bias_lo + j * 16) : _mm512_setzero_ps();
      const __m512 bu = bias_hi ? _mm512_loadu_ps(bias_hi + j * 16) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const f32x16 g = round_as<c10::BFloat16>((f32x16)_mm512_add_ps(acc[r][j], bg));
        const f32x16 u = round_as<c10::BFloat16>((f32x16)_mm512_add_ps(acc[r][2 + j], bu));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + j * 16),
                            (__m256i)_mm512_cvtneps_pbh((__m512)silu_times<c10::BFloat16>(g, u)));
      }
    }
  } else {
    for (int j = 0; j < 4 && j * 16 < cols; ++j) {
      const int n = j * 16;
      const __mmask16 mask = cols - n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (cols - n)) - 1);
      const __m512 b = bias_lo ? _mm512_maskz_loadu_ps(mask, bias_lo + n) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r)
        _mm256_mask_storeu_epi16(out + r * ldo + n, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b)));
    }
  }
}

template <int R, Epilogue E>
inline void tail_rows(int rows, const uint32_t* x, int64_t ld, const uint16_t* w, int64_t pairs, const float* bias_lo,
                      const float* bias_hi, uint16_t* out, int64_t ldo, int cols) {
  if constexpr (R > 0) {
    if (rows != R) return tail_rows<R - 1, E>(rows, x, ld, w, pairs, bias_lo, bias_hi, out, ldo, cols);
    panel_rows<R, 16, E>(x, ld, w, pairs, bias_lo, bias_hi, out, ldo, cols);
  }
}

// Rows [m0, m1) against one block of columns: blocks of kRowsMax rows, the first prefetching. `out`
// and the biases point at the block's first column.
template <Epilogue E>
void rows_block(const uint32_t* x, int64_t ld, int64_t m0, int64_t m1, const uint16_t* w, int64_t pairs,
                const float* bias_lo, const float* bias_hi, uint16_t* out, int64_t ldo, int cols) {
  int64_t m = m0;
  if (m + kRowsMax <= m1) {
    panel_rows<kRowsMax, 16, E>(x + m * ld, ld, w, pairs, bias_lo, bias_hi, out + m * ldo, ldo, cols);
    for (m += kRowsMax; m + kRowsMax <= m1; m += kRowsMax)
      panel_rows<kRowsMax, 0, E>(x + m * ld, ld, w, pairs, bias_lo, bias_hi, out + m * ldo, ldo, cols);
  }
  if (m < m1)
    tail_rows<kRowsMax - 1, E>(static_cast<int>(m1 - m), x + m * ld, ld, w, pairs, bias_lo, bias_hi, out + m * ldo,
                               ldo, cols);
}

// Panel `index`'s first K pair.
inline const uint16_t* panel_at(const uint16_t* panels, int64_t pairs, int64_t index) {
  return panels + index * pairs * kPanel * 2;
}

// x's rows as K pairs (a zero appended to odd K: the panels' padding is zero too), and the checks
// both products share.
at::Tensor x_pairs(const at::Tensor& x, const at::Tensor& panels, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 && panels.dim() == 4 &&
                  panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous(),
              op, ": x and the panels (from bf16_pack) must be bf16");
  const int64_t K = x.size(-1);
  TORCH_CHECK(panels.size(1) == (K + 1) / 2, op, ": the panels hold a weight of ", 2 * panels.size(1),
              " input features; x has ", K);
  at::Tensor rows = x.reshape({-1, K}).contiguous();
  return K % 2 ? at::constant_pad_nd(rows, {0, 1}) : rows;
}

// What every block of a product reads and writes.
struct Operands {
  const uint32_t* x;    // rows as K pairs
  int64_t ld;           // pairs a row
  const uint16_t* w;    // panels
  int64_t pairs;
  const float* bias;    // fp32, or nullptr
  uint16_t* out;
};

// The product's output [..., n_out] over `blocks` blocks of columns, `block(operands, b, m0, m1)`
// computing rows [m0, m1) of block b; rows: x_pairs(x).
template <typename Block>
at::Tensor run_blocks(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& panels,
                      const std::optional<at::Tensor>& bias, int64_t n_out, int64_t blocks, Block block) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t M = rows.size(0);
  if (M == 0) return out;
  const at::Tensor b32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const Operands o{reinterpret_cast<const uint32_t*>(rows.const_data_ptr<at::BFloat16>()), rows.size(1) / 2,
                   reinterpret_cast<const uint16_t*>(panels.const_data_ptr<at::BFloat16>()), panels.size(1),
                   bias ? b32.const_data_ptr<float>() : nullptr,
                   reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>())};
  for_each_gemm_unit(blocks, M, kRowsMax, [&](int64_t b, int64_t m0, int64_t m1) { block(o, b, m0, m1); });
  return out;
}
#endif

// x [..., K] bf16, panels from bf16_pack of a [n, K] weight, bias [n] or None -> [..., n] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const at::Tensor rows = x_pairs(x, panels, "bf16_linear");
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == panels.size(0), "bf16_linear: the panels hold ",
              panels.size(0) * kPanel, " output features (padded to 64); n is ", n);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "bf16_linear: bias must have ", n, " elements");
  return run_blocks(x, rows, panels, bias, n, panels.size(0),
                    [n](const Operands& o, int64_t pn, int64_t m0, int64_t m1) {
                      const int64_t col = pn * kPanel;
                      rows_block<Epilogue::Plain>(o.x, o.ld, m0, m1, panel_at(o.w, o.pairs, pn), o.pairs,
                                                  o.bias ? o.bias + col : nullptr, nullptr, o.out + col, n,
                                                  static_cast<int>(std::min<int64_t>(kPanel, n - col)));
                    });
#else
  TORCH_CHECK(false, "bf16_linear: this build of the CPU kernels has no AVX512-BF16 (the CPU lacks it)");
  return at::Tensor();
#endif
}

// silu(x Wg^T + bg) * (x Wu^T + bu) for panels from bf16_pack of a fused [2 inter, K] gate/up weight
// whose rows were interleaved by 32 (gate rows 32b..32b+31, then up rows 32b..32b+31, block after
// block: cpu_gemm.py's `interleave_halves`), so that each panel is one block's 32 gate columns and
// their 32 up columns, streamed as a plain product streams its panel (gate and up halves read from
// two panels, every other 128 bytes of each, ran a Zen 4 EPYC's 6-row call at half the plain one's
// rate, journal §71); bias [2 inter] (gate first, not interleaved) or None -> [..., inter] bf16: the
// bits of bf16_linear followed by silu_and_mul (each output rounded to bf16 before the silu, as
// there), in one pass that never writes the [..., 2 inter] product. inter must be a multiple of 32.
at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& panels, int64_t inter,
                            const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const at::Tensor rows = x_pairs(x, panels, "bf16_linear_silu");
  TORCH_CHECK(inter > 0 && inter % 32 == 0 && (2 * inter + kPanel - 1) / kPanel == panels.size(0),
              "bf16_linear_silu: inter must be a multiple of 32 and the panels hold a [2 inter, K] weight; "
              "inter is ", inter, ", the panels hold ", panels.size(0) * kPanel, " output features");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == 2 * inter), "bf16_linear_silu: bias must have ",
              2 * inter, " elements");
  return run_blocks(x, rows, panels, bias, inter, inter / 32,
                    [inter](const Operands& o, int64_t blk, int64_t m0, int64_t m1) {
                      const int64_t col = blk * 32;
                      rows_block<Epilogue::Silu>(o.x, o.ld, m0, m1, panel_at(o.w, o.pairs, blk), o.pairs,
                                                 o.bias ? o.bias + col : nullptr,
                                                 o.bias ? o.bias + inter + col : nullptr, o.out + col, inter, 32);
                    });
#else
  TORCH_CHECK(false, "bf16_linear_silu: this build of the CPU kernels has no AVX512-BF16 (the CPU lacks it)");
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_silu(Tensor x, Tensor panels, int inter, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_silu", &bf16_linear_silu);
}
