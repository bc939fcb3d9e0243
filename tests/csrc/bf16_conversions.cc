// Checks csrc/simd.h's bfloat16 vector conversions (the build's ISA, set by
// -DJNG_ISA and its -m flags) against the scalar ones in common.h, bit for
// bit: every bfloat16 widened, and every float32 high part with low parts
// around the rounding ties narrowed (the ties, the carries into the exponent
// and out of the top payload bit, and every NaN's quieting). Compiled and run
// by tests/test_kernels.py; prints the mismatches and exits 1 if any.
#include <cstdio>
#include <cstring>

#include "simd.h"

using namespace jax_normgrad::JNG_ISA;

int main() {
  long bad = 0;
  for (uint32_t b = 0; b < 65536; b += kVec) {
    BF16 h[kVec];
    for (int k = 0; k < kVec; ++k) h[k] = BF16{static_cast<uint16_t>(b + k)};
    const VF v = Ld(VecTag{}, h);
    uint32_t got[kVec];
    std::memcpy(got, &v, sizeof(got));
    for (int k = 0; k < kVec; ++k) {
      const float f = ToFloat(h[k]);
      uint32_t want;
      std::memcpy(&want, &f, sizeof(want));
      if (got[k] != want && bad++ < 10) std::printf("widen %04x: %08x, want %08x\n", h[k].bits, got[k], want);
    }
  }
  // The low 16 bits are rounded off: below, at and above the tie, and the
  // extremes (all ones carries through a NaN's whole payload).
  const uint32_t lows[kVec] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
  for (uint32_t high = 0; high < 65536; ++high) {
    uint32_t u[kVec];
    for (int k = 0; k < kVec; ++k) u[k] = (high << 16) | lows[k];
    float f[kVec];
    std::memcpy(f, u, sizeof(f));
    VF v;
    std::memcpy(&v, f, sizeof(v));
    BF16 got[kVec];
    St(VecTag{}, got, v);
    for (int k = 0; k < kVec; ++k) {
      const BF16 want = FromFloat<BF16>(f[k]);
      if (got[k].bits != want.bits && bad++ < 20)
        std::printf("narrow %08x: %04x, want %04x\n", u[k], got[k].bits, want.bits);
    }
  }
  std::printf("%ld mismatches\n", bad);
  return bad ? 1 : 0;
}
