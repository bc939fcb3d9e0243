"""The benchmarks' heavier workloads and profile parsing, beside the scripts that use them.

The fused residual form's comparisons (``add_layer_norm`` / ``add_rms_norm`` against the
unfused pair and XLA, and a pre-norm MLP stack's training step), the ``jax.profiler``
trace parsing (op and kernel times of a compiled step; several steps in one trace), the
one way the benchmarks change the kernels' tuning (:func:`tuning`) and what a run records
of itself (:func:`run_info`: device, GPU backend, versions, commit). The package keeps what
its command line needs (``jax_normgrad._bench``: the timing loop, the op workloads, the
versions); these are for ``bench_cpu.py``, ``bench_gpu.py``, ``bench_models.py``,
``gpu_sweep.py``, ``gpu_trace.py`` and ``gpu_mosaic_probe.py``, which import this module as
their sibling.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import glob
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _bench
from jax_normgrad._bench import call_times_ms, jnp_layer_norm, jnp_rms_norm


# ----------------------------------------------------------------------------
# The kernels' tuning, and what a run records of itself.


@contextlib.contextmanager
def tuning(**changes):
  """The package's kernel tuning with ``changes`` in force while the block traces and lowers.

  The one place the benchmarks change a tuning (``bench_models``' ``base@key=value``
  variants, ``gpu_sweep``'s configurations, ``gpu_mosaic_probe``'s stages):
  ``jax_normgrad.pallas.config.override`` (keys: ``config.KEYS``), whose changes the ops
  traced inside the block carry into their lowering.
  """
  from jax_normgrad.pallas import config  # pylint: disable=g-import-not-at-top
  with config.override(**changes):
    yield


def commit() -> str | None:
  """The commit measured: ``JNG_COMMIT`` where set (the GPU machine gets the tree without its
  git directory), else git's HEAD here, ``-dirty`` with uncommitted changes; None if neither."""
  if os.environ.get("JNG_COMMIT"):
    return os.environ["JNG_COMMIT"]
  git = ["git", "-C", str(pathlib.Path(__file__).resolve().parent)]
  try:
    head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, timeout=20)
    if head.returncode:
      return None
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head.stdout.strip() + ("-dirty" if dirty else "")


def gpu_backend() -> str | None:
  """The Pallas GPU backend the package's kernels lower to on this machine; None off a GPU."""
  if jax.default_backend() != "gpu":
    return None
  from jax_normgrad import _explain  # pylint: disable=g-import-not-at-top
  return _explain.default_choices()["jax_normgrad_layer_norm_fwd"].implementation


def run_info() -> dict:
  """What a benchmark's JSON says of its run: the date, device, GPU backend, commit, command
  line and versions (``_bench.versions``: jax, jaxlib, the package, ...)."""
  dev = jax.devices()[0]
  return {"date": datetime.date.today().isoformat(),
          "device": f"{dev.platform}: {getattr(dev, 'device_kind', '?')}",
          "gpu_backend": gpu_backend(), "commit": commit(), "command": " ".join(sys.argv),
          **_bench.versions()}


def custom_calls(lowered_text: str) -> int:
  """How many of this package's kernel calls a step's lowered text holds: the CPU custom calls
  (``@jax_normgrad_...``) and, on a GPU or TPU, the Pallas kernels' calls, which name them."""
  return sum(1 for line in lowered_text.splitlines()
             if "custom_call" in line and "jax_normgrad_" in line)


def kernel_targets(lowered_text: str) -> dict[str, int]:
  """The custom-call targets of this package's kernel calls in a lowered module, counted: the
  CPU kernels' own names; on a GPU the Pallas calls' (Triton's or Mosaic GPU's)."""
  found = collections.Counter()
  for line in lowered_text.splitlines():
    if "custom_call" in line and "jax_normgrad_" in line:
      m = re.search(r"custom_call @([\w$.\-]+)|custom_call_target=\"([^\"]+)\"", line)
      found[next(g for g in m.groups() if g) if m else "?"] += 1
  return dict(found)


# ----------------------------------------------------------------------------
# The residual form (add_layer_norm / add_rms_norm): benchmarks/bench_cpu.py and bench_gpu.py
# --residual.


def residual_variants(kind, dtype, residual_dtype=None):
  """Forward + backward of a pre-norm block's residual add and norm, three ways: ``{name: fn}``.

  Each ``fn(x, r, w, b, dy, dh)`` returns y, h and the gradients of x, r
  and the parameters for the cotangents ``dy`` (of y) and ``dh`` (of h,
  from the next block): ``fused`` is :func:`jax_normgrad.add_layer_norm` /
  ``add_rms_norm``; ``unfused`` is this package's ``layer_norm(x +
  residual)`` (the add and the backward's ``dx + dh`` as XLA passes around
  the kernels); ``xla`` is XLA's autodiff of the jnp code (float32 math,
  as _bench's jnp layers). ``residual_dtype`` float32 with a 16-bit
  ``dtype`` (flash-attn's ``residual_in_fp32``): the residual and h are
  float32; the unfused forms add in float32 and the norm's y is rounded
  to ``dtype`` (by the kernel: ``out_dtype``; by XLA in the jnp form).
  """
  centered = kind == "ln"
  stream = jnp.dtype(residual_dtype or dtype)
  fused = (lambda x, r, w, b: jn.add_layer_norm(x, r, w, b, residual_dtype=residual_dtype)) if (
      centered) else (lambda x, r, w, b: jn.add_rms_norm(x, r, w, residual_dtype=residual_dtype))

  def unfused(x, r, w, b):
    h = x.astype(stream) + r
    # out_dtype: the kernel rounds y to x's dtype itself (a float32 stream's norm).
    return (jn.layer_norm(h, w, b, out_dtype=dtype) if centered
            else jn.rms_norm(h, w, out_dtype=dtype)), h

  def xla(x, r, w, b):
    h = x.astype(stream) + r
    return (jnp_layer_norm(h, w, b) if centered else jnp_rms_norm(h, w)).astype(dtype), h

  def step(f):
    def run(x, r, w, b, dy, dh):
      out, vjp = jax.vjp(f, x, r, w, b)
      return out, vjp((dy, dh))
    return jax.jit(run)

  return {name: step(f) for name, f in (("fused", fused), ("unfused", unfused), ("xla", xla))}


def residual_inputs(shape, dtype, residual_dtype=None):
  """The residual rows' operands ``(x, r, w, b, dy, dh)``: x and dy in ``dtype``; the residual,
  h's cotangent and the parameters in the stream's dtype (``residual_dtype``, None: ``dtype``)."""
  stream = jnp.dtype(residual_dtype or dtype)
  k = jax.random.split(jax.random.key(0), 6)
  x, r, dy, dh = (jax.random.normal(ki, shape, jnp.float32).astype(d)
                  for ki, d in zip(k[:4], (dtype, stream, dtype, stream)))
  w = (1 + 0.1 * jax.random.normal(k[4], shape[-1:], jnp.float32)).astype(stream)
  b = (0.1 * jax.random.normal(k[5], shape[-1:], jnp.float32)).astype(stream)
  return x, r, w, b, dy, dh


def measure_residual(kind, shape, dtype, iters, rounds=3, settle_s=0.0, batch_ms=0.0,
                     residual_dtype=None):
  """One residual row: each variant's median over interleaved rounds, and the ratios to fused.

  ``batch_ms``: passed to :func:`call_times_ms` (the GPU benchmark times calls back to back).
  ``residual_dtype``: the residual stream's dtype (:func:`residual_variants`;
  the residual, h's cotangent and the parameters are then in it).
  """
  rows_, hidden = shape
  stream = jnp.dtype(residual_dtype or dtype)
  x, r, w, b, dy, dh = residual_inputs(shape, dtype, residual_dtype)
  variants = residual_variants(kind, dtype, residual_dtype)
  per_round = max(1, -(-iters // rounds))
  samples = {name: [] for name in variants}
  for rnd in range(rounds):
    for name, fn in variants.items():
      time.sleep(settle_s)
      samples[name] += call_times_ms(fn, x, r, w, b, dy, dh, warmup=3 if rnd == 0 else 1,
                                     iters=per_round, batch_ms=batch_ms)
  row = {"workload": f"add_{'layer' if kind == 'ln' else 'rms'}_norm {rows_}x{hidden} "
                     f"{jnp.dtype(dtype).name}"
                     + (f", {stream.name} residual stream" if stream != dtype else ""),
         "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "residual_dtype": stream.name, "rounds": rounds}
  for name, times in samples.items():
    row[f"{name}_ms"] = float(np.median(times))
  row["unfused_vs_fused"] = row["unfused_ms"] / row["fused_ms"]
  row["xla_vs_fused"] = row["xla_ms"] / row["fused_ms"]
  return row


STACK_VARIANTS = ("fused", "unfused", "xla")
# The stack's benchmark rows: (dtype, residual stream dtype; None: dtype's). bfloat16 with a
# float32 stream is flash-attn's residual_in_fp32.
STACK_ROWS = ((jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.float32))


def mlp_stack_step(variant, layers, hidden, ffn, dtype, tokens=4096, residual_dtype=None):
  """A pre-norm stack of MLP blocks (RMSNorm, dense, gelu, dense, residual add): its jitted SGD step.

  ``variant`` (STACK_VARIANTS): "fused", each block's residual add and the
  next norm one :func:`jax_normgrad.add_rms_norm`; "unfused", ``h = h +
  out`` then :func:`jax_normgrad.rms_norm` (this package's kernels either
  way); "xla", ``h = h + out`` then the jnp RMSNorm (XLA's autodiff).
  ``residual_dtype``: the residual stream's dtype (None: ``dtype``;
  float32 with a 16-bit ``dtype`` is flash-attn's ``residual_in_fp32``:
  the unfused forms add in float32 and the norm writes y in ``dtype`` for
  the next dense, ``out_dtype``).
  Returns ``(step, params, batch)``; ``step(params, batch)`` is the jitted
  ``value_and_grad`` of the mean-square loss of the last norm's output
  plus the SGD update of the parameters.
  """
  if variant not in STACK_VARIANTS:
    raise ValueError(f"variant: expected one of {STACK_VARIANTS}, got {variant!r}")
  stream = jnp.dtype(residual_dtype or dtype)
  k = jax.random.split(jax.random.key(0), 2 * layers + 1)
  params = {"norm": [jnp.ones((hidden,), jnp.float32) for _ in range(layers + 1)],
            "w1": [(jax.random.normal(k[2 * i], (hidden, ffn), jnp.float32) / hidden ** 0.5)
                   for i in range(layers)],
            "w2": [(jax.random.normal(k[2 * i + 1], (ffn, hidden), jnp.float32) / ffn ** 0.5)
                   for i in range(layers)]}

  def norm(h, w):
    if variant == "xla":
      return jnp_rms_norm(h, w).astype(dtype)
    return jn.rms_norm(h, w, out_dtype=dtype)  # y rounded to the matmuls' dtype by the kernel

  def loss(params, x):
    h = x.astype(stream)
    y = norm(h, params["norm"][0].astype(stream))
    for i in range(layers):
      out = jax.nn.gelu(y @ params["w1"][i].astype(dtype)) @ params["w2"][i].astype(dtype)
      if variant == "fused":
        y, h = jn.add_rms_norm(out, h, params["norm"][i + 1].astype(dtype),
                               residual_dtype=residual_dtype)
      else:
        h = h + out.astype(stream)
        y = norm(h, params["norm"][i + 1].astype(stream))
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  @jax.jit
  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

  return step, params, jax.random.normal(k[-1], (tokens, hidden), jnp.float32).astype(dtype)


def op_names(hlo_text: str) -> tuple[set[str], set[str]]:
  """``(every instruction, the matmuls)`` of a compiled module's text, by name.

  The matmuls: dots and convolutions, and fusions that contain one.
  """
  bodies, cur = {}, None
  for line in hlo_text.splitlines():
    if line and not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
      cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      bodies[cur] = []
    elif cur is not None:
      bodies[cur].append(line)
  heavy = {name for name, lines in bodies.items()
           if any(re.search(r" (dot|convolution)\(", x) for x in lines)}
  names, matmuls = set(), set()
  for lines in bodies.values():
    for x in lines:
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", x)
      if not m:
        continue
      names.add(m.group(1))
      called = re.search(r"calls=%?([\w.\-]+)", x)
      if m.group(2) in ("dot", "convolution") or (
          m.group(2) == "fusion" and called is not None and called.group(1) in heavy):
        matmuls.add(m.group(1))
  return names, matmuls


def trace_events(fn, args, calls: int) -> list[dict]:
  """The ``jax.profiler`` trace events of ``calls`` blocked calls of ``fn(*args)``."""
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    path, = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      return json.load(f)["traceEvents"]


#: GPU kernels that are matrix products or convolutions, by name (cuBLAS, cuDNN, CUTLASS and
#: XLA's GEMM fusions; not "conv", which would take XLA's convert fusions).
GPU_MATMUL_KERNEL = re.compile(r"gemm|xmma|cutlass|cudnn|wgmma|nvjet|cublas|sm\d\d_", re.IGNORECASE)
#: This package's GPU kernels (the Pallas kernels' names).
GPU_NORM_KERNEL = "jax_normgrad"


def _gpu_pids(events: list[dict]) -> set:
  """The trace's GPU device processes (empty on a CPU run)."""
  return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}


def kernel_totals(events: list[dict], names: set[str] | None = None):
  """``(total us, launches)`` per kernel name (two Counters) over a trace's events.

  The device's events where the trace has a GPU process; else (``names``)
  the host events named as the compiled module's instructions (none without
  ``names``).
  """
  devices = _gpu_pids(events)
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") != "X":
      continue
    if (e["pid"] in devices) if devices else (names is not None and e.get("name") in names):
      total[e["name"]] += e["dur"]
      count[e["name"]] += 1
  return total, count


def step_op_ms(step, args, calls: int = 5, top: int = 0, hlo_text: str | None = None) -> dict:
  """Where a jitted step's time goes, from a profile of ``calls`` calls: ms per call.

  ``ops`` is the time of the compiled module's operations (XLA:CPU's thunks,
  including custom calls; on a GPU the device's kernels), ``matmul`` that of
  the dots and convolutions (and fusions containing one; on a GPU the
  kernels named as ``GPU_MATMUL_KERNEL``), ``other`` the rest: the
  memory-bound passes a norm's implementation changes. On a GPU also
  ``norm``, this package's kernels (part of ``other``), ``launches``, the
  kernels (and memsets) run per call, and with ``top``
  the ``top`` largest kernels as ``kernels``: ``[name, us per call,
  launches per call]``. Summed op durations, not wall time (ops the runtime
  runs concurrently both count). Uses a ``jax.profiler`` trace
  (:func:`trace_events`), so it needs a backend whose runtime emits per-op
  trace events (XLA:CPU and XLA:GPU do). ``hlo_text``: the compiled
  module's text, where the caller has it (``step`` may then be a compiled
  executable); else ``step`` is lowered and compiled again for it.
  """
  names, matmuls = op_names(hlo_text if hlo_text is not None
                             else step.lower(*args).compile().as_text())
  events = trace_events(step, args, calls)
  out = _op_summary(events, names, matmuls, calls, top)
  out.pop("busy", None)
  return out


def _op_summary(events: list[dict], names: set[str], matmuls: set[str], calls: int,
                top: int = 0) -> dict:
  """:func:`step_op_ms`'s summary of one step's events (``calls`` calls); also ``busy``, the
  time (ms per call) some op ran: the union of the ops' intervals."""
  gpus = bool(_gpu_pids(events))
  # Python frames, runtime spans: a CPU's op events are named by their instruction.
  per_kernel, launches = kernel_totals(events, names)
  ops = sum(per_kernel.values())
  is_matmul = (lambda k: GPU_MATMUL_KERNEL.search(k)) if gpus else (lambda k: k in matmuls)
  matmul = sum(t for k, t in per_kernel.items() if is_matmul(k))
  norm = sum(t for k, t in per_kernel.items() if k.startswith(GPU_NORM_KERNEL))
  devices = _gpu_pids(events)
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and (
      e["pid"] in devices if devices else e.get("name") in names))
  busy, end = 0.0, float("-inf")
  for t0, t1 in spans:  # the union of the intervals
    busy += max(0.0, t1 - max(t0, end))
    end = max(end, t1)
  out = {"ops": ops / calls / 1e3, "matmul": matmul / calls / 1e3,
         "other": (ops - matmul) / calls / 1e3, "busy": busy / calls / 1e3}
  if gpus:
    out["norm"] = norm / calls / 1e3
    out["launches"] = sum(launches.values()) / calls
  if top:  # a GPU's kernels (empty on a CPU)
    out["kernels"] = [[k, round(v / calls, 2), launches[k] / calls]
                      for k, v in per_kernel.most_common(top)] if gpus else []
  return out


#: The trace annotation around each step of :func:`trace_steps` (its name follows).
STEP_ANNOTATION = "jax_normgrad_bench:"


def trace_steps(steps: dict, calls: int = 2, top: int = 0, save_to=None) -> dict:
  """Several compiled steps in one ``jax.profiler`` trace, each summarized as :func:`step_op_ms`.

  ``steps``: ``{name: (compiled step, args, compiled module's text)}``.
  Each step's ``calls`` calls (after one untimed) run in turn, each step's
  inside a trace annotation (``STEP_ANNOTATION`` + name); an op belongs to
  the step whose annotation holds its start (the device's kernels run
  inside it: each call is blocked). Returns ``{name: summary}``, the summary
  as :func:`step_op_ms`'s with ``busy`` (ms per call some op ran) and
  ``span`` (the annotation's time per call: the step's wall time as traced,
  host dispatch included), so ``span - busy`` is the time the device (a
  CPU: every thread) ran none of the step's ops. ``save_to``: a path the
  trace (``.trace.json.gz``, for Perfetto or TensorBoard) is copied to.
  """
  for fn, args, _ in steps.values():
    jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for name, (fn, args, _) in steps.items():
        with jax.profiler.TraceAnnotation(STEP_ANNOTATION + name):
          for _ in range(calls):
            jax.block_until_ready(fn(*args))
    path, = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    if save_to is not None:
      pathlib.Path(save_to).parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(path, save_to)
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  # The trace names an annotation by its text after the last ":", args.long_name in full.
  long_name = lambda e: str((e.get("args") or {}).get("long_name", e.get("name", "")))
  windows = {long_name(e)[len(STEP_ANNOTATION):]: (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and long_name(e).startswith(STEP_ANNOTATION)}
  out = {}
  for name, (_, _, hlo_text) in steps.items():
    if name not in windows:
      raise RuntimeError(f"trace_steps: no annotation of {name!r} in the trace")
    t0, t1 = windows[name]
    inside = [e for e in events if e.get("ph") != "X" or t0 <= e.get("ts", t0 - 1) <= t1]
    names, matmuls = op_names(hlo_text)
    out[name] = _op_summary(inside, names, matmuls, calls, top)
    out[name]["span"] = (t1 - t0) / calls / 1e3
  return out


def saves_interval(flax_rounds, variant_rounds, base_rounds, level: float = 0.9,
                   draws: int = 4000, seed: int = 0) -> tuple[float, float, float] | None:
  """The share of the norm time a variant saves, from paired rounds, and its interval.

  Each argument holds one median step time (ms) per round, for flax's
  layers, the variant and the norm-free baseline. The estimate is
  ``median_r(flax_r - variant_r) / median_r(flax_r - base_r)``: each
  round's differences are taken between steps of the same round, so a
  slow spell of the machine that lasts the round moves its variants alike
  and cancels (one shorter than a round does not). The interval resamples the rounds (percentile
  bootstrap, ``draws`` resamples with a fixed seed: the same rounds give
  the same interval). Returns ``(estimate, low, high)``, or None with
  fewer than 3 rounds or a norm time whose median is not positive.
  """
  f, v, b = (np.asarray(a, dtype=np.float64) for a in (flax_rounds, variant_rounds, base_rounds))
  if not (len(f) == len(v) == len(b)):
    raise ValueError(f"rounds: flax, variant and base must have one time per round each, got "
                     f"{len(f)}, {len(v)} and {len(b)}")
  saved, norm = f - v, f - b
  if len(f) < 3 or np.median(norm) <= 0:
    return None
  idx = np.random.default_rng(seed).integers(0, len(f), size=(draws, len(f)))
  num, den = np.median(saved[idx], axis=1), np.median(norm[idx], axis=1)
  # A resample whose norm time is not positive resolves no share: +-inf by the sign of the saving.
  with np.errstate(divide="ignore", invalid="ignore"):
    ratios = np.where(den > 0, num / den, np.copysign(np.inf, num))
  tail = 100 * (1 - level) / 2
  low = np.percentile(ratios, tail, method="inverted_cdf")  # resampled values, none interpolated
  high = np.percentile(ratios, 100 - tail, method="inverted_cdf")
  return float(np.median(saved) / np.median(norm)), float(low), float(high)


def measure_stack(dtype, iters, rounds=3, settle_s=0.0, layers=4, hidden=1024, ffn=256,
                  tokens=4096, residual_dtype=None, profile=False):
  """The MLP stack's training step in each of STACK_VARIANTS, interleaved rounds.

  ``profile``: also each variant's op time split into matmul and other
  (:func:`step_op_ms`) as ``{variant}_{ops,matmul,other}_ms``: the dots are
  the same in every variant and most of the step, so the norms' effect is
  read more precisely in ``other`` than in the wall time.

  Besides each variant's median, ``unfused_vs_fused`` and ``xla_vs_fused``
  are the medians of the per-round ratios (each round times the variants
  back to back, so a ratio sees one machine state: on a shared machine
  these are steadier than the ratio of the medians).
  """
  variants = {name: mlp_stack_step(name, layers, hidden, ffn, dtype, tokens, residual_dtype)
              for name in STACK_VARIANTS}
  per_round = max(1, -(-iters // rounds))
  samples = {name: [] for name in variants}
  per_round_ms = {name: [] for name in variants}
  for rnd in range(rounds):
    for name, (step, params, x) in variants.items():
      time.sleep(settle_s)
      times = call_times_ms(step, params, x, warmup=2 if rnd == 0 else 1, iters=per_round)
      samples[name] += times
      per_round_ms[name].append(float(np.median(times)))
  stream = "" if residual_dtype is None else f", {jnp.dtype(residual_dtype).name} residual stream"
  row = {"workload": f"mlp stack step {layers}x({tokens}x{hidden}, ffn {ffn}) "
                     f"{jnp.dtype(dtype).name}{stream}",
         "dtype": jnp.dtype(dtype).name, "rounds": rounds,
         "residual_dtype": None if residual_dtype is None else jnp.dtype(residual_dtype).name}
  for name, times in samples.items():
    row[f"{name}_ms"] = float(np.median(times))
  for name in ("unfused", "xla"):
    ratios = np.array(per_round_ms[name]) / np.array(per_round_ms["fused"])
    row[f"{name}_vs_fused"] = float(np.median(ratios))
    row[f"{name}_vs_fused_rounds"] = [round(float(r), 4) for r in ratios]
  if profile:
    for name, (step, params, x) in variants.items():
      for key, ms in step_op_ms(step, (params, x)).items():
        row[f"{name}_{key}_ms"] = ms
  return row


def print_residual_rows(rows):
  """One line per residual / stack row: fused, unfused (and XLA) ms and their ratios to fused."""
  for r in rows:
    xla = f" {r['xla_ms']:8.2f}  {r['xla_vs_fused']:5.2f}x" if "xla_ms" in r else ""
    print(f"{r['workload']:48s} fused {r['fused_ms']:8.2f}  unfused {r['unfused_ms']:8.2f} "
          f" {r['unfused_vs_fused']:5.2f}x" + (f" | XLA{xla}" if xla else ""), flush=True)
    if "fused_other_ms" in r:
      other = "  ".join(f"{name} {r[f'{name}_other_ms']:7.2f}" for name in STACK_VARIANTS)
      matmul = "  ".join(f"{r[f'{name}_matmul_ms']:7.2f}" for name in STACK_VARIANTS)
      print(f"{'':48s} op time besides the matmuls, ms: {other} (matmuls: {matmul})", flush=True)
