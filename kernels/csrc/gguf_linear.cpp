// pdserve CPU GGUF linear: x [M, K] times a weight [N, K] kept in its GGUF blocks (Q8_0, Q4_0, Q4_1;
// kernels.reference.dequantize_gguf says the layouts), the contract of kernels.reference.gguf_linear:
// x times the fp32 dequantized weight.
//
// Decode reads every weight once per step, so its time is the weight's bytes (4-bit blocks are about
// a quarter of bf16's) plus the work of decoding them. A block's dot product with x is factored:
//   sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j
// so the 32 integers q_j multiply x directly (exact in fp32: q has at most 8 bits) and the scale and
// minimum apply once per block; sum_j x_j is computed once per row of x and block. Q4_0 subtracts
// its 8 from the integers. With a bf16 x on a CPU with AVX512-BF16, the integers become bf16 (exact)
// and `vdpbf16ps` takes 32 products per instruction; otherwise fp32 FMAs take 16. Each output row is
// walked block by block against up to kRows rows of x at once (a block is decoded once for them
// all); threads take ranges of output rows. Only the order of the sums differs from the reference.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common.h"
#include "work_split.h"

namespace {

constexpr int kRows = 8;   // rows of x per pass over a weight row (their accumulators stay in registers)
// Weight rows read ahead of the one being multiplied (software prefetch): without it a decode-sized
// call streams its blocks from memory at about a quarter of the bandwidth oneDNN reaches.
constexpr int64_t kPrefetchRows = 8;

typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));

enum class Quant { Q8_0, Q4_0, Q4_1 };

template <Quant Q>
constexpr int64_t block_bytes() {
  return Q == Quant::Q8_0 ? 34 : Q == Quant::Q4_0 ? 18 : 20;
}

__attribute__((always_inline)) inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Bytes to fp32 lanes through 32-bit integers. GCC scalarizes the conversion of signed bytes (and
// of any bytes straight to floats), so AVX-512 and AVX2 say it explicitly.
template <bool Signed, typename V>
inline f32x16 to_f32(V q) {
#if defined(__AVX512F__)
  const __m128i b = reinterpret_cast<const __m128i&>(q);
  const __m512 f = _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  return reinterpret_cast<const f32x16&>(f);
#elif defined(__AVX2__)
  const __m128i b = reinterpret_cast<const __m128i&>(q);
  const __m128i b_hi = _mm_unpackhi_epi64(b, b);
  const __m256 lo = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi));
  f32x16 v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
#else
  return __builtin_convertvector(__builtin_convertvector(q, i32x16), f32x16);
#endif
}
inline f32x16 to_f32(u8x16 q) { return to_f32<false>(q); }
inline f32x16 to_f32(i8x16 q) { return to_f32<true>(q); }

// The block's 32 integers as fp32: lo = elements 0-15, hi = 16-31 (Q4_0: q - 8).
template <Quant Q>
inline void block_ints(const uint8_t* blk, f32x16& lo, f32x16& hi) {
  if constexpr (Q == Quant::Q8_0) {
    i8x16 a, b;
    std::memcpy(&a, blk + 2, 16);
    std::memcpy(&b, blk + 18, 16);
    lo = to_f32(a);
    hi = to_f32(b);
  } else {
    u8x16 qs;
    std::memcpy(&qs, blk + (Q == Quant::Q4_1 ? 4 : 2), 16);
    lo = to_f32(static_cast<u8x16>(qs & 0x0F));
    hi = to_f32(static_cast<u8x16>(qs >> 4));
    if constexpr (Q == Quant::Q4_0) {
      lo -= 8.0f;
      hi -= 8.0f;
    }
  }
}

// Rows [m0, m0 + R) of x (fp32 [M][K]) against weight rows [n0, n1): out[m][n].
template <typename T, Quant Q, int R>
void rows_pass(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t row_bytes, T* out,
               int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t num_blocks = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1)
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + kPrefetchRows * row_bytes + o);
    f32x16 acc[R] = {};
    float mins[R] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* blk = row + b * block_bytes<Q>();
      f32x16 lo, hi;
      block_ints<Q>(blk, lo, hi);
      const float d = half_at(blk);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * K + b * 32;
        acc[r] += (lo * load16(xr) + hi * load16(xr + 16)) * d;
      }
      if constexpr (Q == Quant::Q4_1) {
        const float m = half_at(blk + 2);
        for (int r = 0; r < R; ++r) mins[r] += m * xsum[(m0 + r) * num_blocks + b];
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = static_cast<T>(hsum(acc[r]) + mins[r]);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// AVX2 without AVX-512: GCC's 16-lane vector types become pairs of ymm registers moved through the
// stack between the conversions and the FMAs (rows_pass ran at ~0.7 elements per cycle). Here each
// block's 32 integers are four ymm of 8 fp32 lanes. Two loops, by the rows of x in a pass:
// - fewer than kRows (decode of few sequences): rows_pass's factored form, four FMAs per row of x
//   into one product and the block's scale applied once to it; the block's decoding is most of the
//   work here, and this form adds the least to it (at 4 rows it was 1.1x the other).
// - kRows rows: the block dequantized once into fp32 weights exactly as the reference does (q d,
//   or fma(q, d, m) for Q4_1: one rounding), then four FMAs per row of x straight into its
//   accumulator, eight independent chains; 1.15-1.4x the factored form at 16-32 rows of Q4_1,
//   where the per-row work dominates (Q8_0: level).

__attribute__((always_inline)) inline __m256 ints8(__m128i bytes, bool high, bool is_signed) {
  const __m128i b = high ? _mm_unpackhi_epi64(bytes, bytes) : bytes;
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// The block's 32 integers (Q4_0: q - 8) as q[0..3], elements 0-7, 8-15, 16-23, 24-31.
template <Quant Q>
__attribute__((always_inline)) inline void block_ints8(const uint8_t* blk, __m256 q[4]) {
  if constexpr (Q == Quant::Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    q[0] = ints8(a, false, true), q[1] = ints8(a, true, true);
    q[2] = ints8(b, false, true), q[3] = ints8(b, true, true);
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == Quant::Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    constexpr bool is_signed = Q == Quant::Q4_0;
    if constexpr (is_signed) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    q[0] = ints8(lo, false, is_signed), q[1] = ints8(lo, true, is_signed);
    q[2] = ints8(hi, false, is_signed), q[3] = ints8(hi, true, is_signed);
  }
}

// The block's 32 weights, kernels.reference's dequantization in fp32: q d (Q4_0: (q - 8) d), or
// Q4_1's q d + m with one rounding, as the reference's fp32 q * d + m (q d is exact).
template <Quant Q>
__attribute__((always_inline)) inline void block_weights8(const uint8_t* blk, __m256 w[4]) {
  block_ints8<Q>(blk, w);
  const __m256 d = _mm256_set1_ps(half_at(blk));
  if constexpr (Q == Quant::Q4_1) {
    const __m256 m = _mm256_set1_ps(half_at(blk + 2));
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(w[i], d, m);
  } else {
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], d);
  }
}

// rows_pass's contract (x as fp32 [M][K]) on ymm registers.
template <typename T, Quant Q, int R>
void rows_pass_avx2(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t row_bytes, T* out,
                    int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  constexpr bool factored = R < kRows;
  const int64_t num_blocks = K / 32;
  const float* x0 = x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1)
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + kPrefetchRows * row_bytes + o);
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    float mins[R] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* blk = row + b * block_bytes<Q>();
      __m256 q[4];
      if constexpr (factored) {
        block_ints8<Q>(blk, q);
        const __m256 d = _mm256_set1_ps(half_at(blk));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* xr = x0 + r * K + b * 32;
          __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
          t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t);
          t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), t);
          t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t);
          acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
        }
        if constexpr (Q == Quant::Q4_1) {
          const float m = half_at(blk + 2);
          for (int r = 0; r < R; ++r) mins[r] += m * xsum[(m0 + r) * num_blocks + b];
        }
      } else {
        block_weights8<Q>(blk, q);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* xr = x0 + r * K + b * 32;
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xr + 8 * i), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = static_cast<T>(hsum(acc[r]) + mins[r]);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// A 4-bit type's sixteen nibble values as bf16 words (Q4_0: q - 8; small integers: exact in bf16),
// a permutexvar table.
template <Quant Q>
inline __m512i nibble_table() {
  static const __m512i table = [] {
    alignas(64) uint16_t t[32] = {};
    for (int i = 0; i < 16; ++i) {
      const float v = static_cast<float>(Q == Quant::Q4_0 ? i - 8 : i);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      t[i] = static_cast<uint16_t>(bits >> 16);
    }
    return _mm512_load_si512(t);
  }();
  return table;
}

// The block's 32 integers as bf16 (exact), in element order.
template <Quant Q>
inline __m512bh block_ints_bf16(const uint8_t* blk) {
  if constexpr (Q == Quant::Q8_0) {
    const __m128i* p = reinterpret_cast<const __m128i*>(blk + 2);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
  } else {
    // Nibbles to 32 words (elements 0-15 from the low halves, 16-31 from the high), then a table.
    const __m512i table = nibble_table<Q>();
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(blk + (Q == Quant::Q4_1 ? 4 : 2))));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(words, _mm256_set1_epi16(15))),
                                            _mm256_srli_epi16(words, 4), 1);
    return reinterpret_cast<const __m512bh&>(static_cast<const __m512i&>(_mm512_permutexvar_epi16(both, table)));
  }
}

// Two consecutive 4-bit blocks at once: their integers as bf16, lo = [A 0-15, B 0-15] and
// hi = [A 16-31, B 16-31] (x is permuted to match: pair_x), and their scales as [dA x8, dB x8]
// for the sums vdpbf16ps leaves in lanes 0-7 (A) and 8-15 (B).
template <Quant Q>
inline void pair_ints_bf16(const uint8_t* blk, __m512bh& lo, __m512bh& hi, __m512& d) {
  constexpr int64_t off = Q == Quant::Q4_1 ? 4 : 2;
  const __m512i table = nibble_table<Q>();
  const __m256i bytes = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + block_bytes<Q>() + off)), 1);
  const __m512i words = _mm512_cvtepu8_epi16(bytes);
  const __m512i l = _mm512_permutexvar_epi16(_mm512_and_si512(words, _mm512_set1_epi16(15)), table);
  const __m512i h = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
  lo = reinterpret_cast<const __m512bh&>(l);
  hi = reinterpret_cast<const __m512bh&>(h);
  uint16_t da, db;
  std::memcpy(&da, blk, 2);
  std::memcpy(&db, blk + block_bytes<Q>(), 2);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(da | (static_cast<uint32_t>(db) << 16))));
  d = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_castps128_ps512(two));
}

// x's rows with each pair of 4-bit blocks' elements in pair_ints_bf16's order ([A 0-15, B 0-15,
// A 16-31, B 16-31]); an odd last block stays as it is.
inline void pair_x(const c10::BFloat16* x, int64_t M, int64_t K, c10::BFloat16* out) {
  const int64_t pairs = K / 64;
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* src = x + m * K;
    c10::BFloat16* dst = out + m * K;
    for (int64_t p = 0; p < pairs; ++p, src += 64, dst += 64) {
      std::memcpy(dst, src, 32);
      std::memcpy(dst + 16, src + 32, 32);
      std::memcpy(dst + 32, src + 16, 32);
      std::memcpy(dst + 48, src + 48, 32);
    }
    std::memcpy(dst, src, (K - pairs * 64) * sizeof(c10::BFloat16));
  }
}

// As rows_pass, for bf16 x (bf16 [M][K]) with vdpbf16ps. xsum_t is [num_blocks][Mpad] here (a
// block's sums for consecutive rows side by side: one vector load per block for up to 8 rows).
template <Quant Q, int R>
void rows_pass_bf16(const c10::BFloat16* x, const float* xsum_t, int64_t Mpad, int64_t K, const uint8_t* w,
                    int64_t row_bytes, c10::BFloat16* out, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t num_blocks = K / 32;
  const c10::BFloat16* xr = x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1)
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + kPrefetchRows * row_bytes + o);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    __m256 mins = _mm256_setzero_ps();
    const c10::BFloat16* xb = xr;
    int64_t b = 0;
    if constexpr (Q != Quant::Q8_0) {          // x is in pair_x's order: two blocks per step
      for (; b + 1 < num_blocks; b += 2, xb += 64) {
        const uint8_t* blk = row + b * block_bytes<Q>();
        __m512bh lo, hi;
        __m512 d;
        pair_ints_bf16<Q>(blk, lo, hi, d);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xl = _mm512_loadu_si512(xb + r * K), xh = _mm512_loadu_si512(xb + r * K + 32);
          const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo,
                                                               reinterpret_cast<const __m512bh&>(xl)),
                                              hi, reinterpret_cast<const __m512bh&>(xh));
          acc[r] = _mm512_fmadd_ps(dot, d, acc[r]);
        }
        if constexpr (Q == Quant::Q4_1) {
          mins = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk + 2)), _mm256_loadu_ps(xsum_t + b * Mpad + m0), mins);
          mins = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk + block_bytes<Q>() + 2)),
                                 _mm256_loadu_ps(xsum_t + (b + 1) * Mpad + m0), mins);
        }
      }
    }
    for (; b < num_blocks; ++b, xb += 32) {
      const uint8_t* blk = row + b * block_bytes<Q>();
      const __m512bh q = block_ints_bf16<Q>(blk);
      const __m512 d = _mm512_set1_ps(half_at(blk));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xb + r * K);
        acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, reinterpret_cast<const __m512bh&>(xv)),
                                 d, acc[r]);
      }
      if constexpr (Q == Quant::Q4_1)
        mins = _mm256_fmadd_ps(_mm256_set1_ps(half_at(blk + 2)), _mm256_loadu_ps(xsum_t + b * Mpad + m0), mins);
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mins);
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = c10::BFloat16(_mm512_reduce_add_ps(acc[r]) + m8[r]);
  }
}
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

template <typename T, Quant Q, int R>
void tail_pass(int rows, const float* x, const T* xt, const float* xsum, int64_t Mpad, int64_t K, const uint8_t* w,
               int64_t row_bytes, T* out, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  if constexpr (R > 0) {
    if (rows != R) return tail_pass<T, Q, R - 1>(rows, x, xt, xsum, Mpad, K, w, row_bytes, out, N, m0, n0, n1);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return rows_pass_bf16<Q, R>(xt, xsum, Mpad, K, w, row_bytes, out, N, m0, n0, n1);
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
    return rows_pass_avx2<T, Q, R>(x, xsum, K, w, row_bytes, out, N, m0, n0, n1);
#endif
    rows_pass<T, Q, R>(x, xsum, K, w, row_bytes, out, N, m0, n0, n1);
  }
}

template <typename T, Quant Q>
void gguf_impl(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), row_bytes = blocks.size(1), nb = K / 32;
  const T* xp = x.const_data_ptr<T>();
  const bool bf16_dot = kHasBf16Dot && std::is_same_v<T, c10::BFloat16>;
  // x as fp32 (exactly: bf16/fp16 widen without rounding) unless the bf16 dot reads it as it is, and
  // each block's sum of x for the Q4_1 minimum: [M][nb] for the fp32 path, [nb][Mpad] for the bf16 one.
  const int64_t Mpad = (M + kRows - 1) / kRows * kRows;
  std::vector<float> xf(bf16_dot ? 0 : static_cast<size_t>(M * K)), xsum(static_cast<size_t>(Mpad * nb));
  for (int64_t i = 0; i < M * K; ++i) {
    const float v = to_float(xp[i]);
    if (!bf16_dot) xf[i] = v;
    if (Q == Quant::Q4_1) xsum[bf16_dot ? (i % K / 32) * Mpad + i / K : i / 32] += v;
  }
  // The bf16 dot of 4-bit blocks reads x in pair order.
  std::vector<T> xpairs;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && Q != Quant::Q8_0) {
    xpairs.resize(static_cast<size_t>(M * K));
    pair_x(xp, M, K, xpairs.data());
    xp = xpairs.data();
  }
#endif
  const uint8_t* wp = blocks.const_data_ptr<uint8_t>();
  T* op = out.mutable_data_ptr<T>();
  // Ranges of output rows per thread: ~16 KB of weight blocks each, so a thread streams memory.
  const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
  parallel_ranges(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      tail_pass<T, Q, kRows>(rows, xf.data(), xp, xsum.data(), Mpad, K, wp, row_bytes, op, N, m0, n0, n1);
    }
  });
}

// The weight dequantized into `out` [N, K] of type T (kernels.reference.dequantize_gguf: fp32, then
// rounded to T), for the GEMM that batches of many rows take.
template <typename T, Quant Q>
void dequant_impl(const at::Tensor& blocks, at::Tensor& out) {
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1), nb = row_bytes / block_bytes<Q>();
  const uint8_t* wp = blocks.const_data_ptr<uint8_t>();
  T* op = out.mutable_data_ptr<T>();
  parallel_ranges(0, N, std::max<int64_t>(1, 16384 / row_bytes), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + n * row_bytes + b * block_bytes<Q>();
        f32x16 lo, hi;
        block_ints<Q>(blk, lo, hi);
        const float d = half_at(blk), m = Q == Quant::Q4_1 ? half_at(blk + 2) : 0.f;
        T* o = op + n * nb * 32 + b * 32;
        store16(o, lo * d + m);          // q d is exact in fp32, so one rounding either way
        store16(o + 16, hi * d + m);
      }
  });
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t qtype, at::ScalarType dtype) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "gguf_dequantize: blocks must be a CPU uint8 [N, row bytes] tensor");
  TORCH_CHECK(qtype >= 0 && qtype <= 2, "gguf_dequantize: qtype must be 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1); got ", qtype);
  const int64_t bytes = qtype == 0 ? 34 : qtype == 1 ? 18 : 20;
  TORCH_CHECK(blocks.size(1) % bytes == 0, "gguf_dequantize: rows of ", blocks.size(1), " bytes are not whole blocks");
  const at::Tensor bc = blocks.contiguous();
  at::Tensor out = at::empty({blocks.size(0), blocks.size(1) / bytes * 32}, blocks.options().dtype(dtype));
  auto with_quant = [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (qtype) {
      case 0: dequant_impl<T, Quant::Q8_0>(bc, out); break;
      case 1: dequant_impl<T, Quant::Q4_0>(bc, out); break;
      default: dequant_impl<T, Quant::Q4_1>(bc, out); break;
    }
  };
  switch (dtype) {
    case at::kFloat: with_quant(TypeTag<float>{}); break;
    case at::kBFloat16: with_quant(TypeTag<c10::BFloat16>{}); break;
    case at::kHalf: with_quant(TypeTag<c10::Half>{}); break;
    default: TORCH_CHECK(false, "gguf_dequantize: dtype must be float32, bfloat16 or float16; got ", dtype);
  }
  return out;
}

// What both entry points share: the checks, and the dispatch to Kernel<T, Q>::run(x, blocks, out) by
// x's dtype and the blocks' type.
template <template <typename, Quant> class Kernel>
at::Tensor gguf_entry(const char* name, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              name, ": x must be [M, K] and blocks uint8 [N, row bytes]");
  TORCH_CHECK(qtype >= 0 && qtype <= 2, name, ": qtype must be 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1); got ", qtype);
  const int64_t bytes = qtype == 0 ? 34 : qtype == 1 ? 18 : 20;
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && blocks.size(1) == K / 32 * bytes, name, ": x has ", K,
              " features but the blocks' rows hold ", blocks.size(1), " bytes (", bytes, " per 32 features)");
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  at::Tensor out = at::empty({x.size(0), blocks.size(0)}, x.options());
  if (x.size(0) == 0 || blocks.size(0) == 0) return out;
  auto with_quant = [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (qtype) {
      case 0: Kernel<T, Quant::Q8_0>::run(xc, bc, out); break;
      case 1: Kernel<T, Quant::Q4_0>::run(xc, bc, out); break;
      default: Kernel<T, Quant::Q4_1>::run(xc, bc, out); break;
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: with_quant(TypeTag<float>{}); break;
    case at::kBFloat16: with_quant(TypeTag<c10::BFloat16>{}); break;
    case at::kHalf: with_quant(TypeTag<c10::Half>{}); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, bfloat16 or float16; got ", x.scalar_type());
  }
  return out;
}

template <typename T, Quant Q>
struct ExactKernel {
  static void run(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) { gguf_impl<T, Q>(x, blocks, out); }
};

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  return gguf_entry<ExactKernel>("gguf_linear", x, blocks, qtype);
}


// ---- x quantized to int8 per block of 32 features (quantize_activations; llama.cpp's arithmetic) ----
// Each block of a row of x: dx = max|x| / 127, qx = round-half-even(x * (1 / dx)) (0 for a zero
// block), as kernels.reference.quantize_rows_int8 does, bit for bit. A weight block's product with
// it is exact in int32, sum_j q_j qx_j (Q4_0: its q - 8 as sum_j q_j qx_j - 8 sum_j qx_j), then
// dw dx times that sum in fp32, plus for Q4_1 the minimum times the block's exact sum of x.
// maddubs multiplies 32 byte pairs per instruction where the exact path takes 8 products per FMA
// after converting each weight to fp32: about a quarter of the arithmetic per weight.

template <typename T>
void quantize_x_int8(const T* x, int64_t M, int64_t K, int8_t* q, float* d, float* s, int32_t* qsum) {
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < M * nb; ++i) {
    const T* xb = x + i * 32;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 32; ++j) {
      const float v = to_float(xb[j]);
      amax = std::max(amax, std::fabs(v));
      sum += v;
    }
    const float dx = amax / 127.f, inv = dx != 0.f ? 1.f / dx : 0.f;
    int32_t total = 0;
    for (int j = 0; j < 32; ++j) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(to_float(xb[j]) * inv));
      q[i * 32 + j] = v;
      total += v;
    }
    d[i] = dx, s[i] = sum, qsum[i] = total;
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The block's 32 weight bytes as they load: Q8_0 signed, the 4-bit types as nibbles 0-15.
template <Quant Q>
__attribute__((always_inline)) inline __m256i weight_bytes(const uint8_t* blk) {
  if constexpr (Q == Quant::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == Quant::Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
  }
}

// sum_j w_j qx_j of one block as eight int32 partial sums. maddubs takes its first operand unsigned:
// a Q8_0 weight's magnitude, its sign moved to x.
template <Quant Q>
__attribute__((always_inline)) inline __m256i block_dot(__m256i wu, __m256i wq, const int8_t* xb) {
  __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
  if constexpr (Q == Quant::Q8_0) xv = _mm256_sign_epi8(xv, wq);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), _mm256_set1_epi16(1));
}

// Eight blocks' partial sums (eight vectors) to one vector of their eight totals, lane k = d[k]'s.
__attribute__((always_inline)) inline __m256i block_totals(const __m256i d[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Eight consecutive blocks' fp16 fields at `offset` (scale 0, Q4_1's minimum 2) as fp32 lanes.
template <Quant Q>
__attribute__((always_inline)) inline __m256 block_halves(const uint8_t* blk, int offset) {
  alignas(16) uint16_t h[8];
  for (int k = 0; k < 8; ++k) std::memcpy(&h[k], blk + k * block_bytes<Q>() + offset, 2);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}
#endif

// Rows [m0, m0 + R) of the quantized x against weight rows [n0, n1). With AVX2, eight blocks at a
// time: their integer dot products with a row of x are reduced to one vector of eight totals (lane k
// block k: hadd, exact in int32), so the per-block scaling is one conversion and one FMA for eight
// blocks (dw times dx as eight lanes, and Q4_1's minimum times the block sums of x likewise) instead
// of a broadcast, a conversion, an FMA and scalar work per block and row. Remaining blocks go one
// at a time.
template <typename T, Quant Q, int R>
void rows_pass_int8(const int8_t* xq, const float* xd, const float* xs, const int32_t* xqs, int64_t K,
                    const uint8_t* w, int64_t row_bytes, T* out, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1)
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + kPrefetchRows * row_bytes + o);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const uint8_t* blk = row + b * block_bytes<Q>();
      __m256i wq[8], wu[8];
      for (int k = 0; k < 8; ++k) {
        wq[k] = weight_bytes<Q>(blk + k * block_bytes<Q>());
        wu[k] = Q == Quant::Q8_0 ? _mm256_sign_epi8(wq[k], wq[k]) : wq[k];
      }
      const __m256 dw = block_halves<Q>(blk, 0);
      const __m256 mw = Q == Quant::Q4_1 ? block_halves<Q>(blk, 2) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * nb + b;
        __m256i d[8];
        for (int k = 0; k < 8; ++k) d[k] = block_dot<Q>(wu[k], wq[k], xq + (i + k) * 32);
        __m256i total = block_totals(d);
        if constexpr (Q == Quant::Q4_0) {   // sum_j (q_j - 8) qx_j, still exact
          const __m256i qsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs + i));
          total = _mm256_sub_epi32(total, _mm256_slli_epi32(qsum, 3));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dw, _mm256_loadu_ps(xd + i)), acc[r]);
        if constexpr (Q == Quant::Q4_1) acc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + i), acc[r]);
      }
    }
    float mins[R] = {};
    for (; b < nb; ++b) {
      const uint8_t* blk = row + b * block_bytes<Q>();
      const float dw = half_at(blk), mw = Q == Quant::Q4_1 ? half_at(blk + 2) : 0.f;
      const __m256i wq = weight_bytes<Q>(blk);
      const __m256i wu = Q == Quant::Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * nb + b;
        const float scale = dw * xd[i];
        const __m256 dot = _mm256_cvtepi32_ps(block_dot<Q>(wu, wq, xq + i * 32));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), dot, acc[r]);
        if constexpr (Q == Quant::Q4_1) mins[r] += mw * xs[i];
        if constexpr (Q == Quant::Q4_0) mins[r] += scale * static_cast<float>(-8 * xqs[i]);
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = static_cast<T>(hsum(acc[r]) + mins[r]);
#else
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * block_bytes<Q>();
        const int64_t i = (m0 + r) * nb + b;
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) {
          int32_t wj;
          if constexpr (Q == Quant::Q8_0) wj = static_cast<int8_t>(blk[2 + j]);
          else wj = j < 16 ? blk[block_bytes<Q>() - 16 + j] & 15 : blk[block_bytes<Q>() - 32 + j] >> 4;
          dot += wj * xq[i * 32 + j];
        }
        const float scale = half_at(blk) * xd[i];
        total += scale * static_cast<float>(dot);
        if constexpr (Q == Quant::Q4_1) total += half_at(blk + 2) * xs[i];
        if constexpr (Q == Quant::Q4_0) total += scale * static_cast<float>(-8 * xqs[i]);
      }
      out[(m0 + r) * N + n] = static_cast<T>(total);
    }
#endif
  }
}

template <typename T, Quant Q, int R>
void tail_pass_int8(int rows, const int8_t* xq, const float* xd, const float* xs, const int32_t* xqs, int64_t K,
                    const uint8_t* w, int64_t row_bytes, T* out, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  if constexpr (R > 0) {
    if (rows != R) return tail_pass_int8<T, Q, R - 1>(rows, xq, xd, xs, xqs, K, w, row_bytes, out, N, m0, n0, n1);
    rows_pass_int8<T, Q, R>(xq, xd, xs, xqs, K, w, row_bytes, out, N, m0, n0, n1);
  }
}

template <typename T, Quant Q>
void gguf_int8_impl(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), row_bytes = blocks.size(1), nb = K / 32;
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xd(static_cast<size_t>(M * nb)), xs(static_cast<size_t>(M * nb));
  std::vector<int32_t> xqs(static_cast<size_t>(M * nb));
  quantize_x_int8(x.const_data_ptr<T>(), M, K, xq.data(), xd.data(), xs.data(), xqs.data());
  const uint8_t* wp = blocks.const_data_ptr<uint8_t>();
  T* op = out.mutable_data_ptr<T>();
  parallel_ranges(0, N, std::max<int64_t>(1, 16384 / row_bytes), [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      tail_pass_int8<T, Q, kRows>(rows, xq.data(), xd.data(), xs.data(), xqs.data(), K, wp, row_bytes, op, N, m0,
                                  n0, n1);
    }
  });
}

template <typename T, Quant Q>
struct Int8Kernel {
  static void run(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
    gguf_int8_impl<T, Q>(x, blocks, out);
  }
};

at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  return gguf_entry<Int8Kernel>("gguf_linear_int8", x, blocks, qtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int qtype) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int qtype, ScalarType dtype) -> Tensor");
  m.def("gguf_linear_int8(Tensor x, Tensor blocks, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_linear_int8", &gguf_linear_int8);
}
