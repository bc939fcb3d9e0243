// Mean and M2 (the sum of squared deviations from the mean) of float32 rows,
// by parts merged with Chan et al.'s update, each part by shifted sums in one
// pass where those do not cancel (RowMomentsOf): the cancellation-free
// accuracy of a two-pass variance with one pass over memory.
#ifndef JAX_NORMGRAD_CSRC_MOMENTS_H_
#define JAX_NORMGRAD_CSRC_MOMENTS_H_

#include <cstdint>
#include <limits>

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

// How ill-conditioned a shifted one-pass M2 may be before RowMoments falls
// back to two passes: it keeps the one-pass result while n * d^2 <= K * M2,
// d the mean's distance from the shift (x[0]), i.e. while x[0] lies within
// sqrt(K) standard deviations of the mean. The one-pass M2 = Q - S^2 / n
// then loses at most a factor 1 + 2K to cancellation against the two-pass
// form (its rounding errors scale with Q + S^2 / n <= (1 + 2K) M2), well
// inside the float32 accumulation error the tests allow; rows of Gaussian
// data take the second pass about 8% of the time at K = 3.
constexpr float kOnePassMaxShiftRatio = 3.f;

// Mean and M2 of the n values load(tag, j) (ForRow's tags: a vector or a
// scalar of float32) by two passes (the second finds them in cache when n is
// small). Not centered (RMSNorm): mean 0 and M2 the sum of squares.
template <typename Load>
__attribute__((always_inline)) inline void TwoPassMomentsOf(int64_t n, bool centered,
                                                            const Load& load, float* mean,
                                                            float* m2) {
  float m = 0.f;
  if (centered) {
    Acc s;
    ForRow(n, [&](auto tag, int64_t j) { s.Add(tag, load(tag, j)); });
    m = s.Sum() * (1.0f / static_cast<float>(n));
  }
  Acc q;
  ForRow(n, [&](auto tag, int64_t j) {
    auto d = load(tag, j) - m;
    q.Add(tag, d * d);
  });
  *mean = m;
  *m2 = q.Sum();
}

// Mean and M2 of the n > 0 values load(tag, j): one pass that sums d = v -
// v[0] and d^2 (M2 = sum d^2 - (sum d)^2 / n, mean = v[0] + sum d / n),
// where that is well conditioned (kOnePassMaxShiftRatio); else, and for any
// non-finite sum, TwoPassMomentsOf (from cache: the values were just read).
// Which form a row takes depends on its values only, so results stay
// deterministic, and the same 8-wide lanes on every ISA. The forward's
// moments were two passes over each row from L1 beside its output pass;
// one thread, LayerNorm forward rows of 512 float32 in L2 (the row loop
// alone, benchmarks/kernel_rows.cc, 64 rows): 84-90 -> 66 ns a row.
// Where the L3 bounds the forward it gains less: 2048x512 on two threads
// 127 -> 113 us while other tenants loaded the L3, 73 us both when not.
template <typename Load>
__attribute__((always_inline)) inline void RowMomentsOf(int64_t n, bool centered,
                                                        const Load& load, float* mean,
                                                        float* m2) {
  if (!centered) return TwoPassMomentsOf(n, false, load, mean, m2);
  const float shift = load(ScalarTag{}, 0);
  Acc s, q;
  ForRow(n, [&](auto tag, int64_t j) {
    auto d = load(tag, j) - shift;
    s.Add(tag, d);
    q.Add(tag, d * d);
  });
  const float sum = s.Sum(), sq = q.Sum();
  const float md = sum * (1.0f / static_cast<float>(n));
  const float q2 = sq - sum * md;
  // False for NaN, and for an infinite sum of squares (then q2 is NaN or
  // infinite): those rows take the two-pass form, as all rows did before.
  if (sq <= std::numeric_limits<float>::max() && sum * md <= kOnePassMaxShiftRatio * q2) {
    *mean = shift + md;
    *m2 = q2;
    return;
  }
  TwoPassMomentsOf(n, true, load, mean, m2);
}

// RowMomentsOf x[0, n).
template <typename T>
void RowMoments(const T* x, int64_t n, bool centered, float* mean, float* m2) {
  RowMomentsOf(n, centered, [&](auto tag, int64_t j) { return Ld(tag, x + j); }, mean, m2);
}

constexpr int64_t kMomentsChunk = 2048;

// Mean and M2 of x[0, n): RowMoments of each kMomentsChunk values (any
// second pass from L1), merged in order. One pass over memory.
template <typename T>
RunningMoments ChunkedMoments(const T* x, int64_t n, bool centered) {
  RunningMoments acc;
  for (int64_t c0 = 0; c0 < n; c0 += kMomentsChunk) {
    const int64_t len = n - c0 < kMomentsChunk ? n - c0 : kMomentsChunk;
    float m, q;
    RowMoments(x + c0, len, centered, &m, &q);
    acc.Merge(len, m, q);
  }
  return acc;
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

#endif  // JAX_NORMGRAD_CSRC_MOMENTS_H_
