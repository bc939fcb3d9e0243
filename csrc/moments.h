// Mean and M2 (the sum of squared deviations from the mean) of float32 rows,
// by parts merged with Chan et al.'s update: the cancellation-free accuracy
// of a two-pass variance with one pass over memory.
#ifndef JAX_NORMGRAD_CSRC_MOMENTS_H_
#define JAX_NORMGRAD_CSRC_MOMENTS_H_

#include <cstdint>

#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {

// (count, mean, M2) of the parts merged so far, in the caller's fixed order
// (so the result is deterministic).
struct RunningMoments {
  int64_t count = 0;
  float mean = 0.f, m2 = 0.f;
  // Adds n values of mean m and M2 q.
  void Merge(int64_t n, float m, float q) {
    if (n == 0) return;
    const int64_t total = count + n;
    const float fb = static_cast<float>(n) / static_cast<float>(total);
    const float delta = m - mean;
    mean += delta * fb;
    m2 += q + delta * delta * static_cast<float>(count) * fb;
    count = total;
  }
};

// Mean and M2 of x[0, n) by two passes (the second finds x in cache when n
// is small). Not centered (RMSNorm): mean 0 and M2 the sum of squares.
template <typename T>
void TwoPassMoments(const T* x, int64_t n, bool centered, float* mean, float* m2) {
  float m = 0.f;
  if (centered) {
    Acc s;
    ForRow(n, [&](auto tag, int64_t j) { s.Add(tag, Ld(tag, x + j)); });
    m = s.Sum() * (1.0f / static_cast<float>(n));
  }
  Acc q;
  ForRow(n, [&](auto tag, int64_t j) {
    auto d = Ld(tag, x + j) - m;
    q.Add(tag, d * d);
  });
  *mean = m;
  *m2 = q.Sum();
}

constexpr int64_t kMomentsChunk = 2048;

// Mean and M2 of x[0, n): TwoPassMoments of each kMomentsChunk values (the
// second pass from L1), merged in order. One pass over memory.
template <typename T>
RunningMoments ChunkedMoments(const T* x, int64_t n, bool centered) {
  RunningMoments acc;
  for (int64_t c0 = 0; c0 < n; c0 += kMomentsChunk) {
    const int64_t len = n - c0 < kMomentsChunk ? n - c0 : kMomentsChunk;
    float m, q;
    TwoPassMoments(x + c0, len, centered, &m, &q);
    acc.Merge(len, m, q);
  }
  return acc;
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

#endif  // JAX_NORMGRAD_CSRC_MOMENTS_H_
