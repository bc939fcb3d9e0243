#!/usr/bin/env bash
# A lent GPU machine's checks in one call (jax 0.11.2 with CUDA, no package registry), each stage
# under its own time limit and writing its own file in $OUT, so that a stage that fails or runs
# out of time leaves the others' results. From the repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh [--dry-run | --cpu] SECONDS [stage ...]
#     OUT=/some/dir bash benchmarks/gpu_session.sh [--dry-run | --cpu] PLAN
#
# --dry-run prints each stage's command line and time limit, and whether the plan fits its
# seconds, running nothing. --cpu runs every stage here on the CPU at the smoke sizes (--quick,
# --smoke; the test stages only collect): a check of the script and of the stages' arguments.
# JNG_COMMIT: the commit sent (the machine gets the tree without its git directory); it goes
# into env.txt and every JSON. Everything comes back as $OUT/session.tgz, the models' traces as
# $OUT/traces/*.trace.json.gz (the device tool brings back at most 8 files of at most 16 MB).
#
# PLANs: the next calls, each its seconds, stages and settings (the variables below), in the
# order the open GPU issue asks for, from what the H200 runs left open (BENCHMARKS.md): the
# SD-class UNet's GroupNorm kernels (14-25% of the roof, the forward behind XLA's) with and
# without the sample-wide kernels for its groups of 10 channels, and the whole GPU test list on
# the installed package. Device time of a call: its seconds plus about 30-90 s of
# machine start and transfer; a call made within 30 s of the last finds the machine warm.
#   call-1   460 s: install-bg, bench-sd-gn (90) sweep (110: the SD GroupNorm rows, the
#            channels-last tunings: odd groups, also the forward's up to 64 bytes a group,
#            tiles halved) wait-install, tests (200, the whole list).
#            Device command: timeout_s 520, no carry.
#   call-2   290 s: realistic-sd_unet (the fused form, `rewrite`, the fused form with odd
#            groups, bfloat16 and float32). Device command: timeout_s 350, no carry.
# Together about 14 minutes of device time with both starts, 13 with call-2 warm.
#
# Stages, each with its time limit (the limit or what is left of the seconds, whichever is
# less; the last stages of a plan get what the first leave). Recorded durations:
# BENCHMARKS.md and its history.
#   install        pip install --no-build-isolation --no-deps . (the CPU extension too), waited
#                  for (limit 240 s)
#   install-bg     the same in the background, niced; "wait-install" waits for it. Until then the
#                  stages run the sources from a copy on PYTHONPATH (the CPU extension is optional
#                  on a GPU): the Pallas kernels are all Python.
#   selfcheck      python -m jax_normgrad with Triton, then with JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu
#                  ("selfcheck-mosaic": the second only); 90 s each
#   bench          benchmarks/bench_gpu.py, every row (Triton) beside XLA, PyTorch, Liger and
#                  tokamax where they import (after `wheels`); 210 s. The 16 rows with PyTorch
#                  and Liger ran in 90 s on an H100. BENCH_ARGS: more arguments.
#   bench-sd-gn    bench_gpu.py's rows of the SD-class UNet's GroupNorms (NHWC 8x64x64x320,
#                  8x32x32x640, 8x16x16x1280 channels-last, bfloat16 and float32) beside XLA,
#                  PyTorch and Liger, 3 rounds of 6 samples; 90 s (bench_sd_gn.json)
#   bench-peers    bench_gpu.py's LayerNorm and RMSNorm rows (bfloat16 first) with every peer,
#                  tokamax included (run `wheels` first), 3 rounds of 6 samples; 150 s. Each
#                  row is saved as it ends (bench_peers.json).
#   residual       benchmarks/bench_gpu.py --residual (fused residual add, pre-norm stack); 110 s
#   mosaic-bench   bench_gpu.py --only ln (MOSAIC_ONLY: another --only) with --gpu-backend
#                  mosaic_gpu, then with Triton; 80 s each
#   sweep          benchmarks/gpu_sweep.py: the Triton tile heuristics side by side (SWEEP_CONFIGS:
#                  its --configs, SWEEP_ROWS: its --rows, e.g. "add_ln 16384x4096 bfloat16,...");
#                  240 s. call-1: the forward's grid (one row per program, 64 warps per SM) and
#                  the partial sums (one 16K tile, or in XLA) at four LayerNorm / RMSNorm rows and
#                  the small GPU transformer's residual rows; 55 s.
#   mosaic-probe   benchmarks/gpu_mosaic_probe.py (PROBE_ARGS): the Mosaic GPU kernels' lower /
#                  compile / first call / steady time and TB/s per phase, Triton's beside them, a
#                  line per phase as it ends (a stack dump if one hangs); 120 s. call-1: LayerNorm
#                  rows of 1024, 4096 and 16384 bfloat16 with the first kernels' double buffer
#                  (2 stages) against the default plan (8); 75 s.
#   trace          benchmarks/gpu_trace.py (kernel durations per call, compiled modules); 120 s
#   tests          the op suites on the GPU (pytest-xdist), installed package, cut at the deadline;
#                  180 s (call-1: 200; on an H200 the list passed in 147 s, and at 5636ad6 its
#                  TPU-interpreted tests, which skip there now, held it past 180 s)
#   mosaic-tests   the op suites' Default classes with JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu, and
#                  test_mosaic_gpu.py's tests (on a GPU the real kernels: the in-place
#                  forward's refill order, GroupNorm's whole segments, the deeper stages); 100 s
#                  (call-1: 80)
#   wheels         pip install --target /tmp/site .whl/*.whl (benchmarks/gpu_wheels.sh: Liger,
#                  tokamax and its needs, carried as .whl) and /tmp/site on PYTHONPATH for the
#                  stages after it; seconds
#   realistic-M    benchmarks/bench_models.py --model M (sd_unet, gpt2, dit_b: the sizes people
#                  train on one GPU), bfloat16 then float32: flax's layers, the drop-ins with the
#                  kernel forward and XLA's, the fused form, the norms as identity (VARIANTS_M:
#                  its --variants; TRACE_VARIANTS_M: its --trace-variants; REALISTIC_DTYPES:
#                  its --dtypes, default both),
#                  6 interleaved rounds of 4 steps with no profiler, then one trace per dtype with
#                  command buffers on (2 calls of each variant, kernels and idle time; the trace
#                  files in traces/); realistic_M.json / .log, a row saved per dtype. The
#                  steps' compile is most of it: the small models' 4-6 variants compiled in
#                  49-98 s per model and dtype on an H100 (8 threads; now 16, the first variant
#                  alone so that the others find its autotuning); these sizes are not yet timed
#                  on a GPU. 140 s (call-2: 90).
#   models         benchmarks/bench_models.py, the small (launch-bound) models, float32 and
#                  bfloat16, every variant, kernel times from a profile (MODELS_ARGS: more
#                  arguments, e.g. "--model unet --variants fused,fused@gpu_nhwc_split=False": a
#                  tuning as a variant of its own); 260 s
#   models-graphs  `models` with XLA_FLAGS asking for command buffers (CUDA graphs) around every
#                  kind of thunk (models_graphs.json / .log)
#   third-party    examples/third_party_unet.py --size gpu: flaxdiff's UNet, flax / drop-ins with
#                  the kernel forward / with XLA's forward / identities (needs flaxdiff's wheels)
#   forward-tests  tests/test_forward.py, test_layers.py and the drop-in suites on the GPU; 100 s
#   gn-check       benchmarks/gpu_check_group_norm.py: GroupNorm's kernels against XLA at a UNet's
#                  shapes (a quick correctness check before timing); 60 s
# env.txt (nvidia-smi, versions, the commit) is written first. The last lines printed are a
# summary (the device tool returns the end of the output).
set -u
mode=run
case ${1:-} in
  --dry-run) mode=dry; shift ;;
  --cpu) mode=cpu; shift ;;
esac
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"

plan=${1:-540}
[ $# -gt 0 ] && shift
# Each stage's own limit (seconds); a plan sets some lower.
lim_mosaic_tests=100 lim_probe=120 lim_sweep=240 lim_realistic=140 lim_peers=150 lim_gn=90
lim_tests=180
case $plan in
  call-1)
    budget=460
    stages="install-bg bench-sd-gn sweep wait-install tests"
    : "${SWEEP_CONFIGS:=default,nhwc_odd_groups,nhwc_odd_groups_fwd64,nhwc_tiles_half}"
    : "${SWEEP_ROWS:=gn_nhwc 8x320x64x64x32 bfloat16,gn_nhwc 8x640x32x32x32 bfloat16,gn_nhwc 8x1280x16x16x32 bfloat16,gn_nhwc 8x320x64x64x32 float32,gn_nhwc 8x640x32x32x32 float32}"
    lim_sweep=110 lim_tests=200 ;;
  call-2)
    budget=290
    stages="realistic-sd_unet"
    : "${VARIANTS_sd_unet:=fused,rewrite,fused@gpu_nhwc_odd_groups=True}"
    : "${TRACE_VARIANTS_sd_unet:=flax,fused,identity}"
    lim_realistic=280 ;;
  *)
    budget=$plan
    stages=${*:-install selfcheck bench residual tests} ;;
esac
[ "${plan#call-}" != "$plan" ] && [ $# -gt 0 ] && stages="$*"  # a plan's settings, other stages

start=$SECONDS
elapsed=0  # --dry-run: the time the stages before would take at their limits
now() { if [ "$mode" = dry ]; then echo "$elapsed"; else echo $((SECONDS - start)); fi; }
left() { echo $((budget - $(now))); }
cap() { local l=$(( $(left) - ${2:-10} )); echo $(( l < $1 ? (l > 1 ? l : 1) : $1 )); }  # cap N [reserve]
root=$PWD
src=/tmp/jng_src
site_dir=/tmp/site
if [ "$mode" = cpu ]; then
  export JAX_PLATFORMS=cpu
  src=$OUT/.src site_dir=$OUT/.site
fi
if [ "$mode" != dry ]; then rm -rf "$src" && mkdir -p "$src" && cp -r jax_normgrad "$src/"; fi
installed=0
site=""  # $site_dir once the wheels stage has run
srcpath() { local p; [ "$installed" = 1 ] && p="" || p="$src"; echo "$p${site:+${p:+:}$site}"; }
quick() { [ "$mode" = cpu ] && echo "$*"; }  # arguments for --cpu runs only

run() {  # run SECONDS LOG [env options] [VAR=value ...] command ...: under its limit, into $OUT/LOG
  local t=$1 log=$2
  shift 2
  if [ "$mode" = dry ]; then
    printf '%-17s %4s s from %4s s: %s > %s\n' "$stage" "$t" "$elapsed" "$*" "$log"
    elapsed=$((elapsed + t))
    return 0
  fi
  # INT first (Python's KeyboardInterrupt, pytest's summary), KILL 10 s later; timeout signals
  # its whole process group, pytest-xdist's workers too. Rows already measured are on disk.
  timeout -s INT -k 10 "$t" env "$@" >>"$OUT/$log" 2>&1
  echo "$stage rc=$? at $(now) s" >>"$OUT/$log"
}

OP_SUITES="tests/test_layer_norm.py tests/test_rms_norm.py tests/test_group_norm.py
  tests/test_add_norm.py tests/test_layer_norm_grad.py tests/test_layer_norm_options.py
  tests/test_higher_order.py"

if [ "$mode" != dry ]; then
  { [ "$mode" = cpu ] || nvidia-smi
    echo "commit: ${JNG_COMMIT:-unknown (set JNG_COMMIT)}; plan: $plan; stages: $stages"
    python3 -c 'import sys, jax, jaxlib; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
    python3 -m pip list 2>/dev/null | grep -i -E "^(jax|triton|torch|flax|equinox|optax|numpy|nanobind|scikit-build)"; } >"$OUT/env.txt" 2>&1
else
  echo "dry run: plan $plan, $budget s, stages: $stages"
fi

install() {
  CMAKE_BUILD_PARALLEL_LEVEL=${1:-16} timeout 240 nice -n "${2:-0}" python3 -m pip install \
    --no-build-isolation --no-deps . >"$OUT/install.log" 2>&1
  echo "install rc=$? at $(now) s" >>"$OUT/install.log"
}

pytest_run() {  # pytest_run LOG SECONDS [VAR=value ...] -- [pytest arguments ...]
  local log=$1 t=$2 envs=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  [ "$t" -gt 30 ] || [ "$mode" = dry ] || { echo "skipped: $t s left" >"$OUT/$log"; return; }
  local per_test=()  # pytest-timeout, where installed: no test hangs the stage
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
  local how=(-n 12)
  [ "$mode" = cpu ] && how=(--collect-only)
  run "$t" "$log" XLA_PYTHON_CLIENT_PREALLOCATE=false "${envs[@]}" python3 -m pytest -q \
    "${how[@]}" -p no:cacheprovider "${per_test[@]}" -rfE "$@"
}

models_run() {  # models_run LOG SECONDS [VAR=value ...] -- [bench_models.py arguments ...]
  local log=$1 t=$2 envs=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  run "$t" "$log" PYTHONUNBUFFERED=1 PYTHONPATH="$(srcpath)" "${envs[@]}" python3 \
    benchmarks/bench_models.py --compile-threads 16 "$@" $(quick --quick) \
    --trace-dir "$OUT/traces" --out "$OUT/${log%.log}.json"
}

for stage in $stages; do
  case $stage in
    install) [ "$mode" = dry ] && run 240 install.log pip install . || install; installed=1 ;;
    install-bg) [ "$mode" = dry ] && run 0 install.log nice pip install . "&" || {
      (install 12 10) & bgpid=$!; } ;;
    wait-install) [ "$mode" = dry ] && run 0 install.log wait || wait "$bgpid"; installed=1 ;;
    selfcheck|selfcheck-mosaic)
      backends="triton mosaic_gpu"; [ "$stage" = selfcheck ] || backends=mosaic_gpu
      for backend in $backends; do
        # From /tmp: the package on PYTHONPATH (or the installed one), not the checkout's.
        run "$(cap 90)" selfcheck.txt --chdir=/tmp PYTHONPATH="$(srcpath)" \
          JAX_NORMGRAD_GPU_BACKEND=$backend python3 -m jax_normgrad --no-timing --no-progress
      done ;;
    bench)
      run "$(cap 210)" bench.log XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 PYTHONPATH="$(srcpath)" \
        python3 benchmarks/bench_gpu.py --out "$OUT/bench_main.json" ${BENCH_ARGS:-} \
        $(quick --smoke --iters 2 --rounds 1) ;;
    bench-peers)
      run "$(cap $lim_peers 5)" bench_peers.log XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 \
        PYTHONPATH="$(srcpath)" python3 benchmarks/bench_gpu.py --only ln,rms --rounds 3 \
        --iters 18 --out "$OUT/bench_peers.json" $(quick --smoke --iters 2 --rounds 1) ;;
    bench-sd-gn)
      only=${GN_ONLY:-gn_nhwc 8x320x64x64x32,gn_nhwc 8x640x32x32x32,gn_nhwc 8x1280x16x16x32}
      [ "$mode" = cpu ] && only=gn_nhwc  # the smoke rows' channels-last GroupNorm
      run "$(cap $lim_gn 5)" bench_sd_gn.log XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 \
        PYTHONPATH="$(srcpath)" python3 benchmarks/bench_gpu.py --only "$only" --rounds 3 \
        --iters 18 --out "$OUT/bench_sd_gn.json" $(quick --smoke --iters 2 --rounds 1) ;;
    residual)
      run "$(cap 110)" bench.log PYTHONPATH="$(srcpath)" python3 benchmarks/bench_gpu.py \
        --residual --out "$OUT/bench_residual.json" $(quick --smoke --iters 1 --rounds 1) ;;
    mosaic-bench)
      # The LayerNorm rows with each backend, the Triton ones second (the baseline of this run).
      for backend in mosaic_gpu triton; do
        run "$(cap 80 $([ $backend = triton ] && echo 10 || echo 70))" bench.log \
          PYTHONPATH="$(srcpath)" python3 benchmarks/bench_gpu.py --gpu-backend $backend \
          --only "${MOSAIC_ONLY:-ln}" --rounds 3 --iters 30 --out "$OUT/bench_${backend}_ln.json" \
          $(quick --smoke --iters 2 --rounds 1)
      done ;;
    sweep)
      rows=(--rows "${SWEEP_ROWS:-}")
      [ "$mode" = cpu ] && rows=(--smoke --iters 2 --rounds 1)
      run "$(cap $lim_sweep)" sweep.log PYTHONPATH="$(srcpath)" python3 \
        benchmarks/gpu_sweep.py --out "$OUT/sweep.json" \
        --configs "${SWEEP_CONFIGS:-default,partials_old,partials_stages3,pipeline_all,fwd_bpt32,bwd_bpt32,bwd_warps64}" \
        "${rows[@]}" ;;
    mosaic-probe)
      probe_args=${PROBE_ARGS:-}
      [ "$mode" = cpu ] && probe_args="--shapes 8x128 --dtype float32 --impls xla --calls 2"
      run "$(cap $lim_probe)" mosaic_probe.log PYTHONUNBUFFERED=1 PYTHONPATH="$(srcpath)" \
        python3 benchmarks/gpu_mosaic_probe.py $probe_args ;;
    trace)
      run "$(cap 120)" trace.log PYTHONPATH="$(srcpath)" python3 benchmarks/gpu_trace.py \
        --out "$OUT/trace" $(quick --smoke --calls 2) ;;
    tests)
      pytest_run pytest.log "$(cap $lim_tests 20)" -- --junitxml="$OUT/junit.xml" $OP_SUITES \
        tests/test_layers.py tests/test_nonfinite.py tests/test_pallas.py tests/test_mosaic_gpu.py \
        tests/test_dropin_flax.py tests/test_dropin_equinox.py tests/test_validation.py \
        tests/test_validation_family.py tests/test_properties.py tests/test_streaming.py \
        tests/test_kernels.py tests/test_patch.py tests/test_cli.py tests/test_sharding.py \
        tests/test_concurrency.py ;;
    mosaic-tests)
      pytest_run pytest_mosaic.log "$(cap $lim_mosaic_tests 20)" \
        JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu PYTHONPATH="$(srcpath)" -- -k "Default or mosaic" \
        -vv --tb=short --junitxml="$OUT/junit_mosaic.xml" tests/test_pallas.py tests/test_mosaic_gpu.py \
        $OP_SUITES ;;
    wheels)
      if [ "$mode" = dry ]; then
        run 10 wheels.log pip install --target "$site_dir" .whl/*.whl; site=$site_dir
      else
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$site_dir" .whl/*.whl >"$OUT/wheels.log" 2>&1 && site=$site_dir
        echo "wheels rc=$? at $(now) s" >>"$OUT/wheels.log"
      fi ;;
    realistic-*)
      model=${stage#realistic-}
      variants_var=VARIANTS_$model traced_var=TRACE_VARIANTS_$model
      models_run "realistic_$model.log" "$(cap $lim_realistic 5)" -- --model "$model" \
        --dtypes "${REALISTIC_DTYPES:-bfloat16,float32}" --rounds 6 --iters 24 --trace-calls 2 --top-kernels 25 \
        ${!variants_var:+--variants "${!variants_var}"} \
        ${!traced_var:+--trace-variants "${!traced_var}"} ;;
    models|models-graphs)
      # models-graphs: the same under XLA's command buffers (CUDA graphs) for every kind of
      # thunk, the norms' custom calls included: how much of a step's idle time is launches.
      name=${stage/-/_}; flags=${XLA_FLAGS:-}
      graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
      [ "$stage" = models-graphs ] && flags="$flags $graphs --xla_gpu_graph_min_graph_size=2"
      models_run "$name.log" "$(cap 260 20)" XLA_FLAGS="$flags" -- --dtypes float32,bfloat16 --rounds 6 \
        --iters 60 --profile-rounds 1 --top-kernels 30 ${MODELS_ARGS:-} ;;
    third-party)
      run "$(cap 110 10)" third_party.log PYTHONUNBUFFERED=1 PYTHONPATH="$(srcpath)" python3 \
        examples/third_party_unet.py --size gpu --rounds 5 --iters 20 \
        --variants flax,ours_kernel,ours_xla,none ;;
    gn-check)
      run "$(cap 60)" gn_check.log PYTHONPATH="$(srcpath)" python3 \
        benchmarks/gpu_check_group_norm.py $(quick --smoke) ;;
    forward-tests)
      pytest_run pytest_forward.log "$(cap 100 10)" PYTHONPATH="$(srcpath)" -- \
        --junitxml="$OUT/junit_forward.xml" tests/test_forward.py tests/test_layers.py \
        tests/test_dropin_flax.py tests/test_dropin_equinox.py ;;
    *) echo "unknown stage $stage"; [ "$mode" = dry ] && exit 2 ;;
  esac
done

if [ "$mode" = dry ]; then
  echo "planned: $elapsed s of $budget s at the stages' limits"
  [ "$elapsed" -le "$budget" ] || { echo "over budget"; exit 1; }
  exit 0
fi

cd "$root"
echo "===== summary ($(now) s; stages: $stages)"
grep -E "NVIDIA H|Driver|^jax |^commit" "$OUT/env.txt" | head -4
tail -1 "$OUT/install.log" 2>/dev/null
grep -E "FAIL|rc=|^==|rror" "$OUT/selfcheck.txt" 2>/dev/null | head -30
for log in bench.log bench_peers.log bench_sd_gn.log; do
  grep -E "^\||rc=|Error|error|^note|^peers" "$OUT/$log" 2>/dev/null | grep -v "^| ---" | head -40
done
grep -E "^\||rc=|rror" "$OUT/sweep.log" 2>/dev/null | grep -v "^| ---" | head -12
grep -E "^==|rc=|rror" "$OUT/trace.log" 2>/dev/null | head -14
grep -E " fwd: | bwd: |stages|rc=|rror|^Thread|^  File" "$OUT/mosaic_probe.log" 2>/dev/null | head -24
for log in "$OUT"/realistic_*.log "$OUT"/models*.log; do
  [ -f "$log" ] || continue
  grep -E "^(unet|transformer|sd_unet|gpt2|dit_b) |^  [a-z_@=A-Za-z0-9]+ +[0-9.]+ ms|traced:|norms:|rc=|rror" \
    "$log" | cut -c1-160 | head -60
done
grep -E "^flaxdiff|^one training|^  ours|rc=|rror" "$OUT/third_party.log" 2>/dev/null | head -8
tail -14 "$OUT/gn_check.log" 2>/dev/null
tail -1 "$OUT/wheels.log" 2>/dev/null
for log in pytest.log pytest_mosaic.log pytest_forward.log; do
  [ -f "$OUT/$log" ] || continue
  echo "== $log"; grep -E "^(FAILED|ERROR)| (FAILED|ERROR) " "$OUT/$log" | cut -c1-150 | head -25; tail -2 "$OUT/$log"
done
# The device tool brings back at most 8 files of at most 16 MB each: the logs and JSON in one
# archive, the models' traces (one per model and dtype, already compressed) as they are, less any
# over 15 MB.
find "$OUT/traces" -name "*.gz" -size +15M -printf "left out, over 15 MB: %p\n" -delete 2>/dev/null
rm -rf "$OUT/.src" "$OUT/.site"
tar czf /tmp/jng_session.tgz -C "$OUT" --exclude ./traces . \
  && find "$OUT" -mindepth 1 -not -path "$OUT/traces*" -delete \
  && mv /tmp/jng_session.tgz "$OUT/session.tgz"
ls -l "$OUT" "$OUT/traces" 2>/dev/null
