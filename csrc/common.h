// Shared pieces of the CPU kernels: dtype conversion, the deterministic
// parallel-for over the XLA FFI thread pool, and the blocked row reductions.
#ifndef JAX_NORMGRAD_CSRC_COMMON_H_
#define JAX_NORMGRAD_CSRC_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

// Every kernel source is compiled once per instruction set (CMakeLists.txt);
// JNG_ISA names the namespace of one such build, so the copies never mix.
#ifndef JNG_ISA
#define JNG_ISA generic
#endif
#define JNG_CAT2(a, b) a##_##b
#define JNG_CAT(a, b) JNG_CAT2(a, b)
// The FFI handler symbol of this ISA's build: JNG_HANDLER(JngX) = JngX_avx2, ...
#define JNG_HANDLER(name) JNG_CAT(name, JNG_ISA)

namespace jax_normgrad {

namespace ffi = xla::ffi;

namespace JNG_ISA {

// ---------------------------------------------------------------------------
// Element types. Kernels are templated on a storage type; all arithmetic is
// float32 (converted in registers, never as a float32 copy of a tensor).

struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float ToFloat(float v) { return v; }
inline float ToFloat(BF16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float ToFloat(F16 v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, sizeof(h));
  return static_cast<float>(h);
}

template <typename T>
inline T FromFloat(float v);
template <>
inline float FromFloat<float>(float v) {
  return v;
}
template <>
inline BF16 FromFloat<BF16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN.
    return BF16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  }
  // Round to nearest even.
  u += 0x7fffu + ((u >> 16) & 1u);
  return BF16{static_cast<uint16_t>(u >> 16)};
}
template <>
inline F16 FromFloat<F16>(float v) {
  _Float16 h = static_cast<_Float16>(v);
  F16 out;
  std::memcpy(&out.bits, &h, sizeof(out.bits));
  return out;
}

// Calls `fn.template operator()<T>()` with the storage type of `dtype`, or
// returns an error for a dtype the kernels do not support.
template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::BF16:
      return fn(BF16{});
    case ffi::DataType::F16:
      return fn(F16{});
    default:
      return ffi::Error::InvalidArgument(std::string(what) +
                                         ": unsupported dtype (expected float32, "
                                         "float16 or bfloat16)");
  }
}

// For an operand that may be x's dtype or float32 (LayerNorm's
// parameters): calls `fn(U{})` with U = T, the storage type of x, or float;
// an error naming `what` for any other dtype. Each U compiles the loops
// that read the operand again; where only a load or a store differs, XOrF32
// (simd.h) chooses between the two at run time instead.
template <typename T, typename Fn>
ffi::Error DispatchSameOrF32(ffi::DataType dtype, ffi::DataType x_dtype, const char* what,
                             Fn&& fn) {
  if (dtype == x_dtype) return fn(T{});
  if (dtype == ffi::DataType::F32) return fn(float{});
  return ffi::Error::InvalidArgument(std::string(what) + ": dtype must be x's or float32");
}

// A task's non-temporal stores (StStream in simd.h) are weakly ordered:
// ParallelFor fences after every task, so they are visible before the task
// counts as done. Cheap after a task that made none.
inline void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// How long the calling thread of a ParallelFor spins for the helpers' last
// tasks before it sleeps on a condition variable. Waking a sleeping thread
// costs tens of microseconds on a VM, as long as a whole small kernel; the
// helpers' last tasks usually end sooner. Only the waiting changes, never
// which task computes what. Zen 5 VM, float32, processes alternating
// between builds (5 each), 60 blocked calls after 30 ms of warm-up, median
// ms, condition variable only -> spin first: LayerNorm 2048x512 forward
// 0.176 -> 0.113, backward 0.390 -> 0.227, jax.grad 0.458 -> 0.337;
// 2048x1024 0.30 -> 0.25, 0.73 -> 0.61, 1.01 -> 0.96; 8192x1024 and the
// channels-last GroupNorm rows within the noise (0.84-1.28x per row; 8
// rounds more of 8x32x32x64: forward 1.23x, backward 1.21x, grad 1.09x).
constexpr int64_t kSpinWaitMicros = 100;

inline void CpuRelax() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

// ---------------------------------------------------------------------------
// Deterministic parallel-for on the FFI thread pool.
//
// The work is split into `num_tasks` pieces by the caller from the problem
// shape alone, so the arithmetic (and every float result) does not depend on
// how many threads run it or in which order. Threads claim task indices from
// a shared counter and the calling thread claims too, so it never waits on a
// task that nobody has started: no deadlock even when the pool is busy
// running other custom calls.
//
// ParallelForTasks is the pool's part, typed by nothing but a function pointer:
// compiled once per translation unit, not once per kernel loop. The
// kernels' hundreds of loop instantiations each had their own copy of it and
// of the task wrapper the pool's Schedule makes: half of the LayerNorm
// backward's object code and a third of its compile time (AVX2 build, 4.5 ->
// 2.4 MB, 77 -> 49 s of one core). One indirect call per task, not per
// element. fn(ctx, i) runs task i.
inline void ParallelForTasks(ffi::ThreadPool* pool, int64_t num_tasks,
                             void (*fn)(const void*, int64_t), const void* ctx) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  // A task that starts after all indices are claimed returns without touching
  // `ctx`, which may be gone by then; `state` is kept alive by shared_ptr.
  auto worker = [state, fn, ctx, num_tasks]() {
    for (;;) {
      int64_t i = state->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= num_tasks) return;
      fn(ctx, i);
      StoreFence();
      if (state->done.fetch_add(1, std::memory_order_acq_rel) + 1 == num_tasks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  int64_t helpers = std::min<int64_t>(pool->num_threads(), num_tasks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool->Schedule(decltype(worker)(worker));
  worker();
  // Every index is claimed: what is left is at most one task per helper,
  // already running. Spin for it a while before sleeping on the condition
  // variable (see kSpinWaitMicros).
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinWaitMicros);
  while (state->done.load(std::memory_order_acquire) != num_tasks) {
    if (std::chrono::steady_clock::now() > spin_until) {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] {
        return state->done.load(std::memory_order_acquire) == num_tasks;
      });
      return;
    }
    CpuRelax();
  }
}

template <typename Fn>
void ParallelFor(ffi::ThreadPool* pool, int64_t num_tasks, const Fn& fn) {
  if (num_tasks <= 0) return;
  int64_t threads = pool ? pool->num_threads() : 0;
  if (num_tasks == 1 || threads <= 1) {
    for (int64_t i = 0; i < num_tasks; ++i) fn(i);
    StoreFence();
    return;
  }
  ParallelForTasks(pool, num_tasks,
                   [](const void* ctx, int64_t i) { (*static_cast<const Fn*>(ctx))(i); }, &fn);
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A call that moves fewer bytes than this (its big inputs and outputs
// together) runs its tasks on the calling thread: handing tasks to the pool
// and waiting for them cost more than the work. The split into tasks, and
// so every value, stays the same. Interleaved in-process A/B on the
// project's loaded 2-core Xeon VM, float32 channels-last GroupNorm, 32
// groups, thresholds 2, 4 and 8 MiB against none: 8x8x8x128 forward,
// backward, jax.grad 2.4-2.5x, 2.0-2.1x, 2.5-2.7x faster; 8x16x16x64
// 1.9x, 1.7x, 1.6-1.7x; 8x32x32x64 (4 and 6 MiB moved) and LayerNorm
// 2048x512 (8 and 12 MiB) within the noise (0.91-1.31x) at every threshold.
constexpr int64_t kSerialMaxBytes = int64_t{4} << 20;

// The pool for a call that moves `bytes_moved` bytes: none below kSerialMaxBytes.
inline ffi::ThreadPool* PoolFor(ffi::ThreadPool* pool, int64_t bytes_moved) {
  return bytes_moved < kSerialMaxBytes ? nullptr : pool;
}

// Splits `n` items into at most `max_tasks` contiguous blocks of at least
// `min_per_task` items. Depends only on its arguments (determinism).
inline int64_t NumTasks(int64_t n, int64_t min_per_task, int64_t max_tasks) {
  if (n <= 0) return 0;
  int64_t t = CeilDiv(n, std::max<int64_t>(min_per_task, 1));
  return std::max<int64_t>(1, std::min(t, max_tasks));
}
// [begin, end) of block `i` when `n` items are split into `num_tasks` blocks.
inline int64_t BlockBegin(int64_t n, int64_t num_tasks, int64_t i) {
  return (n / num_tasks) * i + std::min(i, n % num_tasks);
}

// Rows [0, M) in `groups` equal contiguous groups, each split into
// `per_group` tasks; task t covers rows [begin(t), end(t)) of group(t).
class RowGroupTasks {
 public:
  RowGroupTasks(int64_t rows, int64_t groups, int64_t per_group)
      : rows_per_group_(rows / groups), groups_(groups), per_group_(per_group) {}
  int64_t num_tasks() const { return groups_ * per_group_; }
  int64_t group(int64_t t) const { return t / per_group_; }
  int64_t begin(int64_t t) const {
    return group(t) * rows_per_group_ + BlockBegin(rows_per_group_, per_group_, t % per_group_);
  }
  int64_t end(int64_t t) const {
    return group(t) * rows_per_group_ + BlockBegin(rows_per_group_, per_group_, t % per_group_ + 1);
  }

 private:
  int64_t rows_per_group_, groups_, per_group_;
};

// The most tasks a kernel splits into. A constant, not the thread count, so
// results are bitwise the same on every machine.
constexpr int64_t kMaxTasks = 32;
// Work below this many elements per task is not worth a thread hop.
constexpr int64_t kMinElementsPerTask = 1 << 15;

// A kernel that moves at least this many bytes (its big inputs and outputs
// together) writes its output by non-temporal stores (StStream in simd.h):
// its working set is past a last-level cache, so the output would be evicted
// before the next op reads it anyway, and a plain store first reads the line
// it overwrites. Measured on the project's 2-core EPYC VM (32 MiB L3), in
// interleaved A/B runs: LayerNorm float32 forward 1.2-1.4x faster, backward
// 1.1-1.3x; GroupNorm float32 1.1-1.2x both ways. Below it the output may
// still be in cache for its consumer. A constant, not sysconf's L3 size: on
// AMD that reports the whole socket's L3 (256 MiB there), not a core
// complex's share. Only where the stores go changes, never a value.
constexpr int64_t kStreamMinBytes = int64_t{32} << 20;
inline bool StreamOutput(int64_t bytes_moved) { return bytes_moved >= kStreamMinBytes; }

// The per-core L2 cache size in bytes (sysconf; 512 KiB where it reports
// none), for choices that depend on whether a row's working set fits there.
// Such a choice changes a reduction's order between machines with different
// L2 sizes (never between runs on one machine).
inline int64_t L2CacheBytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long reported = 0;
#endif
    return reported > 0 ? static_cast<int64_t>(reported) : int64_t{512} << 10;
  }();
  return bytes;
}

// out[h] = sum over t of partials[t * n + h], t ascending (fixed order).
inline void SumPartials(ffi::ThreadPool* pool, const float* partials, float* out,
                        int64_t num_partials, int64_t n) {
  if (!partials || !out) return;
  const int64_t tasks = NumTasks(n, kMinElementsPerTask / std::max<int64_t>(num_partials, 1), kMaxTasks);
  ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t begin = BlockBegin(n, tasks, t), end = BlockBegin(n, tasks, t + 1);
    std::copy(partials + begin, partials + end, out + begin);
    for (int64_t p = 1; p < num_partials; ++p) {
      const float* src = partials + p * n;
      for (int64_t h = begin; h < end; ++h) out[h] += src[h];
    }
  });
}

// Asks the kernel to back a large output buffer with transparent huge pages
// before the kernel first writes it. XLA allocates a fresh buffer for every
// output; above glibc's 32 MiB mmap limit that memory is new pages each call,
// and first-touch faults (4 KiB at a time) can cost more than the kernel
// itself on virtual machines. MADV_HUGEPAGE only changes the paging policy
// of memory this call owns; it is advisory (errors are ignored) and a no-op
// where THP is off. Buffers under 4 MiB are left alone.
inline void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (data == nullptr || bytes < (int64_t{4} << 20)) return;
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// Returns an error when `buffer` does not hold `expected` elements.
inline ffi::Error CheckSize(const char* name, int64_t actual, int64_t expected) {
  if (actual != expected) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected " +
                                       std::to_string(expected) + " elements, got " +
                                       std::to_string(actual));
  }
  return ffi::Error::Success();
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

#define JNG_RETURN_IF_ERROR(expr)         \
  do {                                    \
    ::xla::ffi::Error _err = (expr);      \
    if (_err.failure()) return _err;      \
  } while (0)

#endif  // JAX_NORMGRAD_CSRC_COMMON_H_
