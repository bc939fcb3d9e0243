"""GPU benchmark: jax_normgrad's kernels against XLA's autodiff of jnp layers and the copy roof.

Run from the repository root on a machine with a GPU, after installing the
package (on the project's GPU machine: ``pip install --no-build-isolation
--no-deps .``, the CPU extension being optional there):

    python benchmarks/bench_gpu.py                        # every row, JSON to benchmarks/recorded/
    python benchmarks/bench_gpu.py --out gpu.json --rounds 5 --iters 50
    python benchmarks/bench_gpu.py --only ln              # the rows whose name has "ln"
    python benchmarks/bench_gpu.py --gpu-backend mosaic_gpu   # the Mosaic GPU kernels (sm_90+)
    python benchmarks/bench_gpu.py --residual             # add_layer_norm / add_rms_norm, pre-norm stack

For each row (LayerNorm and RMSNorm 32768x1024, 16384x4096, 4096x16384 in
bfloat16 and float32; GroupNorm 8x256x64x64 with 32 groups, NCHW and NHWC) it
measures, in interleaved rounds within one process:

* the forward with statistics and the backward of this package
  (``layer_norm_fwd`` / ``layer_norm_backward``, the RMSNorm and GroupNorm
  equivalents: the kernels alone) and of XLA (the jitted jnp layer; its
  autodiff pullback with the residuals computed once);
* ``jax.grad`` of each layer (forward + backward, as in training);
* a device-to-device copy of x (read x, write a new buffer): the copy roof.

Every figure is a median of ``--iters`` samples after warm-up; each sample is
the mean time of calls issued back to back for about ``--batch-ms`` and
blocked once (``_bench.call_times_ms``): one call blocked alone would time its
dispatch and synchronisation, tens of microseconds, with a kernel that takes
about as long at these sizes. Bandwidth figures count the bytes a kernel must
move: forward x read and y written, backward x and dy read and dx written
(the statistics and parameters are small); ``*_of_copy`` is that bandwidth
over the copy's (read + write) in the same run. The JSON holds every row,
the machine (device kind, SM count), the versions and the command.

On a machine with no GPU the script runs on the CPU (``--smoke`` uses tiny
shapes: ``tests/test_benchmarks.py`` runs it so), so that the first run on a
GPU measures instead of debugging the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_normgrad import _bench, _implementation

# (kind, shape, dtype); GroupNorm shapes are (n, c, h, w, groups).
ROWS = [
    *[(kind, shape, dtype)
      for dtype in (jnp.bfloat16, jnp.float32)
      for kind in ("ln", "rms")
      for shape in ((32768, 1024), (16384, 4096), (4096, 16384))],
    ("gn", (8, 256, 64, 64, 32), jnp.float32),
    ("gn_nhwc", (8, 256, 64, 64, 32), jnp.float32),
    ("gn", (8, 256, 64, 64, 32), jnp.bfloat16),
    ("gn_nhwc", (8, 256, 64, 64, 32), jnp.bfloat16),
]
# The same kinds at tiny sizes, odd widths included (CPU smoke test).
SMOKE_ROWS = [("ln", (24, 40), jnp.float32), ("rms", (16, 72), jnp.bfloat16),
              ("gn", (2, 6, 3, 5, 3), jnp.float32), ("gn_nhwc", (2, 6, 3, 5, 3), jnp.bfloat16)]
VARIANTS = ("fwd", "bwd", "grad")
# --residual: add_layer_norm / add_rms_norm forward + backward against this package's
# layer_norm(x + residual) and XLA's autodiff (_bench.measure_residual), then a pre-norm MLP
# stack's training step with and without the fused form (_bench.measure_stack).
# (kind, shape, dtype, residual stream dtype; None: dtype's).
RESIDUAL_ROWS = [(kind, shape, dtype, stream)
                 for dtype, stream in ((jnp.bfloat16, None), (jnp.float32, None),
                                       (jnp.bfloat16, jnp.float32))
                 for kind in ("ln", "rms") for shape in ((32768, 1024), (16384, 4096))]
SMOKE_RESIDUAL_ROWS = [("ln", (24, 40), jnp.float32, None), ("rms", (16, 72), jnp.bfloat16, None),
                       ("rms", (16, 72), jnp.bfloat16, jnp.float32)]
STACK = dict(layers=4, hidden=4096, ffn=1024, tokens=16384)
SMOKE_STACK = dict(layers=2, hidden=64, ffn=32, tokens=32)


def workload(kind: str, shape: tuple, dtype) -> _bench.Workload:
  if kind == "ln":
    return _bench.layer_norm_workload(*shape, dtype)
  if kind == "rms":
    return _bench.rms_norm_workload(*shape, dtype)
  return _bench.group_norm_workload(*shape, dtype, channels_last=kind == "gn_nhwc")


def _copy(x):
  # A jitted function cannot return its (undonated) argument's buffer, so XLA copies x
  # into a new one: one read and one write of x.
  return jnp.copy(x)


def measure(kind: str, shape: tuple, dtype, *, iters: int, rounds: int, batch_ms: float = 0.0) -> dict:
  """One row: medians over ``rounds`` interleaved rounds of ``iters / rounds`` samples each."""
  wl = workload(kind, shape, dtype)
  x = wl.xla_fwd[1][0]
  copy = (jax.jit(_copy), (x,))
  per_round = max(1, -(-iters // rounds))
  samples: dict[str, list[float]] = {}
  for r in range(rounds):
    warmup = 3 if r == 0 else 1
    for name, variant in [("copy", copy)] + [
        (f"{v}_{who}", getattr(wl, f"{who}_{v}")) for v in VARIANTS for who in ("ours", "xla")]:
      fn, args = variant
      samples.setdefault(name, []).extend(
          _bench.call_times_ms(fn, *args, warmup=warmup, iters=per_round, batch_ms=batch_ms))
  row = {"workload": wl.name, "kind": kind, "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "rounds": rounds, "calls": per_round * rounds}
  for name, times in samples.items():
    row[f"{name}_ms"] = float(np.median(times))
  copy_bytes = 2 * x.size * x.dtype.itemsize
  row["copy_gbs"] = copy_bytes / (row["copy_ms"] * 1e-3) / 1e9
  nbytes = {"fwd": wl.nbytes_fwd, "bwd": wl.nbytes_bwd,
            "grad": wl.nbytes_fwd + wl.nbytes_bwd}  # forward, then backward
  for v in VARIANTS:
    for who in ("ours", "xla"):
      gbs = nbytes[v] / (row[f"{v}_{who}_ms"] * 1e-3) / 1e9
      row[f"{v}_{who}_gbs"] = gbs
      row[f"{v}_{who}_of_copy"] = gbs / row["copy_gbs"]
    row[f"{v}_vs_xla"] = row[f"{v}_xla_ms"] / row[f"{v}_ours_ms"]
  return row


def print_table(rows: list[dict], out=sys.stdout) -> None:
  head = ("| row | copy GB/s | fwd ours ms (of copy) | fwd XLA ms | fwd vs XLA | bwd ours ms (of copy) "
          "| bwd XLA ms | bwd vs XLA | grad ours ms | grad XLA ms | grad vs XLA |")
  print(head, file=out)
  print("|" + " --- |" * (head.count("|") - 1), file=out)
  for r in rows:
    print(f"| {r['workload']} | {r['copy_gbs']:.0f} "
          f"| {r['fwd_ours_ms']:.3f} ({r['fwd_ours_of_copy']:.0%}) | {r['fwd_xla_ms']:.3f} "
          f"| {r['fwd_vs_xla']:.2f}x "
          f"| {r['bwd_ours_ms']:.3f} ({r['bwd_ours_of_copy']:.0%}) | {r['bwd_xla_ms']:.3f} "
          f"| {r['bwd_vs_xla']:.2f}x | {r['grad_ours_ms']:.3f} | {r['grad_xla_ms']:.3f} "
          f"| {r['grad_vs_xla']:.2f}x |", file=out)


def _driver() -> str | None:
  """The NVIDIA driver's version, from nvidia-smi where there is one."""
  try:
    run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return run.stdout.strip().splitlines()[0] if run.returncode == 0 and run.stdout.strip() else None


def machine() -> dict:
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", "?"),
          "core_count": getattr(dev, "core_count", None), "devices": len(jax.devices()),
          "driver": _driver() if dev.platform == "gpu" else None}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, help="JSON path (default: benchmarks/recorded/"
                      "gpu_<date>_<device>.json)")
  parser.add_argument("--iters", type=int, default=40, help="timed calls per variant (all rounds)")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--batch-ms", type=float, default=2.0,
                      help="each sample: calls issued back to back for about this long, blocked "
                      "once (0: each call blocked and timed alone)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU smoke test)")
  parser.add_argument("--only", default="", help="run the rows whose name contains this text")
  parser.add_argument("--gpu-backend", choices=_implementation.GPU_BACKENDS, default="triton",
                      help="the Pallas GPU backend of the package's kernels (sets "
                      f"{_implementation.GPU_BACKEND_ENV}; what Mosaic GPU cannot run, such as "
                      "channels-last GroupNorm past ~25K channels, Triton runs with a "
                      "FallbackWarning)")
  parser.add_argument("--residual", action="store_true",
                      help="the fused residual form's rows and the pre-norm stack's step instead")
  args = parser.parse_args(argv)
  os.environ[_implementation.GPU_BACKEND_ENV] = args.gpu_backend
  if jax.default_backend() != "gpu" and not args.smoke:
    print(f"note: no GPU ({jax.default_backend()}); these are not GPU figures", file=sys.stderr)
  info = machine()
  date = datetime.date.today().isoformat()
  out = args.out or (pathlib.Path(__file__).parent / "recorded" /
                     f"gpu_{date}_{info['device_kind'].replace(' ', '_')}"
                     f"{'' if args.gpu_backend == 'triton' else '_' + args.gpu_backend}"
                     f"{'_residual' if args.residual else ''}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  rows, versions = [], _bench.versions()

  def save():  # after every row: a run cut short keeps what it measured
    out.write_text(json.dumps({"date": date, "machine": info, "versions": versions,
                               "command": " ".join(sys.argv), "gpu_backend": args.gpu_backend,
                               "batch_ms": args.batch_ms, "rows": rows}, indent=1))

  if args.residual:
    for kind, shape, dtype, stream in (SMOKE_RESIDUAL_ROWS if args.smoke else RESIDUAL_ROWS):
      rows.append(_bench.measure_residual(kind, shape, dtype, args.iters, args.rounds,
                                          batch_ms=args.batch_ms, residual_dtype=stream))
      _bench.print_residual_rows(rows[-1:])
      save()
    for dtype, stream in _bench.STACK_ROWS:
      rows.append(_bench.measure_stack(dtype, args.iters, args.rounds, residual_dtype=stream,
                                       **(SMOKE_STACK if args.smoke else STACK)))
      _bench.print_residual_rows(rows[-1:])
      save()
  for kind, shape, dtype in ([] if args.residual else SMOKE_ROWS if args.smoke else ROWS):
    name = f"{kind} {'x'.join(map(str, shape))} {jnp.dtype(dtype).name}"
    if args.only and args.only not in name:
      continue
    t0 = time.perf_counter()
    row = measure(kind, shape, dtype, iters=args.iters, rounds=args.rounds,
                  batch_ms=args.batch_ms)
    rows.append(row)
    save()
    print(f"{row['workload']}: bwd {row['bwd_ours_ms']:.3f} ms ({row['bwd_vs_xla']:.2f}x XLA, "
          f"{row['bwd_ours_of_copy']:.0%} of copy), fwd {row['fwd_ours_ms']:.3f} ms "
          f"({row['fwd_vs_xla']:.2f}x XLA) [{time.perf_counter() - t0:.1f} s]", file=sys.stderr)
  if not args.residual:
    print_table(rows)
  save()
  print(f"wrote {out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
