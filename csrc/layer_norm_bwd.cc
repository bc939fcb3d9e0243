// LayerNorm backward as an XLA FFI handler (CPU): see layer_norm.cc for the
// layout, the storage types and the residual form; this file is the
// backward of those, layer_norm.h what it shares with the forward.
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "layer_norm.h"
#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {
namespace {

// Partial dweight/dbias accumulators per task are T*H floats each; keep them
// within this many floats so long rows do not cost huge scratch buffers.
constexpr int64_t kMaxPartialFloats = int64_t{1} << 23;
// Each task's partials are zeroed, written and summed again: 3 / (rows per
// task) of the traffic of x and dy (float32). At 8 rows per task that was
// 37%, and long rows paid it (few rows, so few rows per task): interleaved
// A/B of 32 against 8 rows, float32 backward with dweight and dbias,
// without page faults, 256x32768 7.14 -> 6.17 ms, 512x16384 6.90 -> 5.92,
// 128x65536 6.77 -> 6.19 (4 tasks); with them 256x32768 18.83 -> 11.91
// (the 8 MiB of partials were fresh pages). Rows >= 1024 per group keep
// kMaxTasks tasks.
constexpr int64_t kMinRowsPerPartial = 32;

// The backward also takes column chunks for long rows when a group's x and
// dy together are at most this big (see LayerNormBwdImpl).
constexpr int64_t kColumnChunksMaxBytes = int64_t{32} << 20;

// The backward of one parameter group, row by row or column chunk by chunk:
//   xhat = (x - mean) * rstd,  g = dy * w
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
// (mean(g) is dropped when !centered: RMSNorm), dweight += dy * xhat,
// dbias += dy. A first pass over a row computes the two means; the second,
// fused, pass finds the row in cache and writes dx and accumulates
// dweight/dbias. Which outputs are computed (dx, dweight, dbias) is a
// run-time choice: null pointers, tested once per vector by branches that
// every vector of a call takes the same way (predicted, off the critical
// path of the loads and FMAs), so one loop serves every output mask.
// normalized: x already holds xhat (the forward saved it instead of x), there
// is no mean, and rstd (null when dx is not computed) only scales dx.
// xhat_out (optional) receives xhat in T (AscendC's res_for_gamma). dy is
// in Tdy: T or float32 where the forward's y was (for a 16-bit x, the two
// at run time: an XOrF32<T>), or (float32 x: the residual form's float32 h)
// the 16-bit dtype of its y. dx_dy (optional,
// with dx) receives dx once more, rounded to Tdy: the residual form's
// gradient of a 16-bit x when h is float32, so that no XLA pass widens dy
// before the kernel or rounds dx after it.
// dy's element type where its row pointer D is a pointer; T where it is an
// XOrF32<T> (a 16-bit x's dy, in T or float32: then there is no dx_dy).
template <typename T, typename D>
struct DyElem {
  using type = T;
};
template <typename T, typename E>
struct DyElem<T, const E*> {
  using type = E;
};

template <typename T, typename D, typename Tp>
struct LayerNormBwd {
  using Tdy = typename DyElem<T, D>::type;
  D dy;  // const Tdy*, or an XOrF32<T> (simd.h) for a 16-bit x
  const T* x;
  const float* mean;
  const float* rstd;
  const Tp* w;  // this group's weight row, float32 or x's dtype
  const T* dh;  // added into dx (the residual form; null: none)
  T* dx;        // null: dx is not computed
  Tdy* dx_dy;  // dx in dy's dtype too (with dx; null: none)
  T* xhat_out;
  int64_t H;
  bool centered, normalized;
  bool stream_dx;  // dx by non-temporal stores where a row is aligned (StStream)

  // Whether the row loop's vector stores at p (Tdy) are as aligned as those
  // at q (T), which ForRowWide aligns: p's offset within a 64-byte line,
  // scaled to T's size, equals q's. So where q's stores may stream, p's may.
  static bool AlignedAlike(const Tdy* p, const T* q) {
    if constexpr (sizeof(Tdy) > sizeof(T)) {
      return false;
    } else {
      constexpr uintptr_t kRatio = sizeof(T) / sizeof(Tdy);
      return (reinterpret_cast<uintptr_t>(p) % (64 / kRatio)) * kRatio ==
             reinterpret_cast<uintptr_t>(q) % 64;
    }
  }

  float Mu(int64_t i) const { return (centered && !normalized) ? mean[i] : 0.f; }
  float Rs(int64_t i) const { return rstd ? rstd[i] : 1.f; }
  // xhat = (x - mu) * xs; with mu = 0 and xs = 1 it is x itself, exactly, so
  // the normalized mode needs no branch in the loops.
  float Xs(int64_t i) const { return normalized ? 1.f : Rs(i); }

  // Sums of g and g * xhat over columns [c0, c0 + n) of row i.
  void Sums(int64_t i, int64_t c0, int64_t n, float* s_g, float* s_gx) const {
    const D dyr = dy + (i * H + c0);
    const T* xr = x + i * H + c0;
    const Tp* wr = w + c0;
    const float mu = Mu(i), xs = Xs(i);
    Acc a_g, a_gx;
    ForRow(n, [&](auto tag, int64_t j) {
      auto g = Ld(tag, dyr + j) * Ld(tag, wr + j);
      a_g.Add(tag, g);
      a_gx.Add(tag, g * ((Ld(tag, xr + j) - mu) * xs));
    });
    *s_g = a_g.Sum();
    *s_gx = a_gx.Sum();
  }

  // dx = rs * g - b - k * xhat: b and k of row i from its two sums.
  void Coefficients(int64_t i, float s_g, float s_gx, float* b, float* k) const {
    const float inv_h = 1.0f / static_cast<float>(H);
    *b = centered ? Rs(i) * s_g * inv_h : 0.f;
    *k = Rs(i) * s_gx * inv_h;
  }

  // The storage types the residual form brings (ops/add_norm.py), and only
  // they instantiate its loops (the handler refuses the others): dh (x's
  // dtype T) with dy in T or, for a float32 h, in the 16-bit dtype of its y;
  // the second dx (kDxDy) only in the latter case.
  static constexpr bool kDhTypes = sizeof(Tdy) <= sizeof(T);
  static constexpr bool kDxDyTypes = sizeof(T) == 4 && sizeof(Tdy) == 2;

  // The fused pass over columns [c0, c0 + n) of row i; dw, db (null: not
  // computed) point at column c0 of the accumulators, which it adds to, or
  // overwrites when `overwrite` (the first row into outputs nobody zeroed).
  // Prefetches the line `ahead` elements on in dy and x (0: none).
  // The residual form's dh (kDh) and second dx (kDxDy) are instantiations
  // of their own (FusedResidual): the plain loop has no code for them.
  template <bool kDh = false, bool kDxDy = false>
  void Fused(int64_t i, int64_t c0, int64_t n, float b, float k, float* dw, float* db,
             int64_t ahead, bool overwrite = false) const {
    if constexpr (!kDh && !kDxDy && kDhTypes) {
      if (dx && (dh || dx_dy)) return FusedResidual(i, c0, n, b, k, dw, db, ahead, overwrite);
    }
    const D dyr = dy + (i * H + c0);
    const T* xr = x + i * H + c0;
    const Tp* wr = w + c0;
    // The mask as locals (registers): the loop's stores could alias members.
    T* dxr = dx ? dx + i * H + c0 : nullptr;
    [[maybe_unused]] const T* dhr = kDh ? dh + i * H + c0 : nullptr;
    [[maybe_unused]] Tdy* dx2r = kDxDy ? dx_dy + i * H + c0 : nullptr;
    T* xo = xhat_out ? xhat_out + i * H + c0 : nullptr;
    const bool with_dx = dxr != nullptr, with_dw = dw != nullptr, with_db = db != nullptr;
    const bool accumulate = !overwrite;
    const float mu = Mu(i), rs = Rs(i), xs = Xs(i);
    const bool stream = with_dx && StreamRow(stream_dx, dxr);
    [[maybe_unused]] bool stream2 = false;
    if constexpr (kDxDy)
      stream2 = stream && (sizeof(Tdy) == 4 || kStreamNarrowRows) && AlignedAlike(dx2r, dxr);
    ForRowWide(dxr, n, [&](auto tag, int64_t j) {
      if (ahead) PrefetchLine(tag, dyr + ahead + j), PrefetchLine(tag, xr + ahead + j);
      auto d = Ld(tag, dyr + j);
      auto xh = (Ld(tag, xr + j) - mu) * xs;
      if (with_dx) {
        auto g = rs * (d * Ld(tag, wr + j)) - b - k * xh;
        if constexpr (kDh) {
          if (ahead) PrefetchLine(tag, dhr + ahead + j);
          g = g + Ld(tag, dhr + j);
        }
        StOut(tag, dxr + j, g, stream);
        if constexpr (kDxDy) StOut(tag, dx2r + j, g, stream2);
      }
      // Overwriting adds d * xh to -0, which leaves every value as it is
      // (+0 + -0 is +0): the first row's dw is d * xh exactly.
      if (with_dw) {
        const auto base = accumulate ? Ld(tag, dw + j) : -decltype(d){};
        St(tag, dw + j, MulAdd(d, xh, base));
      }
      if (with_db) St(tag, db + j, accumulate ? Ld(tag, db + j) + d : d);
      if (xo) St(tag, xo + j, xh);
    });
  }

  // The residual form's loops (dh, and dx in dy's dtype too: kDxDy), each an
  // instantiation of its own. Not inlined into the plain Fused, whose code
  // (and its inlining into Rows) then stays what it was without them.
  __attribute__((noinline)) void FusedResidual(int64_t i, int64_t c0, int64_t n, float b,
                                               float k, float* dw, float* db, int64_t ahead,
                                               bool overwrite) const {
    if (!dx_dy) return Fused<true, false>(i, c0, n, b, k, dw, db, ahead, overwrite);
    if constexpr (kDxDyTypes) {
      if (!dh) return Fused<false, true>(i, c0, n, b, k, dw, db, ahead, overwrite);
      Fused<true, true>(i, c0, n, b, k, dw, db, ahead, overwrite);
    }
  }

  // Rows [row_begin, row_end) whole, into this task's dw/db accumulators
  // (null: not computed).
  void Rows(int64_t row_begin, int64_t row_end, float* dw, float* db) const {
    const bool prefetch_rows = PrefetchNextRow<T>(H);
    for (int64_t i = row_begin; i < row_end; ++i) {
      float b = 0.f, k = 0.f;
      if (dx) {
        float s_g, s_gx;
        Sums(i, 0, H, &s_g, &s_gx);
        Coefficients(i, s_g, s_gx, &b, &k);
      }
      // Next row's x and dy: fetched during this in-cache pass, so the
      // memory system is not idle while this core computes.
      Fused(i, 0, H, b, k, dw, db, prefetch_rows && i + 1 < row_end ? H : 0);
    }
  }
};

// The backward of few, long rows (UseColumnChunks) by column chunks.
// Phase 1: the two sums of every (row, chunk); per row they are added in
// chunk order. Phase 2: each chunk's task runs the fused pass over its
// columns of every row and owns its dweight/dbias columns outright (no
// partials; the first row overwrites them, so they need no zeroing). The
// second phase reads x and dy again: worth it only where the rows are too
// few to keep the pool busy.
template <typename Op>
void ColumnChunkedBwd(ffi::ThreadPool* pool, const Op& op, int64_t row_begin, int64_t row_end,
                      bool with_dx, float* dw, float* db) {
  const int64_t rows = row_end - row_begin;
  const ColumnChunks cc(op.H);
  const int64_t chunks = cc.count;
  auto border = [&](int64_t c) { return cc.begin(c); };
  std::vector<float> b(static_cast<size_t>(rows), 0.f), k(static_cast<size_t>(rows), 0.f);
  if (with_dx) {
    std::vector<float> sums(static_cast<size_t>(2 * rows * chunks));
    ParallelFor(pool, rows * chunks, [&](int64_t t) {
      const int64_t r = t / chunks, c = t % chunks;
      op.Sums(row_begin + r, border(c), border(c + 1) - border(c), &sums[2 * t], &sums[2 * t + 1]);
    });
    for (int64_t r = 0; r < rows; ++r) {
      float s_g = 0.f, s_gx = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        s_g += sums[2 * (r * chunks + c)];
        s_gx += sums[2 * (r * chunks + c) + 1];
      }
      op.Coefficients(row_begin + r, s_g, s_gx, &b[r], &k[r]);
    }
  }
  ParallelFor(pool, chunks, [&](int64_t c) {
    const int64_t c0 = border(c), n = border(c + 1) - c0;
    float* dwc = dw ? dw + c0 : nullptr;
    float* dbc = db ? db + c0 : nullptr;
    op.Fused(row_begin, c0, n, b[0], k[0], dwc, dbc, 0, /*overwrite=*/true);
    for (int64_t r = 1; r < rows; ++r) op.Fused(row_begin + r, c0, n, b[r], k[r], dwc, dbc, 0);
  });
}

// fn(T{}, dy, Tp{}): the backward's storage types of x and weight, and dy's
// row as the loops read it. dy is x's dtype or float32 (for a 16-bit x an
// XOrF32<T>, the two chosen at run time), or any of the three with a
// float32 x (the residual form's float32 h under a 16-bit y), a pointer of
// its type.
template <typename Fn>
ffi::Error DispatchBwdTypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                            const ffi::AnyBuffer& weight, bool has_weight, bool widen, Fn&& fn) {
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    auto with_dy = [&](auto dyp) {
      return DispatchParams<T>(x, weight, has_weight, weight, false, widen,
                               [&](auto ptag) { return fn(tag, dyp, ptag); });
    };
    if constexpr (sizeof(T) == 4) {
      return DispatchFloat(dy.element_type(), "grad_out", [&](auto dytag) {
        return with_dy(static_cast<const decltype(dytag)*>(dy.untyped_data()));
      });
    } else {
      XOrF32<T> dyp;
      JNG_RETURN_IF_ERROR(
          XOrF32Of(dy.element_type(), x.element_type(), "grad_out", dy.untyped_data(), &dyp));
      return with_dy(dyp);
    }
  });
}

}  // namespace

ffi::Error LayerNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                            ffi::AnyBuffer weight, ffi::AnyBuffer dh,
                            ffi::Result<ffi::AnyBuffer> dx,
                            ffi::ResultBuffer<ffi::F32> dweight,
                            ffi::ResultBuffer<ffi::F32> dbias,
                            ffi::Result<ffi::AnyBuffer> xhat,
                            ffi::Result<ffi::AnyBuffer> dx_dy, int64_t param_groups,
                            bool has_weight, bool compute_dx, bool compute_dweight,
                            bool compute_dbias, bool centered, bool normalized,
                            bool write_xhat, bool has_dh, bool write_dx_dy) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x: expected rank 2 (rows, H)");
  const int64_t M = dims[0], H = dims[1], W = param_groups;
  if (W <= 0 || M % W != 0)
    return ffi::Error::InvalidArgument("param_groups: must be positive and divide the rows");
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
  JNG_RETURN_IF_ERROR(CheckSize("dh", dh.element_count(), has_dh ? M * H : 0));
  if (has_dh && !compute_dx)
    return ffi::Error::InvalidArgument("dh: added into grad_input, which is not computed");
  if (has_dh && dh.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("dh: dtype must match x");
  JNG_RETURN_IF_ERROR(CheckSize("grad_input_dy_dtype", dx_dy->element_count(),
                                write_dx_dy ? M * H : 0));
  if (write_dx_dy && !compute_dx)
    return ffi::Error::InvalidArgument("grad_input_dy_dtype: needs grad_input, which is not computed");
  if (write_dx_dy && dx_dy->element_type() != dy.element_type())
    return ffi::Error::InvalidArgument("grad_input_dy_dtype: dtype must match grad_out");
  // The residual form's storage types (LayerNormBwd::kDhTypes, kDxDyTypes).
  const bool f32_x = x.element_type() == ffi::DataType::F32;
  const bool f32_dy = dy.element_type() == ffi::DataType::F32;
  if (has_dh && f32_dy && !f32_x)
    return ffi::Error::InvalidArgument("dh: needs grad_out in x's dtype or a 16-bit grad_out "
                                       "with a float32 x, got a float32 grad_out with a 16-bit x");
  if (write_dx_dy && !(f32_x && !f32_dy))
    return ffi::Error::InvalidArgument("grad_input_dy_dtype: needs a float32 x and a 16-bit "
                                       "grad_out");
  float* dw_out = compute_dweight ? dweight->typed_data() : nullptr;
  float* db_out = compute_dbias ? dbias->typed_data() : nullptr;
  const int64_t rows_per_group = M / W;
  // Few, long rows: column chunks (which write dweight/dbias without zeroing).
  // Also long rows whose x and dy fit a large last-level cache but a row's
  // do not fit half the L2 (where the row tasks' fused pass would re-read
  // the row from L3): the second phase's re-read is served by the L3, and
  // chunk-owned parameter gradients save the per-task partials. Zen 3 (512
  // KiB L2), 64x65536 float32: 3.3 -> 2.3 ms. Where the row fits (Zen 5, 1
  // MiB L2) the row tasks win: subprocess A/B, 6 rounds, 64x65536 float32
  // 1.93 -> 1.53 ms, 256x32768 bfloat16 3.09 -> 2.07, 128x65536 bfloat16
  // 3.12 -> 2.71 (5-6 of 6 rounds each).
  const int64_t xdy_bytes = static_cast<int64_t>(x.size_bytes() + dy.size_bytes());
  const bool column_chunks =
      UseColumnChunks(rows_per_group, H) ||
      (H >= 2 * kMinColumnsPerChunk && M > 0 && 2 * (xdy_bytes / M) > L2CacheBytes() &&
       xdy_bytes / W <= kColumnChunksMaxBytes);
  // Long rows make the parameter gradients as big as a tensor (see AdviseHugePages).
  AdviseHugePages(dw_out, static_cast<int64_t>(dweight->size_bytes()));
  AdviseHugePages(db_out, static_cast<int64_t>(dbias->size_bytes()));
  if (dw_out && !column_chunks) std::fill(dw_out, dw_out + W * H, 0.f);
  if (db_out && !column_chunks) std::fill(db_out, db_out + W * H, 0.f);
  if (M == 0 || H == 0) return ffi::Error::Success();

  ffi::ThreadPool* pool_p = PoolFor(&pool, static_cast<int64_t>(
      x.size_bytes() + dy.size_bytes() + dx->size_bytes() + dh.size_bytes() +
      dx_dy->size_bytes()));
  const float* mean_p = centered && !normalized ? mean.typed_data() : nullptr;
  const float* rstd_p = needs_rstd ? rstd.typed_data() : nullptr;

  const bool need_partials = dw_out || db_out;
  int64_t per_group = NumTasks(rows_per_group, CeilDiv(kMinElementsPerTask, H), kMaxTasks);
  if (need_partials) {
    // Each task writes and later re-reads its own H-long dweight/dbias rows.
    // Keep tasks at least kMinRowsPerPartial rows long (but two of them
    // where there are rows).
    const int64_t by_rows = std::max<int64_t>(2, rows_per_group / kMinRowsPerPartial);
    per_group = std::max<int64_t>(1, std::min({per_group, kMaxPartialFloats / (W * H), by_rows}));
  }
  if (column_chunks) per_group = 1;
  RowGroupTasks split(M, W, per_group);
  // Per-task partial sums of dweight/dbias, summed in task order afterwards.
  // With one task per group the partials are the outputs themselves.
  const bool use_partials = per_group > 1;
  std::vector<float> dw_part, db_part;
  if (use_partials) {
    if (dw_out) dw_part.assign(static_cast<size_t>(split.num_tasks() * H), 0.f);
    if (db_out) db_part.assign(static_cast<size_t>(split.num_tasks() * H), 0.f);
  }
  return DispatchBwdTypes(x, dy, weight, has_weight, WidenParams(rows_per_group, H),
                          [&](auto tag, auto dyp, auto ptag) {
    using T = decltype(tag);
    using D = decltype(dyp);
    using Tp = decltype(ptag);
    using Tdy = typename DyElem<T, D>::type;
    std::vector<Tp> w_ones;
    const Tp* w = ParamsOrConstant<T>(weight, has_weight, W * H, 1.f, &w_ones);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    T* dxp = compute_dx ? reinterpret_cast<T*>(dx->untyped_data()) : nullptr;
    AdviseHugePages(dxp, static_cast<int64_t>(dx->size_bytes()));
    // A 16-bit dx too where kStreamNarrowRows (simd.h) says so.
    const bool stream_dx =
        compute_dx && (sizeof(T) == 4 || kStreamNarrowRows) &&
        StreamOutput(static_cast<int64_t>(x.size_bytes() + dy.size_bytes() + dx->size_bytes()));
    T* xhp = write_xhat ? reinterpret_cast<T*>(xhat->untyped_data()) : nullptr;
    const T* dhp = has_dh ? reinterpret_cast<const T*>(dh.untyped_data()) : nullptr;
    Tdy* dx_dyp = write_dx_dy ? reinterpret_cast<Tdy*>(dx_dy->untyped_data()) : nullptr;
    AdviseHugePages(dx_dyp, static_cast<int64_t>(dx_dy->size_bytes()));
    auto op_of = [&](int64_t grp) {
      return LayerNormBwd<T, D, Tp>{dyp, xp, mean_p, rstd_p, w + grp * H, dhp, dxp, dx_dyp,
                                      xhp, H, centered, normalized, stream_dx};
    };
    if (column_chunks) {
      for (int64_t grp = 0; grp < W; ++grp)
        ColumnChunkedBwd(pool_p, op_of(grp), grp * rows_per_group, (grp + 1) * rows_per_group,
                         compute_dx, dw_out ? dw_out + grp * H : nullptr,
                         db_out ? db_out + grp * H : nullptr);
    } else {
      ParallelFor(pool_p, split.num_tasks(), [&](int64_t t) {
        const int64_t grp = split.group(t);
        float* dw = dw_out ? (use_partials ? dw_part.data() + t * H : dw_out + grp * H) : nullptr;
        float* db = db_out ? (use_partials ? db_part.data() + t * H : db_out + grp * H) : nullptr;
        op_of(grp).Rows(split.begin(t), split.end(t), dw, db);
      });
    }
    if (use_partials) {
      for (int64_t grp = 0; grp < W; ++grp) {
        const int64_t off = grp * per_group * H;
        if (dw_out) SumPartials(pool_p, dw_part.data() + off, dw_out + grp * H, per_group, H);
        if (db_out) SumPartials(pool_p, db_part.data() + off, db_out + grp * H, per_group, H);
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

// Handler symbols: the attributes are bound by name; keep in step with
// jax_normgrad/_ffi.py.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JNG_HANDLER(JngLayerNormBwd), jax_normgrad::JNG_ISA::LayerNormBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // dy (M, H)
                                  .Arg<xla::ffi::AnyBuffer>()               // x (M, H)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // mean (M) or (0)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd (M)
                                  .Arg<xla::ffi::AnyBuffer>()  // weight (W, H) or (0): f32 or x's
                                  .Arg<xla::ffi::AnyBuffer>()               // dh (M, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // dx (M, H) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dweight (W, H) or (0)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dbias (W, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()               // xhat (M, H) or (0)
                                  .Ret<xla::ffi::AnyBuffer>()  // dx in dy's dtype (M, H) or (0)
                                  .Attr<int64_t>("param_groups")
                                  .Attr<bool>("has_weight")
                                  .Attr<bool>("compute_dx")
                                  .Attr<bool>("compute_dweight")
                                  .Attr<bool>("compute_dbias")
                                  .Attr<bool>("centered")
                                  .Attr<bool>("normalized")
                                  .Attr<bool>("write_xhat")
                                  .Attr<bool>("has_dh")
                                  .Attr<bool>("write_dx_dy"));
