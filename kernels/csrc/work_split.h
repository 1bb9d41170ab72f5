// How the pdserve CPU kernels' work meets the threads (OpenMP's through ATen, or the kernels' own:
// work_pool.h): each thread runs its own share of work items in order, then takes what is left of
// the others' (run_shares_stealing); at::parallel_for's contract on either (parallel_ranges); the own
// GEMMs' units (for_each_gemm_unit) and the attention kernels' items, longest first
// (for_each_longest_first).
// Private to the kernels' translation units, as common.h.
#pragma once

#include <ATen/Parallel.h>

#include "work_pool.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace {

// Whether the kernels' work runs on their own threads (work_pool.h) rather than OpenMP's: where
// OpenMP's threads sleep when idle (OMP_WAIT_POLICY=passive), or PDSERVE_WORK_POOL=1;
// PDSERVE_WORK_POOL=0 never. With OpenMP's default policy its idle thread spins for milliseconds
// after each of torch's own parallel ops and takes the core the pool's helper needs (a decode step
// 20% slower, journal §67).
inline bool use_work_pool() {
  static const bool on = [] {
    const char* pool = std::getenv("PDSERVE_WORK_POOL");
    if (pool != nullptr && *pool != '\0') return std::string_view(pool) != "0";
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    if (policy == nullptr) return false;
    std::string lower(policy);
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return lower == "passive";
  }();
  return on;
}

// Runs fn(state, item_of(t, k)) for k in [0, share_of(t)) of every share t in [0, threads): thread t
// works through share t in order, then takes what is left of the others' shares,
// one item at a time (`state = init()` once per thread). Why not shares alone: where the engine shares
// its cores with a server's other processes (the ingress, Serve's proxy, Ray's), a thread descheduled
// for one of their bursts held its share while its partner spun at the region's end; now the partner
// takes it. A served prefill-heavy load went 7-10% faster, offline prefill beside bursts 12%
// (docs/perf/journal.md §56); alone, each thread runs its own share in order, as before.
// Where fn takes a third argument it is called fn(state, item, next): `next` the item after this one
// in its share (-1 at the share's end), the one a thread running its share in order takes next, so that
// fn may start fetching its data (a hint: another thread may take it instead).
template <typename Share, typename ItemOf, typename Init, typename Fn>
void run_shares_stealing(int64_t threads, Share&& share_of, ItemOf&& item_of, Init&& init, Fn&& fn) {
  if (threads <= 0) return;
  using pdserve_work_pool::WorkPool;
  using State = std::decay_t<decltype(init())>;
  // Item k of share t (of `size` items).
  auto call = [&](State& state, int64_t t, int64_t k, int64_t size) {
    if constexpr (std::is_invocable_v<Fn&, State&, int64_t, int64_t>)
      fn(state, item_of(t, k), k + 1 < size ? item_of(t, k + 1) : int64_t{-1});
    else
      fn(state, item_of(t, k));
  };
  if (use_work_pool() && !at::in_parallel_region()) {
    std::vector<int64_t> sizes(static_cast<size_t>(threads));
    for (int64_t t = 0; t < threads; ++t) sizes[t] = share_of(t);
    using Call = decltype(call);
    struct Ctx {
      Call& run_item;
      Init& init;
      const std::vector<int64_t>& sizes;
    } ctx{call, init, sizes};
    pdserve_work_pool::Work work;
    work.ctx = &ctx;
    work.run = [](void* c, void** state, int64_t t, int64_t k) {
      Ctx& x = *static_cast<Ctx*>(c);
      if (*state == nullptr) *state = new State(x.init());
      x.run_item(*static_cast<State*>(*state), t, k, x.sizes[t]);
    };
    work.free_state = [](void* state) { delete static_cast<State*>(state); };
    if (WorkPool::instance().run(work, sizes, at::get_num_threads())) return;
    if (WorkPool::in_item() || at::get_num_threads() < 2) {     // nested, or one thread: in order, here
      auto state = init();
      for (int64_t t = 0; t < threads; ++t)
        for (int64_t k = 0; k < sizes[t]; ++k) call(state, t, k, sizes[t]);
      return;
    }
  }
  struct alignas(64) Cursor {
    std::atomic<int64_t> next{0};
  };
  std::unique_ptr<Cursor[]> cursors(new Cursor[static_cast<size_t>(threads)]);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t) {
    auto state = init();
    for (int64_t k = 0; k < threads; ++k) {
      const int64_t t = (t0 + k) % threads, size = share_of(t);
      for (int64_t i = cursors[t].next.fetch_add(1, std::memory_order_relaxed); i < size;
           i = cursors[t].next.fetch_add(1, std::memory_order_relaxed))
        call(state, t, i, size);
    }
  });
}

// at::parallel_for's contract (f(first, last) over contiguous ranges of at least `grain` indices,
// together covering [begin, end)) on the kernels' threads: up to four ranges a thread, so that a
// thread done with its own takes what a descheduled one left.
template <typename F>
void parallel_ranges(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin, threads = at::get_num_threads();
  if (n <= 0) return;
  if (!use_work_pool() || at::in_parallel_region()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (n <= grain || threads < 2 || pdserve_work_pool::WorkPool::in_item()) {
    f(begin, end);
    return;
  }
  const int64_t ranges = std::min<int64_t>(n / std::max<int64_t>(grain, 1), 4 * threads);
  if (ranges < 2) {
    f(begin, end);
    return;
  }
  const int64_t shares = std::min(threads, ranges);
  run_shares_stealing(shares, [&](int64_t t) { return ranges * (t + 1) / shares - ranges * t / shares; },
                      [&](int64_t t, int64_t k) { return ranges * t / shares + k; }, [] { return 0; },
                      [&](int, int64_t r) { f(begin + n * r / ranges, begin + n * (r + 1) / ranges); });
}

// run_shares_stealing over [0, n) cut in contiguous, even shares.
template <typename Init, typename Fn>
void for_each_index_stealing(int64_t n, Init&& init, Fn&& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  run_shares_stealing(threads, [&](int64_t t) { return n * (t + 1) / threads - n * t / threads; },
                      [&](int64_t t, int64_t k) { return n * t / threads + k; }, init, fn);
}

// The work of the own GEMMs (bf16_gemm.cpp, f32_gemm.cpp): (column block, row group) units,
// block-major, over the threads, `block(b, m0, m1)` computing rows [m0, m1) of block b. Few blocks (a
// 576-wide output has nine panels) split unevenly over the threads, so their rows are cut in groups
// (as even as they divide, each at least `rows_max` rows) until the units divide evenly or are many;
// a thread then streams about the same share of the weight as with whole blocks.
template <typename Block>
void for_each_gemm_unit(int64_t blocks, int64_t M, int64_t rows_max, Block block) {
  const int64_t threads = at::get_num_threads();
  const int64_t max_groups = std::max<int64_t>(1, std::min<int64_t>(4, M / rows_max));
  int64_t groups = 1;
  while (groups < max_groups && (blocks * groups) % threads != 0 && blocks * groups < 8 * threads) ++groups;
  for_each_index_stealing(blocks * groups, [] { return 0; }, [&](int, int64_t u) {
    const int64_t g = u % groups, m0 = M * g / groups, m1 = M * (g + 1) / groups;
    if (m0 < m1) block(u / groups, m0, m1);
  });
}

// Work items to threads, longest first, each to the least loaded thread: `cost(item)` estimates an
// item's time. Returns each thread's items; at most min(threads, num_items) lists.
template <typename Cost>
std::vector<std::vector<int64_t>> assign_longest_first(int64_t num_items, int64_t threads, Cost cost) {
  std::vector<int64_t> order(static_cast<size_t>(num_items));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  threads = std::max<int64_t>(1, std::min(threads, num_items));
  std::vector<std::vector<int64_t>> assigned(static_cast<size_t>(threads));
  std::vector<int64_t> load(static_cast<size_t>(threads), 0);
  for (const int64_t item : order) {
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    assigned[t].push_back(item);
    load[t] += cost(item);
  }
  return assigned;
}

// Runs fn(state, item) (or fn(state, item, next): run_shares_stealing) for every item: each thread's
// share as assign_longest_first makes it, then what is left of the others' (run_shares_stealing).
template <typename Cost, typename Init, typename Fn>
void for_each_longest_first(int64_t num_items, Cost cost, Init&& init, Fn&& fn) {
  const auto assigned = assign_longest_first(num_items, at::get_num_threads(), cost);
  run_shares_stealing(static_cast<int64_t>(assigned.size()), [&](int64_t t) { return static_cast<int64_t>(assigned[t].size()); },
                      [&](int64_t t, int64_t k) { return assigned[t][k]; }, init, fn);
}

}  // namespace
