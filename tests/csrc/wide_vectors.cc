// Checks csrc/simd.h's 16-wide loads and rounding stores (JNG_WIDE_VECTORS,
// the avx512bf16 build) against the 8-wide ones, bit for bit, for bfloat16
// and float16: every 16-bit value widened, and every float32 high part with
// low parts around the rounding ties narrowed (with subnormals, which send a
// bfloat16 vector to its exact fallback, beside normal values in the same
// vector). The 8-wide forms are checked against the scalar ones by
// bf16_conversions.cc and f16_conversions.cc. Compiled and run by
// tests/test_kernels.py; prints the mismatches and exits 1 if any.
#include <cstdio>
#include <cstring>

#include "simd.h"

using namespace jax_normgrad::JNG_ISA;

#if !defined(JNG_WIDE_VECTORS)
int main() {
  std::printf("this build has no 16-wide vectors\n");
  return 1;
}
#else
template <typename T>
long Check(const char* name) {
  long bad = 0;
  for (uint32_t b = 0; b < 65536; b += kWideVec) {
    T h[kWideVec];
    for (int k = 0; k < kWideVec; ++k) h[k] = T{static_cast<uint16_t>(b + k)};
    const VW wide = Ld(WideTagL<0>{}, h);
    const VF lo = Ld(VecTag{}, h), hi = Ld(VecTag{}, h + kVec);
    if (std::memcmp(&wide, &lo, sizeof(lo)) != 0 ||
        std::memcmp(reinterpret_cast<const char*>(&wide) + sizeof(lo), &hi, sizeof(hi)) != 0) {
      if (bad++ < 10) std::printf("%s widen %04x..: differs\n", name, b);
    }
  }
  // Two high parts per vector (one of them possibly subnormal or zero, the
  // other not), each with eight low parts: below, at and above the tie.
  const uint32_t lows[kVec] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
  for (uint32_t high = 0; high < 65536; ++high) {
    const uint32_t other = (high * 40503u + 0x3f80u) & 0xffffu;
    uint32_t u[kWideVec];
    for (int k = 0; k < kVec; ++k) {
      u[k] = (high << 16) | lows[k];
      u[kVec + k] = (other << 16) | lows[k];
    }
    VW v;
    std::memcpy(&v, u, sizeof(v));
    VF lo, hi;
    std::memcpy(&lo, u, sizeof(lo));
    std::memcpy(&hi, u + kVec, sizeof(hi));
    T got[kWideVec], want[kWideVec];
    St(WideTagL<0>{}, got, v);
    St(VecTag{}, want, lo);
    St(VecTag{}, want + kVec, hi);
    for (int k = 0; k < kWideVec; ++k) {
      if (got[k].bits != want[k].bits && bad++ < 20)
        std::printf("%s narrow %08x: %04x, want %04x\n", name, u[k], got[k].bits, want[k].bits);
    }
  }
  return bad;
}

int main() {
  const long bad = Check<BF16>("bfloat16") + Check<F16>("float16");
  std::printf("%ld mismatches\n", bad);
  return bad ? 1 : 0;
}
#endif
