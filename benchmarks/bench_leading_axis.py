"""CPU benchmark: a norm over the leading axis (named-axis code), by XLA against the op on a moved view.

Code written over named axes (penzai) puts the normalized axis first in the jaxpr, where
``jn.rewrite`` leaves the norm alone ("statistics over axes (0,)"). This times what moving it
would give: the gradient (``jax.vjp``) of an RMSNorm over axis 0 written in jnp, against
``jn.rms_norm`` on the transposed view, transposed back; medians of interleaved rounds after
a warm-up, one process, as ratios (XLA's time over the moved op's: above 1 the move pays).

    PYTHONPATH=$PWD python benchmarks/bench_leading_axis.py [--rounds 5] [--iters 20] [--out F]
"""

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn

ROWS = [((768, 4096), jnp.float32), ((768, 4096), jnp.bfloat16), ((2048, 2048), jnp.float32),
        ((2048, 2048), jnp.bfloat16), ((4096, 1024), jnp.bfloat16)]


def leading(x, w):
  """RMSNorm over axis 0, as named-axis code writes it."""
  ms = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=0, keepdims=True)
  return (x * jax.lax.rsqrt(ms + 1e-6)).astype(x.dtype) * w[:, None]


def moved(x, w):
  """The op on the transposed view."""
  return jn.rms_norm(x.T, w, eps=1e-6).T


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  rows = []
  for shape, dtype in ROWS:
    x = jax.random.normal(jax.random.PRNGKey(0), shape, dtype)
    w, dy = jnp.ones(shape[:1], dtype), jnp.ones(shape, dtype)
    fns = {name: jax.jit(lambda x, w, f=f: jax.vjp(f, x, w)[1](dy))
           for name, f in (("xla", leading), ("moved", moved))}
    for f in fns.values():
      jax.block_until_ready(f(x, w))
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
      for name, f in fns.items():
        start = time.perf_counter()
        for _ in range(args.iters):
          out = f(x, w)
        jax.block_until_ready(out)
        times[name].append((time.perf_counter() - start) / args.iters * 1e3)
    ms = {name: float(np.median(t)) for name, t in times.items()}
    rows.append({"shape": list(shape), "dtype": jnp.dtype(dtype).name, "xla_ms": ms["xla"],
                 "moved_ms": ms["moved"], "xla_over_moved": ms["xla"] / ms["moved"]})
    print(f"{'x'.join(map(str, shape))} {jnp.dtype(dtype).name}: XLA {ms['xla']:.2f} ms, "
          f"moved op {ms['moved']:.2f} ms, {ms['xla'] / ms['moved']:.2f}x", flush=True)
  if args.out:
    info = {"jax": jax.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "backend": jax.default_backend()}
    with open(args.out, "w") as f:
      json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
