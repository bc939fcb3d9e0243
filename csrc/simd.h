// Portable 8-wide float32 vectors (GCC/Clang vector extensions) for the row
// loops: loads convert float32/bfloat16/float16 to float32 in registers and
// stores round back once. Each kernel source is compiled once per ISA (see
// CMakeLists.txt): the same code becomes SSE2 or AVX2+FMA+F16C instructions.
#ifndef JAX_NORMGRAD_CSRC_SIMD_H_
#define JAX_NORMGRAD_CSRC_SIMD_H_

#include <cstdint>
#include <cstring>

#include "common.h"

namespace jax_normgrad {
namespace JNG_ISA {

constexpr int kVec = 8;
typedef float VF __attribute__((vector_size(32)));
typedef uint32_t VU32 __attribute__((vector_size(32)));
typedef int32_t VI32 __attribute__((vector_size(32)));
typedef uint16_t VU16 __attribute__((vector_size(16)));
typedef _Float16 VH __attribute__((vector_size(16)));

// Tags select the vector body or the scalar tail of a row loop; the same
// generic lambda serves both, since float and VF share their operators.
struct VecTag {};
struct ScalarTag {};

inline VF Splat(float s) { return VF{} + s; }

inline VF Ld(VecTag, const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline VF Ld(VecTag, const BF16* p) {
  VU16 h;
  std::memcpy(&h, p, sizeof(h));
  VU32 u = __builtin_convertvector(h, VU32) << 16;
  VF v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
inline VF Ld(VecTag, const F16* p) {
  VH h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, VF);
}
template <typename T>
inline float Ld(ScalarTag, const T* p) {
  return ToFloat(*p);
}

inline void St(VecTag, float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }
inline void St(VecTag, BF16* p, VF v) {
  VU32 u;
  std::memcpy(&u, &v, sizeof(u));
  // Round to nearest even; NaN stays a quiet NaN (as FromFloat<BF16>).
  VI32 is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  VU32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  VU32 nan = (u >> 16) | 0x40u;
  VU32 r = is_nan ? nan : rounded;
  VU16 h = __builtin_convertvector(r, VU16);
  std::memcpy(p, &h, sizeof(h));
}
inline void St(VecTag, F16* p, VF v) {
  VH h = __builtin_convertvector(v, VH);
  std::memcpy(p, &h, sizeof(h));
}
template <typename T>
inline void St(ScalarTag, T* p, float v) {
  *p = FromFloat<T>(v);
}

// A float32 sum with a vector part and a scalar (tail) part, combined in a
// fixed order: deterministic.
struct Acc {
  VF v = VF{};
  float s = 0.f;
  void Add(VF x) { v += x; }
  void Add(float x) { s += x; }
  float Sum() const {
    float t[kVec];
    std::memcpy(t, &v, sizeof(t));
    for (int w = kVec / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) t[k] += t[k + w];
    return t[0] + s;
  }
};

// Calls body(VecTag, j) for j = 0, 8, 16, ... while 8 elements remain, then
// body(ScalarTag, j) for the tail.
template <typename Body>
inline void ForRow(int64_t n, const Body& body) {
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) body(VecTag{}, j);
  for (; j < n; ++j) body(ScalarTag{}, j);
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

#endif  // JAX_NORMGRAD_CSRC_SIMD_H_
