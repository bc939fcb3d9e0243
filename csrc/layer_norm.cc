// LayerNorm forward-with-statistics and backward as XLA FFI handlers (CPU).
//
// Canonical layout: x is (M, H) row-major, one row per normalized slice. The
// rows form W = param_groups equal contiguous groups (W > 1 only under vmap
// with per-example parameters): group k uses weight[k] and bias[k] and its
// rows sum into dweight[k] and dbias[k].
// Statistics, weight and bias arrive as float32 (the Python side converts the
// small vectors), so the kernels are templated on the storage type of x alone.
// Both handlers can also write xhat (write_xhat), and the backward can start
// from xhat instead of x (normalized): the AscendC / InfiniOp forms of the
// backward run on these same kernels.
#include <cmath>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {
namespace {

// Partial dweight/dbias accumulators per task are T*H floats each; keep them
// within this many floats so long rows do not cost huge scratch buffers.
constexpr int64_t kMaxPartialFloats = int64_t{1} << 23;
constexpr int64_t kMinRowsPerPartial = 8;

// `xhat_out` (optional) receives xhat = (x - mean) * rstd in T, for a backward
// from the normalized input (layer_norm(save="normalized")).
template <typename T>
void LayerNormFwdRows(const T* x, const float* w, const float* b, T* y, T* xhat_out,
                      float* mean_out, float* rstd_out, int64_t row_begin,
                      int64_t row_end, int64_t H, float eps, bool centered) {
  const float inv_h = 1.0f / static_cast<float>(H);
  const bool prefetch_rows = PrefetchNextRow<T>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* xr = x + i * H;
    float mu = 0.f;
    if (centered) {
      Acc s;
      ForRow(H, [&](auto tag, int64_t j) { s.Add(tag, Ld(tag, xr + j)); });
      mu = s.Sum() * inv_h;
    }
    // Two-pass variance: the row is in cache, and it avoids the cancellation
    // of E[x^2] - E[x]^2.
    Acc q;
    ForRow(H, [&](auto tag, int64_t j) {
      auto d = Ld(tag, xr + j) - mu;
      q.Add(tag, d * d);
    });
    const float rs = 1.0f / std::sqrt(q.Sum() * inv_h + eps);
    if (mean_out) mean_out[i] = mu;
    rstd_out[i] = rs;
    T* yr = y + i * H;
    T* xo = xhat_out ? xhat_out + i * H : nullptr;
    // w and b are never null here (ones / zeros stand in for absent ones).
    const bool prefetch = prefetch_rows && i + 1 < row_end;
    ForRow(H, [&](auto tag, int64_t j) {
      if (prefetch) PrefetchLine(tag, xr + H + j);
      auto xh = (Ld(tag, xr + j) - mu) * rs;
      if (xo) St(tag, xo + j, xh);
      St(tag, yr + j, xh * Ld(tag, w + j) + Ld(tag, b + j));
    });
  }
}

// dx for rows [row_begin, row_end) and this block's dweight/dbias partials:
//   xhat = (x - mean) * rstd,  g = dy * w
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
// (mean(g) is dropped when !centered: RMSNorm). The first pass over the row
// computes the two means; the second, fused, pass finds the row in cache and
// writes dx and accumulates dweight += dy * xhat, dbias += dy. Templated on
// which outputs are computed, so a masked output costs nothing.
// normalized: x already holds xhat (the forward saved it instead of x), there
// is no mean, and rstd (null when dx is not computed) only scales dx.
// xhat_out (optional) receives xhat in T (AscendC's res_for_gamma).
template <typename T, bool kDx, bool kDw, bool kDb>
void LayerNormBwdRows(const T* dy, const T* x, const float* mean, const float* rstd,
                      const float* w, T* dx, T* xhat_out, float* dw, float* db,
                      int64_t row_begin, int64_t row_end, int64_t H, bool centered,
                      bool normalized) {
  const float inv_h = 1.0f / static_cast<float>(H);
  const bool prefetch_rows = PrefetchNextRow<T>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* dyr = dy + i * H;
    const T* xr = x + i * H;
    const float mu = (centered && !normalized) ? mean[i] : 0.f;
    const float rs = rstd ? rstd[i] : 1.f;
    // xhat = (x - mu) * xs; with mu = 0 and xs = 1 it is x itself, exactly, so
    // the normalized mode needs no branch in the loops.
    const float xs = normalized ? 1.f : rs;
    float b = 0.f, k = 0.f;  // dx = rs * g - b - k * xhat
    if (kDx) {
      Acc s_g, s_gx;
      ForRow(H, [&](auto tag, int64_t j) {
        auto g = Ld(tag, dyr + j) * Ld(tag, w + j);
        s_g.Add(tag, g);
        s_gx.Add(tag, g * ((Ld(tag, xr + j) - mu) * xs));
      });
      b = centered ? rs * s_g.Sum() * inv_h : 0.f;
      k = rs * s_gx.Sum() * inv_h;
    }
    T* dxr = kDx ? dx + i * H : nullptr;
    T* xo = xhat_out ? xhat_out + i * H : nullptr;
    // Next row's x and dy: fetched during this in-cache pass, so the memory
    // system is not idle while this core computes.
    const bool prefetch = prefetch_rows && i + 1 < row_end;
    ForRow(H, [&](auto tag, int64_t j) {
      if (prefetch) PrefetchLine(tag, dyr + H + j), PrefetchLine(tag, xr + H + j);
      auto d = Ld(tag, dyr + j);
      auto xh = (Ld(tag, xr + j) - mu) * xs;
      if (kDx) St(tag, dxr + j, rs * (d * Ld(tag, w + j)) - b - k * xh);
      if (kDw) St(tag, dw + j, Ld(tag, dw + j) + d * xh);
      if (kDb) St(tag, db + j, Ld(tag, db + j) + d);
      if (xo) St(tag, xo + j, xh);
    });
  }
}

// LayerNormBwdRows with the output mask as template arguments.
template <typename T>
void LayerNormBwdRowsMasked(bool do_dx, bool do_dw, bool do_db, const T* dy, const T* x,
                            const float* mean, const float* rstd, const float* w, T* dx,
                            T* xhat_out, float* dw, float* db, int64_t row_begin,
                            int64_t row_end, int64_t H, bool centered, bool normalized) {
  using Fn = void (*)(const T*, const T*, const float*, const float*, const float*, T*, T*,
                      float*, float*, int64_t, int64_t, int64_t, bool, bool);
  static constexpr Fn kTable[8] = {
      LayerNormBwdRows<T, false, false, false>, LayerNormBwdRows<T, false, false, true>,
      LayerNormBwdRows<T, false, true, false>,  LayerNormBwdRows<T, false, true, true>,
      LayerNormBwdRows<T, true, false, false>,  LayerNormBwdRows<T, true, false, true>,
      LayerNormBwdRows<T, true, true, false>,   LayerNormBwdRows<T, true, true, true>};
  kTable[(do_dx ? 4 : 0) + (do_dw ? 2 : 0) + (do_db ? 1 : 0)](
      dy, x, mean, rstd, w, dx, xhat_out, dw, db, row_begin, row_end, H, centered, normalized);
}

// Parameters as float32 rows for every group, ones / zeros where absent, so
// the row loops need no branch on presence.
std::vector<float> ParamsOrConstant(const float* p, int64_t size, float constant) {
  return p ? std::vector<float>(p, p + size) : std::vector<float>(static_cast<size_t>(size), constant);
}

}  // namespace

ffi::Error LayerNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> bias,
                            ffi::Result<ffi::AnyBuffer> y,
                            ffi::ResultBuffer<ffi::F32> mean,
                            ffi::ResultBuffer<ffi::F32> rstd,
                            ffi::Result<ffi::AnyBuffer> xhat, float eps,
                            int64_t param_groups, bool has_weight, bool has_bias,
                            bool centered, bool write_xhat) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x: expected rank 2 (rows, H)");
  const int64_t M = dims[0], H = dims[1], W = param_groups;
  if (W <= 0 || M % W != 0)
    return ffi::Error::InvalidArgument("param_groups: must be positive and divide the rows");
  if (y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("y: dtype must match x");
  JNG_RETURN_IF_ERROR(CheckSize("y", y->element_count(), M * H));
  JNG_RETURN_IF_ERROR(CheckSize("weight", weight.element_count(), has_weight ? W * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("bias", bias.element_count(), has_bias ? W * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("mean", mean->element_count(), centered ? M : 0));
  JNG_RETURN_IF_ERROR(CheckSize("rstd", rstd->element_count(), M));
  if (xhat->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("xhat: dtype must match x");
  JNG_RETURN_IF_ERROR(CheckSize("xhat", xhat->element_count(), write_xhat ? M * H : 0));
  if (M == 0) return ffi::Error::Success();
  if (H == 0) return ffi::Error::InvalidArgument("x: normalized size must be positive");
  const std::vector<float> w = ParamsOrConstant(has_weight ? weight.typed_data() : nullptr, W * H, 1.f);
  const std::vector<float> b = ParamsOrConstant(has_bias ? bias.typed_data() : nullptr, W * H, 0.f);
  float* mean_p = centered ? mean->typed_data() : nullptr;
  float* rstd_p = rstd->typed_data();
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    T* yp = reinterpret_cast<T*>(y->untyped_data());
    AdviseHugePages(yp, M * H * static_cast<int64_t>(sizeof(T)));
    T* xhp = write_xhat ? reinterpret_cast<T*>(xhat->untyped_data()) : nullptr;
    RowGroupTasks split(M, W, NumTasks(M / W, CeilDiv(kMinElementsPerTask, H), kMaxTasks));
    ParallelFor(&pool, split.num_tasks(), [&](int64_t t) {
      const int64_t grp = split.group(t);
      LayerNormFwdRows(xp, w.data() + grp * H, b.data() + grp * H, yp, xhp, mean_p, rstd_p,
                       split.begin(t), split.end(t), H, eps, centered);
    });
    return ffi::Error::Success();
  });
}

ffi::Error LayerNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                            ffi::Buffer<ffi::F32> weight, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::ResultBuffer<ffi::F32> dweight,
                            ffi::ResultBuffer<ffi::F32> dbias,
                            ffi::Result<ffi::AnyBuffer> xhat, int64_t param_groups,
                            bool has_weight, bool compute_dx, bool compute_dweight,
                            bool compute_dbias, bool centered, bool normalized,
                            bool write_xhat) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x: expected rank 2 (rows, H)");
  const int64_t M = dims[0], H = dims[1], W = param_groups;
  if (W <= 0 || M % W != 0)
    return ffi::Error::InvalidArgument("param_groups: must be positive and divide the rows");
  if (dy.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("grad_out: dtype must match x");
  if (dx->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("grad_input: dtype must match x");
  JNG_RETURN_IF_ERROR(CheckSize("grad_out", dy.element_count(), M * H));
  if (xhat->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("xhat: dtype must match x");
  // With x = xhat (normalized) there is no mean, and rstd only serves dx.
  const bool needs_rstd = compute_dx || !normalized;
  JNG_RETURN_IF_ERROR(CheckSize("mean", mean.element_count(), centered && !normalized ? M : 0));
  JNG_RETURN_IF_ERROR(CheckSize("rstd", rstd.element_count(), needs_rstd ? M : 0));
  JNG_RETURN_IF_ERROR(CheckSize("weight", weight.element_count(), has_weight ? W * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("xhat", xhat->element_count(), write_xhat ? M * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("grad_input", dx->element_count(), compute_dx ? M * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("grad_weight", dweight->element_count(), compute_dweight ? W * H : 0));
  JNG_RETURN_IF_ERROR(CheckSize("grad_bias", dbias->element_count(), compute_dbias ? W * H : 0));
  float* dw_out = compute_dweight ? dweight->typed_data() : nullptr;
  float* db_out = compute_dbias ? dbias->typed_data() : nullptr;
  if (dw_out) std::fill(dw_out, dw_out + W * H, 0.f);
  if (db_out) std::fill(db_out, db_out + W * H, 0.f);
  if (M == 0 || H == 0) return ffi::Error::Success();

  const bool need_partials = dw_out || db_out;
  int64_t per_group = NumTasks(M / W, CeilDiv(kMinElementsPerTask, H), kMaxTasks);
  if (need_partials) {
    // Each task writes and later re-reads its own H-long dweight/dbias rows:
    // traffic of 1/rows-per-task of the inputs'. Keep tasks at least
    // kMinRowsPerPartial rows long (but two of them where there are rows).
    const int64_t by_rows = std::max<int64_t>(2, (M / W) / kMinRowsPerPartial);
    per_group = std::max<int64_t>(1, std::min({per_group, kMaxPartialFloats / (W * H), by_rows}));
  }
  RowGroupTasks split(M, W, per_group);
  // Per-task partial sums of dweight/dbias, summed in task order afterwards.
  // With one task per group the partials are the outputs themselves.
  const bool use_partials = per_group > 1;
  std::vector<float> dw_part, db_part;
  if (use_partials) {
    if (dw_out) dw_part.assign(static_cast<size_t>(split.num_tasks() * H), 0.f);
    if (db_out) db_part.assign(static_cast<size_t>(split.num_tasks() * H), 0.f);
  }
  const std::vector<float> w = ParamsOrConstant(has_weight ? weight.typed_data() : nullptr, W * H, 1.f);
  const float* mean_p = centered && !normalized ? mean.typed_data() : nullptr;
  const float* rstd_p = needs_rstd ? rstd.typed_data() : nullptr;
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = reinterpret_cast<const T*>(dy.untyped_data());
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    T* dxp = compute_dx ? reinterpret_cast<T*>(dx->untyped_data()) : nullptr;
    AdviseHugePages(dxp, compute_dx ? M * H * static_cast<int64_t>(sizeof(T)) : 0);
    T* xhp = write_xhat ? reinterpret_cast<T*>(xhat->untyped_data()) : nullptr;
    ParallelFor(&pool, split.num_tasks(), [&](int64_t t) {
      const int64_t grp = split.group(t);
      float* dw = dw_out ? (use_partials ? dw_part.data() + t * H : dw_out + grp * H) : nullptr;
      float* db = db_out ? (use_partials ? db_part.data() + t * H : db_out + grp * H) : nullptr;
      LayerNormBwdRowsMasked(compute_dx, dw != nullptr, db != nullptr, dyp, xp, mean_p, rstd_p,
                             w.data() + grp * H, dxp, xhp, dw, db, split.begin(t), split.end(t),
                             H, centered, normalized);
    });
    if (use_partials) {
      for (int64_t grp = 0; grp < W; ++grp) {
        const int64_t off = grp * per_group * H;
        if (dw_out) SumPartials(&pool, dw_part.data() + off, dw_out + grp * H, per_group, H);
        if (db_out) SumPartials(&pool, db_part.data() + off, db_out + grp * H, per_group, H);
      }
    }
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
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // weight (W, H) or (0)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // bias (W, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // y (M, H)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (M) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (M)
                                  .Ret<xla::ffi::AnyBuffer>()               // xhat (M, H) or (0)
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("has_weight")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("centered")
                                  .Attr<bool>("write_xhat"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JNG_HANDLER(JngLayerNormBwd), jax_normgrad::JNG_ISA::LayerNormBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // dy (M, H)
                                  .Arg<xla::ffi::AnyBuffer>()               // x (M, H)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (M) or (0)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (M)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // weight (W, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // dx (M, H) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dweight (W, H) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dbias (W, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // xhat (M, H) or (0)
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("has_weight")
                                  .Attr<bool>("compute_dx")
                                  .Attr<bool>("compute_dweight")
                                  .Attr<bool>("compute_dbias")
                                  .Attr<bool>("centered")
                                  .Attr<bool>("normalized")
                                  .Attr<bool>("write_xhat"));
