// The CPU forward kernels' row loops alone, without XLA, Python or the
// thread pool: median microseconds per call of LayerNormFwdRows /
// AddLayerNormFwdRows (csrc/layer_norm.cc) on float32 rows, the same
// 64-byte-aligned buffers every call, on one thread or split in two halves
// over two threads (a spinning helper). On this project's shared VMs a
// process's wall-clock medians move by more than a kernel change of 10-20%;
// these loops' medians repeat to about 1% while the machine is steady, so a
// change to the row code is timed here first, against the old code compiled
// from a `git archive` of it:
//
//   I=$(python -c "import jax.ffi; print(jax.ffi.include_dir())")
//   F="-std=gnu++17 -O3 -fno-math-errno -DJNG_ISA=avx512bf16 -mavx2 -mfma -mf16c \
//      -mavx512f -mavx512vl -mavx512dq -mavx512bf16 -mprefer-vector-width=256 -pthread"
//   g++ $F -isystem $I -Icsrc benchmarks/kernel_rows.cc -o /tmp/rows_new
//   mkdir -p /tmp/old && git archive HEAD~1 csrc | tar -x -C /tmp/old
//   g++ $F -isystem $I -I/tmp/old/csrc benchmarks/kernel_rows.cc -o /tmp/rows_old
//   for i in 1 2 3; do /tmp/rows_old ln 64 512 1; /tmp/rows_new ln 64 512 1; done
//
// (-DJNG_ISA=avx2 -mavx2 -mfma -mf16c for a CPU without AVX-512 BF16; the
// flags are CMakeLists.txt's jng_kernel_variant's.) Arguments: OP (ln, rms,
// add_ln, add_rms, or copy: y = x with the kernels' loads and stores, the
// floor of a forward that reads x once and writes y once), rows, row length,
// threads (1 or 2), calls per median (default 2000), output buffers (default
// 1). y streams past the cache where the handlers stream it (x and y 32 MiB
// or more, StreamOutput in csrc/common.h). Through XLA
// each call writes a fresh output buffer, which is seldom in cache (the
// allocator hands out 6 or more addresses in turn for a 4 MiB output), so
// its lines are read for ownership before they are written; with OUTPUTS >
// 1 the calls rotate through that many y (and h) buffers to time that.
// Prints five medians and the first row's mean and rstd (the same bits from
// both builds where a change keeps them).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "layer_norm.cc"

namespace {

using namespace jax_normgrad::JNG_ISA;

struct Aligned {
  float* p;
  explicit Aligned(size_t n) : p(static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64))) {}
  Aligned(Aligned&& o) noexcept : p(o.p) { o.p = nullptr; }
  Aligned(const Aligned&) = delete;
  ~Aligned() { std::free(p); }
};

struct Problem {
  bool copy, centered, residual;  // of the op: ln (false, true, false), rms, add_ln, add_rms
  bool stream;                    // y written past the cache, as the handlers decide it
  int64_t rows, h;
  float *x, *r, *hs, *y, *w, *b, *mean, *rstd;
  void Run(int64_t begin, int64_t end) const {
    if (copy) {
      float* yb = y + begin * h;
      const float* xb = x + begin * h;
      const bool s = StreamRow(stream, yb);
      ForRowWide(yb, (end - begin) * h,
                 [&](auto tag, int64_t j) { StOut(tag, yb + j, Ld(tag, xb + j), s); });
    } else if (!residual) {
      LayerNormFwdRows<float, float*, float>(x, w, b, y, nullptr, mean, rstd, begin, end, h,
                                             1e-5f, centered, stream);
    } else {
      AddLayerNormFwdRows<float, float>(x, XOrF32<float>(r, true), XOrF32<float>(hs, true), w, b,
                                        y, mean, rstd, begin, end, h, 1e-5f, centered, stream);
    }
    StoreFence();  // as ParallelFor's tasks end
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s ln|rms|add_ln|add_rms|copy ROWS H THREADS [CALLS [OUTPUTS]]\n",
                 argv[0]);
    return 2;
  }
  const std::string op = argv[1];
  const int64_t rows = std::atoll(argv[2]), h = std::atoll(argv[3]);
  const int threads = std::atoi(argv[4]);
  const int calls = argc > 5 ? std::atoi(argv[5]) : 2000;
  const int outputs = argc > 6 ? std::atoi(argv[6]) : 1;
  if ((op != "ln" && op != "rms" && op != "add_ln" && op != "add_rms" && op != "copy") ||
      rows < threads || h < 1 || (threads != 1 && threads != 2) || calls < 1 || outputs < 1 ||
      outputs > 64) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const size_t n = static_cast<size_t>(rows * h);
  Aligned x(n), r(n), w(h), b(h), mean(rows), rstd(rows);
  std::vector<Aligned> ys, hss;
  for (int k = 0; k < outputs; ++k) {
    ys.emplace_back(n), hss.emplace_back(n);
    std::fill(ys.back().p, ys.back().p + n, 0.f);  // pages touched before the timing
    std::fill(hss.back().p, hss.back().p + n, 0.f);
  }
  for (size_t i = 0; i < n; ++i) {
    x.p[i] = 3.f * std::sin(0.37f * static_cast<float>(i % 100003)) + 1.f;
    r.p[i] = std::cos(0.11f * static_cast<float>(i % 100003));
  }
  for (int64_t j = 0; j < h; ++j) w.p[j] = 1.f + 0.001f * static_cast<float>(j % 7), b.p[j] = 0.f;
  Problem prob{op == "copy", op == "ln" || op == "add_ln", op.rfind("add_", 0) == 0,
               StreamOutput(static_cast<int64_t>(2 * n * sizeof(float))), rows, h,
               x.p, r.p, hss[0].p, ys[0].p, w.p, b.p, mean.p, rstd.p};
  const int64_t half = rows / 2;

  std::atomic<int> go{0}, done{0};
  std::atomic<bool> stop{false};
  std::thread helper;
  if (threads == 2) {
    helper = std::thread([&] {
      int seen = 0;
      while (!stop.load(std::memory_order_acquire)) {
        const int g = go.load(std::memory_order_acquire);
        if (g == seen) continue;
        seen = g;
        prob.Run(half, rows);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<double> us;
    for (int c = 0; c < calls; ++c) {
      prob.y = ys[c % outputs].p, prob.hs = hss[c % outputs].p;  // before the helper is released
      const auto t0 = std::chrono::steady_clock::now();
      if (threads == 2) {
        const int d0 = done.load(std::memory_order_acquire);
        go.fetch_add(1, std::memory_order_acq_rel);
        prob.Run(0, half);
        while (done.load(std::memory_order_acquire) == d0) {
        }
      } else {
        prob.Run(0, rows);
      }
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    std::printf("%.1f ", us[us.size() / 2]);
  }
  stop.store(true, std::memory_order_release);
  if (helper.joinable()) helper.join();
  std::printf("us  (%s %lldx%lld, %d thread%s, %d output%s)  mean[0] %.9g rstd[0] %.9g\n",
              op.c_str(), static_cast<long long>(rows), static_cast<long long>(h), threads,
              threads == 2 ? "s" : "", outputs, outputs == 1 ? "" : "s", mean.p[0], rstd.p[0]);
  return 0;
}
