// LayerNorm forward-with-statistics and backward as XLA FFI handlers (CPU).
//
// Canonical layout: x is (M, H) row-major, one row per normalized slice. The
// rows form W = param_groups equal contiguous groups (W > 1 only under vmap
// with per-example parameters): group k uses weight[k] and bias[k] and its
// rows sum into dweight[k] and dbias[k].
// Statistics arrive as float32; weight and bias as float32 or in x's dtype
// (as the user's parameters are: a 16-bit weight is read, not converted into
// a float32 copy first, which for few long rows is as big as x). The kernels
// are templated on the storage type of x and of the parameters, Tp. y
// (forward) and dy (backward) are in x's dtype or float32 (a 16-bit x with a
// float32 result), read and written through an XOrF32 (simd.h), the two at
// run time in one loop; or, with a float32 x, in any of the three (y for
// 16-bit matmuls after a float32 residual stream), each a template copy.
// Which outputs the backward computes is a run-time choice too
// (layer_norm_bwd.cc).
// Both handlers can also write xhat (write_xhat), and the backward can start
// from xhat instead of x (normalized): the AscendC / InfiniOp forms of the
// backward run on these same kernels.
// The residual form (add_layer_norm / add_rms_norm) too: the forward reads x
// and a residual and writes h = x + residual besides y (has_residual),
// normalizing h as it stores it (the float32 sum rounded to h's dtype), and
// the backward, whose x is then h, adds h's incoming cotangent dh into dx
// in its output pass (has_dh).
// This file: the forward. layer_norm_bwd.cc: the backward. layer_norm.h:
// what both use (their parameter rows and column chunks). Two translation
// units, so that a build compiles them side by side.
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "layer_norm.h"
#include "moments.h"
#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {
namespace {

// Whether a forward row loop prefetches the next row (PrefetchNextRow) in
// its moments pass rather than its output pass: the moments loop (loads and
// adds into 4 chains) has issue slots to spare, and the output loop (bound
// by its loads and stores) is then compiled with no prefetch code at all.
// Not where y streams: rows then come from memory, and the output pass's
// prefetch measured faster. In-process A/B through XLA
// (benchmarks/ab_builds.py, 12-14 rounds, float32 LayerNorm forward,
// medians of the per-round speedups, four to six runs): 512x512
// 1.12-1.24x, 2048x512 1.11-1.30x, 1024x768 1.05-1.13x, 2048x1024 (16 MiB
// moved) 1.00-1.14x; the moments-pass prefetch where y streams: 8192x1024
// 0.95-0.98x (BENCHMARKS-history.md, 2026-11-27).
inline bool PrefetchInMomentsPass(bool stream_y) { return !stream_y; }

// y = xhat * w + b for n elements, xhat = (x - mu) * rs, and xhat itself into
// xo when given (w and b are never null: ones / zeros stand in for absent
// ones). kPrefetch: prefetches the line `ahead` elements on in x (0: none);
// without it the loop has no prefetch code (PrefetchInMomentsPass).
template <bool kPrefetch, typename T, typename Y, typename Tp>
void FwdOutput(const T* x, const Tp* w, const Tp* b, Y y, T* xo, int64_t n, float mu,
               float rs, int64_t ahead, bool stream_y) {
  const bool stream = StreamRow(stream_y, y);
  ForRowWide(y, n, [&](auto tag, int64_t j) {
    if constexpr (kPrefetch) {
      if (ahead) PrefetchLine(tag, x + ahead + j);
    }
    auto xh = (Ld(tag, x + j) - mu) * rs;
    if (xo) St(tag, xo + j, xh);
    StOut(tag, y + j, MulAdd(xh, Ld(tag, w + j), Ld(tag, b + j)), stream);
  });
}

// `xhat_out` (optional) receives xhat = (x - mean) * rstd in T, for a backward
// from the normalized input (layer_norm(save="normalized")).
template <typename T, typename Y, typename Tp>
void LayerNormFwdRows(const T* x, const Tp* w, const Tp* b, Y y, T* xhat_out,
                      float* mean_out, float* rstd_out, int64_t row_begin,
                      int64_t row_end, int64_t H, float eps, bool centered, bool stream_y) {
  const float inv_h = 1.0f / static_cast<float>(H);
  const bool prefetch_rows = PrefetchNextRow<T>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* xr = x + i * H;
    const int64_t ahead = prefetch_rows && i + 1 < row_end ? H : 0;
    // Moments without E[x^2] - E[x]^2 cancellation (RowMoments: shifted sums
    // in one pass, two passes where those would cancel): over the row where
    // the next-row prefetch keeps it in cache, else by L1-sized chunks (one
    // pass over memory, where a row's second pass read it from L2, L3 or
    // memory). Subprocess A/B of the forward (best of three 15-call medians,
    // 4 alternating rounds): 8x2^20 float32 4.51 -> 3.91 ms, bfloat16 4.65
    // -> 3.84, 64x2^17 float32 3.69 -> 3.40.
    float mu, m2;
    if (!prefetch_rows) {
      const RunningMoments m = ChunkedMoments(xr, H, centered);
      mu = m.mean;
      m2 = m.m2;
    } else {
      const int64_t early = PrefetchInMomentsPass(stream_y) ? ahead : 0;
      RowMomentsOf(
          H, centered,
          [&](auto tag, int64_t j) {
            if (early) PrefetchLine(tag, xr + early + j);
            return Ld(tag, xr + j);
          },
          &mu, &m2);
    }
    const float rs = 1.0f / std::sqrt(m2 * inv_h + eps);
    if (mean_out) mean_out[i] = mu;
    rstd_out[i] = rs;
    T* xo = xhat_out ? xhat_out + i * H : nullptr;
    if (PrefetchInMomentsPass(stream_y)) {
      FwdOutput<false>(xr, w, b, y + i * H, xo, H, mu, rs, 0, stream_y);
    } else {
      FwdOutput<true>(xr, w, b, y + i * H, xo, H, mu, rs, ahead, stream_y);
    }
  }
}

// The residual form's output pass with a float32 h: v = x + residual in
// float32, h = v, y = (v - mu) * rs * w + b (FwdOutput's arithmetic).
// Prefetches the lines `ahead` elements on in x and the residual (0: none).
template <typename T, typename Tp>
void AddFwdOutput(const T* x, XOrF32<T> r, float* h, const Tp* w, const Tp* b, T* y, int64_t n,
                  float mu, float rs, int64_t ahead, bool stream_y) {
  const bool stream = StreamRow(stream_y, y);
  ForRowWide(y, n, [&](auto tag, int64_t j) {
    if (ahead) PrefetchLine(tag, x + ahead + j), PrefetchLine(tag, r + ahead + j);
    auto v = Ld(tag, x + j) + Ld(tag, r + j);
    St(tag, h + j, v);
    auto xh = (v - mu) * rs;
    StOut(tag, y + j, MulAdd(xh, Ld(tag, w + j), Ld(tag, b + j)), stream);
  });
}

// The residual form's forward of rows [row_begin, row_end) with a 16-bit h
// (x's dtype T): h is normalized as it is stored. By kMomentsChunk chunks,
// h = x + residual summed in float32 and stored, rounded once, then the
// chunk's moments read back from it (RowMoments, from L1), merged in order;
// then FwdOutput over the stored h: the statistics and y of the plain
// kernel on that h (bit for bit for a row of one chunk). Rounding the sum
// in registers instead (pack and widen, in the moments pass and again in
// the output pass) measured 1.9-2.0x slower for bfloat16 (float16 1.01x;
// BENCHMARKS-history.md, 2026-12-01). Prefetches the next row's x and
// residual in the sums.
template <typename T, typename Tp>
void AddLayerNormFwdStoredRows(const T* x, XOrF32<T> r, T* h, const Tp* w, const Tp* b, T* y,
                               float* mean_out, float* rstd_out, int64_t row_begin,
                               int64_t row_end, int64_t H, float eps, bool centered,
                               bool stream_y) {
  const float inv_h = 1.0f / static_cast<float>(H);
  const bool prefetch_rows = PrefetchNextRow<float>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const int64_t ahead = prefetch_rows && i + 1 < row_end ? H : 0;
    RunningMoments m;
    for (int64_t c0 = 0; c0 < H; c0 += kMomentsChunk) {
      const int64_t len = H - c0 < kMomentsChunk ? H - c0 : kMomentsChunk;
      const T* xc = x + i * H + c0;
      const XOrF32<T> rc = r + (i * H + c0);
      T* hc = h + i * H + c0;
      ForRowWide(hc, len, [&](auto tag, int64_t j) {
        if (ahead) PrefetchLine(tag, xc + ahead + j), PrefetchLine(tag, rc + ahead + j);
        St(tag, hc + j, Ld(tag, xc + j) + Ld(tag, rc + j));
      });
      float mu, q;
      RowMoments(hc, len, centered, &mu, &q);
      m.Merge(len, mu, q);
    }
    // m2 * inv_h, as LayerNormFwdRows's (the float32 h's form divides).
    const float rs = 1.0f / std::sqrt(m.m2 * inv_h + eps);
    if (mean_out) mean_out[i] = m.mean;
    rstd_out[i] = rs;
    FwdOutput<false>(h + i * H, w, b, y + i * H, static_cast<T*>(nullptr), H, m.mean, rs, 0,
                     stream_y);
  }
}

// The residual form's forward of rows [row_begin, row_end): a 16-bit h
// takes AddLayerNormFwdStoredRows; a float32 h (no rounding: the float32
// sum is what is stored), the statistics of x + residual by kMomentsChunk
// chunks (RowMomentsOf the sum, added as it is read: one pass over x and the
// residual, any second pass from L1), merged in order, then one output
// pass that sums again (the row is in cache: the next-row prefetch for
// short rows, L2 for long ones) and writes h and y. This h is written once,
// in the pass that writes y, and never read back: summing into an L1 buffer
// first and reading the moments from there measured slower (the same
// harness as moments.h's, 64 rows of 512 float32 in L2: 9.0-10.4 against
// 6.8 us with the mean, 7.3 against 6.0 without).
template <typename T, typename Tp>
void AddLayerNormFwdRows(const T* x, XOrF32<T> r, XOrF32<T> h, const Tp* w, const Tp* b, T* y,
                         float* mean_out, float* rstd_out, int64_t row_begin, int64_t row_end,
                         int64_t H, float eps, bool centered, bool stream_y) {
  if constexpr (!std::is_same_v<T, float>) {
    if (!h.f32()) {
      return AddLayerNormFwdStoredRows(x, r, h.as_x(), w, b, y, mean_out, rstd_out, row_begin,
                                       row_end, H, eps, centered, stream_y);
    }
  }
  float* hf = h.as_f32();
  const bool prefetch_rows = PrefetchNextRow<float>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    RunningMoments m;
    for (int64_t c0 = 0; c0 < H; c0 += kMomentsChunk) {
      const int64_t len = H - c0 < kMomentsChunk ? H - c0 : kMomentsChunk;
      const T* xc = x + i * H + c0;
      const XOrF32<T> rc = r + (i * H + c0);
      float mu, q;
      RowMomentsOf(
          len, centered, [&](auto tag, int64_t j) { return Ld(tag, xc + j) + Ld(tag, rc + j); },
          &mu, &q);
      m.Merge(len, mu, q);
    }
    const float rs = 1.0f / std::sqrt(m.m2 / static_cast<float>(H) + eps);
    if (mean_out) mean_out[i] = m.mean;
    rstd_out[i] = rs;
    AddFwdOutput(x + i * H, r + i * H, hf + i * H, w, b, y + i * H, H, m.mean, rs,
                 prefetch_rows && i + 1 < row_end ? H : 0, stream_y);
  }
}

// The forward of rows [row_begin, row_end) by column chunks. Phase 1: per
// (row, chunk) a mean and M2 (the sum of squared deviations; RowMoments,
// any second pass over the chunk in cache), merged per row in chunk order
// (Chan et al.): the cancellation-free variance with one pass over memory.
// RMSNorm sums x^2 instead. Phase 2: the output pass per (row, chunk).
template <typename T, typename Y, typename Tp>
void LayerNormFwdChunked(ffi::ThreadPool* pool, const T* x, const Tp* w, const Tp* b,
                         Y y, T* xhat_out, float* mean_out, float* rstd_out,
                         int64_t row_begin, int64_t row_end, int64_t H, float eps,
                         bool centered, bool stream_y) {
  const ColumnChunks cc(H);
  const int64_t rows = row_end - row_begin, units = rows * cc.count;
  std::vector<float> cm(static_cast<size_t>(units)), cq(static_cast<size_t>(units));
  ParallelFor(pool, units, [&](int64_t u) {
    const int64_t i = row_begin + u / cc.count, c = u % cc.count, n = cc.size(c);
    RowMoments(x + i * H + cc.begin(c), n, centered, &cm[u], &cq[u]);
  });
  std::vector<float> mu(static_cast<size_t>(rows)), rs(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    RunningMoments m;
    for (int64_t c = 0; c < cc.count; ++c) m.Merge(cc.size(c), cm[r * cc.count + c], cq[r * cc.count + c]);
    mu[r] = m.mean;
    rs[r] = 1.0f / std::sqrt(m.m2 / static_cast<float>(H) + eps);
    if (mean_out) mean_out[row_begin + r] = m.mean;
    rstd_out[row_begin + r] = rs[r];
  }
  ParallelFor(pool, units, [&](int64_t u) {
    const int64_t r = u / cc.count, i = row_begin + r, c0 = cc.begin(u % cc.count);
    FwdOutput<false>(x + i * H + c0, w + c0, b + c0, y + i * H + c0,
                     xhat_out ? xhat_out + i * H + c0 : nullptr, cc.size(u % cc.count), mu[r],
                     rs[r], 0, stream_y);
  });
}

// fn(T{}, y, Tp{}): the forward's storage types of x and the parameters,
// and y as the row loops write it. y is x's dtype or float32: for a 16-bit
// x an XOrF32<T>, the two chosen at run time (simd.h); or any of the three
// with a float32 x (a float32 residual stream's norm feeding 16-bit
// matmuls: y rounded once here, no float32 y written for XLA to round), a
// pointer of its type.
template <typename Fn>
ffi::Error DispatchFwdTypes(const ffi::AnyBuffer& x, ffi::DataType y_dtype, void* y_data,
                            const ffi::AnyBuffer& weight, bool has_weight,
                            const ffi::AnyBuffer& bias, bool has_bias, bool widen, Fn&& fn) {
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    auto with_y = [&](auto y) {
      return DispatchParams<T>(x, weight, has_weight, bias, has_bias, widen,
                               [&](auto ptag) { return fn(tag, y, ptag); });
    };
    if constexpr (sizeof(T) == 4) {
      return DispatchFloat(y_dtype, "y", [&](auto ytag) {
        return with_y(static_cast<decltype(ytag)*>(y_data));
      });
    } else {
      XOrF32<T> y;
      JNG_RETURN_IF_ERROR(XOrF32Of(y_dtype, x.element_type(), "y", y_data, &y));
      return with_y(y);
    }
  });
}

// y as x's storage type, where the residual form has it so.
template <typename T>
T* AsX(T* y) {
  return y;
}
template <typename T>
T* AsX(XOrF32<T> y) {
  return y.as_x();
}

// The residual form's forward over every row: row tasks (AddLayerNormFwdRows)
// for each storage type of residual and h, x's or float32. Few, long rows
// take no column chunks here: fewer than kMinRowsForRowTasks rows per group
// run on that many tasks.
template <typename T, typename Tp>
ffi::Error AddLayerNormFwd(ffi::ThreadPool* pool, ffi::DataType x_dtype, const T* xp,
                           const ffi::AnyBuffer& residual,
                           ffi::AnyBuffer& h, const Tp* w, const Tp* b, T* yp, float* mean_p,
                           float* rstd_p, int64_t M, int64_t W, int64_t H, float eps,
                           bool centered, bool stream_y) {
  XOrF32<T> rp, hp;
  JNG_RETURN_IF_ERROR(
      XOrF32Of(residual.element_type(), x_dtype, "residual", residual.untyped_data(), &rp));
  JNG_RETURN_IF_ERROR(XOrF32Of(h.element_type(), x_dtype, "h", h.untyped_data(), &hp));
  AdviseHugePages(h.untyped_data(), static_cast<int64_t>(h.size_bytes()));
  RowGroupTasks split(M, W, NumTasks(M / W, CeilDiv(kMinElementsPerTask, H), kMaxTasks));
  ParallelFor(pool, split.num_tasks(), [&](int64_t t) {
    const int64_t grp = split.group(t);
    AddLayerNormFwdRows(xp, rp, hp, w + grp * H, b + grp * H, yp, mean_p, rstd_p,
                        split.begin(t), split.end(t), H, eps, centered, stream_y);
  });
  return ffi::Error::Success();
}

}  // namespace

ffi::Error LayerNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                            ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y,
                            ffi::ResultBuffer<ffi::F32> mean,
                            ffi::ResultBuffer<ffi::F32> rstd,
                            ffi::Result<ffi::AnyBuffer> xhat, ffi::Result<ffi::AnyBuffer> h,
                            float eps, int64_t param_groups, bool has_weight, bool has_bias,
                            bool centered, bool write_xhat, bool has_residual) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x: expected rank 2 (rows, H)");
  const int64_t M = dims[0], H = dims[1], W = param_groups;
  if (W <= 0 || M % W != 0)
    return ffi::Error::InvalidArgument("param_groups: must be positive and divide the rows");
  JNG_RETURN_IF_ERROR(CheckSize("y", y->element_count(), M * H));
  JNG_RETURN_IF_ERROR(CheckSize("weight", weight.element_count(), has_weight ? W * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("bias", bias.element_count(), has_bias ? W * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("mean", mean->element_count(), centered ? M : 0));
  JNG_RETURN_IF_ERROR(CheckSize("rstd", rstd->element_count(), M));
  if (xhat->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("xhat: dtype must match x");
  JNG_RETURN_IF_ERROR(CheckSize("xhat", xhat->element_count(), write_xhat ? M * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("residual", residual.element_count(), has_residual ? M * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("h", h->element_count(), has_residual ? M * H : 0));
  if (has_residual && write_xhat)
    return ffi::Error::InvalidArgument("write_xhat: not available with a residual");
  if (has_residual && y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("y: dtype must match x's with a residual");
  if (M == 0) return ffi::Error::Success();
  if (H == 0) return ffi::Error::InvalidArgument("x: normalized size must be positive");
  float* mean_p = centered ? mean->typed_data() : nullptr;
  float* rstd_p = rstd->typed_data();
  ffi::ThreadPool* pool_p = PoolFor(&pool, static_cast<int64_t>(
      x.size_bytes() + y->size_bytes() + residual.size_bytes() + h->size_bytes()));
  return DispatchFwdTypes(x, y->element_type(), y->untyped_data(), weight, has_weight, bias,
                          has_bias, WidenParams(M / W, H), [&](auto tag, auto yp, auto ptag) {
    using T = decltype(tag);
    using Y = decltype(yp);
    using Tp = decltype(ptag);
    std::vector<Tp> w_ones, b_zeros;
    const Tp* w = ParamsOrConstant<T>(weight, has_weight, W * H, 1.f, &w_ones);
    const Tp* b = ParamsOrConstant<T>(bias, has_bias, W * H, 0.f, &b_zeros);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    AdviseHugePages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
    const bool stream_y = StreamOutput(static_cast<int64_t>(x.size_bytes() + y->size_bytes()));
    T* xhp = write_xhat ? reinterpret_cast<T*>(xhat->untyped_data()) : nullptr;
    if (has_residual) {
      // y is in x's dtype here (checked above).
      if constexpr (std::is_same_v<Y, T*> || std::is_same_v<Y, XOrF32<T>>) {
        return AddLayerNormFwd<T, Tp>(pool_p, x.element_type(), xp, residual, *h, w, b, AsX(yp),
                                      mean_p, rstd_p, M, W, H, eps, centered, stream_y);
      }
      return ffi::Error::InvalidArgument("y: dtype must match x's with a residual");
    }
    if (UseColumnChunks(M / W, H)) {
      for (int64_t grp = 0; grp < W; ++grp)
        LayerNormFwdChunked(pool_p, xp, w + grp * H, b + grp * H, yp, xhp, mean_p,
                            rstd_p, grp * (M / W), (grp + 1) * (M / W), H, eps, centered, stream_y);
      return ffi::Error::Success();
    }
    RowGroupTasks split(M, W, NumTasks(M / W, CeilDiv(kMinElementsPerTask, H), kMaxTasks));
    ParallelFor(pool_p, split.num_tasks(), [&](int64_t t) {
      const int64_t grp = split.group(t);
      LayerNormFwdRows(xp, w + grp * H, b + grp * H, yp, xhp, mean_p, rstd_p,
                       split.begin(t), split.end(t), H, eps, centered, stream_y);
    });
    return ffi::Error::Success();
  });
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

// Handler symbols: the attributes are bound by name; keep in step with
// jax_normgrad/_ffi.py.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JNG_HANDLER(JngLayerNormFwd), jax_normgrad::JNG_ISA::LayerNormFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x (M, H)
                                  .Arg<xla::ffi::AnyBuffer>()  // residual (M, H) or (0): f32 or x's
                                  .Arg<xla::ffi::AnyBuffer>()  // weight (W, H) or (0): f32 or x's
                                  .Arg<xla::ffi::AnyBuffer>()  // bias (W, H) or (0): as weight
                                  .Ret<xla::ffi::AnyBuffer>()               // y (M, H)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (M) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (M)
                                  .Ret<xla::ffi::AnyBuffer>()               // xhat (M, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()  // h (M, H) or (0): f32 or x's
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("has_weight")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("centered")
                                  .Attr<bool>("write_xhat")
                                  .Attr<bool>("has_residual"));
