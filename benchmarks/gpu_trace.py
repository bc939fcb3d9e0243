"""Where a GPU step's time goes, kernel by kernel: a ``jax.profiler`` trace per function.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu_trace.py --out trace_dir

For each function (the residual op rows of ``bench_gpu.py --residual`` whose
fused form trailed XLA's or the unfused pair, each fused, unfused and XLA;
the pre-norm MLP stack's step, fused and XLA,
with a float32 residual stream) it writes the compiled module's text
(``{name}.hlo.txt``: which converts and fusions surround the custom calls)
and traces ``--calls`` calls after a warm-up, each function in a trace of its
own. The device's kernel events (the trace's ``/device:GPU`` process) are
summed by kernel name and divided by the calls: microseconds per call, one
table per function, printed and saved as ``kernels.json``. Summed durations,
not wall time. This found, on 2026-11-26, the partials reduction and the
32-warp forward the tile sweep then fixed (BENCHMARKS-history.md, "GPU: NVIDIA H200").

On a machine with no GPU (``--smoke``, tiny shapes) the events are the host
runtime's, matched to the compiled module's instruction names (a check of
the script, which the test suite runs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_lib  # noqa: E402  (the sibling module: workloads, trace parsing)

BF16, F32 = jnp.bfloat16, jnp.float32
#: (kind, shape, dtype, residual stream dtype): the residual rows whose fused form trailed XLA's.
OP_ROWS = [("rms", (32768, 1024), BF16, None), ("rms", (16384, 4096), F32, None),
           ("rms", (32768, 1024), BF16, F32), ("ln", (32768, 1024), BF16, F32),
           # The row whose fused form trails the unfused pair (0.92x, H200).
           ("ln", (16384, 4096), BF16, None)]
STACK = dict(layers=4, hidden=4096, ffn=1024, tokens=16384)
SMOKE_OP_ROWS = [("rms", (16, 72), BF16, F32)]
SMOKE_STACK = dict(layers=2, hidden=64, ffn=32, tokens=32)


def jobs(smoke: bool) -> list[tuple[str, object, tuple]]:
  """``(name, jitted function, args)``: the fused and XLA forms of each row, then the stack."""
  out = []
  for kind, shape, dtype, stream in SMOKE_OP_ROWS if smoke else OP_ROWS:
    k = jax.random.split(jax.random.key(0), 4)
    s = jnp.dtype(stream or dtype)
    x, r, dy, dh = (jax.random.normal(ki, shape, F32).astype(d)
                    for ki, d in zip(k, (dtype, s, dtype, s)))
    w, b = jnp.ones(shape[1:], s), jnp.zeros(shape[1:], s)
    tag = (f"{kind}_{'x'.join(map(str, shape))}_{jnp.dtype(dtype).name}"
           + ("_f32stream" if stream is not None else ""))
    for variant, fn in bench_lib.residual_variants(kind, dtype, stream).items():
      out.append((f"{tag}_{variant}", fn, (x, r, w, b, dy, dh)))
  for variant in ("fused", "xla"):
    step, params, batch = bench_lib.mlp_stack_step(variant, dtype=BF16, residual_dtype=F32,
                                                **(SMOKE_STACK if smoke else STACK))
    out.append((f"stack_bf16_f32stream_{variant}", step, (params, batch)))
  return out


def kernel_times(events: list[dict], calls: int, names: set[str] | None = None) -> dict:
  """``{kernel: [us per call, launches per call]}`` from a trace's events, largest first.

  The device's events where the trace has a GPU process; else (``names``)
  the host events named as the compiled module's instructions.
  """
  total, count = bench_lib.kernel_totals(events, names)
  return {k: [round(v / calls, 2), count[k] / calls] for k, v in total.most_common()}


def trace(fn, args, calls: int) -> list[dict]:
  """The events of ``calls`` blocked calls of ``fn`` (compiled and warmed up first)."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  return bench_lib.trace_events(fn, args, calls)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, required=True, help="a directory")
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (a check of the script)")
  parser.add_argument("--only", default="", help="the functions whose name contains this text")
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  result = {}
  for name, fn, fn_args in jobs(args.smoke):
    if args.only not in name:
      continue
    text = fn.lower(*fn_args).compile().as_text()
    (args.out / f"{name}.hlo.txt").write_text(text)
    kernels = kernel_times(trace(fn, fn_args, args.calls), args.calls, bench_lib.op_names(text)[0])
    result[name] = kernels
    print(f"== {name}: {sum(v[0] for v in kernels.values()):.1f} us per call")
    for kernel, (us, n) in list(kernels.items())[:15]:
      print(f"  {us:9.1f} us  x{n:g}  {kernel[:100]}")
    (args.out / "kernels.json").write_text(json.dumps(
        {"machine": str(jax.devices()[0].device_kind), "calls": args.calls, "kernels": result},
        indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
