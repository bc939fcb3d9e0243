// The activations GroupNorm fuses into its output pass (forward) and its
// first pass (backward), and their derivatives: the formulas of
// jax_normgrad/_activations.py, generic over a float, an 8-wide VF and (in
// the avx512bf16 build) a 16-wide VW, by the same operations on every width,
// so an element's value does not depend on the loop's vector width (see
// ForRowWide).
#ifndef JAX_NORMGRAD_CSRC_ACTIVATION_H_
#define JAX_NORMGRAD_CSRC_ACTIVATION_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace jax_normgrad {
namespace JNG_ISA {

// Codes of the `activation` attribute; the Python side maps names to these
// (jax_normgrad/_ffi.py ACTIVATION_CODES).
enum Activation : int64_t { kIdentity = 0, kSilu = 1, kGelu = 2, kRelu = 3 };

template <typename V>
inline V Bcast(float s) {
  return V{} + s;
}
template <typename V>
inline V Max(V a, V b) {
  return a > b ? a : b;
}
template <typename V>
inline V Min(V a, V b) {
  return a < b ? a : b;
}

// 2^n for integer-valued n in [-126, 127], by building the exponent field.
inline float Pow2(float n) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline VF Pow2(VF n) {
  return AsFloat((VU32)((__builtin_convertvector(n, VI32) + 127) << 23));
}
#if defined(JNG_WIDE_VECTORS)
typedef int32_t VWI32 __attribute__((vector_size(64)));
inline VW Pow2(VW n) {
  VW f;
  const VWI32 bits = (__builtin_convertvector(n, VWI32) + 127) << 23;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
#endif

// exp(x), about 2 ulp over the clamped range [-87, 88] (Cephes' expf
// polynomial): n = round(x / ln 2) by the 1.5 * 2^23 trick (no
// float-to-int rounding mode involved), r = x - n ln 2 in two parts,
// exp(r) by a degree-6 polynomial, times 2^n.
template <typename V>
inline V Exp(V x) {
  x = Min(Max(x, Bcast<V>(-87.0f)), Bcast<V>(88.0f));
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  const V n = (x * 1.44269504088896341f + kMagic) - kMagic;
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = Bcast<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * (r * r) + r + 1.0f) * Pow2(n);
}

template <typename V>
inline V Sigmoid(V z) {
  return 1.0f / (Exp(-z) + 1.0f);
}

// tanh-approximate gelu = 0.5 z (1 + tanh(u)) = z sigmoid(2u),
// u = sqrt(2/pi) (z + 0.044715 z^3).
constexpr float kGeluC2 = 2.0f * 0.7978845608028654f;  // 2 sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

// act(z) for activation A (kIdentity: z).
template <int64_t A, typename V>
inline V Act(V z) {
  if constexpr (A == kSilu) {
    return z * Sigmoid(z);
  } else if constexpr (A == kGelu) {
    return z * Sigmoid(z * ((z * z) * (kGeluC2 * kGeluA) + kGeluC2));
  } else if constexpr (A == kRelu) {
    return z < Bcast<V>(0.0f) ? Bcast<V>(0.0f) : z;  // NaN stays NaN, as jnp.maximum
  } else {
    return z;
  }
}

// d act(z) / dz for activation A (kIdentity: 1).
template <int64_t A, typename V>
inline V ActGrad(V z) {
  if constexpr (A == kSilu) {
    const V s = Sigmoid(z);
    return s * (z * (1.0f - s) + 1.0f);
  } else if constexpr (A == kGelu) {
    const V z2 = z * z;
    const V s = Sigmoid(z * (z2 * (kGeluC2 * kGeluA) + kGeluC2));
    // d/dz z s(2u) = s + z s (1 - s) 2u',  2u' = 2 sqrt(2/pi) (1 + 3 a z^2)
    return s + z * s * (1.0f - s) * (z2 * (3.0f * kGeluC2 * kGeluA) + kGeluC2);
  } else if constexpr (A == kRelu) {
    return z > Bcast<V>(0.0f) ? Bcast<V>(1.0f) : Bcast<V>(0.0f);
  } else {
    return Bcast<V>(1.0f);
  }
}

// fn(std::integral_constant<int64_t, A>{}) for the activation code `a`.
template <typename Fn>
ffi::Error DispatchActivation(int64_t a, const Fn& fn) {
  switch (a) {
    case kIdentity:
      return fn(std::integral_constant<int64_t, kIdentity>{});
    case kSilu:
      return fn(std::integral_constant<int64_t, kSilu>{});
    case kGelu:
      return fn(std::integral_constant<int64_t, kGelu>{});
    case kRelu:
      return fn(std::integral_constant<int64_t, kRelu>{});
    default:
      return ffi::Error::InvalidArgument(
          "activation: expected 0 (none), 1 (silu), 2 (gelu) or 3 (relu)");
  }
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

#endif  // JAX_NORMGRAD_CSRC_ACTIVATION_H_
