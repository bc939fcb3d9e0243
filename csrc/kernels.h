// The XLA FFI handlers of jax_normgrad: one symbol per op, defined next to its
// kernel (layer_norm.cc, group_norm.cc) and exported by module.cc.
#ifndef JAX_NORMGRAD_CSRC_KERNELS_H_
#define JAX_NORMGRAD_CSRC_KERNELS_H_

#include "common.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JngLayerNormFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JngLayerNormBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JngGroupNormFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JngGroupNormBwd);

#endif  // JAX_NORMGRAD_CSRC_KERNELS_H_
