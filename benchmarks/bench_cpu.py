"""CPU benchmark: jax_normgrad against XLA's autodiff of jnp layers and PyTorch, with the bandwidth floor.

Run from the repository root after `pip install .`:

    python benchmarks/bench_cpu.py                   # the issue's rows + a hidden-size sweep
    python benchmarks/bench_cpu.py --quick           # the issue's, 16-bit and model-shape rows only
    python benchmarks/bench_cpu.py --model-shapes    # the shapes small models normalize only
    python benchmarks/bench_cpu.py --sweep-dtypes float32,bfloat16,float16   # a sweep per dtype
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
        python benchmarks/bench_cpu.py               # without fresh-mmap page faults
    python benchmarks/bench_cpu.py --residual        # add_layer_norm / add_rms_norm only
    python benchmarks/bench_cpu.py --stack           # only the pre-norm MLP stack step of --residual

Every figure is a median after warm-up (block_until_ready), all variants of a
row measured in the same process in interleaved rounds (--rounds; each round
times every column in turn, so a slow spell of the shared machine is spread
over the columns instead of landing on one). Before each column's calls the
run pauses (--settle-ms), so threads another runtime left spinning do not
take a core from it (see SETTLE_S), then warms up with untimed calls for
_bench.WARMUP_MS, so the column is timed in its steady state. The floor
of a backward is the bytes it must move (read x and dy, write dx), of a
forward those of reading x and writing y, over the memory bandwidth
measured in the same run (a STREAM-like triad: PyTorch's on all its threads
where installed, else NumPy's on one). Writes a JSON file and, with
matplotlib, a PNG of throughput against hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _bench, _ffi

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_lib  # noqa: E402  (the sibling module: the residual and stack workloads)

ISSUE_ROWS = [
    ("ln", (8192, 1024), jnp.float32),
    ("ln", (64, 65536), jnp.float32),
    ("ln", (16384, 512), jnp.float32),
    ("ln", (8192, 1024), jnp.bfloat16),
    ("gn", (4, 512, 64, 64, 32), jnp.float32),
]
# The other 16-bit cases, measured after the issue's rows in every run: a
# dtype no row covers can regress unseen (float16 once ran 5x slower than
# bfloat16 through a lane-by-lane conversion).
DTYPE_ROWS = [
    ("ln", (8192, 1024), jnp.float16),
    ("gn", (4, 512, 64, 64, 32), jnp.bfloat16),
    ("gn", (4, 512, 64, 64, 32), jnp.float16),
]
# The shapes small models normalize (issue 29): GroupNorm channels-last
# (Flax's layout) from a UNet's deepest level to its widest, 32 groups, and
# LayerNorm over a DiT's / a small transformer's tokens. At these sizes the
# per-call costs (the FFI call, the thread pool's wake-up) are a larger part
# of a kernel's time than at the issue's rows. Measured in every run after
# the 16-bit rows; ``--model-shapes`` runs only these.
MODEL_ROWS = [
    ("gn_nhwc", (8, 128, 8, 8, 32), jnp.float32),
    ("gn_nhwc", (8, 64, 16, 16, 32), jnp.float32),
    ("gn_nhwc", (8, 128, 16, 16, 32), jnp.float32),
    ("gn_nhwc", (8, 64, 32, 32, 32), jnp.float32),
    ("gn_nhwc", (8, 320, 32, 32, 32), jnp.float32),
    ("ln", (8 * 256, 512), jnp.float32),
    ("ln", (8 * 256, 1024), jnp.float32),
    ("ln", (8 * 1024, 1024), jnp.float32),
]
# --residual's op rows (add_layer_norm / add_rms_norm each): the issue's
# LayerNorm shapes, then bfloat16 activations with a float32 residual stream
# (residual_dtype=float32, flash-attn's residual_in_fp32): (shape, dtype,
# stream dtype; None: dtype's).
RESIDUAL_ROWS = [(shape, dtype, None) for kind, shape, dtype in ISSUE_ROWS if kind == "ln"] + [
    ((8192, 1024), jnp.bfloat16, jnp.float32)]
# Up to one row of 2^23: the last three points have 8, 2 and 1 rows (the
# kernels split fewer than 4 rows into column chunks across the pool).
SWEEP_HIDDEN = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 1 << 20, 1 << 22, 1 << 23]
SWEEP_ELEMENTS = 1 << 23  # rows * hidden per sweep point (32 MiB of float32)


def triad_bandwidth_gbs(n: int = 1 << 24, iters: int = 10) -> tuple[float, str]:
  """STREAM triad a = b + s * c on preallocated 64 MiB arrays, in GB/s (3 arrays counted).

  With PyTorch installed it runs on all its intra-op threads (as the kernels
  use every core); otherwise NumPy's single thread (a lower bound).
  """
  try:
    import torch
    b, c, a = torch.rand(n), torch.rand(n), torch.empty(n)
    run = lambda: torch.add(b, c, alpha=1.5, out=a)
    method = f"torch triad, {torch.get_num_threads()} threads"
  except ImportError:
    b, c = np.random.rand(n).astype(np.float32), np.random.rand(n).astype(np.float32)
    a = np.empty_like(b)
    run = lambda: (np.multiply(c, np.float32(1.5), out=a), np.add(a, b, out=a))
    method = "numpy triad, 1 thread"
  run()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  return 3 * n * 4 / float(np.median(times)) / 1e9, method


def torch_calls(kind, shape, dtype):
  """PyTorch native kernels: ``{"bwd": f, "fwd": f}``, each f running once and returning its ms (None when not installed).

  bwd: ``torch.autograd.grad`` through the layer, the backward alone timed
  (the forward that builds the graph runs first, untimed); fwd: the layer
  under ``no_grad``.
  """
  try:
    import torch
  except ImportError:
    return None
  tdtype = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16,
            jnp.dtype(jnp.float16): torch.float16}[jnp.dtype(dtype)]
  torch.manual_seed(0)
  if kind == "ln":
    rows, hidden = shape
    x = torch.randn(rows, hidden, dtype=tdtype, requires_grad=True)
    w = torch.randn(hidden, dtype=tdtype, requires_grad=True)
    b = torch.randn(hidden, dtype=tdtype, requires_grad=True)
    fwd = lambda: torch.nn.functional.layer_norm(x, (hidden,), w, b)
  else:
    n, c, h, w_, groups = shape
    x = torch.randn(n, c, h, w_, dtype=tdtype)
    if kind == "gn_nhwc":  # PyTorch's channels-last GroupNorm kernels
      x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    w = torch.randn(c, dtype=tdtype, requires_grad=True)
    b = torch.randn(c, dtype=tdtype, requires_grad=True)
    fwd = lambda: torch.nn.functional.group_norm(x, groups, w, b)
  dy = torch.randn_like(x)

  def bwd_once():
    y = fwd()
    t0 = time.perf_counter()
    torch.autograd.grad(y, (x, w, b), dy)
    return 1e3 * (time.perf_counter() - t0)

  def fwd_once():
    with torch.no_grad():
      t0 = time.perf_counter()
      fwd()
      return 1e3 * (time.perf_counter() - t0)

  return {"bwd": bwd_once, "fwd": fwd_once}


def flax_grad_times(kind, shape, dtype, iters, layer_dtype=None, with_value=False):
  """jax.grad of flax.linen's layer vs of the jax_normgrad.flax drop-in, same input and params, ms.

  The loss is ``vdot(layer(x), dy)``. LayerNorm on (rows, hidden); GroupNorm
  in Flax's channels-last layout (the NCHW shape's channels moved last).
  ``layer_dtype``: the layers' ``dtype`` (None: Flax's default, the result
  promoted with the float32 parameters). ``with_value``: ``jax.value_and_grad``
  instead, so y is computed (with ``jax.grad`` nothing reads y, and XLA drops
  every op that only y needs; in a model the next layer reads it). None when
  flax is not installed.
  """
  try:
    import flax.linen as nn
    import jax_normgrad.flax as jnf
  except ImportError:
    return None
  if kind == "ln":
    x_shape, make = shape, lambda mod: mod.LayerNorm(dtype=layer_dtype)
  else:
    n, c, h, w_, groups = shape
    x_shape, make = (n, h, w_, c), lambda mod: mod.GroupNorm(num_groups=groups, dtype=layer_dtype)
  k = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(k[0], x_shape, jnp.float32).astype(dtype)
  dy = jax.random.normal(k[1], x_shape, jnp.float32).astype(dtype)
  out = {}
  for who, mod in (("flax", nn), ("ours", jnf)):
    layer = make(mod)
    params = layer.init(jax.random.key(1), x)
    loss = lambda p, x, dy: jnp.vdot(layer.apply(p, x).astype(jnp.float32), dy.astype(jnp.float32))
    grad = (jax.value_and_grad if with_value else jax.grad)(loss, argnums=(0, 1))
    out[who] = _bench.median_ms(jax.jit(grad), params, x, dy, iters=iters)
  return out


# Seconds to pause before each column's calls. PyTorch's OpenMP workers
# busy-wait for milliseconds after every op (libgomp's spin count) and XLA's
# pool threads spin too: on a 2-core machine a worker still spinning from the
# previous column takes a core from the next column's first calls (this
# package's GroupNorm bfloat16 forward timed right after PyTorch's backward:
# 4.49 1.02 0.86 0.84 4.22 1.82 2.19 ms; 1.62 1.34 1.38 1.24 1.19 1.26 1.19
# with OMP_WAIT_POLICY=PASSIVE). After the pause one untimed call wakes the
# column's own threads, so each column is timed in its own steady state.
# The forwards, timed right after PyTorch's backward, moved most (Zen 5,
# PyTorch's forward time over ours, no pause -> 50 ms, two runs): LayerNorm
# 64x65536 float32 0.79 -> 1.16 and 0.82 -> 1.14, GroupNorm float32 0.89 ->
# 1.26 and 1.05 -> 1.13, bfloat16 0.86 -> 1.30 and 1.12 -> 1.39; the
# backwards (after XLA's columns) by no more than the noise.
SETTLE_S = 0.05


def measure(kind, shape, dtype, bandwidth, iters, rounds=3, settle_s=SETTLE_S):
  """One row: every column's median over ``rounds`` interleaved rounds.

  Each round times, one after another, ours, XLA's and PyTorch's backward,
  then the forwards (and XLA's one pass, ``Workload.xla_pass``), then
  ``jax.grad`` of ours and of XLA's, each ``iters / rounds`` calls after a
  ``settle_s`` pause and warm-up calls (three in the first round, then
  one, then more until ``_bench.WARMUP_MS`` have passed; none with
  ``settle_s=0``). The
  column's figure is the median of all its calls: a slow spell of the
  shared machine lands in every column's samples rather than in one
  column's. ``<variant>_vs_xla_rounds`` / ``bwd_vs_torch_rounds`` give
  each round's own ratio of medians, for the spread.
  """
  wl = (_bench.layer_norm_workload(*shape, dtype) if kind == "ln"
        else _bench.group_norm_workload(*shape, dtype, channels_last=kind == "gn_nhwc"))
  row = {"workload": wl.name, "kind": kind, "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "rounds": rounds, "settle_s": settle_s}
  tc = torch_calls(kind, shape, dtype)
  per_round = max(1, -(-iters // rounds))
  samples = {}  # (variant, who) -> [ms per call], in rounds
  round_medians = {}
  for r in range(rounds):
    warmup = 3 if r == 0 else (1 if settle_s else 0)
    warmup_ms = _bench.WARMUP_MS if settle_s else 0.0
    for variant in ("bwd", "fwd", "grad"):
      for who in ("ours", "xla", "pass", "torch"):
        if who == "torch" and (tc is None or variant == "grad"):
          continue
        if who == "pass" and variant != "fwd":
          continue
        time.sleep(settle_s)
        if who == "torch":
          _bench.warm_up(tc[variant], warmup, warmup_ms)
          times = [tc[variant]() for _ in range(per_round)]
        else:
          fn, args = wl.xla_pass if who == "pass" else getattr(wl, f"{who}_{variant}")
          times = _bench.call_times_ms(fn, *args, warmup=warmup, iters=per_round, warmup_ms=warmup_ms)
        samples.setdefault((variant, who), []).extend(times)
        round_medians.setdefault((variant, who), []).append(float(np.median(times)))
  for (variant, who), times in samples.items():
    row[f"{variant}_{who}_ms"] = float(np.median(times))
  for variant in ("bwd", "fwd", "grad"):
    row[f"{variant}_vs_xla_rounds"] = [
        x / o for x, o in zip(round_medians[(variant, "xla")], round_medians[(variant, "ours")])]
  if tc is not None:
    row["bwd_vs_torch_rounds"] = [
        t / o for t, o in zip(round_medians[("bwd", "torch")], round_medians[("bwd", "ours")])]
  row["bwd_floor_ms"] = wl.nbytes_bwd / (bandwidth * 1e9) * 1e3
  # The forward's floor (read x, write y): XLA's forward over it bounds how
  # far any kernel can be ahead of XLA's (a ratio to XLA above XLA's / floor
  # would be faster than the memory).
  row["fwd_floor_ms"] = wl.nbytes_fwd / (bandwidth * 1e9) * 1e3
  row["fwd_vs_xla"] = row["fwd_xla_ms"] / row["fwd_ours_ms"]
  row["fwd_vs_floor"] = row["fwd_ours_ms"] / row["fwd_floor_ms"]
  row["fwd_xla_vs_floor"] = row["fwd_xla_ms"] / row["fwd_floor_ms"]
  # XLA's forward over XLA's one elementwise pass (Workload.xla_pass): the
  # lead over XLA of a forward as fast as that pass.
  row["fwd_xla_vs_pass"] = row["fwd_xla_ms"] / row["fwd_pass_ms"]
  row["bwd_ours_gbs"] = wl.nbytes_bwd / (row["bwd_ours_ms"] * 1e-3) / 1e9
  row["bwd_vs_xla"] = row["bwd_xla_ms"] / row["bwd_ours_ms"]
  row["bwd_vs_floor"] = row["bwd_ours_ms"] / row["bwd_floor_ms"]
  if tc is not None:
    row["bwd_vs_torch"] = row["bwd_torch_ms"] / row["bwd_ours_ms"]
    row["fwd_vs_torch"] = row["fwd_torch_ms"] / row["fwd_ours_ms"]
  row["grad_vs_xla"] = row["grad_xla_ms"] / row["grad_ours_ms"]
  fl = flax_grad_times(kind, shape, dtype, iters)
  if fl:
    row["flax_grad_flax_ms"], row["flax_grad_ours_ms"] = fl["flax"], fl["ours"]
    row["flax_grad_speedup"] = fl["flax"] / fl["ours"]
    fl = flax_grad_times(kind, shape, dtype, iters, with_value=True)
    row["flax_vg_flax_ms"], row["flax_vg_ours_ms"] = fl["flax"], fl["ours"]
  if fl and jnp.dtype(dtype) != jnp.float32:
    # The layers with dtype=x's dtype: a 16-bit result, no float32 promotion.
    fl = flax_grad_times(kind, shape, dtype, iters, layer_dtype=dtype)
    row["flax16_grad_flax_ms"], row["flax16_grad_ours_ms"] = fl["flax"], fl["ours"]
  return row


def print_table(rows):
  print(f"{'workload':36s} {'floor':>6s} {'ours':>7s} {'XLA':>7s} {'torch':>7s}"
        f" {'xXLA':>6s} {'xtorch':>7s} {'/floor':>7s} | {'fwd floor':>9s} {'ours':>7s} {'XLA':>7s}"
        f" {'torch':>7s} {'XLA/floor':>9s} {'XLA/pass':>8s}"
        f" | {'grad ours':>9s} {'XLA':>7s} | {'flax drop-in':>12s} {'flax.linen':>10s}")
  for r in rows:
    torch_b = f"{r['bwd_torch_ms']:7.2f}" if "bwd_torch_ms" in r else "      -"
    torch_f = f"{r['fwd_torch_ms']:7.2f}" if "fwd_torch_ms" in r else "      -"
    vs_t = f"{r['bwd_vs_torch']:6.2f}x" if "bwd_vs_torch" in r else "      -"
    print(f"{r['workload']:36s} {r['bwd_floor_ms']:6.2f} {r['bwd_ours_ms']:7.2f} "
          f"{r['bwd_xla_ms']:7.2f} {torch_b} {r['bwd_vs_xla']:5.1f}x {vs_t} "
          f"{r['bwd_vs_floor']:6.2f}x | {r['fwd_floor_ms']:9.2f} {r['fwd_ours_ms']:7.2f} "
          f"{r['fwd_xla_ms']:7.2f} {torch_f} {r['fwd_xla_vs_floor']:8.2f}x "
          f"{r.get('fwd_xla_vs_pass', float('nan')):7.2f}x | "
          f"{r['grad_ours_ms']:9.2f} {r['grad_xla_ms']:7.2f} | "
          f"{r.get('flax_grad_ours_ms', float('nan')):12.2f} {r.get('flax_grad_flax_ms', float('nan')):10.2f}"
          + (f" | value_and_grad: {r['flax_vg_ours_ms']:.2f} {r['flax_vg_flax_ms']:.2f}"
             if "flax_vg_ours_ms" in r else "")
          + (f" | layer dtype={r['dtype']}: {r['flax16_grad_ours_ms']:.2f} {r['flax16_grad_flax_ms']:.2f}"
             if "flax16_grad_ours_ms" in r else "")
          + (" | bwd by round: xXLA " + " ".join(f"{v:.1f}" for v in r["bwd_vs_xla_rounds"])
             if "bwd_vs_xla_rounds" in r else "")
          + (", xtorch " + " ".join(f"{v:.2f}" for v in r["bwd_vs_torch_rounds"])
             if "bwd_vs_torch_rounds" in r else ""),
          flush=True)


def plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  sweep = [r for r in rows if r.get("sweep")]
  if not sweep:
    return
  dtypes = list(dict.fromkeys(r["dtype"] for r in sweep))  # one panel per dtype, in run order
  fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4), squeeze=False)
  for ax, dtype in zip(axes[0], dtypes):
    points = [r for r in sweep if r["dtype"] == dtype]
    hidden = [r["shape"][1] for r in points]
    for key, label in (("bwd_ours_ms", "jax_normgrad"), ("bwd_xla_ms", "XLA autodiff"),
                       ("bwd_torch_ms", "PyTorch"), ("bwd_floor_ms", "bandwidth floor")):
      if all(key in r for r in points):
        gbs = [r["nbytes"] / (r[key] * 1e-3) / 1e9 for r in points]
        ax.plot(hidden, gbs, marker="o", label=label, linestyle="--" if "floor" in key else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"hidden size (rows x hidden = 2^23, {dtype}; 2^23 is one row)")
    ax.set_ylabel("LayerNorm backward GB/s (x, dy read; dx written)")
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def cpu_model() -> str:
  """The CPU's model name and its cache sizes, from /proc/cpuinfo and sysfs ("" where absent)."""
  try:
    with open("/proc/cpuinfo") as f:
      name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    return ""
  caches = []
  for index in sorted(pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
    try:
      level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
      size = (index / "size").read_text().strip()
    except OSError:
      continue
    if kind != "Instruction":
      caches.append(f"L{level} {size}")
  return f"{name} ({', '.join(caches)})" if caches else name


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="the issue's, the 16-bit and the model-shape rows, no sweep")
  parser.add_argument("--iters", type=int, default=20, help="timed calls per column (split over the rounds)")
  parser.add_argument("--rounds", type=int, default=3,
                      help="interleaved rounds per row: each round times every column in turn")
  parser.add_argument("--settle-ms", type=float, default=1e3 * SETTLE_S,
                      help="pause before each column's calls, ms (0: none, and no per-round warm-up)")
  parser.add_argument("--out", default="benchmarks/results/cpu.json")
  parser.add_argument("--plot", default="benchmarks/results/cpu_ln_sweep.png")
  parser.add_argument("--sweep-dtypes", default="float32",
                      help="comma-separated dtypes of the hidden-size sweep (float32, bfloat16, float16)")
  parser.add_argument("--model-shapes", action="store_true",
                      help="only the shapes small models normalize (MODEL_ROWS)")
  parser.add_argument("--residual", action="store_true",
                      help="only add_layer_norm / add_rms_norm (the issue's LayerNorm rows) and the "
                           "pre-norm MLP stack's training step, fused against unfused and XLA")
  parser.add_argument("--stack", action="store_true",
                      help="only the pre-norm MLP stack's training step (bench_lib.STACK_ROWS) of --residual")
  parser.add_argument("--keep-freed-memory", action="store_true",
                      help="call jax_normgrad.keep_freed_memory() first (no fresh-page faults)")
  args = parser.parse_args(argv)
  kept = jn.keep_freed_memory() if args.keep_freed_memory else False

  info = _bench.versions()
  try:
    import torch
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
  except ImportError:
    info["torch"] = None
  info["GLIBC_TUNABLES"] = os.environ.get("GLIBC_TUNABLES", "")
  info["cpu_kernel_isa"] = _ffi.isa()
  info["cpu_model"] = cpu_model()
  info["keep_freed_memory"] = kept
  settle_s = args.settle_ms / 1e3
  info["settle_s"] = settle_s
  bandwidth, method = triad_bandwidth_gbs()
  info["triad_gbs"], info["triad_method"] = bandwidth, method
  print(json.dumps(info))
  print(f"memory bandwidth ({method}): {bandwidth:.1f} GB/s")
  rows = []
  if args.residual or args.stack:
    for kind in ("ln", "rms") if args.residual else ():
      for shape, dtype, stream in RESIDUAL_ROWS:
        rows.append(bench_lib.measure_residual(kind, shape, dtype, args.iters, args.rounds, settle_s,
                                            residual_dtype=stream))
        bench_lib.print_residual_rows(rows[-1:])
    for dtype, stream in bench_lib.STACK_ROWS:
      rows.append(bench_lib.measure_stack(dtype, args.iters, args.rounds, settle_s,
                                       residual_dtype=stream, profile=True))
      bench_lib.print_residual_rows(rows[-1:])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return
  for kind, shape, dtype in (MODEL_ROWS if args.model_shapes else ISSUE_ROWS + DTYPE_ROWS + MODEL_ROWS):
    rows.append(measure(kind, shape, dtype, bandwidth, args.iters, args.rounds, settle_s))
    print_table(rows[-1:])
  if not args.quick and not args.model_shapes:
    for name in args.sweep_dtypes.split(","):
      dtype = jnp.dtype(name)
      print(f"\nsweep, {dtype.name} LayerNorm, rows x hidden = 2^23:")
      for hidden in SWEEP_HIDDEN:
        r = measure("ln", (SWEEP_ELEMENTS // hidden, hidden), dtype, bandwidth, args.iters, args.rounds,
                    settle_s)
        r["sweep"], r["nbytes"] = True, 3 * SWEEP_ELEMENTS * dtype.itemsize
        rows.append(r)
        print_table([r])
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
  print(f"wrote {out}")
  if not args.quick and not args.model_shapes:
    plot(rows, args.plot)


if __name__ == "__main__":
  sys.exit(main())
