// LayerNorm forward-with-statistics and backward as XLA FFI handlers (CPU).
//
// Canonical layout: x is (M, H) row-major, one row per normalized slice. The
// rows form W = param_groups equal contiguous groups (W > 1 only under vmap
// with per-example parameters): group k uses weight[k] and bias[k] and its
// rows sum into dweight[k] and dbias[k].
// Statistics arrive as float32; weight and bias as float32 or in x's dtype
// (as the user's parameters are: a 16-bit weight is read, not converted into
// a float32 copy first, which for few long rows is as big as x). The kernels
// are templated on the storage type of x, of y (forward) or dy (backward),
// which is x's or float32 (a 16-bit x with a float32 result), and of the
// parameters, Tp.
// Both handlers can also write xhat (write_xhat), and the backward can start
// from xhat instead of x (normalized): the AscendC / InfiniOp forms of the
// backward run on these same kernels.
// The residual form (add_layer_norm / add_rms_norm) too: the forward reads x
// and a residual and writes h = x + residual besides y (has_residual), and
// the backward, whose x is then h, adds h's incoming cotangent dh into dx
// in its output pass (has_dh).
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "moments.h"
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

// y = xhat * w + b for n elements, xhat = (x - mu) * rs, and xhat itself into
// xo when given (w and b are never null: ones / zeros stand in for absent
// ones). Prefetches the line `ahead` elements on in x (0: none).
template <typename T, typename Ty, typename Tp>
void FwdOutput(const T* x, const Tp* w, const Tp* b, Ty* y, T* xo, int64_t n, float mu,
               float rs, int64_t ahead, bool stream_y) {
  const bool stream = StreamRow(stream_y, y);
  ForRowWide(y, n, [&](auto tag, int64_t j) {
    if (ahead) PrefetchLine(tag, x + ahead + j);
    auto xh = (Ld(tag, x + j) - mu) * rs;
    if (xo) St(tag, xo + j, xh);
    StOut(tag, y + j, xh * Ld(tag, w + j) + Ld(tag, b + j), stream);
  });
}

// `xhat_out` (optional) receives xhat = (x - mean) * rstd in T, for a backward
// from the normalized input (layer_norm(save="normalized")).
template <typename T, typename Ty, typename Tp>
void LayerNormFwdRows(const T* x, const Tp* w, const Tp* b, Ty* y, T* xhat_out,
                      float* mean_out, float* rstd_out, int64_t row_begin,
                      int64_t row_end, int64_t H, float eps, bool centered, bool stream_y) {
  const float inv_h = 1.0f / static_cast<float>(H);
  const bool prefetch_rows = PrefetchNextRow<T>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* xr = x + i * H;
    // Two-pass variance (no E[x^2] - E[x]^2 cancellation): over the row where
    // the next-row prefetch keeps it in cache, else by L1-sized chunks (one
    // pass over memory, where the row's second pass read it from L2, L3 or
    // memory). Subprocess A/B of the forward (best of three 15-call medians,
    // 4 alternating rounds): 8x2^20 float32 4.51 -> 3.91 ms, bfloat16 4.65
    // -> 3.84, 64x2^17 float32 3.69 -> 3.40.
    float mu, m2;
    if (!prefetch_rows) {
      const RunningMoments m = ChunkedMoments(xr, H, centered);
      mu = m.mean;
      m2 = m.m2;
    } else {
      TwoPassMoments(xr, H, centered, &mu, &m2);
    }
    const float rs = 1.0f / std::sqrt(m2 * inv_h + eps);
    if (mean_out) mean_out[i] = mu;
    rstd_out[i] = rs;
    FwdOutput(xr, w, b, y + i * H, xhat_out ? xhat_out + i * H : nullptr, H, mu, rs,
              prefetch_rows && i + 1 < row_end ? H : 0, stream_y);
  }
}

// s = x + residual for n elements, summed in float32.
template <typename T, typename Tr>
void AddRow(const T* x, const Tr* r, float* s, int64_t n) {
  ForRow(n, [&](auto tag, int64_t j) { St(tag, s + j, Ld(tag, x + j) + Ld(tag, r + j)); });
}

// The residual form's output pass: v = x + residual in float32, h = v
// rounded once, y = (v - mu) * rs * w + b (FwdOutput's arithmetic on the
// unrounded sum). Prefetches the lines `ahead` elements on in x and the
// residual (0: none).
template <typename T, typename Tr, typename Th, typename Ty, typename Tp>
void AddFwdOutput(const T* x, const Tr* r, Th* h, const Tp* w, const Tp* b, Ty* y, int64_t n,
                  float mu, float rs, int64_t ahead, bool stream_y) {
  const bool stream = StreamRow(stream_y, y);
  ForRowWide(y, n, [&](auto tag, int64_t j) {
    if (ahead) PrefetchLine(tag, x + ahead + j), PrefetchLine(tag, r + ahead + j);
    auto v = Ld(tag, x + j) + Ld(tag, r + j);
    St(tag, h + j, v);
    auto xh = (v - mu) * rs;
    StOut(tag, y + j, xh * Ld(tag, w + j) + Ld(tag, b + j), stream);
  });
}

// The residual form's forward of rows [row_begin, row_end), as flash-attn's:
// the statistics of the float32 sum x + residual by kMomentsChunk chunks
// (each summed into an L1 buffer, its moments from there, merged in order),
// then one output pass that sums again (the row is in cache: the next-row
// prefetch for short rows, L2 for long ones) and writes h and y. h is
// written once, in the pass that writes y, and never read back.
template <typename T, typename Tr, typename Th, typename Ty, typename Tp>
void AddLayerNormFwdRows(const T* x, const Tr* r, Th* h, const Tp* w, const Tp* b, Ty* y,
                         float* mean_out, float* rstd_out, int64_t row_begin, int64_t row_end,
                         int64_t H, float eps, bool centered, bool stream_y) {
  float s[kMomentsChunk];
  const bool prefetch_rows = PrefetchNextRow<float>(H);
  for (int64_t i = row_begin; i < row_end; ++i) {
    RunningMoments m;
    for (int64_t c0 = 0; c0 < H; c0 += kMomentsChunk) {
      const int64_t len = H - c0 < kMomentsChunk ? H - c0 : kMomentsChunk;
      AddRow(x + i * H + c0, r + i * H + c0, s, len);
      float mu, q;
      TwoPassMoments(static_cast<const float*>(s), len, centered, &mu, &q);
      m.Merge(len, mu, q);
    }
    const float rs = 1.0f / std::sqrt(m.m2 / static_cast<float>(H) + eps);
    if (mean_out) mean_out[i] = m.mean;
    rstd_out[i] = rs;
    AddFwdOutput(x + i * H, r + i * H, h + i * H, w, b, y + i * H, H, m.mean, rs,
                 prefetch_rows && i + 1 < row_end ? H : 0, stream_y);
  }
}

// Few, long rows (fewer than kMinRowsForRowTasks per parameter group, of at
// least 2 * kMinColumnsPerChunk): the kernels split the rows into column
// chunks across the pool, so one row uses every core.
constexpr int64_t kMinRowsForRowTasks = 4;
constexpr int64_t kMinColumnsPerChunk = int64_t{1} << 14;

// The backward also takes column chunks for long rows when a group's x and
// dy together are at most this big (see LayerNormBwdImpl).
constexpr int64_t kColumnChunksMaxBytes = int64_t{32} << 20;

bool UseColumnChunks(int64_t rows_per_group, int64_t H) {
  return rows_per_group > 0 && rows_per_group < kMinRowsForRowTasks &&
         H >= 2 * kMinColumnsPerChunk;
}

// Column chunks of a row of H: borders on 64-element multiples (vector loads
// stay line-aligned), the last chunk to H. Shape-only (determinism).
struct ColumnChunks {
  int64_t H, count;
  explicit ColumnChunks(int64_t h) : H(h), count(NumTasks(h, kMinColumnsPerChunk, kMaxTasks)) {}
  int64_t begin(int64_t c) const { return c == count ? H : BlockBegin(H / 64, count, c) * 64; }
  int64_t size(int64_t c) const { return begin(c + 1) - begin(c); }
};

// The forward of rows [row_begin, row_end) by column chunks. Phase 1: per
// (row, chunk) a mean and M2 (the sum of squared deviations; two passes
// over the chunk, in cache), merged per row in chunk order (Chan et al.):
// the cancellation-free variance with one pass over memory. RMSNorm sums
// x^2 instead. Phase 2: the output pass per (row, chunk).
template <typename T, typename Ty, typename Tp>
void LayerNormFwdChunked(ffi::ThreadPool* pool, const T* x, const Tp* w, const Tp* b,
                         Ty* y, T* xhat_out, float* mean_out, float* rstd_out,
                         int64_t row_begin, int64_t row_end, int64_t H, float eps,
                         bool centered, bool stream_y) {
  const ColumnChunks cc(H);
  const int64_t rows = row_end - row_begin, units = rows * cc.count;
  std::vector<float> cm(static_cast<size_t>(units)), cq(static_cast<size_t>(units));
  ParallelFor(pool, units, [&](int64_t u) {
    const int64_t i = row_begin + u / cc.count, c = u % cc.count, n = cc.size(c);
    TwoPassMoments(x + i * H + cc.begin(c), n, centered, &cm[u], &cq[u]);
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
    FwdOutput(x + i * H + c0, w + c0, b + c0, y + i * H + c0,
              xhat_out ? xhat_out + i * H + c0 : nullptr, cc.size(u % cc.count), mu[r], rs[r], 0,
              stream_y);
  });
}

// The backward of one parameter group, row by row or column chunk by chunk:
//   xhat = (x - mean) * rstd,  g = dy * w
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
// (mean(g) is dropped when !centered: RMSNorm), dweight += dy * xhat,
// dbias += dy. A first pass over a row computes the two means; the second,
// fused, pass finds the row in cache and writes dx and accumulates
// dweight/dbias. Templated on which outputs are computed, so a masked output
// costs nothing.
// normalized: x already holds xhat (the forward saved it instead of x), there
// is no mean, and rstd (null when dx is not computed) only scales dx.
// xhat_out (optional) receives xhat in T (AscendC's res_for_gamma). dy is
// in Tdy: T, or float32 where the forward's y was, or (float32 x: the
// residual form's float32 h) the 16-bit dtype of its y. dx_dy (optional,
// with dx) receives dx once more, rounded to Tdy: the residual form's
// gradient of a 16-bit x when h is float32, so that no XLA pass widens dy
// before the kernel or rounds dx after it.
template <typename T, typename Tdy, typename Tp, bool kDx, bool kDw, bool kDb>
struct LayerNormBwd {
  const Tdy* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  const Tp* w;  // this group's weight row, float32 or x's dtype
  const T* dh;  // added into dx (the residual form; null: none)
  T* dx;
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
    const Tdy* dyr = dy + i * H + c0;
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

  // The fused pass over columns [c0, c0 + n) of row i; dw, db point at
  // column c0 of the accumulators, which it adds to, or overwrites when
  // kOverwrite (the first row into outputs nobody zeroed). Prefetches the
  // line `ahead` elements on in dy and x (0: none).
  // The residual form's dh (kDh) and second dx (kDxDy) are instantiations
  // of their own (FusedResidual): the plain loop stays as it was.
  template <bool kOverwrite = false, bool kDh = false, bool kDxDy = false>
  void Fused(int64_t i, int64_t c0, int64_t n, float b, float k, float* dw, float* db,
             int64_t ahead) const {
    if constexpr (kDx && !kDh && !kDxDy) {
      if (dh || dx_dy) return FusedResidual<kOverwrite>(i, c0, n, b, k, dw, db, ahead);
    }
    const Tdy* dyr = dy + i * H + c0;
    const T* xr = x + i * H + c0;
    const Tp* wr = w + c0;
    T* dxr = kDx ? dx + i * H + c0 : nullptr;
    [[maybe_unused]] const T* dhr = kDh ? dh + i * H + c0 : nullptr;
    [[maybe_unused]] Tdy* dx2r = kDxDy ? dx_dy + i * H + c0 : nullptr;
    T* xo = xhat_out ? xhat_out + i * H + c0 : nullptr;
    const float mu = Mu(i), rs = Rs(i), xs = Xs(i);
    const bool stream = kDx && StreamRow(stream_dx, dxr);
    [[maybe_unused]] bool stream2 = false;
    if constexpr (kDxDy)
      stream2 = stream && (sizeof(Tdy) == 4 || kStreamNarrowRows) && AlignedAlike(dx2r, dxr);
    ForRowWide(dxr, n, [&](auto tag, int64_t j) {
      if (ahead) PrefetchLine(tag, dyr + ahead + j), PrefetchLine(tag, xr + ahead + j);
      auto d = Ld(tag, dyr + j);
      auto xh = (Ld(tag, xr + j) - mu) * xs;
      if (kDx) {
        auto g = rs * (d * Ld(tag, wr + j)) - b - k * xh;
        if constexpr (kDh) {
          if (ahead) PrefetchLine(tag, dhr + ahead + j);
          g = g + Ld(tag, dhr + j);
        }
        StOut(tag, dxr + j, g, stream);
        if constexpr (kDxDy) StOut(tag, dx2r + j, g, stream2);
      }
      if (kDw) St(tag, dw + j, kOverwrite ? d * xh : Ld(tag, dw + j) + d * xh);
      if (kDb) St(tag, db + j, kOverwrite ? d : Ld(tag, db + j) + d);
      if (xo) St(tag, xo + j, xh);
    });
  }

  // The residual form's loops (dh, and dx in dy's dtype too: kDxDy), each an
  // instantiation of its own. Not inlined into the plain Fused, whose code
  // (and its inlining into Rows) then stays what it was without them.
  template <bool kOverwrite>
  __attribute__((noinline)) void FusedResidual(int64_t i, int64_t c0, int64_t n, float b,
                                               float k, float* dw, float* db,
                                               int64_t ahead) const {
    if (!dx_dy) return Fused<kOverwrite, true, false>(i, c0, n, b, k, dw, db, ahead);
    if (!dh) return Fused<kOverwrite, false, true>(i, c0, n, b, k, dw, db, ahead);
    Fused<kOverwrite, true, true>(i, c0, n, b, k, dw, db, ahead);
  }

  // Rows [row_begin, row_end) whole, into this task's dw/db accumulators.
  void Rows(int64_t row_begin, int64_t row_end, float* dw, float* db) const {
    const bool prefetch_rows = PrefetchNextRow<T>(H);
    for (int64_t i = row_begin; i < row_end; ++i) {
      float b = 0.f, k = 0.f;
      if (kDx) {
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

// Calls fn(std::bool_constant<dx>, <dw>, <db>) with the output mask as types.
template <typename Fn>
void WithMask(bool dx, bool dw, bool db, const Fn& fn) {
  using T_ = std::true_type;
  using F_ = std::false_type;
  switch ((dx ? 4 : 0) + (dw ? 2 : 0) + (db ? 1 : 0)) {
    case 0: return fn(F_{}, F_{}, F_{});
    case 1: return fn(F_{}, F_{}, T_{});
    case 2: return fn(F_{}, T_{}, F_{});
    case 3: return fn(F_{}, T_{}, T_{});
    case 4: return fn(T_{}, F_{}, F_{});
    case 5: return fn(T_{}, F_{}, T_{});
    case 6: return fn(T_{}, T_{}, F_{});
    default: return fn(T_{}, T_{}, T_{});
  }
}

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
    op.template Fused<true>(row_begin, c0, n, b[0], k[0], dwc, dbc, 0);
    for (int64_t r = 1; r < rows; ++r) op.Fused(row_begin + r, c0, n, b[r], k[r], dwc, dbc, 0);
  });
}

// Parameter rows for every group as the kernels read them (Tp, see
// DispatchParams): in place; ones / zeros where absent (exact in every type),
// so the row loops need no branch on presence; or a 16-bit parameter (x's
// storage type T) widened into a float32 copy where DispatchParams chose
// Tp = float for it.
template <typename T, typename Tp>
const Tp* ParamsOrConstant(const ffi::AnyBuffer& p, bool present, int64_t size, float constant,
                           std::vector<Tp>* storage) {
  if (!present) {
    storage->assign(static_cast<size_t>(size), FromFloat<Tp>(constant));
    return storage->data();
  }
  if constexpr (sizeof(T) == 2 && sizeof(Tp) == 4) {
    if (p.element_type() != ffi::DataType::F32) {  // widened: p is in T
      const T* src = reinterpret_cast<const T*>(p.untyped_data());
      storage->resize(static_cast<size_t>(size));
      for (int64_t i = 0; i < size; ++i) (*storage)[i] = ToFloat(src[i]);
      return storage->data();
    }
  }
  // In place when the types agree: a long row's weight is as big as x.
  return reinterpret_cast<const Tp*>(p.untyped_data());
}

// Whether 16-bit parameters are widened into float32 copies before the row
// loops (ParamsOrConstant): where each row of them is short (a float32 row
// within 64 KiB, so it stays in L1/L2) and read by many rows, the copy costs
// little and saves a conversion per vector in every row's passes (in cache,
// bfloat16 512x1024 and 2048x1024 backward: 10-15%). Long rows' parameters
// are read as they are: half the bytes, and a copy would be as big as x
// (bfloat16 forward of 1 x 2^23: 1.91 ms, against 5.98 with float32
// copies made by XLA before the call). At least 32 rows per parameter row
// keep the copies (float32) within 1/16 of a 16-bit x's bytes.
bool WidenParams(int64_t rows_per_group, int64_t H) {
  return rows_per_group >= 32 && H * 4 <= (int64_t{64} << 10);
}

// The parameters' dtype: the present ones' (weight's and bias's must agree),
// float32 or x's; calls fn(Tp{}) with Tp its storage type, or float where
// there are none or `widen` (16-bit ones read from float32 copies).
template <typename T, typename Fn>
ffi::Error DispatchParams(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight, bool has_weight,
                          const ffi::AnyBuffer& bias, bool has_bias, bool widen, Fn&& fn) {
  if (has_weight && has_bias && weight.element_type() != bias.element_type())
    return ffi::Error::InvalidArgument("bias: dtype must match weight's");
  if (!has_weight && !has_bias) return fn(float{});
  const ffi::AnyBuffer& p = has_weight ? weight : bias;
  return DispatchSameOrF32<T>(p.element_type(), x.element_type(), has_weight ? "weight" : "bias",
                              [&](auto ptag) {
                                if constexpr (sizeof(ptag) == 2) {
                                  if (widen) return fn(float{});
                                }
                                return fn(ptag);
                              });
}

// fn(T{}, Ty{}, Tp{}): the forward's storage types of x, y and the parameters.
// y is x's dtype or float32, or any of the three with a float32 x (a float32
// residual stream's norm feeding 16-bit matmuls: y rounded once here, no
// float32 y written for XLA to round).
template <typename Fn>
ffi::Error DispatchFwdTypes(const ffi::AnyBuffer& x, ffi::DataType y_dtype,
                            const ffi::AnyBuffer& weight, bool has_weight,
                            const ffi::AnyBuffer& bias, bool has_bias, bool widen, Fn&& fn) {
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    auto with_y = [&](auto ytag) {
      return DispatchParams<T>(x, weight, has_weight, bias, has_bias, widen,
                               [&](auto ptag) { return fn(tag, ytag, ptag); });
    };
    if constexpr (sizeof(T) == 4) return DispatchFloat(y_dtype, "y", with_y);
    return DispatchSameOrF32<T>(y_dtype, x.element_type(), "y", with_y);
  });
}

// fn(T{}, Tdy{}, Tp{}): the backward's storage types of x, dy and weight.
// dy is x's dtype or float32, or any of the three with a float32 x (the
// residual form's float32 h under a 16-bit y).
template <typename Fn>
ffi::Error DispatchBwdTypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                            const ffi::AnyBuffer& weight, bool has_weight, bool widen, Fn&& fn) {
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    auto with_dy = [&](auto dytag) {
      return DispatchParams<T>(x, weight, has_weight, weight, false, widen,
                               [&](auto ptag) { return fn(tag, dytag, ptag); });
    };
    if constexpr (sizeof(T) == 4) return DispatchFloat(dy.element_type(), "grad_out", with_dy);
    return DispatchSameOrF32<T>(dy.element_type(), x.element_type(), "grad_out", with_dy);
  });
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
  return DispatchSameOrF32<T>(residual.element_type(), x_dtype, "residual", [&](auto rtag) {
    return DispatchSameOrF32<T>(h.element_type(), x_dtype, "h", [&](auto htag) {
      using Tr = decltype(rtag);
      using Th = decltype(htag);
      const Tr* rp = reinterpret_cast<const Tr*>(residual.untyped_data());
      Th* hp = reinterpret_cast<Th*>(h.untyped_data());
      AdviseHugePages(hp, static_cast<int64_t>(h.size_bytes()));
      RowGroupTasks split(M, W, NumTasks(M / W, CeilDiv(kMinElementsPerTask, H), kMaxTasks));
      ParallelFor(pool, split.num_tasks(), [&](int64_t t) {
        const int64_t grp = split.group(t);
        AddLayerNormFwdRows(xp, rp, hp, w + grp * H, b + grp * H, yp, mean_p, rstd_p,
                            split.begin(t), split.end(t), H, eps, centered, stream_y);
      });
      return ffi::Error::Success();
    });
  });
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
  return DispatchFwdTypes(x, y->element_type(), weight, has_weight, bias, has_bias,
                          WidenParams(M / W, H), [&](auto tag, auto ytag, auto ptag) {
    using T = decltype(tag);
    using Ty = decltype(ytag);
    using Tp = decltype(ptag);
    std::vector<Tp> w_ones, b_zeros;
    const Tp* w = ParamsOrConstant<T>(weight, has_weight, W * H, 1.f, &w_ones);
    const Tp* b = ParamsOrConstant<T>(bias, has_bias, W * H, 0.f, &b_zeros);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    Ty* yp = reinterpret_cast<Ty*>(y->untyped_data());
    AdviseHugePages(yp, static_cast<int64_t>(y->size_bytes()));
    const bool stream_y = StreamOutput(static_cast<int64_t>(x.size_bytes() + y->size_bytes()));
    T* xhp = write_xhat ? reinterpret_cast<T*>(xhat->untyped_data()) : nullptr;
    if (has_residual) {
      if constexpr (std::is_same_v<Ty, T>) {
        return AddLayerNormFwd<T, Tp>(pool_p, x.element_type(), xp, residual, *h, w, b, yp, mean_p, rstd_p, M, W, H,
                                      eps, centered, stream_y);
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
                          [&](auto tag, auto dytag, auto ptag) {
    using T = decltype(tag);
    using Tdy = decltype(dytag);
    using Tp = decltype(ptag);
    std::vector<Tp> w_ones;
    const Tp* w = ParamsOrConstant<T>(weight, has_weight, W * H, 1.f, &w_ones);
    const Tdy* dyp = reinterpret_cast<const Tdy*>(dy.untyped_data());
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
    WithMask(compute_dx, dw_out != nullptr, db_out != nullptr, [&](auto kdx, auto kdw, auto kdb) {
      using Op = LayerNormBwd<T, Tdy, Tp, decltype(kdx)::value, decltype(kdw)::value,
                              decltype(kdb)::value>;
      auto op_of = [&](int64_t grp) {
        return Op{dyp, xp, mean_p, rstd_p, w + grp * H, dhp, dxp, dx_dyp, xhp, H, centered,
                  normalized, stream_dx};
      };
      if (column_chunks) {
        for (int64_t grp = 0; grp < W; ++grp)
          ColumnChunkedBwd(pool_p, op_of(grp), grp * rows_per_group, (grp + 1) * rows_per_group,
                           compute_dx, dw_out ? dw_out + grp * H : nullptr,
                           db_out ? db_out + grp * H : nullptr);
        return;
      }
      ParallelFor(pool_p, split.num_tasks(), [&](int64_t t) {
        const int64_t grp = split.group(t);
        float* dw = dw_out ? (use_partials ? dw_part.data() + t * H : dw_out + grp * H) : nullptr;
        float* db = db_out ? (use_partials ? db_part.data() + t * H : db_out + grp * H) : nullptr;
        op_of(grp).Rows(split.begin(t), split.end(t), dw, db);
      });
    });
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
