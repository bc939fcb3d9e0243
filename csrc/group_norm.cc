// GroupNorm forward-with-statistics, channels-last apply (y from given
// statistics) and backward as XLA FFI handlers (CPU).
//
// x is (N, C, HW) (channels_last=false) or (N, HW, C) (channels_last=true),
// both read in place, never transposed; y (forward) and dy (backward) are in
// x's dtype or float32 (a 16-bit x with a float32 result), which of the two
// a run-time choice of the loops compiled for x's dtype (XOrF32, simd.h).
// Statistics are (N, G) float32; gamma and beta arrive as float32 (W, C):
// the samples form W equal contiguous parameter groups (W > 1 only under
// vmap with per-example parameters).
// Each (n, g) block has D = C/G * HW elements.
//
// Backward, per block (means over the block, g = dy * gamma[c]):
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
// computed from per-(n, c) sums db = sum_hw dy and ds = sum_hw dy * (x - mean):
//   sum(g) = sum_c gamma[c] db[n,c],  sum(g xhat) = rstd sum_c gamma[c] ds[n,c],
//   dgamma[c] = sum_n rstd[n,g] ds[n,c],  dbeta[c] = sum_n db[n,c]  (n ascending),
// and written as dx = a[c] dy - b - k (x - mean) with a = rstd gamma[c],
// b = rstd mean(g), k = rstd^2 mean(g xhat): one FMA chain per element.
//
// A fused activation (the `activation` attribute, activation.h): the forward
// writes y = act(z), z = xhat gamma[c] + beta[c], and the backward reads the
// cotangent of act(z) and uses dz = dy act'(z) in place of dy above, with z
// recomputed from x, the statistics, gamma and beta, so z is never stored.
// With a float32 x the backward's first pass keeps dz in dx for its second
// (act' once per element) unless dx streams; a 16-bit dx cannot hold it, so
// there the second pass computes it again.
// The kernels take the activation as a template argument: without one they
// compile to exactly the plain loops.
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "activation.h"
#include "kernels.h"
#include "moments.h"
#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {
namespace {

struct GnShape {
  int64_t N, C, HW, G, Cg;
  int64_t W = 1;  // parameter groups: sample n uses gamma/beta row n / (N / W).
  int64_t D() const { return Cg * HW; }
  // The per-channel parameter row of sample n, or nullptr when absent.
  const float* ParamRow(const float* p, int64_t n) const {
    return p ? p + (n / (N / W)) * C : nullptr;
  }
};

// The number of hw-chunks per sample for channels-last kernels: enough tasks
// to occupy the pool, each at least kMinElementsPerTask. Shape-only.
int64_t ChunksPerSample(const GnShape& s) {
  if (s.HW == 0) return 1;
  int64_t p = CeilDiv(kMaxTasks, std::max<int64_t>(s.N, 1));
  p = std::min(p, std::max<int64_t>(1, (s.HW * s.C) / kMinElementsPerTask));
  return std::max<int64_t>(1, std::min(p, s.HW));
}

// Channels-last: for every sample n in [n_begin, n_end) and chunk p of its hw
// range, calls fn(n, hw_begin, hw_end, unit) on the pool, unit = n * P + p.
template <typename Fn>
void ForEachHwChunk(ffi::ThreadPool* pool, const GnShape& s, int64_t P, int64_t n_begin,
                    int64_t n_end, const Fn& fn) {
  const int64_t unit_elems = std::max<int64_t>(s.HW * s.C / P, 1);
  const int64_t units = (n_end - n_begin) * P;
  const int64_t tasks = NumTasks(units, CeilDiv(kMinElementsPerTask, unit_elems), kMaxTasks);
  ParallelFor(pool, tasks, [&](int64_t t) {
    for (int64_t v = BlockBegin(units, tasks, t); v < BlockBegin(units, tasks, t + 1); ++v) {
      const int64_t u = n_begin * P + v, n = u / P, p = u % P;
      fn(n, BlockBegin(s.HW, P, p), BlockBegin(s.HW, P, p + 1), u);
    }
  });
}

// Channels-last column sums for samples [n_begin, n_end): out[n * width + k]
// = sum over hw of the values that chunk_fn(n, hb, he, acc) adds into
// acc[0..width) (zeros) for pixels [hb, he), in pixel order; per chunk, then
// over chunks in order (deterministic, and the same for any sample range).
template <typename Fn>
void ColumnSums(ffi::ThreadPool* pool, const GnShape& s, int64_t n_begin, int64_t n_end,
                int64_t width, const Fn& chunk_fn, float* out) {
  const int64_t P = ChunksPerSample(s);
  std::vector<float> part(static_cast<size_t>((n_end - n_begin) * P * width), 0.f);
  ForEachHwChunk(pool, s, P, n_begin, n_end, [&](int64_t n, int64_t hb, int64_t he, int64_t u) {
    chunk_fn(n, hb, he, part.data() + (u - n_begin * P) * width);
  });
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* pn = part.data() + (n - n_begin) * P * width;
    float* o = out + n * width;
    std::copy(pn, pn + width, o);
    for (int64_t p = 1; p < P; ++p) {
      const float* src = pn + p * width;
      for (int64_t k = 0; k < width; ++k) o[k] += src[k];
    }
  }
}

// The channels-last backward walks the samples in batches of about
// kSampleBatchBytes of input, each batch's two passes back to back, so the
// second finds the batch in the last-level cache instead of memory. The
// batching changes no arithmetic.
constexpr int64_t kSampleBatchBytes = int64_t{8} << 20;

template <typename Fn>
void ForEachSampleBatch(const GnShape& s, int64_t bytes_per_sample, const Fn& fn) {
  const int64_t per_batch = std::max<int64_t>(1, kSampleBatchBytes / std::max<int64_t>(bytes_per_sample, 1));
  for (int64_t n0 = 0; n0 < s.N; n0 += per_batch) fn(n0, std::min(s.N, n0 + per_batch));
}

// Per-(n, c) values of a per-(n, g) statistic for samples [n_begin, n_end),
// so channels-last inner loops run over contiguous c.
void ExpandGroups(const GnShape& s, const float* per_group, int64_t n_begin, int64_t n_end,
                  float* out) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t c = 0; c < s.C; ++c) out[n * s.C + c] = per_group[n * s.G + c / s.Cg];
}

// Per-(n, c) coefficients of the normalized, scaled and shifted value
// z = (x - mean) a + b: a = rstd[n, g] w[c], b = bias[c] (w, bias: the
// sample's parameter rows, absent: 1 and 0).
void AffineCoefficients(const GnShape& s, const float* rstd, const float* w, const float* bias,
                        float* a, float* b) {
  ExpandGroups(s, rstd, 0, s.N, a);
  for (int64_t n = 0; n < s.N; ++n) {
    const float* wn = s.ParamRow(w, n);
    const float* bn = s.ParamRow(bias, n);
    for (int64_t c = 0; c < s.C; ++c) {
      if (wn) a[n * s.C + c] *= wn[c];
      b[n * s.C + c] = bn ? bn[c] : 0.f;
    }
  }
}

// Per-(n, c) backward coefficients: dx = a dy - b - k (x - mean) where
//   a = rstd gamma[c],  b = rstd mean(g),  k = rstd^2 mean(g xhat),
// i.e. rstd * (g - mean(g) - xhat * mean(g xhat)) with xhat = (x - mean) rstd.
// For sample n and groups [g_begin, g_end); a, b, k are indexed from the
// first channel of g_begin.
void BwdCoefficients(const GnShape& s, const float* rstd, const float* gamma, const float* db,
                     const float* ds, int64_t n, int64_t g_begin, int64_t g_end, float* a,
                     float* b, float* k) {
  const float inv_d = 1.0f / static_cast<float>(s.D());
  const float* gn = s.ParamRow(gamma, n);
  for (int64_t g = g_begin; g < g_end; ++g) {
    float sum_g = 0.f, sum_gdx = 0.f;  // sum(g), sum(g (x - mean))
    for (int64_t c = g * s.Cg; c < (g + 1) * s.Cg; ++c) {
      const float gm = gn ? gn[c] : 1.f;
      sum_g += gm * db[n * s.C + c];
      sum_gdx += gm * ds[n * s.C + c];
    }
    const float rs = rstd[n * s.G + g];
    const float mean_g = sum_g * inv_d;
    const float mean_gxhat = sum_gdx * rs * inv_d;
    for (int64_t c = g * s.Cg; c < (g + 1) * s.Cg; ++c) {
      const int64_t i = c - g_begin * s.Cg;
      a[i] = rs * (gn ? gn[c] : 1.f);
      b[i] = rs * mean_g;
      k[i] = rs * rs * mean_gxhat;
    }
  }
}

// The backward's first pass can keep dz = dy act'(z) in a float32 dx for
// the second pass: dx + offset where it does (keep; only possible where
// kMayKeep: an activation and a float32 x), else (or without a dx) nullptr.
template <bool kMayKeep, typename T>
float* DzBuffer(bool keep, T* dx, int64_t offset) {
  if constexpr (kMayKeep) {
    return keep && dx ? dx + offset : nullptr;
  } else {
    return nullptr;
  }
}
// fn(std::true_type{}) where the first pass kept dz (keep; only possible
// where kMayKeep), else fn(std::false_type{}): the second pass compiled for each.
template <bool kMayKeep, typename Fn>
void WithKeptDz(bool keep, const Fn& fn) {
  if constexpr (kMayKeep) {
    if (keep) return fn(std::true_type{});
  }
  fn(std::false_type{});
}
// The second pass's dz where the first kept it (kKeep), else dy.
template <bool kKeep, typename Tag, typename T>
inline auto LdDzOrDy(Tag tag, const T* dz, XOrF32<T> dy) {
  if constexpr (kKeep) {
    return Ld(tag, dz);
  } else {
    return Ld(tag, dy);
  }
}

template <int64_t A, typename T>
void GroupNormFwdNCHW(ffi::ThreadPool* pool, const GnShape& s, const T* x, const float* w,
                      const float* b, float eps, XOrF32<T> y, float* mean, float* rstd,
                      bool stream_y) {
  const int64_t D = s.D(), blocks = s.N * s.G;
  const float inv_d = 1.0f / static_cast<float>(D);
  const int64_t tasks = NumTasks(blocks, CeilDiv(kMinElementsPerTask, D), kMaxTasks);
  const bool prefetch_blocks = PrefetchNextBlock<T>(D);
  ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t block_end = BlockBegin(blocks, tasks, t + 1);
    for (int64_t bi = BlockBegin(blocks, tasks, t); bi < block_end; ++bi) {
      const int64_t n = bi / s.G, g = bi % s.G;
      const int64_t off = (n * s.C + g * s.Cg) * s.HW;
      const T* xb = x + off;
      // Moments without E[x^2] - E[x]^2 cancellation (RowMoments), any second
      // pass from cache. By L1-sized chunks (ChunkedMoments, as LayerNorm's long
      // rows) measured no faster: float32 4x512x64x64 g32 3.01 -> 3.00 ms,
      // bfloat16 (with the prefetch) 1.99 -> 2.09.
      float mu, m2;
      RowMoments(xb, D, true, &mu, &m2);
      const float rs = 1.0f / std::sqrt(m2 * inv_d + eps);
      mean[bi] = mu;
      rstd[bi] = rs;
      if (!y) continue;
      const float* wn = s.ParamRow(w, n);
      const float* bn = s.ParamRow(b, n);
      // The next block (contiguous after this one) while this one is read from cache.
      const bool prefetch = prefetch_blocks && bi + 1 < block_end;
      for (int64_t ci = 0; ci < s.Cg; ++ci) {
        const int64_t c = g * s.Cg + ci;
        const float a = rs * (wn ? wn[c] : 1.f), bb = bn ? bn[c] : 0.f;
        const T* xc = xb + ci * s.HW;
        const XOrF32<T> yc = y + (off + ci * s.HW);
        const bool stream = StreamRow(stream_y, yc);
        ForRowWide(yc, s.HW, [&](auto tag, int64_t j) {
          if (prefetch) PrefetchLine(tag, xc + D + j);
          StOut(tag, yc + j, Act<A>((Ld(tag, xc + j) - mu) * a + bb), stream);
        });
      }
    }
  });
}

// Per-channel running moments of a channels-last chunk: count, mean and M2
// (the sum of squared deviations from the mean), merged with Chan et al.'s
// update, so the statistics need one pass over memory and keep the
// cancellation-free accuracy of a two-pass variance.
struct Moments {
  int64_t count = 0;
  std::vector<float> mean, m2;
  explicit Moments(int64_t channels) : mean(channels, 0.f), m2(channels, 0.f) {}
  // Adds moments of `nb` more values per channel: means mb, sums of squared
  // deviations qb.
  void Merge(int64_t nb, const float* mb, const float* qb) {
    if (nb == 0) return;
    const int64_t n = count + nb;
    const float fb = static_cast<float>(nb) / static_cast<float>(n);
    const float fab = static_cast<float>(count) * fb;  // count * nb / n
    float* m = mean.data();
    float* q = m2.data();
    ForRow(static_cast<int64_t>(mean.size()), [&](auto tag, int64_t c) {
      auto delta = Ld(tag, mb + c) - Ld(tag, m + c);
      St(tag, m + c, Ld(tag, m + c) + delta * fb);
      St(tag, q + c, Ld(tag, q + c) + Ld(tag, qb + c) + delta * delta * fab);
    });
    count = n;
  }
  void Merge(const Moments& o) { Merge(o.count, o.mean.data(), o.m2.data()); }
};

// Two per-channel sums over pixels [h0, h1) of a channels-last (HW, C)
// array, for channels [c, c + NV * lanes) (NV vectors of Tag's lanes;
// NV = 0: channel c alone): a[k] += t1, b[k] += t2 with term(tag, h, k) ->
// (t1, t2) the terms of pixel h, channel k. The sums stay in registers
// across the pixels and add in pixel order (deterministic, and the same for
// any vector width). Prefetches pixel h + ahead's lines of these channels
// (0: none) in `pre`.
template <int NV, typename Tag, typename T, typename Term>
__attribute__((always_inline)) inline void ColumnPairSums(const T* pre, int64_t C, int64_t c,
                                                          int64_t h0, int64_t h1, int64_t ahead,
                                                          float* a, float* b, const Term& term) {
  if constexpr (NV == 0) {
    float sa = a[c], sb = b[c];
    for (int64_t h = h0; h < h1; ++h) {
      const auto t = term(ScalarTag{}, h, c);
      sa += t.first;
      sb += t.second;
    }
    a[c] = sa;
    b[c] = sb;
  } else {
    using V = decltype(Ld(Tag{}, a));
    constexpr int64_t kLanes = sizeof(V) / sizeof(float);
    V sa[NV], sb[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      sa[v] = Ld(Tag{}, a + c + v * kLanes);
      sb[v] = Ld(Tag{}, b + c + v * kLanes);
    }
    for (int64_t h = h0; h < h1; ++h) {
      if (ahead) {
        const T* p = pre + (h + ahead) * C + c;
        for (int64_t o = 0; o < NV * kLanes * static_cast<int64_t>(sizeof(T)); o += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(p) + o);
      }
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const auto t = term(Tag{}, h, c + v * kLanes);
        sa[v] += t.first;
        sb[v] += t.second;
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      St(Tag{}, a + c + v * kLanes, sa[v]);
      St(Tag{}, b + c + v * kLanes, sb[v]);
    }
  }
}

// a[k] += sum of t1, b[k] += sum of t2 over pixels [hb, he), every channel
// k of a channels-last (HW, C) array (see ColumnPairSums): in blocks of
// pixels that fit in L1, each block swept by runs of 4 vectors of channels
// (16-wide in the avx512bf16 build, then 8-wide), then single vectors, then
// single channels. Each run prefetches its channels of the next block, in
// `pre` (x's rows). The order of the adds depends on the shape alone.
template <typename T, typename Term>
__attribute__((always_inline)) inline void ChannelsLastPairSums(const T* pre, int64_t C,
                                                                int64_t hb, int64_t he, float* a,
                                                                float* b, const Term& term) {
  const int64_t block =
      std::max<int64_t>(1, (int64_t{16} << 10) / (C * static_cast<int64_t>(sizeof(T))));
  for (int64_t h0 = hb; h0 < he; h0 += block) {
    const int64_t h1 = std::min(he, h0 + block);
    // Prefetch the next block while this one is swept from L1.
    const int64_t ahead = h1 + (h1 - h0) <= he ? block : 0;
    int64_t c = 0;
#if defined(JNG_WIDE_VECTORS)
    // The elementwise term (an activation's exp and divide in the backward)
    // at twice the width: float32 8x16x16x128 backward with SiLU 337-348 us
    // with 8-wide runs, 203-209 us with these (two processes each).
    for (; c + 4 * kWideVec <= C; c += 4 * kWideVec)
      ColumnPairSums<4, WideTagL<0>>(pre, C, c, h0, h1, ahead, a, b, term);
#endif
    for (; c + 4 * kVec <= C; c += 4 * kVec)
      ColumnPairSums<4, VecTag>(pre, C, c, h0, h1, ahead, a, b, term);
    for (; c + kVec <= C; c += kVec) ColumnPairSums<1, VecTag>(pre, C, c, h0, h1, ahead, a, b, term);
    for (; c < C; ++c) ColumnPairSums<0, ScalarTag>(pre, C, c, h0, h1, 0, a, b, term);
  }
}

// Moments over pixels [hb, he) of one sample (x: its (HW, C) slice), in one
// pass over memory: per channel the sums of d = x - K and d^2, with K the
// mean of the chunk's first (up to 8) pixels, then M2 = sum d^2 - (sum d)^2 / n.
// K is an average of the data, so (K - mean)^2 is at most the largest
// squared deviation, itself a part of M2: the subtraction loses at most
// about n float32 roundings of M2 (typically far fewer), never the
// digits that E[x^2] - E[x]^2 loses to a large mean. Register-blocked (see
// ChannelsLastPairSums): about one load per vector of x, where a pass per
// block plus a merge per block cost several.
template <typename T>
void ChunkMoments(const T* x, int64_t C, int64_t hb, int64_t he, Moments* out) {
  if (he <= hb) return;
  std::vector<float> k(static_cast<size_t>(C), 0.f), s1(static_cast<size_t>(C), 0.f),
      s2(static_cast<size_t>(C), 0.f);
  const int64_t first = std::min<int64_t>(8, he - hb);
  for (int64_t h = hb; h < hb + first; ++h)
    for (int64_t c = 0; c < C; ++c) k[c] += ToFloat(x[h * C + c]);
  for (int64_t c = 0; c < C; ++c) k[c] /= static_cast<float>(first);
  const float* kp = k.data();
  ChannelsLastPairSums(x, C, hb, he, s1.data(), s2.data(), [&](auto tag, int64_t h, int64_t c) {
    const auto d = Ld(tag, x + h * C + c) - Ld(tag, kp + c);
    return std::make_pair(d, d * d);
  });
  const float n = static_cast<float>(he - hb);
  for (int64_t c = 0; c < C; ++c) {
    const float m = s1[c] / n;
    s2[c] = std::max(0.f, s2[c] - s1[c] * m);
    s1[c] = k[c] + m;
  }
  out->Merge(he - hb, s1.data(), s2.data());
}

// Group statistics of sample n from its per-channel moments: channels merged
// in ascending order; mean[n, g] and rstd[n, g] = 1 / sqrt(M2 / D + eps).
void GroupMoments(const GnShape& s, const Moments& m, int64_t n, float eps, float* mean,
                  float* rstd) {
  for (int64_t g = 0; g < s.G; ++g) {
    RunningMoments gm;
    for (int64_t c = g * s.Cg; c < (g + 1) * s.Cg; ++c) gm.Merge(m.count, m.mean[c], m.m2[c]);
    mean[n * s.G + g] = gm.mean;
    rstd[n * s.G + g] = 1.0f / std::sqrt(gm.m2 / static_cast<float>(s.D()) + eps);
  }
}

// Channels-last statistics in one pass over memory: per chunk and channel a
// mean and M2 (sum of squared deviations), merged in a fixed order, then
// over each group's channels.
template <typename T>
void StatsNHWC(ffi::ThreadPool* pool, const GnShape& s, const T* x, float eps, float* mean,
               float* rstd) {
  const int64_t P = ChunksPerSample(s);
  std::vector<Moments> part;
  part.reserve(static_cast<size_t>(s.N * P));
  for (int64_t u = 0; u < s.N * P; ++u) part.emplace_back(s.C);
  ForEachHwChunk(pool, s, P, 0, s.N, [&](int64_t n, int64_t hb, int64_t he, int64_t u) {
    ChunkMoments(x + n * s.HW * s.C, s.C, hb, he, &part[u]);
  });
  for (int64_t n = 0; n < s.N; ++n) {
    Moments& m = part[n * P];
    for (int64_t p = 1; p < P; ++p) m.Merge(part[n * P + p]);
    GroupMoments(s, m, n, eps, mean, rstd);
  }
}

// Channels-last y = (x - mean) * rstd * weight[c] + bias[c] from given (N, G)
// statistics, as (x - mu[c]) * a[c] + bb[c] with per-(n, c) coefficients.
// The lowering calls the statistics (GroupNormFwdImpl with an empty y) and
// this (GroupNormApplyImpl) as two custom calls, so that XLA drops this pass
// where y is unused, as it drops jnp code. One call for both measured no
// faster: the statistics need the whole sample before y's first element,
// and an L3 re-read of x costs about what a memory read does here.
template <int64_t A, typename T>
void GroupNormApplyNHWC(ffi::ThreadPool* pool, const GnShape& s, const T* x, const float* mean,
                        const float* rstd, const float* w, const float* b, XOrF32<T> y,
                        bool stream_y) {
  const size_t nc = static_cast<size_t>(s.N * s.C);
  std::vector<float> mu_c(nc), a_c(nc), b_c(nc);
  ExpandGroups(s, mean, 0, s.N, mu_c.data());
  AffineCoefficients(s, rstd, w, b, a_c.data(), b_c.data());
  ForEachHwChunk(pool, s, ChunksPerSample(s), 0, s.N, [&](int64_t n, int64_t hb, int64_t he,
                                                          int64_t) {
    const float* mu = mu_c.data() + n * s.C;
    const float* a = a_c.data() + n * s.C;
    const float* bb = b_c.data() + n * s.C;
    for (int64_t hw = hb; hw < he; ++hw) {
      const T* xr = x + (n * s.HW + hw) * s.C;
      const XOrF32<T> yr = y + (n * s.HW + hw) * s.C;
      const bool stream = StreamRow(stream_y, yr);
      ForRowWide(yr, s.C, [&](auto tag, int64_t c) {
        StOut(tag, yr + c,
              Act<A>((Ld(tag, xr + c) - Ld(tag, mu + c)) * Ld(tag, a + c) + Ld(tag, bb + c)),
              stream);
      });
    }
  });
}

// Channels-last forward: the statistics, then y unless y == nullptr.
template <int64_t A, typename T>
void GroupNormFwdNHWC(ffi::ThreadPool* pool, const GnShape& s, const T* x, const float* w,
                      const float* b, float eps, XOrF32<T> y, float* mean, float* rstd,
                      bool stream_y) {
  StatsNHWC(pool, s, x, eps, mean, rstd);
  if (y) GroupNormApplyNHWC<A>(pool, s, x, mean, rstd, w, b, y, stream_y);
}

// Fills db[n*C + c] = sum_hw dy and ds[n*C + c] = sum_hw dy * (x - mean[n, g]),
// and, when dx != nullptr, writes dx. NCHW: one task owns whole (n, g) blocks,
// so a block's second pass finds x and dy in cache.
template <int64_t A, typename T>
void GroupNormBwdNCHW(ffi::ThreadPool* pool, const GnShape& s, XOrF32<T> dy, const T* x,
                      const float* mean, const float* rstd, const float* gamma, const float* beta,
                      T* dx, float* db, float* ds, bool stream_dx) {
  const int64_t D = s.D(), blocks = s.N * s.G;
  const float inv_d = 1.0f / static_cast<float>(D);
  // With an activation and a float32 dx that does not stream, the first pass
  // keeps dz in dx (see GroupNormBwdNHWC).
  constexpr bool kKeepDz = A != kIdentity && std::is_same_v<T, float>;
  const bool keep_dz = kKeepDz && !stream_dx;
  const int64_t tasks = NumTasks(blocks, CeilDiv(kMinElementsPerTask, std::max<int64_t>(D, 1)), kMaxTasks);
  ParallelFor(pool, tasks, [&](int64_t t) {
    for (int64_t bi = BlockBegin(blocks, tasks, t); bi < BlockBegin(blocks, tasks, t + 1); ++bi) {
      const int64_t n = bi / s.G, g = bi % s.G;
      const float mu = mean[bi], rs = rstd[bi];
      const float* gn = s.ParamRow(gamma, n);
      const float* bn = s.ParamRow(beta, n);
      float sum_g = 0.f, sum_gdx = 0.f;
      for (int64_t c = g * s.Cg; c < (g + 1) * s.Cg; ++c) {
        const XOrF32<T> dyc = dy + (n * s.C + c) * s.HW;
        const T* xc = x + (n * s.C + c) * s.HW;
        const float gm = gn ? gn[c] : 1.f;
        const float za = rs * gm, zb = bn ? bn[c] : 0.f;  // z = (x - mean) za + zb
        [[maybe_unused]] float* dzc = DzBuffer<kKeepDz>(keep_dz, dx, (n * s.C + c) * s.HW);
        Acc sd, sdx;
        ForRow(s.HW, [&](auto tag, int64_t j) {
          const auto xm = Ld(tag, xc + j) - mu;
          auto d = Ld(tag, dyc + j);
          if constexpr (A != kIdentity) {
            d = d * ActGrad<A>(xm * za + zb);
            if constexpr (kKeepDz) {
              if (dzc) St(tag, dzc + j, d);
            }
          }
          sd.Add(tag, d);
          sdx.Add(tag, d * xm);
        });
        const float dbc = sd.Sum(), dsc = sdx.Sum();
        db[n * s.C + c] = dbc;
        ds[n * s.C + c] = dsc;
        sum_g += gm * dbc;
        sum_gdx += gm * dsc;
      }
      if (!dx) continue;
      const float b = rs * sum_g * inv_d;
      const float k = rs * rs * (sum_gdx * rs * inv_d);
      for (int64_t c = g * s.Cg; c < (g + 1) * s.Cg; ++c) {
        const XOrF32<T> dyc = dy + (n * s.C + c) * s.HW;
        const T* xc = x + (n * s.C + c) * s.HW;
        T* dxc = dx + (n * s.C + c) * s.HW;
        const float a = rs * (gn ? gn[c] : 1.f), zb = bn ? bn[c] : 0.f;
        const bool stream = StreamRow(stream_dx, dxc);
        WithKeptDz<kKeepDz>(keep_dz, [&](auto kept) {
          constexpr bool kKept = decltype(kept)::value;
          ForRowWide(dxc, s.HW, [&](auto tag, int64_t j) {
            const auto xm = Ld(tag, xc + j) - mu;
            auto d = LdDzOrDy<kKept>(tag, dxc + j, dyc + j);
            if constexpr (A != kIdentity && !kKept) d = d * ActGrad<A>(xm * a + zb);
            StOut(tag, dxc + j, a * d - b - k * xm, stream);
          });
        });
      }
    }
  });
}

template <int64_t A, typename T>
void GroupNormBwdNHWC(ffi::ThreadPool* pool, const GnShape& s, XOrF32<T> dy, const T* x,
                      const float* mean, const float* rstd, const float* gamma, const float* beta,
                      T* dx, float* db, float* ds, bool stream_dx) {
  const size_t nc = static_cast<size_t>(s.N * s.C);
  std::vector<float> mu_c(nc);
  ExpandGroups(s, mean, 0, s.N, mu_c.data());
  // With an activation, z = (x - mean) za[c] + zb[c] per (n, c).
  std::vector<float> za_c, zb_c;
  if constexpr (A != kIdentity) {
    za_c.resize(nc);
    zb_c.resize(nc);
    AffineCoefficients(s, rstd, gamma, beta, za_c.data(), zb_c.data());
  }
  // With an activation and a float32 dx, the first pass keeps dz = dy act'(z)
  // in dx, where the second pass reads it back: act' (an exp and a divide)
  // once per element instead of twice, for the same values. Not where dx
  // streams: there dz's stores would fetch dx's lines from memory and write
  // them back (4x64x64x512 SiLU backward 4.8-5.4 ms without, 6.5-8.2 ms
  // with). A 16-bit dx cannot hold dz exactly, so there the second pass
  // computes it again.
  constexpr bool kKeepDz = A != kIdentity && std::is_same_v<T, float>;
  const bool keep_dz = kKeepDz && !stream_dx;
  // [db | ds] column sums of one sample side by side, in one pass over x, dy.
  std::vector<float> both(2 * nc);
  const int64_t P = ChunksPerSample(s);
  ForEachSampleBatch(s, 2 * s.HW * s.C * static_cast<int64_t>(sizeof(T)), [&](int64_t n0, int64_t n1) {
    // Register-blocked (ChannelsLastPairSums): with the sums kept in memory
    // across pixels, each pixel's adds waited on the last pixel's stores
    // (8x32x32x64: this pass took 2/3 of the call).
    ColumnSums(pool, s, n0, n1, 2 * s.C, [&](int64_t n, int64_t hb, int64_t he, float* acc) {
      const XOrF32<T> dyn = dy + n * s.HW * s.C;
      const T* xn = x + n * s.HW * s.C;
      const float* mu = mu_c.data() + n * s.C;
      [[maybe_unused]] const float* za = A != kIdentity ? za_c.data() + n * s.C : nullptr;
      [[maybe_unused]] const float* zb = A != kIdentity ? zb_c.data() + n * s.C : nullptr;
      [[maybe_unused]] float* dzn = DzBuffer<kKeepDz>(keep_dz, dx, n * s.HW * s.C);
      const int64_t C = s.C;  // a local: the stores to dz made GCC reload s.C every vector
      ChannelsLastPairSums(xn, C, hb, he, acc, acc + C, [&](auto tag, int64_t h, int64_t c) {
        const int64_t i = h * C + c;
        const auto xm = Ld(tag, xn + i) - Ld(tag, mu + c);
        auto d = Ld(tag, dyn + i);
        if constexpr (A != kIdentity) {
          d = d * ActGrad<A>(xm * Ld(tag, za + c) + Ld(tag, zb + c));
          if constexpr (kKeepDz) {
            if (dzn) St(tag, dzn + i, d);
          }
        }
        return std::make_pair(d, d * xm);
      });
    }, both.data());
    for (int64_t n = n0; n < n1; ++n) {
      std::copy(both.data() + 2 * n * s.C, both.data() + (2 * n + 1) * s.C, db + n * s.C);
      std::copy(both.data() + (2 * n + 1) * s.C, both.data() + (2 * n + 2) * s.C, ds + n * s.C);
    }
    if (!dx) return;
    // dx = a[c] dy - b[c] - k[c] (x - mean[c]) for this batch (the batch's
    // x and dy are still in cache).
    std::vector<float> co(static_cast<size_t>(3 * (n1 - n0) * s.C));
    for (int64_t n = n0; n < n1; ++n) {
      float* cn = co.data() + 3 * (n - n0) * s.C;
      BwdCoefficients(s, rstd, gamma, db, ds, n, 0, s.G, cn, cn + s.C, cn + 2 * s.C);
    }
    ForEachHwChunk(pool, s, P, n0, n1, [&](int64_t n, int64_t hb, int64_t he, int64_t) {
      const float* mu = mu_c.data() + n * s.C;
      [[maybe_unused]] const float* za = A != kIdentity ? za_c.data() + n * s.C : nullptr;
      [[maybe_unused]] const float* zb = A != kIdentity ? zb_c.data() + n * s.C : nullptr;
      const float* a = co.data() + 3 * (n - n0) * s.C;
      const float* b = a + s.C;
      const float* k = b + s.C;
      WithKeptDz<kKeepDz>(keep_dz, [&](auto kept) {
        constexpr bool kKept = decltype(kept)::value;
        for (int64_t hw = hb; hw < he; ++hw) {
          const XOrF32<T> dyr = dy + (n * s.HW + hw) * s.C;
          const T* xr = x + (n * s.HW + hw) * s.C;
          T* dxr = dx + (n * s.HW + hw) * s.C;
          const bool stream = StreamRow(stream_dx, dxr);
          ForRowWide(dxr, s.C, [&](auto tag, int64_t c) {
            const auto xm = Ld(tag, xr + c) - Ld(tag, mu + c);
            auto d = LdDzOrDy<kKept>(tag, dxr + c, dyr + c);
            if constexpr (A != kIdentity && !kKept)
              d = d * ActGrad<A>(xm * Ld(tag, za + c) + Ld(tag, zb + c));
            StOut(tag, dxr + c, Ld(tag, a + c) * d - Ld(tag, b + c) - Ld(tag, k + c) * xm, stream);
          });
        }
      });
    });
  });
}

ffi::Error ParseShape(const ffi::AnyBuffer& x, bool channels_last, int64_t G, int64_t W,
                      GnShape* s) {
  auto dims = x.dimensions();
  if (dims.size() != 3)
    return ffi::Error::InvalidArgument("x: expected rank 3 (N, C, HxW) or (N, HxW, C)");
  s->N = dims[0];
  s->C = channels_last ? dims[2] : dims[1];
  s->HW = channels_last ? dims[1] : dims[2];
  s->G = G;
  if (G <= 0 || s->C <= 0 || s->C % G != 0)
    return ffi::Error::InvalidArgument("group: must be positive and divide C");
  s->Cg = s->C / G;
  s->W = W;
  if (W <= 0 || s->N % W != 0)
    return ffi::Error::InvalidArgument("param_groups: must be positive and divide N");
  return ffi::Error::Success();
}

}  // namespace

// y may be empty: the statistics alone (the lowering's first half of a
// channels-last forward, whose y GroupNormApplyImpl writes).
ffi::Error GroupNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> bias,
                            ffi::Result<ffi::AnyBuffer> y,
                            ffi::ResultBuffer<ffi::F32> mean,
                            ffi::ResultBuffer<ffi::F32> rstd, float eps, int64_t group,
                            int64_t param_groups, bool channels_last, bool has_weight,
                            bool has_bias, int64_t activation) {
  GnShape s;
  JNG_RETURN_IF_ERROR(ParseShape(x, channels_last, group, param_groups, &s));
  const bool compute_y = y->element_count() != 0;
  JNG_RETURN_IF_ERROR(CheckSize("y", y->element_count(), compute_y ? s.N * s.C * s.HW : 0));
  JNG_RETURN_IF_ERROR(CheckSize("weight", weight.element_count(), has_weight ? s.W * s.C : 0));
  JNG_RETURN_IF_ERROR(CheckSize("bias", bias.element_count(), has_bias ? s.W * s.C : 0));
  JNG_RETURN_IF_ERROR(CheckSize("mean", mean->element_count(), s.N * s.G));
  JNG_RETURN_IF_ERROR(CheckSize("rstd", rstd->element_count(), s.N * s.G));
  if (s.N == 0) return ffi::Error::Success();
  if (s.HW == 0) return ffi::Error::InvalidArgument("x: HxW must be positive for the forward");
  const float* w = has_weight ? weight.typed_data() : nullptr;
  const float* b = has_bias ? bias.typed_data() : nullptr;
  return DispatchActivation(activation, [&](auto act) {
    return DispatchFloat(x.element_type(), "x", [&](auto tag) {
      using T = decltype(tag);
      constexpr int64_t A = decltype(act)::value;
      const T* xp = reinterpret_cast<const T*>(x.untyped_data());
      XOrF32<T> yp;
      JNG_RETURN_IF_ERROR(XOrF32Of(y->element_type(), x.element_type(), "y",
                                   compute_y ? y->untyped_data() : nullptr, &yp));
      AdviseHugePages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
      const bool stream_y = StreamOutput(static_cast<int64_t>(x.size_bytes() + y->size_bytes()));
      ffi::ThreadPool* p = PoolFor(&pool, static_cast<int64_t>(x.size_bytes() + y->size_bytes()));
      if (channels_last)
        GroupNormFwdNHWC<A>(p, s, xp, w, b, eps, yp, mean->typed_data(), rstd->typed_data(),
                            stream_y);
      else
        GroupNormFwdNCHW<A>(p, s, xp, w, b, eps, yp, mean->typed_data(), rstd->typed_data(),
                            stream_y);
      return ffi::Error::Success();
    });
  });
}

// Channels-last y from given (N, G) statistics (see GroupNormApplyNHWC):
// the forward's second pass as its own call.
ffi::Error GroupNormApplyImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                              ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> bias,
                              ffi::Result<ffi::AnyBuffer> y, int64_t group,
                              int64_t param_groups, bool has_weight, bool has_bias,
                              int64_t activation) {
  GnShape s;
  JNG_RETURN_IF_ERROR(ParseShape(x, /*channels_last=*/true, group, param_groups, &s));
  JNG_RETURN_IF_ERROR(CheckSize("y", y->element_count(), s.N * s.C * s.HW));
  JNG_RETURN_IF_ERROR(CheckSize("mean", mean.element_count(), s.N * s.G));
  JNG_RETURN_IF_ERROR(CheckSize("rstd", rstd.element_count(), s.N * s.G));
  JNG_RETURN_IF_ERROR(CheckSize("weight", weight.element_count(), has_weight ? s.W * s.C : 0));
  JNG_RETURN_IF_ERROR(CheckSize("bias", bias.element_count(), has_bias ? s.W * s.C : 0));
  if (s.N == 0 || s.HW == 0) return ffi::Error::Success();
  const float* w = has_weight ? weight.typed_data() : nullptr;
  const float* b = has_bias ? bias.typed_data() : nullptr;
  return DispatchActivation(activation, [&](auto act) {
    return DispatchFloat(x.element_type(), "x", [&](auto tag) {
      using T = decltype(tag);
      XOrF32<T> yp;
      JNG_RETURN_IF_ERROR(
          XOrF32Of(y->element_type(), x.element_type(), "y", y->untyped_data(), &yp));
      AdviseHugePages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
      GroupNormApplyNHWC<decltype(act)::value>(
          PoolFor(&pool, static_cast<int64_t>(x.size_bytes() + y->size_bytes())), s,
          reinterpret_cast<const T*>(x.untyped_data()), mean.typed_data(),
          rstd.typed_data(), w, b, yp,
          StreamOutput(static_cast<int64_t>(x.size_bytes() + y->size_bytes())));
      return ffi::Error::Success();
    });
  });
}

ffi::Error GroupNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                            ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> beta,
                            ffi::Result<ffi::AnyBuffer> dx,
                            ffi::ResultBuffer<ffi::F32> dgamma,
                            ffi::ResultBuffer<ffi::F32> dbeta, int64_t group,
                            int64_t param_groups, bool channels_last, bool has_gamma,
                            bool has_beta, int64_t activation, bool compute_dx,
                            bool compute_dgamma, bool compute_dbeta) {
  GnShape s;
  JNG_RETURN_IF_ERROR(ParseShape(x, channels_last, group, param_groups, &s));
  if (dx->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("grad_input: dtype must match x");
  const int64_t size = s.N * s.C * s.HW;
  const int64_t psize = s.W * s.C;
  JNG_RETURN_IF_ERROR(CheckSize("grad_out", dy.element_count(), size));
  JNG_RETURN_IF_ERROR(CheckSize("mean", mean.element_count(), s.N * s.G));
  JNG_RETURN_IF_ERROR(CheckSize("rstd", rstd.element_count(), s.N * s.G));
  JNG_RETURN_IF_ERROR(CheckSize("gamma", gamma.element_count(), has_gamma ? psize : 0));
  JNG_RETURN_IF_ERROR(CheckSize("beta", beta.element_count(), has_beta ? psize : 0));
  if (has_beta && activation == kIdentity)
    return ffi::Error::InvalidArgument("beta: only the backward of an activation reads beta");
  JNG_RETURN_IF_ERROR(CheckSize("grad_input", dx->element_count(), compute_dx ? size : 0));
  JNG_RETURN_IF_ERROR(CheckSize("grad_gamma", dgamma->element_count(), compute_dgamma ? psize : 0));
  JNG_RETURN_IF_ERROR(CheckSize("grad_beta", dbeta->element_count(), compute_dbeta ? psize : 0));
  float* dg_out = compute_dgamma ? dgamma->typed_data() : nullptr;
  float* dbt_out = compute_dbeta ? dbeta->typed_data() : nullptr;
  if (dg_out) std::fill(dg_out, dg_out + psize, 0.f);
  if (dbt_out) std::fill(dbt_out, dbt_out + psize, 0.f);
  if (s.N == 0 || s.HW == 0) return ffi::Error::Success();
  // Per-(n, c) sums, N*C floats each: 1/HW of the tensor.
  std::vector<float> db(static_cast<size_t>(s.N * s.C)), ds(static_cast<size_t>(s.N * s.C));
  const float* gm = has_gamma ? gamma.typed_data() : nullptr;
  const float* bt = has_beta ? beta.typed_data() : nullptr;
  const float* mp = mean.typed_data();
  const float* rp = rstd.typed_data();
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    ffi::Error dy_error = DispatchActivation(activation, [&](auto act) {
      constexpr int64_t A = decltype(act)::value;
      XOrF32<T> dyp;
      JNG_RETURN_IF_ERROR(
          XOrF32Of(dy.element_type(), x.element_type(), "grad_out", dy.untyped_data(), &dyp));
      const T* xp = reinterpret_cast<const T*>(x.untyped_data());
      T* dxp = compute_dx ? reinterpret_cast<T*>(dx->untyped_data()) : nullptr;
      AdviseHugePages(dxp, static_cast<int64_t>(dx->size_bytes()));
      const bool stream_dx = compute_dx && StreamOutput(static_cast<int64_t>(
                                               x.size_bytes() + dy.size_bytes() + dx->size_bytes()));
      ffi::ThreadPool* p = PoolFor(&pool, static_cast<int64_t>(
                                              x.size_bytes() + dy.size_bytes() + dx->size_bytes()));
      if (channels_last)
        GroupNormBwdNHWC<A>(p, s, dyp, xp, mp, rp, gm, bt, dxp, db.data(), ds.data(), stream_dx);
      else
        GroupNormBwdNCHW<A>(p, s, dyp, xp, mp, rp, gm, bt, dxp, db.data(), ds.data(), stream_dx);
      return ffi::Error::Success();
    });
    if (dy_error.failure()) return dy_error;
    // Parameter gradients: sums over the samples of each parameter group, in
    // ascending n.
    const int64_t per_group = s.N / s.W;
    for (int64_t n = 0; n < s.N; ++n) {
      const int64_t off = (n / per_group) * s.C;
      for (int64_t c = 0; c < s.C; ++c) {
        if (dg_out) dg_out[off + c] += rp[n * s.G + c / s.Cg] * ds[n * s.C + c];
        if (dbt_out) dbt_out[off + c] += db[n * s.C + c];
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

XLA_FFI_DEFINE_HANDLER_SYMBOL(JNG_HANDLER(JngGroupNormFwd), jax_normgrad::JNG_ISA::GroupNormFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // weight (W, C) or (0)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // bias (W, C) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // y or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (N, G)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (N, G)
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("channels_last")
                                  .Attr<bool>("has_weight")
                                  .Attr<bool>("has_bias")
                                  .Attr<int64_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JNG_HANDLER(JngGroupNormApply), jax_normgrad::JNG_ISA::GroupNormApplyImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x (N, HW, C)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (N, G)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (N, G)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // weight (W, C) or (0)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // bias (W, C) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // y
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("has_weight")
                                  .Attr<bool>("has_bias")
                                  .Attr<int64_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JNG_HANDLER(JngGroupNormBwd), jax_normgrad::JNG_ISA::GroupNormBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // dy
                                  .Arg<xla::ffi::AnyBuffer>()               // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (N, G)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (N, G)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // gamma (W, C) or (0)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // beta (W, C) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // dx or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dgamma (W, C) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dbeta (W, C) or (0)
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("channels_last")
                                  .Attr<bool>("has_gamma")
                                  .Attr<bool>("has_beta")
                                  .Attr<int64_t>("activation")
                                  .Attr<bool>("compute_dx")
                                  .Attr<bool>("compute_dgamma")
                                  .Attr<bool>("compute_dbeta"));
