"""CPU benchmark: a small model's training step under jax_normgrad.rewrite, against the drop-ins and plain XLA.

Run from the repository root after `pip install .` (flax):

    python benchmarks/bench_rewrite.py            # 5 rounds
    python benchmarks/bench_rewrite.py --quick    # tiny model, 1 round: a smoke run

The model is bench_models.py's pre-norm transformer (flax LayerNorm) and
UNet-style stack (flax GroupNorm then SiLU), three ways: ``flax`` (plain
XLA), ``dropin`` (the package's drop-in layers: the same kernels) and
``rewrite`` (flax's layers, the step's loss under :func:`jax_normgrad.rewrite`).
Each step is jitted ``value_and_grad`` plus SGD, timed in interleaved rounds
(medians). Also: the rewrite's own trace-time cost (``jax.make_jaxpr`` of the
rewritten loss minus that of the plain loss) against the step's jit compile.
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


def trace_cost(model: str, size: str, repeats: int = 3) -> dict:
  """Median seconds to trace the loss plainly and under the rewrite, and to compile the step."""
  loss, p, x, t = setup(model, "flax", size)
  rw = jn.rewrite(loss)
  plain, rewritten = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.make_jaxpr(jax.value_and_grad(loss))(p, x, t)
    plain.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    jax.make_jaxpr(jax.value_and_grad(rw))(p, x, t)
    rewritten.append(time.perf_counter() - t0)
  t0 = time.perf_counter()
  step_of(rw).lower(p, x, t).compile()
  compile_s = time.perf_counter() - t0
  return {"trace_plain_s": float(np.median(plain)), "trace_rewrite_s": float(np.median(rewritten)),
          "rewrite_overhead_s": float(np.median(rewritten) - np.median(plain)),
          "compile_s": compile_s}


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
  parser.add_argument("--out", default="benchmarks/results/rewrite.json")
  args = parser.parse_args(argv)
  size = "quick" if args.quick else "default"
  iters, rounds = (2, 1) if args.quick else (args.iters, args.rounds)
  settle_s = 0.0 if args.quick else bm.SETTLE_S
  info = _bench.versions()
  info.update(cpu_model=cpu_model(), command=" ".join(sys.argv), loadavg_start=os.getloadavg())
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
  info["loadavg_end"] = os.getloadavg()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
