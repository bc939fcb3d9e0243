"""CPU benchmark: a small model's training step under jax_normgrad.rewrite, against the drop-ins and plain XLA.

Run from the repository root after `pip install .` (flax):

    python benchmarks/bench_rewrite.py            # 5 rounds
    python benchmarks/bench_rewrite.py --quick    # tiny model, 1 round: a smoke run
    python benchmarks/bench_rewrite.py --depth-sweep 16,32,64,128,256   # the trace cost by depth
    python benchmarks/bench_rewrite.py --frameworks   # six frameworks' training loops

The model is bench_models.py's pre-norm transformer (flax LayerNorm) and
UNet-style stack (flax GroupNorm then SiLU), three ways: ``flax`` (plain
XLA), ``dropin`` (the package's drop-in layers: the same kernels) and
``rewrite`` (flax's layers, the step's loss under :func:`jax_normgrad.rewrite`).
Each step is jitted ``value_and_grad`` plus SGD, timed in interleaved rounds
(medians). Also: the rewrite's own trace-time cost (``jax.make_jaxpr`` of the
rewritten loss minus that of the plain loss) against the step's jit compile.

``--depth-sweep``: the trace cost alone, of the "quick" transformer (width 32) of
N // 2 blocks for each N given (N + 1 norms: one before the first block, two in each):
``make_jaxpr`` of the loss's ``value_and_grad``, plain and under the rewrite,
interleaved, medians of ``--repeats``. The rewrite's cost should grow linearly
with the norms: its share of the plain trace stays flat.

``--frameworks``: rewrite_loops.py's training loops (flax NNX and linen,
keras ``model.fit``, haiku, equinox, transformers' GPT-2), each plainly and
with its one line: the norms rewritten, whether the runs are equal (the
largest difference of the losses and the state over the steps, relative),
the first step's compile and the median step, both ways (the second of two
rounds: the first pays the imports and what both ways share).
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_lib  # noqa: E402  (the benchmarks' shared helpers)
import bench_models as bm  # noqa: E402  (the models and the timing conventions)
import rewrite_loops  # noqa: E402  (the frameworks' training loops)
from bench_cpu import cpu_model  # noqa: E402

import jax_normgrad as jn  # noqa: E402
from jax_normgrad import _bench  # noqa: E402

VARIANTS = ("flax", "dropin", "rewrite")


def setup(model: str, variant: str, size: str):
  """``(loss, params, x, target)`` for one model and variant."""
  base = {"flax": "flax", "rewrite": "flax", "dropin": "dropin" if model == "transformer" else "ours"}
  if model == "transformer":
    m, x, t = bm.transformer_setup(base[variant], "layer", size)
  else:
    m, x, t = bm.unet_setup(base[variant], size)
  params = bm.init_params(m, x)

  def loss(p, x, t):
    return jnp.mean(jnp.square(m.apply(p, x) - t))

  return (jn.rewrite(loss) if variant == "rewrite" else loss), params, x, t


def step_of(loss):
  @jax.jit
  def step(p, x, t):
    val, g = jax.value_and_grad(loss)(p, x, t)
    return val, jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)
  return step


def _trace_times(loss, rewritten_loss, args, repeats: int) -> tuple[list, list]:
  """Seconds of ``make_jaxpr`` of each loss's ``value_and_grad``, interleaved, ``repeats`` each."""
  times = ([], [])
  for _ in range(repeats):
    for fn, out in zip((loss, rewritten_loss), times):
      t0 = time.perf_counter()
      jax.make_jaxpr(jax.value_and_grad(fn))(*args)
      out.append(time.perf_counter() - t0)
  return times


def trace_cost(model: str, size: str, repeats: int = 3) -> dict:
  """Median seconds to trace the loss plainly and under the rewrite, and to compile the step."""
  loss, p, x, t = setup(model, "flax", size)
  rw = jn.rewrite(loss)
  plain, rewritten = _trace_times(loss, rw, (p, x, t), repeats)
  t0 = time.perf_counter()
  step_of(rw).lower(p, x, t).compile()
  compile_s = time.perf_counter() - t0
  return {"trace_plain_s": float(np.median(plain)), "trace_rewrite_s": float(np.median(rewritten)),
          "rewrite_overhead_s": float(np.median(rewritten) - np.median(plain)),
          "compile_s": compile_s}


def depth_sweep(norms: list[int], repeats: int) -> list[dict]:
  """Per target number of norms: the norms rewritten and the plain and rewritten trace times."""
  rows = []
  for target in norms:
    blocks = max(1, target // 2)
    quick = bm.TRANSFORMER_SIZES["quick"]
    m, x, t = bm.transformer_setup("flax", "layer", quick._replace(blocks=blocks))
    p = bm.init_params(m, x)

    def loss(p, x, t, m=m):
      return jnp.mean(jnp.square(m.apply(p, x) - t))

    reports = []
    rw = jn.rewrite(loss, report=reports.append)
    plain, rewritten = _trace_times(loss, rw, (p, x, t), repeats)
    row = {"blocks": blocks, "norms": sum(reports[-1].counts().values()),
           "trace_plain_s": float(np.median(plain)), "trace_rewrite_s": float(np.median(rewritten))}
    row["rewrite_overhead_s"] = row["trace_rewrite_s"] - row["trace_plain_s"]
    row["overhead_vs_plain"] = row["rewrite_overhead_s"] / row["trace_plain_s"]
    row["overhead_per_norm_ms"] = 1e3 * row["rewrite_overhead_s"] / row["norms"]
    rows.append(row)
    print(f"{row['norms']} norms ({blocks} blocks): trace {row['trace_plain_s']:.3f} s, under the "
          f"rewrite {row['trace_rewrite_s']:.3f} s: +{row['rewrite_overhead_s']:.3f} s "
          f"({100 * row['overhead_vs_plain']:.0f}% of the plain trace, "
          f"{row['overhead_per_norm_ms']:.1f} ms a norm)", flush=True)
  return rows


def frameworks(steps: int) -> list[dict]:
  """Per framework installed: its loop plainly and rewritten, compared and timed."""
  import importlib.util
  rows = []
  for name, (module, _, _) in rewrite_loops.LOOPS.items():
    if importlib.util.find_spec(module.split(".")[0]) is None:
      print(f"{name}: {module} is not installed", flush=True)
      continue
    for _ in range(2):  # the first round warms up what both ways share (imports, jax's caches)
      plain = rewrite_loops.train(name, False, steps)
      new = rewrite_loops.train(name, True, steps)
    row = {"framework": name, "steps": steps, "norms": new.norms,
           "kernel_calls": bench_lib.custom_calls(new.text),
           "max_difference": rewrite_loops.max_difference(new, plain),
           "compile_plain_s": plain.compile_s, "compile_rewrite_s": new.compile_s,
           "step_plain_ms": 1e3 * float(np.median(plain.step_s)),
           "step_rewrite_ms": 1e3 * float(np.median(new.step_s))}
    rows.append(row)
    print(f"{name}: {row['norms']} norms rewritten ({row['kernel_calls']} kernel calls), "
          f"largest difference {row['max_difference']:.1e}; first step's compile "
          f"{row['compile_plain_s']:.2f} s plain, {row['compile_rewrite_s']:.2f} s rewritten; "
          f"step {row['step_plain_ms']:.2f} ms, {row['step_rewrite_ms']:.2f} ms", flush=True)
  return rows


def measure(model: str, size: str, iters: int, rounds: int, settle_s: float) -> dict:
  steps = {}
  for v in VARIANTS:
    loss, p, x, t = setup(model, v, size)
    step = step_of(loss)
    steps[v] = (step, (p, x, t), bench_lib.custom_calls(step.lower(p, x, t).as_text()))
  samples = {v: [] for v in steps}
  per_round = max(1, -(-iters // rounds))
  for rnd in range(rounds):
    for v, (step, args, _) in steps.items():
      time.sleep(settle_s)
      samples[v] += _bench.call_times_ms(step, *args, warmup=2 if rnd == 0 else 1, iters=per_round)
  row = {"model": model, "size": size, "rounds": rounds, "iters": per_round * rounds}
  for v, (step, args, calls) in steps.items():
    row[f"{v}_ms"] = float(np.median(samples[v]))
    row[f"{v}_custom_calls"] = calls
    row[f"{v}_loss"] = float(step(*args)[0])
  row["flax_vs_rewrite"] = row["flax_ms"] / row["rewrite_ms"]
  row["dropin_vs_rewrite"] = row["dropin_ms"] / row["rewrite_ms"]
  row.update(trace_cost(model, size))
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny models, 1 round of 2 steps")
  parser.add_argument("--model", choices=("transformer", "unet", "all"), default="all")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--depth-sweep", default=None, metavar="N,N,...",
                      help="only the trace cost, of the transformer unrolled to about N norms each")
  parser.add_argument("--repeats", type=int, default=3, help="--depth-sweep's traces per depth")
  parser.add_argument("--frameworks", action="store_true",
                      help="only the frameworks' training loops, plain and rewritten")
  parser.add_argument("--steps", type=int, default=10, help="--frameworks' steps per loop")
  parser.add_argument("--out", default=None,
                      help="default benchmarks/results/rewrite.json (rewrite_depth.json, "
                      "rewrite_frameworks.json)")
  args = parser.parse_args(argv)
  info = _bench.versions()
  info.update(cpu_model=cpu_model(), command=" ".join(sys.argv), loadavg_start=os.getloadavg())
  if args.depth_sweep:
    rows = depth_sweep([int(n) for n in args.depth_sweep.split(",")], args.repeats)
    return _write(args.out or "benchmarks/results/rewrite_depth.json", info, rows)
  if args.frameworks:
    rows = frameworks(args.steps)
    return _write(args.out or "benchmarks/results/rewrite_frameworks.json", info, rows)
  size = "quick" if args.quick else "default"
  iters, rounds = (2, 1) if args.quick else (args.iters, args.rounds)
  settle_s = 0.0 if args.quick else bm.SETTLE_S
  rows = []
  for model in (("transformer", "unet") if args.model == "all" else (args.model,)):
    row = measure(model, size, iters, rounds, settle_s)
    rows.append(row)
    print(f"{model} ({size}): flax {row['flax_ms']:.2f} ms, drop-ins {row['dropin_ms']:.2f} ms, "
          f"rewrite {row['rewrite_ms']:.2f} ms ({row['rewrite_custom_calls']} kernel calls; "
          f"drop-ins {row['dropin_custom_calls']}): flax/rewrite {row['flax_vs_rewrite']:.3f}x, "
          f"drop-ins/rewrite {row['dropin_vs_rewrite']:.3f}x; trace {row['trace_plain_s']:.3f} s, "
          f"under the rewrite {row['trace_rewrite_s']:.3f} s, compile {row['compile_s']:.2f} s",
          flush=True)
  return _write(args.out or "benchmarks/results/rewrite.json", info, rows)


def _write(path, info, rows):
  info["loadavg_end"] = os.getloadavg()
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
