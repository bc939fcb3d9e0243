// The nanobind module _jax_normgrad: registrations() maps each XLA FFI target
// name to a capsule holding its handler (see jax_normgrad/_ffi.py), built for
// the best instruction set this CPU supports.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu_isa.h"
#include "kernels.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The kernel builds this module has, best first, each with whether this CPU
// can run it: "avx512bf16" (AVX2+FMA+F16C with AVX-512 VL/DQ/BF16), "avx2"
// (AVX2+FMA+F16C), "generic" (the baseline ISA). CMake's JAX_NORMGRAD_ISAS
// says which of the first two are built (by default the best one the building
// CPU runs; "all" for a wheel meant for other machines), JAX_NORMGRAD_GENERIC
// whether the last is (always, but in CI's sanitized build).
std::vector<std::pair<std::string, bool>> IsaBuilds() {
  std::vector<std::pair<std::string, bool>> builds;
#ifdef JNG_HAVE_AVX512BF16
  builds.emplace_back("avx512bf16", jax_normgrad::CpuRunsAvx512bf16());
#endif
#ifdef JNG_HAVE_AVX2
  builds.emplace_back("avx2", jax_normgrad::CpuRunsAvx2());
#endif
#ifdef JNG_HAVE_GENERIC
  builds.emplace_back("generic", true);
#endif
  return builds;
}

std::string BuildNames(const std::vector<std::pair<std::string, bool>>& builds) {
  std::string names;
  for (const auto& [name, runs] : builds)
    names += (names.empty() ? "" : ", ") + name + (runs ? "" : " (not on this CPU)");
  return names;
}

// The best build the CPU runs, or the one the environment variable
// JAX_NORMGRAD_ISA names (tests and comparisons). A name this module has no
// build of, or whose build this CPU cannot run, is an error (ValueError at
// import): a comparison must not run other kernels than it asked for. An
// empty value is no request.
std::string SelectedIsa() {
  const auto builds = IsaBuilds();
  const char* forced = std::getenv("JAX_NORMGRAD_ISA");
  if (forced != nullptr && *forced != '\0') {
    const std::string name = forced;
    std::string why = "no such kernel build (avx512bf16, avx2, generic)";
    std::string hint;
    if (name == "avx512bf16" || name == "avx2" || name == "generic") {
      why = "this install has no " + name + " kernels";
      hint = "; a source install builds the generic ones and the best this CPU runs, "
             "JAX_NORMGRAD_ISAS=all in pip install's environment builds them all";
    }
    for (const auto& [build, runs] : builds) {
      if (build != name) continue;
      if (runs) return name;
      why = "this CPU does not run the " + name + " kernels";
      hint = "";
    }
    throw nb::value_error(("JAX_NORMGRAD_ISA=" + name + ": " + why + " (this install has " +
                           BuildNames(builds) + hint +
                           "). Unset it for the best build this CPU runs.")
                              .c_str());
  }
  for (const auto& [name, runs] : builds)
    if (runs) return name;
  return "";  // a build without generic kernels on a CPU that runs none of its builds
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
// CMake's JAX_NORMGRAD_ISAS as this module was built with ("host", "all" or
// names, comma-separated).
#ifndef JNG_ISAS_REQUESTED
#define JNG_ISAS_REQUESTED ""
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
  m.def("isa_builds", &IsaBuilds, "(name, runs on this CPU) of each kernel build, best first.");
  m.def("registrations", []() {
    nb::dict d;
    const std::string isa = SelectedIsa();
#ifdef JNG_HAVE_AVX512BF16
    if (isa == "avx512bf16") {
      JNG_REGISTRATIONS(d, avx512bf16);
      return d;
    }
#endif
#ifdef JNG_HAVE_AVX2
    if (isa == "avx2") {
      JNG_REGISTRATIONS(d, avx2);
      return d;
    }
#endif
#ifdef JNG_HAVE_GENERIC
    JNG_REGISTRATIONS(d, generic);
    return d;
#else
    throw std::runtime_error("this build of the kernels has none this CPU runs (built without "
                             "the generic ones: JAX_NORMGRAD_GENERIC=OFF)");
#endif
  });
  m.attr("sanitizers") = JNG_SANITIZERS;
  m.attr("isas_requested") = JNG_ISAS_REQUESTED;
  // Bytes a kernel moves from which it writes its output by non-temporal
  // stores (common.h); tests size their streamed cases past it.
  m.attr("_stream_min_bytes") = jax_normgrad::generic::kStreamMinBytes;
  DefineIndexHelpers(m);
}
