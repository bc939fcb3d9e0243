// The nanobind module _jax_normgrad: registrations() maps each XLA FFI target
// name to a capsule holding its handler (see jax_normgrad/_ffi.py), built for
// the best instruction set this CPU supports.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

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
    d["jax_normgrad_group_norm_apply"] = EncapsulateFfiHandler(JngGroupNormApply_##isa);   \
    d["jax_normgrad_group_norm_bwd"] = EncapsulateFfiHandler(JngGroupNormBwd_##isa);       \
  } while (0)

// The sanitizers the module was built with (CMake JAX_NORMGRAD_SANITIZE sets
// it), so CI can assert that it imported the sanitized build.
#ifndef JNG_SANITIZERS
#define JNG_SANITIZERS ""
#endif

void Require(bool ok, const char* what) {
  if (!ok) throw nb::value_error(what);
}

// Test-only bindings of the pure index helpers of common.h: tests check the
// 64-bit index arithmetic at sizes beyond 2^31 without allocating a tensor.
// The preconditions the kernels guarantee are checked here, so a bad test
// argument raises instead of dividing by zero.
void DefineIndexHelpers(nb::module_& m) {
  using namespace jax_normgrad::generic;  // the baseline copy of common.h
  m.def("_ceil_div", [](int64_t a, int64_t b) {
    Require(a >= 0 && b > 0, "_ceil_div: expected a >= 0, b > 0");
    return CeilDiv(a, b);
  });
  m.def("_num_tasks", [](int64_t n, int64_t min_per_task, int64_t max_tasks) {
    Require(max_tasks > 0, "_num_tasks: expected max_tasks > 0");
    return NumTasks(n, min_per_task, max_tasks);
  });
  m.def("_block_begin", [](int64_t n, int64_t num_tasks, int64_t i) {
    Require(n >= 0 && num_tasks > 0 && i >= 0 && i <= num_tasks,
            "_block_begin: expected n >= 0, num_tasks > 0, 0 <= i <= num_tasks");
    return BlockBegin(n, num_tasks, i);
  });
  m.def("_row_group_task", [](int64_t rows, int64_t groups, int64_t per_group, int64_t t) {
    Require(rows >= 0 && groups > 0 && rows % groups == 0 && per_group > 0,
            "_row_group_task: expected groups > 0 dividing rows >= 0, per_group > 0");
    RowGroupTasks split(rows, groups, per_group);
    Require(t >= 0 && t < split.num_tasks(), "_row_group_task: expected 0 <= t < num_tasks");
    return std::make_tuple(split.group(t), split.begin(t), split.end(t));
  });
}

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
  m.attr("sanitizers") = JNG_SANITIZERS;
  // Bytes a kernel moves from which it writes its output by non-temporal
  // stores (common.h); tests size their streamed cases past it.
  m.attr("_stream_min_bytes") = jax_normgrad::generic::kStreamMinBytes;
  DefineIndexHelpers(m);
}
