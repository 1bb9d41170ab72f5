// Helpers shared by the pdserve CPU kernels (cpu_ops.cpp, prefill_attention.cpp, gguf_linear.cpp): sixteen
// (and eight) fp32 lanes as GCC vector types, loads and stores from fp32/bf16/fp16 (rounding to nearest even,
// as torch does), exp to about 1 ulp, horizontal reductions; the check of a block table against the pool
// (how work meets the threads: work_split.h). Private to those three translation units.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace {
// A software prefetch of the cache line at p that the compiler keeps. GCC 12 deletes a loop whose only
// effect is __builtin_prefetch (a block walk that prefetches the next chunk's rows, as the attention
// kernels' are, compiled to nothing: docs/perf/journal.md §70); an asm statement it must emit.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// prefetch_line over every cache line of [p, p + bytes).
inline void prefetch_span(const void* p, int64_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(p), end = first + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = first & ~uintptr_t{63}; line < end; line += 64) prefetch_line(reinterpret_cast<const void*>(line));
}

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Sixteen fp32 lanes as a GCC vector: one AVX-512 register, or two AVX2 ones, or four NEON ones.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));   // for unaligned loads
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
// Eight fp32 lanes: one AVX2 register, where a kernel's working set of sixteen-lane vectors would
// not fit in the sixteen registers AVX2 has (prefill_attention.cpp).
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint8_t u8x8 __attribute__((vector_size(8), aligned(1)));
typedef float f32x4 __attribute__((vector_size(16)));

// The attention kernels' vector: as wide as one register, 16 lanes with AVX-512 and 8 elsewhere. At
// 16 lanes on AVX2 each vector is two registers and their working sets spill (on a Zen 1 the prefill
// kernel ran at 0.2-0.5x torch's SDPA, the decode kernel's K/V reads at a third of the AVX-512 rate).
#ifdef __AVX512F__
typedef f32x16 Lanes;
#else
typedef f32x8 Lanes;
#endif
constexpr int kLanes = sizeof(Lanes) / sizeof(float);

// The int32 (and uint32) vector with the lanes of fp32 vector V.
template <typename V>
struct IntLanes;
template <>
struct IntLanes<f32x16> {
  using type = i32x16;
  using utype = u32x16;
};
template <>
struct IntLanes<f32x8> {
  using type = i32x8;
  using utype = u32x8;
};

// exp(x) to about 1 ulp: 2^(x log2 e) split into an integer power, put into the exponent bits, and a
// degree-7 Taylor polynomial of e^f on |f| <= ln2 / 2. Above 88.37 it is inf (fp32's exp overflows
// at 88.72; the power of two must stay below 2^128) and below -87.3 zero (where it turns subnormal).
// V: f32x16 or f32x8, lane by lane the same arithmetic.
template <typename V>
__attribute__((always_inline)) inline V exp_approx(V x) {
  using I = typename IntLanes<V>::type;
  const V c = x < -87.3f ? V{} - 87.3f : x > 88.37f ? V{} + 88.37f : x;
  const V t = c * 1.4426950408889634f;
  const V n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const V f = (t - n) * 0.6931471805599453f;
  V p = f * (1.0f / 5040.0f) + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  const V y = p * reinterpret_cast<const V&>(bits);
  return x < -87.3f ? V{} : x > 88.37f ? V{} + INFINITY : y;
}

#if defined(__AVX512F__)
// 2^f for |f| <= 1/2 (to ~1e-7): a degree-6 Taylor polynomial on fused multiply-adds.
inline __m512 exp2_taylor(__m512 f) {
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

// exp(x) as exp_approx computes it (the same split into 2^n 2^f, to about 1 ulp), in half its
// operations where the CPU has AVX-512: vscalefps applies the power (overflowing to inf and
// underflowing through the subnormals to 0 as exp does, where exp_approx cuts off at 88.37 and
// -87.3), so no clamps or exponent-bit arithmetic around exp2_taylor. x is kept within [-104, 89]
// (exp is 0 and inf beyond) so that n stays finite; NaN stays NaN.
inline f32x16 exp_scalef(f32x16 x) {
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), (__m512)x));
  const __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (f32x16)_mm512_scalef_ps(exp2_taylor(_mm512_sub_ps(t, n)), n);
}
#endif

// Logit soft-capping (Gemma 2): cap * tanh(s / cap), lane by lane with the C library's tanh (as torch
// computes it; a few dozen lanes a chunk, so its scalar cost does not show).
template <typename V>
inline V soft_cap(V s, float cap) {
  constexpr int n = sizeof(V) / sizeof(float);
  for (int i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
  return s;
}

template <typename T>
inline f32x16 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *reinterpret_cast<const f32x16u*>(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#ifdef __AVX512F__
    const __m256i narrow = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16);
    return reinterpret_cast<const f32x16&>(wide);
#else
    const u32x16 wide = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16;
    return reinterpret_cast<const f32x16&>(wide);
#endif
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    // e4m3 -> fp16 bits: the sign to bit 15, exponent and mantissa (7 bits) shifted under fp16's
    // (5-bit exponent, 10-bit mantissa), which is the value times 2^(7 - 15); the fp16 -> fp32
    // conversion is exact (e4m3's subnormals are fp16 subnormals: no flush), and * 256 undoes the
    // exponent bias difference. (0x7F, e4m3's NaN, reads as 480: the write path never stores NaN
    // from finite input, saturating at +-448.)
    const u16x16 w = __builtin_convertvector(*reinterpret_cast<const u8x16*>(p), u16x16);
    const u16x16 h = ((w & 0x80) << 8) | ((w & 0x7F) << 7);
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(reinterpret_cast<const __m256i&>(h));
    return reinterpret_cast<const f32x16&>(f) * 256.0f;
#elif defined(__F16C__)
    const __m256i h256 = reinterpret_cast<const __m256i&>(h);
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h256));
    const __m256 hi = _mm256_cvtph_ps(_mm256_extractf128_si256(h256, 1));
    f32x16 v;
    std::memcpy(&v, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
    return v * 256.0f;
#else
    f32x16 v;
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits())) * 256.0f;
    return v;
#endif
  } else {
    f32x16 v;
    for (int i = 0; i < 16; ++i) v[i] = to_float(p[i]);
    return v;
  }
}

// Eight lanes, the same conversions as load16.
template <typename T>
inline f32x8 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *reinterpret_cast<const f32x8u*>(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const u32x8 wide = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;
    return reinterpret_cast<const f32x8&>(wide);
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<const f32x8&>(f);
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    const u16x8 w = __builtin_convertvector(*reinterpret_cast<const u8x8*>(p), u16x8);
    const u16x8 h = ((w & 0x80) << 8) | ((w & 0x7F) << 7);   // as load16
    const __m256 f = _mm256_cvtph_ps(reinterpret_cast<const __m128i&>(h));
    return reinterpret_cast<const f32x8&>(f) * 256.0f;
#endif
  } else {
    f32x8 v;
    for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
    return v;
  }
}

// As many elements as V has lanes (V: f32x16 or f32x8).
template <typename V, typename T>
inline V load_v(const T* p) {
  if constexpr (sizeof(V) == sizeof(f32x16))
    return load16(p);
  else
    return load8(p);
}

// kLanes elements as a Lanes vector.
template <typename T>
inline Lanes load_lanes(const T* p) {
  return load_v<Lanes>(p);
}

template <typename T>
inline void store16(T* p, f32x16 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    u32x16 bits = reinterpret_cast<const u32x16&>(v);
    const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;     // round to nearest even
    bits = v != v ? u32x16{} + 0x7FC0u : rounded;                             // NaN stays NaN
    const u16x16 narrow = __builtin_convertvector(bits, u16x16);
    std::memcpy(p, &narrow, sizeof narrow);
  } else {
    for (int i = 0; i < 16; ++i) p[i] = static_cast<T>(v[i]);
  }
}

// Eight lanes, the same conversions as store16.
template <typename T>
inline void store8(T* p, f32x8 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    u32x8 bits = reinterpret_cast<const u32x8&>(v);
    const u32x8 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;      // as store16
    bits = v != v ? u32x8{} + 0x7FC0u : rounded;
    const u16x8 narrow = __builtin_convertvector(bits, u16x8);
    std::memcpy(p, &narrow, sizeof narrow);
  } else {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<T>(v[i]);
  }
}

template <typename T, typename V>
inline void store_v(T* p, V v) {
  if constexpr (sizeof(V) == sizeof(f32x16))
    store16(p, v);
  else
    store8(p, v);
}

// v rounded to T and back: the rounding torch applies after each elementwise op in T.
template <typename T, typename V>
inline V round_as(V v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    using U = typename IntLanes<V>::utype;
    const U bits = reinterpret_cast<const U&>(v);
    const U rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;   // as store16
    return v != v ? v : reinterpret_cast<const V&>(rounded);
  } else {
    T tmp[sizeof(V) / sizeof(float)];
    store_v(tmp, v);
    return load_v<V>(tmp);
  }
}

// silu(g) * u in T's arithmetic, as kernels/reference.py's silu_and_mul (the silu rounded to T,
// then the product), for silu-and-mul (cpu_ops.cpp) and the gate/up GEMMs that end in it
// (bf16_gemm.cpp, f32_gemm.cpp), which must give the same bits. Its exp: with AVX-512, for bf16 and fp16
// activations (whose rounding of the silu hides the two exps' last-bit differences: on 16.8 M
// elements both equal torch's bf16 result bitwise, and both miss its fp16 result on the same 4,247),
// the cheaper exp_scalef: 1.46-1.48x the op's speed at 2,048 x 3,072 bf16 (perf/journal.md §54).
// fp32 keeps exp_approx, whose bits the fp32 paths' token-exact checks were made with.
// Always inlined, with exp_approx: their arithmetic then takes its caller's fp-contract setting, and
// the fp32 callers (silu_and_mul_impl, f32_gemm.cpp's fused epilogue) both compile without
// contraction, so the two give the same bits whatever a build's inlining would have chosen.
template <typename T>
__attribute__((always_inline)) inline Lanes silu_exp(Lanes x) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, float>) return exp_scalef(x);
#endif
  return exp_approx(x);
}

template <typename T>
__attribute__((always_inline)) inline Lanes silu_times(Lanes g, Lanes u) {
  return round_as<T>(round_as<T>(g / (1.f + silu_exp<T>(-g))) * u);
}

// n (at most V's lanes) elements: a full vector, or the first n zero-filled; and its store.
template <typename V, typename T>
inline V load_upto(const T* p, int64_t n) {
  constexpr int64_t kN = sizeof(V) / sizeof(float);
  if (n == kN) return load_v<V>(p);
  T tmp[kN] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load_v<V>(tmp);
}

template <typename T, typename V>
inline void store_upto(T* p, V v, int64_t n) {
  constexpr int64_t kN = sizeof(V) / sizeof(float);
  if (n == kN) {
    store_v(p, v);
    return;
  }
  T tmp[kN];
  store_v(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

// One level of an NxN transpose-and-add (N the vector's lanes): fold<W>(x, y) splits the lanes into
// groups of W, takes the groups alternately from x and y (x's first two W-lane groups, then y's first
// two, then x's next two, ...) and adds the second group of each pair to the first. Applied as a
// binary tree to N vectors a[0..N-1] (fold<N/2> on pairs, fold<N/4> on those results, ..., fold<1>),
// lane j of the result is the sum of the lanes of a[bitrev(j)] (j's log2(N) bits reversed): about one
// shuffle-add per input instead of log2(N) for a horizontal sum of each.
constexpr int fold_lane(int j, int width, int second, int lanes) {
  const int group = j / width;
  return group % 2 * lanes + group / 2 * 2 * width + second * width + j % width;
}

template <int W, typename V, int... J>
inline V fold_lanes(V x, V y, std::integer_sequence<int, J...>) {
  constexpr int n = sizeof(V) / sizeof(float);
  return __builtin_shufflevector(x, y, fold_lane(J, W, 0, n)...) + __builtin_shufflevector(x, y, fold_lane(J, W, 1, n)...);
}

template <int W, typename V>
inline V fold(V x, V y) {
  return fold_lanes<W>(x, y, std::make_integer_sequence<int, sizeof(V) / sizeof(float)>{});
}

// j's `bits` low bits in reverse order: the token whose sum the fold tree leaves in lane j.
constexpr int bitrev(int j, int bits) { return bits == 0 ? 0 : (j & 1) << (bits - 1) | bitrev(j >> 1, bits - 1); }

// Horizontal max and sum as trees of halvings rather than dependent scalar steps.
inline float hmax(f32x8 a) {
  const f32x4 a_lo = __builtin_shufflevector(a, a, 0, 1, 2, 3), a_hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 b = a_lo < a_hi ? a_hi : a_lo;
  const f32x4 b_sw = __builtin_shufflevector(b, b, 2, 3, 0, 1);
  const f32x4 c = b < b_sw ? b_sw : b;
  return std::max(c[0], c[1]);
}

inline float hmax(f32x16 v) {
  const f32x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(lo < hi ? hi : lo);
}

inline float hsum(f32x8 a) {
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return c[0] + c[1];
}

inline float hsum(f32x16 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The attention kernels read raw memory: every block that lens[b] tokens need must be in row b of the
// table and in the pool. `op` names the caller in the error.
inline void check_block_tables(const char* op, const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                               int64_t num_blocks) {
  const int64_t* len_ptr = lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.size(0); ++b) {
    const int64_t len = len_ptr[b], used = (len + block_size - 1) / block_size;
    TORCH_CHECK(len >= 0 && used <= tables.size(1), op, ": seq_len ", len, " of row ", b,
                " needs more blocks than the block table's ", tables.size(1));
    const int64_t* row = tables.const_data_ptr<int64_t>() + b * tables.size(1);
    for (int64_t j = 0; j < used; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, op, ": block id ", row[j], " is outside the pool of ",
                  num_blocks);
  }
}

// The attention kernels' common checks of a query [tokens, heads, head_dim] against the KV cache.
inline void check_attention_inputs(const char* op, const at::Tensor& query, const at::Tensor& kv_cache) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, op, ": query [tokens, heads, head_dim], kv_cache 5-D");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() || kv_cache.scalar_type() == at::kFloat8_e4m3fn, op,
              ": kv_cache must have the query's dtype or float8_e4m3fn");
  TORCH_CHECK(kv_cache.is_contiguous(), op, ": kv_cache must be contiguous");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0 && query.size(2) == kv_cache.size(4), op,
              ": query heads/head_dim do not match the cache");
}

// A layer's paged cache as the kernels read it: K and V pools of [num_blocks, block_size] token rows,
// each row all KV heads of one token (token_stride elements).
template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  int64_t block_size, num_kv_heads, token_stride;

  explicit PagedKV(const at::Tensor& kv_cache)
      : k(kv_cache.const_data_ptr<T>()),
        v(k + kv_cache.size(1) * kv_cache.size(2) * kv_cache.size(3) * kv_cache.size(4)),
        block_size(kv_cache.size(2)),
        num_kv_heads(kv_cache.size(3)),
        token_stride(kv_cache.size(3) * kv_cache.size(4)) {}

  // Offset of token `pos` of a sequence with block table `table`, in elements, into k or v.
  int64_t row(const int64_t* table, int64_t pos) const {
    return (table[pos / block_size] * block_size + pos % block_size) * token_stride;
  }

  // f(t, row(table, pos + t)) for t in [0, count): the block walked from one division (a division per
  // token was a measurable part of a chunk's time on a Zen 3, docs/perf/journal.md §48).
  template <typename F>
  void for_rows(const int64_t* table, int64_t pos, int64_t count, F&& f) const {
    int64_t block = pos / block_size, offset = pos % block_size;
    for (int64_t t = 0; t < count; ++t) {
      f(t, (table[block] * block_size + offset) * token_stride);
      if (++offset == block_size) offset = 0, ++block;
    }
  }

  // Prefetches elements [first, first + count) of the K and V rows of tokens [pos, pos + n): the next
  // chunk an attention kernel reads, fetched while it computes this one (all KV heads: first 0, count
  // token_stride; one head's: first h * D, count D).
  void prefetch_rows(const int64_t* table, int64_t pos, int64_t n, int64_t first, int64_t count) const {
    const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
    for_rows(table, pos, n, [&](int64_t, int64_t row) {
      prefetch_span(k + row + first, bytes);
      prefetch_span(v + row + first, bytes);
    });
  }
};

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}, TypeTag<C>{}, std::integral_constant<int, D>{}) for query's dtype T, the
// cache's element type C (T, or fp8 e4m3) and head size D: the dtypes and head sizes the kernels
// are built for (kernels/cpu_ops.py: DTYPES, HEAD_DIMS; others run the reference).
template <typename F>
void dispatch_dtype_and_head_dim(const char* op, const at::Tensor& query, const at::Tensor& kv_cache, F&& f) {
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  auto with_dim = [&](auto tag, auto cache_tag) {
    switch (query.size(2)) {
      case 16: f(tag, cache_tag, std::integral_constant<int, 16>{}); break;
      case 32: f(tag, cache_tag, std::integral_constant<int, 32>{}); break;
      case 64: f(tag, cache_tag, std::integral_constant<int, 64>{}); break;
      case 96: f(tag, cache_tag, std::integral_constant<int, 96>{}); break;
      case 128: f(tag, cache_tag, std::integral_constant<int, 128>{}); break;
      case 256: f(tag, cache_tag, std::integral_constant<int, 256>{}); break;
      default: TORCH_CHECK(false, op, ": head_dim must be one of 16, 32, 64, 96, 128, 256; got ", query.size(2));
    }
  };
  auto with_cache = [&](auto tag) {
    if (fp8)
      with_dim(tag, TypeTag<c10::Float8_e4m3fn>{});
    else
      with_dim(tag, tag);
  };
  switch (query.scalar_type()) {
    case at::kFloat: with_cache(TypeTag<float>{}); break;
    case at::kBFloat16: with_cache(TypeTag<c10::BFloat16>{}); break;
    case at::kHalf: with_cache(TypeTag<c10::Half>{}); break;
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16; got ", query.scalar_type());
  }
}

}  // namespace
