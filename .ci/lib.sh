# Sourced by the CI steps (.ci/*): what they share.

# ci_phase NAME: the step's time so far, printed where its phase NAME ends (set-up: venvs,
# packages, builds; the tests after it), so that each step's log says where its time went.
ci_phase() {
  echo "ci: $(basename "$0"): $1 done at ${SECONDS} s"
}

# requirements LIST...: pyproject.toml's requirement lists, one requirement a
# line. LIST: "dependencies" (the project's), "build-system" (its build's) or the
# name of an extra ("test", "accel-check").
requirements() {
  python3 - "$@" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
for name in sys.argv[1:]:
    print("\n".join(p["project"]["dependencies"] if name == "dependencies"
                    else p["build-system"]["requires"] if name == "build-system"
                    else p["project"]["optional-dependencies"][name]))
PY
}

# version_stage_tests: the pytest arguments of the version stages (.ci/oldest-jax,
# .ci/newest-jax), one a line. Their rule: a test module runs whole where what it
# tests reaches API that differs between jax versions, judged by what the module
# imports and calls:
#   * jax_normgrad/_compat.py's users: the dispatcher (test_dispatch), the GPU target
#     and its abstract devices (test_gpu_target), the partitioning rules and shard_map
#     (test_sharding), the Pallas lowerings and interpreters (test_pallas, test_mosaic_gpu,
#     test_explain_kernels, test_tpu_interpret, test_triton_deprecation; test_add_norm,
#     whose Pallas and Mosaic GPU classes and exports are the residual form's; the four
#     whose cost is a matrix of interpreted kernel cases, test_pallas, test_mosaic_gpu,
#     test_tpu_interpret and test_add_norm, by the fewest of their tests that reach every
#     line of jax_normgrad/ they reach beyond the rest of the stage: .ci/version-tests.txt,
#     made by .ci/select-version-tests from a coverage run), the
#     rewrite's jaxpr reading (test_rewrite, test_rewrite_frameworks,
#     test_rewrite_semantics, test_rewrite_fuzz) and the table of jax internals it reads,
#     probed (test_compat);
#   * jax.export (test_forward, and the modules above);
#   * custom_vjp and the primitives' JVPs under jax's transformations, to any order
#     (test_higher_order), the settings read at trace and lowering time (test_settings);
#   * the FFI calls: registration, attributes and error returns (test_kernels, less its
#     ISA builds' checks: C++ alone, .ci/isa-builds);
#   * the flax and equinox APIs the drop-ins and patch() call (test_dropin_flax,
#     test_dropin_equinox, test_patch; pip picks those libraries' releases per jax).
# The rest, a smoke: each op suite's default (C++ kernel) class, its forward and backward
# ops through this jax's FFI. Not run (the same on any jax; the README's test command runs
# them): the layers under jit and vmap (test_layers: the primitives' own batching rules),
# the op suites' other classes and tests (jnp references, option checks, and their
# interpreted Pallas and Mosaic GPU kernels, whose lowerings and interpreters test_pallas,
# test_tpu_interpret and test_add_norm reach), the C++ kernels alone (test_properties,
# test_streaming, test_nonfinite, test_sizes, test_concurrency, test_malloc), the
# trace-time argument checks (test_validation, test_validation_family), the package's
# files and docs (test_imports, test_docs, test_readme, test_cli, test_notebooks), the
# benchmark tools (test_benchmarks: each stage runs the smoke runs that reach jax's
# internals itself), the vendored flax/equinox suites (test_third_party, pinned to the
# newest releases) and the examples (test_examples: .ci/examples).
stage_tests_whole() {
  printf '%s\n' \
    tests/test_dispatch.py tests/test_gpu_target.py tests/test_sharding.py \
    tests/test_explain_kernels.py tests/test_triton_deprecation.py \
    tests/test_rewrite.py tests/test_rewrite_frameworks.py \
    tests/test_rewrite_semantics.py tests/test_rewrite_fuzz.py tests/test_compat.py \
    tests/test_forward.py tests/test_higher_order.py \
    tests/test_settings.py tests/test_kernels.py \
    tests/test_dropin_flax.py tests/test_dropin_equinox.py tests/test_patch.py \
    tests/test_layer_norm.py::TestLayerNormDefault::test_forward \
    tests/test_layer_norm.py::TestLayerNormDefault::test_backward \
    tests/test_rms_norm.py::TestRmsNormDefault::test_forward \
    tests/test_rms_norm.py::TestRmsNormDefault::test_backward \
    tests/test_group_norm.py::TestGroupNormDefault::test_forward \
    tests/test_group_norm.py::TestGroupNormDefault::test_backward \
    tests/test_layer_norm_grad.py::TestLayerNormGradDefault::test_layer_norm_grad \
    tests/test_layer_norm_options.py::TestLayerNormOptionsDefault::test_save_normalized \
    --deselect=tests/test_kernels.py::test_isa_selection \
    --deselect=tests/test_kernels.py::test_isa_builds_share_only_baseline_code \
    --deselect=tests/test_kernels.py::test_other_isa_builds_are_correct_too \
    --deselect=tests/test_kernels.py::test_generic_isa_float16_conversions_match_f16c \
    --deselect=tests/test_kernels.py::test_bfloat16_vector_conversions_match_scalar \
    --deselect=tests/test_kernels.py::test_16_wide_vector_conversions_match_8_wide \
    --deselect=tests/test_kernels.py::test_avx512bf16_build_computes_the_avx2_builds_bits
}

# The version stages' budget of the rewrite's fuzz (tests/test_rewrite_fuzz.py): its kept
# examples and 10 derandomized cases, which reach the rewrite's jaxpr reading on that jax; the
# README's test command runs its 40.
VERSION_STAGE_FUZZ_EXAMPLES=10

# The benchmark tools' smoke runs that reach jax's internals or its profiler (the Mosaic GPU
# probe's lowering, the traces), which .ci/newest-jax runs with version_stage_tests in one
# pytest run (jax 0.8.1, .ci/oldest-jax's, lacks the API the Mosaic GPU kernels use).
stage_benchmark_tests() {
  printf 'tests/test_benchmarks.py::%s\n' test_gpu_mosaic_probe_runs test_gpu_mosaic_probe_stages \
    test_gpu_mosaic_probe_lowered test_gpu_trace_smoke_run test_trace_steps_splits_one_trace_by_step \
    test_bench_models_tuned_variants_trace_under_their_override
}

# The version stages' arguments: the whole modules above, and the matrix modules' cases.
version_stage_tests() {
  stage_tests_whole
  grep -v '^#' "$(dirname "${BASH_SOURCE[0]}")/version-tests.txt"
}

# The version stages' virtual environments and their packages (not the package itself), made
# by the stages or ahead of them by .ci/prepare-envs, which .ci/run starts in the background
# while the README's test command runs: these steps only download and unpack wheels, and
# would otherwise leave both cores idle. A finished environment is marked (.ci-deps-done) and
# used as it is; an unfinished one is made anew.
CI_DEPS_DONE=.ci-deps-done

# oldest_jax: the oldest supported jax (pyproject.toml's "jax>=").
oldest_jax() {
  python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(re.search(r'"?jax>=([0-9.]+)', " ".join(deps)).group(1))
PY
}

# newest_python: NEWEST_PYTHON, else python3.12 on the PATH, else pyenv's; fails without one.
newest_python() {
  local candidate
  for candidate in "${NEWEST_PYTHON:-}" python3.12 \
      "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/3.12*/bin/python3.12; do
    if [[ -n "$candidate" ]] && "$candidate" -c "import sys; assert sys.version_info >= (3, 12)" \
        2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "no Python >= 3.12 found (set NEWEST_PYTHON)" >&2
  return 1
}

# ci_venv DIR PYTHON REQUIREMENT...: DIR a virtual environment of PYTHON with the requirements
# installed, made anew unless a finished one is there.
ci_venv() {
  local dir=$1 python=$2
  shift 2
  if [[ -f "$dir/$CI_DEPS_DONE" ]]; then
    return 0
  fi
  rm -rf "$dir"
  "$python" -m venv "$dir"
  # --no-compile: Python compiles what the tests import, not all of every package (CPU time
  # taken from the tests running beside this).
  "$dir/bin/python" -m pip install -q --no-compile "$@"
  touch "$dir/$CI_DEPS_DONE"
}

# build_venv: .venv-ci-build, pyproject.toml's build-system.requires (what pip's isolated
# build environment installs: scikit-build-core, nanobind, the oldest jaxlib's FFI headers),
# from which the steps that build the package again (.ci/isa-builds, .ci/sanitize) build it
# without isolation (build_package) instead of pip making that environment anew for each build
# (about 20 s each). The same packages as the README's isolated install, and the same cmake
# and compiler (the PATH's), so the compile commands are its own: .ci/isa-builds still reuses
# its objects.
build_venv() {
  local reqs
  mapfile -t reqs < <(requirements build-system)
  ci_venv .venv-ci-build python3 "${reqs[@]}"
}

# build_package SITE PIP-ARGS...: the package built from .venv-ci-build (made here if it is not
# there yet) and installed into the directory SITE, without its dependencies.
build_package() {
  local site=$1
  shift
  build_venv
  .venv-ci-build/bin/python -m pip install -q --no-deps --no-build-isolation "$@" \
    --target "$site" .
}

# unmet REQUIREMENT...: those of the requirements, and of the extras they name, that the
# active Python's installed distributions do not satisfy, one a line: what a step adds in a
# directory of its own (pip install --target) instead of into a venv another step is using.
unmet() {
  python - "$@" <<'PY'
import sys
from importlib import metadata
from packaging.requirements import Requirement

def unmet(req):
  if req.marker and not req.marker.evaluate({"extra": ""}):
    return []
  try:
    have = metadata.version(req.name)
  except metadata.PackageNotFoundError:
    return [str(req)]
  if not req.specifier.contains(have, prereleases=True):
    return [str(req)]
  out = []
  for e in req.extras:
    for r in metadata.requires(req.name) or []:
      r = Requirement(r)
      if r.marker and r.marker.evaluate({"extra": e}):
        r.marker = None
        out += unmet(r)
  return out

print("\n".join(r for a in sys.argv[1:] for r in unmet(Requirement(a))))
PY
}

# beside_venv SITE REQUIREMENT...: those of the requirements the active venv does not
# satisfy (unmet), installed into the directory SITE (made anew), which goes first on
# PYTHONPATH: what a step adds without changing the venv the steps beside it use (.ci/run).
beside_venv() {
  local site=$1 missing
  shift
  rm -rf "$site" && mkdir -p "$site"
  mapfile -t missing < <(unmet "$@")
  if (( ${#missing[@]} )); then
    pip install -q --no-compile --target "$site" "${missing[@]}"
  fi
  export PYTHONPATH="$PWD/$site"
}

# oldest_venv: .venv-ci-oldest, the test extra resolved against the oldest jax (pip picks the
# flax and equinox releases that accept it), without the package itself.
oldest_venv() {
  local oldest reqs
  oldest=$(oldest_jax)
  mapfile -t reqs < <(requirements dependencies test)
  ci_venv .venv-ci-oldest python3 "${reqs[@]}" "jax==$oldest" "jaxlib==$oldest"
}

# newest_venv: .venv-ci-newest, the newest Python with the package's and the test extra's
# requirements at the newest releases pip finds (the package is built into it by .ci/newest-jax).
newest_venv() {
  local python reqs
  python=$(newest_python)
  mapfile -t reqs < <(requirements dependencies test)
  ci_venv .venv-ci-newest "$python" "${reqs[@]}"
}
