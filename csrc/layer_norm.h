// What the LayerNorm forward (layer_norm.cc) and backward (layer_norm_bwd.cc)
// kernels share: the few-long-rows rule and its column chunks, and the
// parameter rows as the kernels read them. Included by both, once per ISA
// build (JNG_ISA), each copy in its translation unit's anonymous namespace.
#ifndef JAX_NORMGRAD_CSRC_LAYER_NORM_H_
#define JAX_NORMGRAD_CSRC_LAYER_NORM_H_

#include <cstdint>
#include <vector>

#include "common.h"
#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {
namespace {

// Few, long rows (fewer than kMinRowsForRowTasks per parameter group, of at
// least 2 * kMinColumnsPerChunk): the kernels split the rows into column
// chunks across the pool, so one row uses every core.
constexpr int64_t kMinRowsForRowTasks = 4;
constexpr int64_t kMinColumnsPerChunk = int64_t{1} << 14;

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

}  // namespace
}  // namespace JNG_ISA
}  // namespace jax_normgrad

#endif  // JAX_NORMGRAD_CSRC_LAYER_NORM_H_
