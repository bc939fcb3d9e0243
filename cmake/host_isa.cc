// CMake's probe of the building CPU (JAX_NORMGRAD_ISAS=host, CMakeLists.txt):
// prints the best kernel build it runs, by the checks module.cc selects with.
#include <cstdio>

#include "cpu_isa.h"

int main() {
  const char* best = "generic";
#if defined(__x86_64__) || defined(__i386__)
  if (jax_normgrad::CpuRunsAvx2()) best = "avx2";
#ifdef JNG_COMPILER_HAS_AVX512BF16
  if (jax_normgrad::CpuRunsAvx512bf16()) best = "avx512bf16";
#endif
#endif
  std::printf("%s", best);
  return 0;
}
