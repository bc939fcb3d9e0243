// Checks csrc/simd.h's float16 vector conversions of the SSE2 build (no
// F16C: integer vector operations) against the F16C instructions, bit for
// bit: every float16 widened, and every float32 high part with low parts
// around the rounding ties narrowed. Compiled and run by
// tests/test_kernels.py (-DJNG_ISA=generic, without -mf16c); prints the
// mismatches and exits 1 if there are any.
#include <immintrin.h>

#include <cstdio>
#include <cstring>

#include "simd.h"

using namespace jax_normgrad::JNG_ISA;

__attribute__((target("f16c,avx"))) static void WidenF16C(const uint16_t* h, float* f) {
  _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
}
__attribute__((target("f16c,avx"))) static void NarrowF16C(const float* f, uint16_t* h) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h),
                   _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT));
}

int main() {
  long bad = 0;
  for (uint32_t b = 0; b < 65536; b += kVec) {
    uint16_t h[kVec];
    for (int k = 0; k < kVec; ++k) h[k] = static_cast<uint16_t>(b + k);
    uint32_t want[kVec], got[kVec];
    WidenF16C(h, reinterpret_cast<float*>(want));
    const VF v = Ld(VecTag{}, reinterpret_cast<const F16*>(h));
    std::memcpy(got, &v, sizeof(got));
    for (int k = 0; k < kVec; ++k)
      if (got[k] != want[k] && bad++ < 10) std::printf("widen %04x: %08x, want %08x\n", h[k], got[k], want[k]);
  }
  // Low 13 bits are the ones rounded off for normal results; these straddle
  // the ties (0x1000) and the carries, and the subnormal range's ties fall
  // among the high parts' own bits.
  const uint32_t lows[kVec] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff};
  for (uint32_t high = 0; high < (1u << 19); ++high) {
    uint32_t u[kVec];
    for (int k = 0; k < kVec; ++k) u[k] = (high << 13) | lows[k];
    float f[kVec];
    std::memcpy(f, u, sizeof(f));
    uint16_t want[kVec], got[kVec];
    NarrowF16C(f, want);
    VF v;
    std::memcpy(&v, f, sizeof(v));
    St(VecTag{}, reinterpret_cast<F16*>(got), v);
    for (int k = 0; k < kVec; ++k)
      if (got[k] != want[k] && bad++ < 20) std::printf("narrow %08x: %04x, want %04x\n", u[k], got[k], want[k]);
  }
  std::printf("%ld mismatches\n", bad);
  return bad ? 1 : 0;
}
