// The nanobind module _jax_normgrad: registrations() maps each XLA FFI target
// name to a capsule holding its handler (see jax_normgrad/_ffi.py), built for
// the best instruction set this CPU supports.
#include <cstdlib>
#include <cstring>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "kernels.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// "avx2" where the CPU has AVX2, FMA and F16C and the module was built with
// that variant; "generic" (the baseline ISA) otherwise, or when the
// environment variable JAX_NORMGRAD_ISA=generic asks for it (tests).
std::string SelectedIsa() {
#ifdef JNG_HAVE_AVX2
  const char* forced = std::getenv("JAX_NORMGRAD_ISA");
  if (forced && std::strcmp(forced, "generic") == 0) return "generic";
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return "avx2";
#endif
  return "generic";
}

#define JNG_REGISTRATIONS(d, isa)                                                          \
  do {                                                                                     \
    d["jax_normgrad_layer_norm_fwd"] = EncapsulateFfiHandler(JngLayerNormFwd_##isa);       \
    d["jax_normgrad_layer_norm_bwd"] = EncapsulateFfiHandler(JngLayerNormBwd_##isa);       \
    d["jax_normgrad_group_norm_fwd"] = EncapsulateFfiHandler(JngGroupNormFwd_##isa);       \
    d["jax_normgrad_group_norm_bwd"] = EncapsulateFfiHandler(JngGroupNormBwd_##isa);       \
  } while (0)

}  // namespace

NB_MODULE(_jax_normgrad, m) {
  m.doc() = "XLA FFI CPU kernels of jax_normgrad.";
  m.def("isa", &SelectedIsa, "The instruction set of the kernels registrations() returns.");
  m.def("registrations", []() {
    nb::dict d;
#ifdef JNG_HAVE_AVX2
    if (SelectedIsa() == "avx2") {
      JNG_REGISTRATIONS(d, avx2);
      return d;
    }
#endif
    JNG_REGISTRATIONS(d, generic);
    return d;
  });
}
