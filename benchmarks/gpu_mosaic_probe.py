"""Where the Mosaic GPU kernels' time goes: trace, compile, first call and steady calls, per phase.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu_mosaic_probe.py                      # LayerNorm 1024x1024, then 32768x1024 bf16
    python benchmarks/gpu_mosaic_probe.py --shapes 32768x1024 --dtype float32

In two GPU sessions ``bench_gpu.py --gpu-backend mosaic_gpu`` finished no
row in 80 s, which does not say whether the compile or the kernels take the
time. This script times each phase of ``layer_norm_fwd`` and
``layer_norm_backward`` under ``implementation="mosaic_gpu"`` (and the Triton
kernels' as the baseline) with a line flushed after each, and every
``--dump-every`` seconds prints every thread's stack (``faulthandler``), so a
run cut short still shows the phase and the frame it was in.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _bench


def _phases(name: str, fn, args, calls: int) -> None:
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  t3 = time.perf_counter()
  # Samples of calls issued back to back for about 2 ms (the GPU benchmarks' method).
  steady = np.median(_bench.call_times_ms(compiled, *args, warmup=1, iters=calls, batch_ms=2.0))
  print(f"{name}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, first call {t3 - t2:.3f} s, "
        f"steady {steady:.3f} ms/call (median of {calls} samples)", flush=True)


def probe(rows: int, hidden: int, dtype, impl: str, calls: int) -> None:
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (rows, hidden), jnp.float32).astype(dtype)
  dy = jax.random.normal(k[1], (rows, hidden), jnp.float32).astype(dtype)
  w = (1 + 0.1 * jax.random.normal(k[2], (hidden,))).astype(dtype)
  b = (0.1 * jax.random.normal(k[3], (hidden,))).astype(dtype)
  tag = f"{impl} LayerNorm {rows}x{hidden} {jnp.dtype(dtype).name}"
  fwd = lambda x, w, b: jn.layer_norm_fwd(x, hidden, w, b, implementation=impl)
  _phases(f"{tag} fwd", fwd, (x, w, b), calls)
  _, mean, rstd = jax.jit(fwd)(x, w, b)
  bwd = lambda dy, x, m, r, w, b: jn.layer_norm_backward(dy, x, hidden, m, r, w, b, implementation=impl)
  _phases(f"{tag} bwd", bwd, (dy, x, mean, rstd, w, b), calls)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="1024x1024,32768x1024")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--impls", default="triton,mosaic_gpu")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--dump-every", type=float, default=45.0)
  args = parser.parse_args(argv)
  # sys.__stderr__: the process's fd 2 even where sys.stderr is replaced (pytest's capture).
  faulthandler.dump_traceback_later(args.dump_every, repeat=True, file=sys.__stderr__)
  print(f"jax {jax.__version__}, {jax.devices()}", flush=True)
  for shape in args.shapes.split(","):
    rows, hidden = map(int, shape.split("x"))
    for impl in args.impls.split(","):
      try:
        probe(rows, hidden, jnp.dtype(args.dtype), impl, args.calls)
      except Exception as e:  # a phase that fails: say so, go on with the next
        print(f"{impl} {shape}: {type(e).__name__}: {str(e)[:400]}", flush=True)
  faulthandler.cancel_dump_traceback_later()
  return 0


if __name__ == "__main__":
  sys.exit(main())
