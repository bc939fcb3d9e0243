// The XLA FFI handlers of jax_normgrad: one symbol per op and instruction set,
// defined next to its kernel (layer_norm.cc, layer_norm_bwd.cc, group_norm.cc),
// which CMake compiles once per ISA; module.cc exports the best set the CPU
// supports.
#ifndef JAX_NORMGRAD_CSRC_KERNELS_H_
#define JAX_NORMGRAD_CSRC_KERNELS_H_

#include "common.h"

#define JNG_DECLARE_HANDLERS(isa)                              \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JngLayerNormFwd_##isa);       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JngLayerNormBwd_##isa);       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JngGroupNormFwd_##isa);       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JngGroupNormApply_##isa);     \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JngGroupNormBwd_##isa)

#ifdef JNG_HAVE_GENERIC
JNG_DECLARE_HANDLERS(generic);
#endif
#ifdef JNG_HAVE_AVX2
JNG_DECLARE_HANDLERS(avx2);
#endif
#ifdef JNG_HAVE_AVX512BF16
JNG_DECLARE_HANDLERS(avx512bf16);
#endif

#endif  // JAX_NORMGRAD_CSRC_KERNELS_H_
