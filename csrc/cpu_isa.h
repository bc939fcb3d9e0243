// Whether this CPU runs each kernel build's instruction set (GCC/Clang's
// __builtin_cpu_supports): module.cc registers the best build the CPU runs at
// import, and CMake's host probe (cmake/host_isa.cc) compiles for the best one
// the CPU that builds runs, so the two never disagree.
#ifndef JAX_NORMGRAD_CSRC_CPU_ISA_H_
#define JAX_NORMGRAD_CSRC_CPU_ISA_H_

#if defined(__x86_64__) || defined(__i386__)
namespace jax_normgrad {

// The "avx2" build: AVX2, FMA and F16C.
inline bool CpuRunsAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

// The "avx512bf16" build: the AVX2 one's with AVX-512 F, VL, DQ and BF16. Only
// where the compiler knows AVX-512 BF16 (CMake's JNG_COMPILER_HAS_AVX512BF16).
#ifdef JNG_COMPILER_HAS_AVX512BF16
inline bool CpuRunsAvx512bf16() {
  return CpuRunsAvx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}
#endif

}  // namespace jax_normgrad
#endif  // x86

#endif  // JAX_NORMGRAD_CSRC_CPU_ISA_H_
