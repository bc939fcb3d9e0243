#!/usr/bin/env bash
# A GPU session's checks in one call, for the project's lent GPU machine (jax 0.11.2 with CUDA,
# no package registry), each stage under its own time limit and writing its own file in $OUT,
# so that a stage that fails or runs out of time leaves the others' results. From the
# repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh [seconds, default 540] [stage ...]
#
# Stages, in the order given (default: the first session's, "install selfcheck bench residual
# tests"):
#   install        pip install --no-build-isolation --no-deps . (the CPU extension too), waited for
#   install-bg     the same in the background, niced; "wait-install" waits for it. Until then the
#                  stages run the sources from a copy on PYTHONPATH (the CPU extension is optional
#                  on a GPU): the Pallas kernels are all Python.
#   selfcheck      python -m jax_normgrad with Triton, then with JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu
#                  ("selfcheck-mosaic": the second only)
#   bench          benchmarks/bench_gpu.py, every row (Triton)
#   residual       benchmarks/bench_gpu.py --residual
#   mosaic-bench   bench_gpu.py --only ln (MOSAIC_ONLY: another --only) with --gpu-backend
#                  mosaic_gpu, then with Triton
#   sweep          benchmarks/gpu_sweep.py (tile heuristics; SWEEP_CONFIGS: its --configs,
#                  SWEEP_ROWS: its --rows, e.g. "add_ln 16384x4096 bfloat16,...")
#   mosaic-probe   benchmarks/gpu_mosaic_probe.py: the Mosaic GPU kernels' lower / compile / first
#                  call / steady time per phase, Triton's beside them (a stack dump if one hangs)
#   trace          benchmarks/gpu_trace.py (kernel durations per call, compiled modules)
#   tests          the op suites on the GPU (pytest-xdist), installed package, cut at the deadline
#   mosaic-tests   the op suites' Default classes with JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu, and
#                  test_pallas.py's Mosaic GPU tests (on a GPU the real kernels: the in-place
#                  forward's refill order, GroupNorm's whole segments, the deeper stages)
#   wheels         pip install --target /tmp/site .whl/*.whl (Liger-Kernel, flaxdiff: carry .whl)
#                  and /tmp/site on PYTHONPATH for the stages after it
#   models         benchmarks/bench_models.py, both models, float32 and bfloat16, every variant
#                  (kernel and XLA forwards), kernel times from a profile (MODELS_ARGS: more args,
#                  e.g. "--model unet --variants fused,fused@gpu_nhwc_split=False": a tuning as
#                  a variant of its own)
#   models-graphs  the same with XLA_FLAGS asking for command buffers (CUDA graphs) around every
#                  kind of thunk (models_graphs.json / .log)
#   third-party    examples/third_party_unet.py --size gpu: flaxdiff's UNet, flax / drop-ins with
#                  the kernel forward / with XLA's forward / identities (needs wheels)
#   forward-tests  tests/test_forward.py, test_layers.py and the drop-in suites on the GPU
#   gn-check       benchmarks/gpu_check_group_norm.py: GroupNorm's kernels against XLA at a UNet's
#                  shapes (a quick correctness check before timing)
# Each stage's time limit is its own cap or what is left of the budget, whichever is less.
# env.txt (nvidia-smi, versions) is always written first. The last lines printed are a
# summary (the device tool returns the end of the output); at the end every file in $OUT
# goes into $OUT/session.tgz (the device tool brings back at most 8 files).
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
budget=${1:-540}
shift || true
stages=${*:-install selfcheck bench residual tests}
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
cap() { local l=$(( $(left) - ${2:-10} )); echo $(( l < $1 ? (l > 1 ? l : 1) : $1 )); }  # cap N [reserve]
root=$PWD
src=/tmp/jng_src
rm -rf "$src" && mkdir -p "$src" && cp -r jax_normgrad "$src/"
installed=0
site=""  # /tmp/site once the wheels stage has run
srcpath() { local p; [ "$installed" = 1 ] && p="" || p="$src"; echo "$p${site:+${p:+:}$site}"; }

OP_SUITES="tests/test_layer_norm.py tests/test_rms_norm.py tests/test_group_norm.py
  tests/test_add_norm.py tests/test_layer_norm_grad.py tests/test_layer_norm_options.py
  tests/test_higher_order.py"

{ nvidia-smi; python3 -c 'import sys, jax, jaxlib; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
  python3 -m pip list 2>/dev/null | grep -i -E "^(jax|triton|flax|equinox|optax|numpy|nanobind|scikit-build)"; } >"$OUT/env.txt" 2>&1

install() {
  CMAKE_BUILD_PARALLEL_LEVEL=${1:-16} timeout 240 nice -n "${2:-0}" python3 -m pip install \
    --no-build-isolation --no-deps . >"$OUT/install.log" 2>&1
  echo "install rc=$? at $((SECONDS - start)) s" >>"$OUT/install.log"
}

pytest_run() {  # pytest_run LOG SECONDS [VAR=value ...] -- [pytest arguments ...]
  local log=$1 t=$2 envs=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  [ "$t" -gt 30 ] || { echo "skipped: $t s left" >"$OUT/$log"; return; }
  local per_test=()  # pytest-timeout, where installed: no test hangs the stage
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
  env XLA_PYTHON_CLIENT_PREALLOCATE=false "${envs[@]}" timeout -s INT "$t" python3 -m pytest \
    -q -n 12 -p no:cacheprovider "${per_test[@]}" -rfE "$@" >"$OUT/$log" 2>&1
  echo "pytest rc=$? at $((SECONDS - start)) s" >>"$OUT/$log"
}

for stage in $stages; do
  case $stage in
    install) install; installed=1 ;;
    install-bg) (install 12 10) & bgpid=$! ;;
    wait-install) wait "$bgpid"; installed=1 ;;
    selfcheck|selfcheck-mosaic)
      backends="triton mosaic_gpu"; [ "$stage" = selfcheck ] || backends=mosaic_gpu
      for backend in $backends; do
        (cd /tmp && echo "== $backend" && PYTHONPATH=$(srcpath) JAX_NORMGRAD_GPU_BACKEND=$backend \
           timeout "$(cap 90)" python3 -m jax_normgrad --no-timing --no-progress; echo "rc=$?")
      done >>"$OUT/selfcheck.txt" 2>&1 ;;
    bench)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 PYTHONPATH=$(srcpath) timeout "$(cap 210)" python3 \
        benchmarks/bench_gpu.py --out "$OUT/bench_main.json" ${BENCH_ARGS:-} \
        >>"$OUT/bench.log" 2>&1
      echo "bench main rc=$? at $((SECONDS - start)) s" >>"$OUT/bench.log" ;;
    residual)
      PYTHONPATH=$(srcpath) timeout "$(cap 110)" python3 benchmarks/bench_gpu.py --residual \
        --out "$OUT/bench_residual.json" >>"$OUT/bench.log" 2>&1
      echo "bench residual rc=$? at $((SECONDS - start)) s" >>"$OUT/bench.log" ;;
    mosaic-bench)
      # The LayerNorm rows with each backend, the Triton ones second (the baseline of this run).
      PYTHONPATH=$(srcpath) timeout "$(cap 80 70)" python3 benchmarks/bench_gpu.py --gpu-backend \
        mosaic_gpu --only "${MOSAIC_ONLY:-ln}" --rounds 3 --iters 30 --out "$OUT/bench_mosaic.json" \
        >>"$OUT/bench.log" 2>&1
      echo "bench mosaic rc=$? at $((SECONDS - start)) s" >>"$OUT/bench.log"
      PYTHONPATH=$(srcpath) timeout "$(cap 80)" python3 benchmarks/bench_gpu.py --only "${MOSAIC_ONLY:-ln}" --rounds 3 \
        --iters 30 --out "$OUT/bench_triton_ln.json" >>"$OUT/bench.log" 2>&1
      echo "bench triton (ln rows) rc=$? at $((SECONDS - start)) s" >>"$OUT/bench.log" ;;
    sweep)
      PYTHONPATH=$(srcpath) timeout "$(cap 240)" python3 benchmarks/gpu_sweep.py --out "$OUT/sweep.json" \
        --configs "${SWEEP_CONFIGS:-default,partials_old,partials_stages3,pipeline_all,fwd_bpt32,bwd_bpt32,bwd_warps64}" \
        --rows "${SWEEP_ROWS:-}" >"$OUT/sweep.log" 2>&1
      echo "sweep rc=$? at $((SECONDS - start)) s" >>"$OUT/sweep.log" ;;
    mosaic-probe)
      PYTHONUNBUFFERED=1 PYTHONPATH=$(srcpath) timeout "$(cap 120)" python3 \
        benchmarks/gpu_mosaic_probe.py ${PROBE_ARGS:-} >"$OUT/mosaic_probe.log" 2>&1
      echo "mosaic probe rc=$? at $((SECONDS - start)) s" >>"$OUT/mosaic_probe.log" ;;
    trace)
      PYTHONPATH=$(srcpath) timeout "$(cap 120)" python3 benchmarks/gpu_trace.py --out "$OUT/trace" \
        >"$OUT/trace.log" 2>&1
      echo "trace rc=$? at $((SECONDS - start)) s" >>"$OUT/trace.log" ;;
    tests)
      pytest_run pytest.log "$(cap 180 20)" -- --junitxml="$OUT/junit.xml" $OP_SUITES \
        tests/test_layers.py tests/test_nonfinite.py tests/test_pallas.py \
        tests/test_dropin_flax.py tests/test_dropin_equinox.py tests/test_validation.py \
        tests/test_validation_family.py tests/test_properties.py tests/test_streaming.py \
        tests/test_kernels.py tests/test_patch.py tests/test_cli.py tests/test_sharding.py \
        tests/test_concurrency.py ;;
    mosaic-tests)
      pytest_run pytest_mosaic.log "$(cap 100 20)" \
        JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu PYTHONPATH=$(srcpath) -- -k "Default or mosaic" \
        --junitxml="$OUT/junit_mosaic.xml" $OP_SUITES tests/test_pallas.py ;;
    wheels)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 && site=/tmp/site
      echo "wheels rc=$? at $((SECONDS - start)) s" >>"$OUT/wheels.log" ;;
    models|models-graphs)
      # models-graphs: the same under XLA's command buffers (CUDA graphs) for every kind of
      # thunk, the norms' custom calls included: how much of a step's idle time is launches.
      name=${stage/-/_}; flags=${XLA_FLAGS:-}
      graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
      [ "$stage" = models ] || flags="$flags $graphs --xla_gpu_graph_min_graph_size=2"
      XLA_FLAGS="$flags" PYTHONUNBUFFERED=1 PYTHONPATH=$(srcpath) timeout "$(cap 260 20)" \
        python3 benchmarks/bench_models.py --dtypes float32,bfloat16 --rounds 6 --iters 60 \
        --profile-rounds 1 --top-kernels 30 --compile-threads 16 ${MODELS_ARGS:-} \
        --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1
      echo "$stage rc=$? at $((SECONDS - start)) s" >>"$OUT/$name.log" ;;
    third-party)
      PYTHONUNBUFFERED=1 PYTHONPATH=$(srcpath) timeout "$(cap 110 10)" python3 examples/third_party_unet.py \
        --size gpu --rounds 5 --iters 20 --variants flax,ours_kernel,ours_xla,none \
        >"$OUT/third_party.log" 2>&1
      echo "third-party rc=$? at $((SECONDS - start)) s" >>"$OUT/third_party.log" ;;
    gn-check)
      PYTHONPATH=$(srcpath) timeout "$(cap 60)" python3 benchmarks/gpu_check_group_norm.py \
        >"$OUT/gn_check.log" 2>&1
      echo "gn-check rc=$? at $((SECONDS - start)) s" >>"$OUT/gn_check.log" ;;
    forward-tests)
      pytest_run pytest_forward.log "$(cap 100 10)" PYTHONPATH=$(srcpath) -- \
        --junitxml="$OUT/junit_forward.xml" tests/test_forward.py tests/test_layers.py \
        tests/test_dropin_flax.py tests/test_dropin_equinox.py ;;
    *) echo "unknown stage $stage" ;;
  esac
done

cd "$root"
echo "===== summary ($((SECONDS - start)) s; stages: $stages)"
grep -E "NVIDIA H|Driver|^jax " "$OUT/env.txt" | head -3
tail -1 "$OUT/install.log" 2>/dev/null
grep -E "FAIL|rc=|^==|rror" "$OUT/selfcheck.txt" 2>/dev/null | head -30
grep -E "^\||rc=|Error|error" "$OUT/bench.log" 2>/dev/null | grep -v "^| ---" | head -40
grep -E "fused|rc=" "$OUT/bench.log" 2>/dev/null | head -12
grep -E "^\||rc=|rror" "$OUT/sweep.log" 2>/dev/null | grep -v "^| ---" | head -12
grep -E "^==|rc=|rror" "$OUT/trace.log" 2>/dev/null | head -14
grep -E " fwd: | bwd: |rc=|rror|^Thread|^  File" "$OUT/mosaic_probe.log" 2>/dev/null | head -24
for log in models.log models_graphs.log; do
  grep -E "^(unet|pre-norm)|^  [a-z_@=A-Za-z0-9]+ +[0-9.]+ ms|norms:|rc=|rror" "$OUT/$log" 2>/dev/null | head -40
done
grep -E "^flaxdiff|^one training|^  ours|rc=|rror" "$OUT/third_party.log" 2>/dev/null | head -8
cat "$OUT/gn_check.log" 2>/dev/null | tail -14
tail -1 "$OUT/wheels.log" 2>/dev/null
for log in pytest.log pytest_mosaic.log pytest_forward.log; do
  [ -f "$OUT/$log" ] || continue
  echo "== $log"; grep -E "^(FAILED|ERROR)" "$OUT/$log" | cut -c1-150 | head -25; tail -2 "$OUT/$log"
done
# The device tool brings back at most 8 files: the logs and JSON in one archive.
tar czf /tmp/jng_session.tgz -C "$OUT" . && find "$OUT" -type f -delete && mv /tmp/jng_session.tgz "$OUT/session.tgz"
