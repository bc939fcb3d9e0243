// The nanobind module _jax_normgrad: registrations() maps each XLA FFI target
// name to a capsule holding its handler (see jax_normgrad/_ffi.py).
#include <nanobind/nanobind.h>

#include "kernels.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_normgrad, m) {
  m.doc() = "XLA FFI CPU kernels of jax_normgrad.";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_normgrad_layer_norm_fwd"] = EncapsulateFfiHandler(JngLayerNormFwd);
    d["jax_normgrad_layer_norm_bwd"] = EncapsulateFfiHandler(JngLayerNormBwd);
    d["jax_normgrad_group_norm_fwd"] = EncapsulateFfiHandler(JngGroupNormFwd);
    d["jax_normgrad_group_norm_bwd"] = EncapsulateFfiHandler(JngGroupNormBwd);
    return d;
  });
}
