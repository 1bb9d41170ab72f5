// What AMX-BF16 tiles can do on this CPU, one thread: the tile product's own rate, and a plain
// 2 x 2-tile GEMM loop's over operands in two layouts (docs/perf/journal.md §58). Compare with
// oneDNN's GEMM on the same shapes (`benchmarks/cpu_linear.py`, or torch's `F.linear` in bf16).
//
//     g++ -O2 -mamx-tile -mamx-bf16 -o /tmp/amx_tile_rate benchmarks/amx_tile_rate.cpp
//     /tmp/amx_tile_rate                 # M N K = 2048 1536 576 (SmolLM2's gate/up at 2,048 rows)
//     /tmp/amx_tile_rate 2048 4096 4096  # Llama-3-8B's attention output
//
// Prints GFLOP/s of: `tdpbf16ps` on four independent accumulators with no loads (the peak); the GEMM
// with the weights as pdserve's own bf16 panels (64 columns, K in pairs: a B tile is 16 rows 256
// bytes apart) and the activations read in place; the GEMM with both operands repacked as
// contiguous 1 KB tiles. The GEMMs store fp32 results and skip the bf16 conversion; the values are
// zeros (the rate does not depend on them). Linux only (tile permission through arch_prctl).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double peak_gflops() {
  alignas(64) static uint16_t operand[16 * 32] = {};
  alignas(64) static float result[16 * 16];
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const long steps = 5000000;
  const auto t = std::chrono::steady_clock::now();
  for (long i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  const double s = seconds_since(t);
  _tile_stored(0, result, 64);
  return 4.0 * steps * 16 * 16 * 32 * 2 / s / 1e9;
}

// A tile's address and row stride in bytes (_tile_loadd takes its tile number as a literal).
using Tile = std::pair<const void*, long>;

// C[M x N] (fp32) = A[M x K] * B[K x N], 32 x 32 outputs at a time from 2 A and 2 B tiles. a(m, k)
// and b(n, k) give the Tile for rows m.. (or columns n..) at K-step k.
template <typename ATile, typename BTile>
double gemm_gflops(int M, int N, int K, ATile a, BTile b, float* C, int reps) {
  const auto t = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (int m = 0; m < M; m += 32)
      for (int n = 0; n < N; n += 32) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int k = 0; k < K; k += 32) {
          const Tile a0 = a(m, k), a1 = a(m + 16, k), b0 = b(n, k), b1 = b(n + 16, k);
          _tile_loadd(4, a0.first, a0.second);
          _tile_loadd(6, b0.first, b0.second);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, b1.first, b1.second);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, a1.first, a1.second);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        float* c = C + static_cast<size_t>(m) * N + n;
        _tile_stored(0, c, N * 4);
        _tile_stored(1, c + 16, N * 4);
        _tile_stored(2, c + 16 * N, N * 4);
        _tile_stored(3, c + 16 * N + 16, N * 4);
      }
  return 2.0 * reps * M * N * K / seconds_since(t) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int M = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int N = argc > 2 ? std::atoi(argv[2]) : 1536;
  const int K = argc > 3 ? std::atoi(argv[3]) : 576;
  if (M % 32 || N % 64 || K % 32) {
    std::fprintf(stderr, "M must be a multiple of 32, N of 64 and K of 32; got %d %d %d\n", M, N, K);
    return 2;
  }
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::fprintf(stderr, "this kernel or CPU does not let the process use AMX tiles\n");
    return 1;
  }
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = 16;
  _tile_loadconfig(&config);

  const double peak = peak_gflops();
  std::printf("tdpbf16ps, no loads: %.0f GFLOP/s\n", peak);

  // 64-byte aligned (a tile row that straddles two cache lines costs both), zero-filled.
  auto zeros = [](size_t bytes) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    std::memset(p, 0, bytes);
    return std::unique_ptr<void, decltype(&std::free)>(p, &std::free);
  };
  const auto a_mem = zeros(static_cast<size_t>(M) * K * 2), b_mem = zeros(static_cast<size_t>(K) * N * 2),
             c_mem = zeros(static_cast<size_t>(M) * N * 4);
  const auto* A = static_cast<const uint16_t*>(a_mem.get());
  const auto* B = static_cast<const uint16_t*>(b_mem.get());
  auto* C = static_cast<float*>(c_mem.get());
  const int reps = std::max(1, static_cast<int>(2e10 / (2.0 * M * N * K)));
  // Activations in place (row stride K x 2 bytes); weights in panels [N/64][K/2][64][2].
  auto a_rows = [&](int m, int k) { return Tile{A + static_cast<size_t>(m) * K + k, K * 2L}; };
  auto b_panels = [&](int n, int k) {
    return Tile{B + static_cast<size_t>(n / 64) * K * 64 + static_cast<size_t>(k / 2) * 128 + (n % 64) * 2,
                256L};
  };
  // Both repacked as contiguous 1 KB tiles: A [M/16][K/32][16][32], B [N/16][K/32][16][16][2].
  auto a_tiles = [&](int m, int k) { return Tile{A + (static_cast<size_t>(m / 16) * (K / 32) + k / 32) * 512, 64L}; };
  auto b_tiles = [&](int n, int k) { return Tile{B + (static_cast<size_t>(n / 16) * (K / 32) + k / 32) * 512, 64L}; };
  const double in_place = gemm_gflops(M, N, K, a_rows, b_panels, C, reps);
  const double repacked = gemm_gflops(M, N, K, a_tiles, b_tiles, C, reps);
  std::printf("2 x 2-tile GEMM %d x %d x %d: weights in panels, activations in place %.0f GFLOP/s (%.0f%% of the "
              "peak); both as contiguous tiles %.0f GFLOP/s (%.0f%%)\n",
              M, N, K, in_place, 100 * in_place / peak, repacked, 100 * repacked / peak);
  _tile_release();
  return 0;
}
