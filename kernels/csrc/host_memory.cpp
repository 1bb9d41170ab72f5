// Memory advice for the KV prefault thread (engine/worker/host_memory.py), in the kernels' library
// because it is the C++ the engine process loads anyway: madvise(2) over many ranges in one call.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// Each range's madvise through ctypes gave the GIL back and took it again, 60 times a chunk; the
// prefault thread, at idle priority and descheduled while holding it, stalled the step's thread
// (docs/perf/journal.md §67). The system call itself, as host_memory.py makes it: UCX patches libc's
// madvise (§61). 0, or the first failing range's errno (EINTR retried).
int64_t madvise_ranges(at::IntArrayRef starts, at::IntArrayRef lengths, int64_t advice) {
  TORCH_CHECK(starts.size() == lengths.size(), "madvise_ranges: ", starts.size(), " starts but ",
              lengths.size(), " lengths");
#if defined(__linux__)
  for (size_t i = 0; i < starts.size(); ++i) {
    while (syscall(SYS_madvise, reinterpret_cast<void*>(starts[i]), static_cast<size_t>(lengths[i]),
                   static_cast<int>(advice)) != 0) {
      if (errno != EINTR) return errno;
    }
  }
  return 0;
#else
  return ENOSYS;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("madvise_ranges(int[] starts, int[] lengths, int advice) -> int", &madvise_ranges);
}
