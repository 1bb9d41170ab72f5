// The kernels' own threads: a region of work items that ends when its items are done, not when every
// thread has arrived (an OpenMP region's barrier). Why: where the engine shares its cores with a
// server's other processes (Serve's proxy, the ingress, Ray's), a thread descheduled for one of their
// bursts held every region's end until it ran again, while its partner spun; with work stealing
// (work_split.h) the partner already took the rest of its items, and here it also goes on without it.
// A helper that is not running when a region starts takes no part in it; one descheduled in the
// middle of an item holds only that item, and the caller, having spun a little, sleeps on a futex so
// that the kernel may run the helper on its core. Idle helpers spin briefly, then sleep: a core left
// idle between steps is one the server's other processes can use without preempting a kernel.
// (docs/perf/journal.md §67.) One pool per process (inline function statics are shared by the
// extension's translation units); the kernels reach it through work_split.h.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pdserve_work_pool {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Sleep while *word == expected (or until woken); spurious returns are fine, callers re-check.
inline void wait_on(std::atomic<uint32_t>& word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  if (word.load() == expected) std::this_thread::yield();
#endif
}

inline void wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, 1 << 30, nullptr, nullptr, 0);
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline int64_t env_us(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

// A claim word per share: the region's epoch (24 bits), the share's size and its next item (20 bits
// each), so that a helper still holding a finished region's epoch can never claim a later region's
// item (its compare-and-swap sees another epoch) however long it was descheduled.
constexpr int kItemBits = 20;
constexpr uint64_t kItemMask = (uint64_t{1} << kItemBits) - 1;
constexpr uint32_t kEpochMask = (uint32_t{1} << 24) - 1;
constexpr int64_t kMaxItems = int64_t{1} << kItemBits;
constexpr int kMaxShares = 256;

inline uint64_t pack(uint32_t epoch, int64_t size, int64_t next) {
  return (uint64_t{epoch & kEpochMask} << (2 * kItemBits)) | (static_cast<uint64_t>(size) << kItemBits) |
         static_cast<uint64_t>(next);
}

// One region's work, type-erased: run(ctx, &state, share, k) runs item k of the share, making the
// thread's state on its first item; free_state deletes it.
struct Work {
  void (*run)(void* ctx, void** state, int64_t share, int64_t k) = nullptr;
  void (*free_state)(void* state) = nullptr;
  void* ctx = nullptr;
};

class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool();     // never destroyed: helpers may outlive static teardown
    return *pool;
  }

  // Runs every item of `sizes.size()` shares (share t of sizes[t] items) with up to `threads` threads,
  // the caller one of them; returns when all are done. False (nothing run) where the pool cannot take
  // the region: another region in flight (a second caller thread, or a call from inside an item),
  // too many shares or items; the caller then runs it some other way.
  bool run(const Work& work, const std::vector<int64_t>& sizes, int64_t threads) {
    const int64_t shares = static_cast<int64_t>(sizes.size());
    if (shares > kMaxShares || in_item_ || threads < 2) return false;
    int64_t total = 0;
    for (const int64_t s : sizes) {
      if (s >= kMaxItems) return false;
      total += s;
    }
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    if (total == 0) return true;
    ensure_helpers(threads - 1);
    const uint32_t epoch = (epoch_.load(std::memory_order_relaxed) + 1) & kEpochMask;
    work_ = work;
    participants_.store(threads - 1, std::memory_order_relaxed);
    shares_.store(shares, std::memory_order_relaxed);
    remaining_.store(total, std::memory_order_relaxed);
    error_ = nullptr;
    has_error_.store(false, std::memory_order_relaxed);
    const int64_t marked = std::max(shares, last_shares_);
    for (int64_t t = 0; t < marked; ++t)      // every cursor a helper may read carries this epoch
      cursors_[t].word.store(pack(epoch, t < shares ? sizes[t] : 0, 0), std::memory_order_release);
    last_shares_ = shares;
    epoch_.store(epoch, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) wake_all(epoch_);

    work_through(epoch, 0, shares);
    wait_until_done();
    if (has_error_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
    return true;
  }

 private:
  struct alignas(64) Cursor {
    std::atomic<uint64_t> word{0};
  };

  WorkPool() : cursors_(new Cursor[kMaxShares]), spin_ns_(1000 * env_us("PDSERVE_POOL_SPIN_US", 100)),
               wait_spin_ns_(1000 * env_us("PDSERVE_POOL_WAIT_SPIN_US", 50)) {}

  // The next item of share t in region `epoch`, or -1.
  int64_t claim(uint32_t epoch, int64_t t) {
    std::atomic<uint64_t>& word = cursors_[t].word;
    uint64_t c = word.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(c >> (2 * kItemBits)) != epoch) return -1;
      const int64_t next = static_cast<int64_t>(c & kItemMask), size = static_cast<int64_t>((c >> kItemBits) & kItemMask);
      if (next >= size) return -1;
      if (word.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return next;
    }
  }

  // Own share first, then the others' in turn, with the thread's state made on its first item. The
  // work is read only while holding a claimed item of this epoch: until that item is done the region
  // cannot end, so its work (and what its ctx points to, on the caller's stack) is alive.
  void work_through(uint32_t epoch, int64_t self, int64_t shares) {
    in_item_ = true;
    void* state = nullptr;
    void (*free_state)(void*) = nullptr;
    for (int64_t j = 0; j < shares; ++j) {
      const int64_t t = (self + j) % shares;
      for (int64_t k = claim(epoch, t); k >= 0; k = claim(epoch, t)) {
        const Work w = work_;
        free_state = w.free_state;
        try {
          w.run(w.ctx, &state, t, k);
        } catch (...) {
          bool expected = false;
          if (has_error_.compare_exchange_strong(expected, true)) error_ = std::current_exception();
        }
        finish_item();
      }
    }
    if (state != nullptr) free_state(state);
    in_item_ = false;
  }

  void finish_item() {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      done_.fetch_add(1, std::memory_order_seq_cst);
      if (caller_sleeping_.load(std::memory_order_seq_cst)) wake_all(done_);
    }
  }

  void wait_until_done() {
    const int64_t until = now_ns() + wait_spin_ns_;
    while (remaining_.load(std::memory_order_acquire) > 0) {
      if (now_ns() < until) {
        for (int i = 0; i < 16; ++i) cpu_relax();
        continue;
      }
      // A helper holds an item and is not running: sleep, so that this core can run it.
      caller_sleeping_.store(true, std::memory_order_seq_cst);
      const uint32_t seen = done_.load(std::memory_order_seq_cst);
      if (remaining_.load(std::memory_order_seq_cst) > 0) wait_on(done_, seen);
      caller_sleeping_.store(false, std::memory_order_relaxed);
    }
  }

  void ensure_helpers(int64_t count) {
    while (static_cast<int64_t>(helpers_.size()) < count) {
      const int64_t index = static_cast<int64_t>(helpers_.size()) + 1;
      helpers_.emplace_back([this, index] { helper_loop(index); });
      helpers_.back().detach();
    }
  }

  void helper_loop(int64_t index) {
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t until = now_ns() + spin_ns_;
      while (epoch_.load(std::memory_order_acquire) == seen) {
        if (now_ns() < until) {
          for (int i = 0; i < 16; ++i) cpu_relax();
          continue;
        }
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        if (epoch_.load(std::memory_order_seq_cst) == seen) wait_on(epoch_, seen);
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (index > participants_.load(std::memory_order_relaxed)) continue;
      work_through(seen, index, shares_.load(std::memory_order_relaxed));
    }
  }

  std::mutex busy_;
  std::unique_ptr<Cursor[]> cursors_;
  const int64_t spin_ns_, wait_spin_ns_;
  std::vector<std::thread> helpers_;
  Work work_;
  int64_t last_shares_ = 0;
  std::exception_ptr error_;
  alignas(64) std::atomic<uint32_t> epoch_{0};
  std::atomic<int64_t> participants_{0}, shares_{0};
  std::atomic<int> sleeping_{0};
  alignas(64) std::atomic<int64_t> remaining_{0};
  std::atomic<uint32_t> done_{0};
  std::atomic<bool> caller_sleeping_{false}, has_error_{false};
  static thread_local bool in_item_;

 public:
  // Whether this thread is running a pool item (a kernel called from inside one runs serially).
  static bool in_item() { return in_item_; }
};

inline thread_local bool WorkPool::in_item_ = false;

}  // namespace pdserve_work_pool
