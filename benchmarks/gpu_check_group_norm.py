"""GroupNorm's kernels against the pure-JAX reference at a UNet's shapes, on the device in hand.

A quick check on a GPU machine before timing new kernels: y, the
statistics and every gradient of ``jax_normgrad.group_norm`` (the platform's
kernels) against ``implementation="xla"``, channels-last with 32 groups of 2
to 8 channels (the sample-wide kernels, split and whole) and with an
activation, float32 and bfloat16. Prints the largest error of each output
relative to its largest value and exits 1 if one is over the dtype's bound
(a few roundings of the dtype). ``--smoke``: small shapes (CPU, interpreted).

    python benchmarks/gpu_check_group_norm.py
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn

# (N, H, W, C, groups, activation)
SHAPES = [(32, 32, 32, 64, 32, None), (32, 16, 16, 128, 32, "silu"), (32, 8, 8, 256, 32, None),
          (8, 64, 64, 256, 32, "silu"), (4, 16, 16, 320, 32, None)]
SMOKE_SHAPES = [(3, 5, 7, 16, 8, None), (2, 9, 9, 48, 24, "silu")]
BOUND = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def check(shape, dtype) -> list[tuple[str, float]]:
  n, h, w, c, g, act = shape
  k = jax.random.split(jax.random.key(0), 4)
  x = (2 * jax.random.normal(k[0], (n, h, w, c)) + 0.3).astype(dtype)
  gamma = 1 + jax.random.normal(k[1], (c,))
  beta = jax.random.normal(k[2], (c,))
  ct = jax.random.normal(k[3], x.shape).astype(dtype)

  def run(impl):
    f = lambda x, a, b: jn.group_norm(x, g, a, b, channel_axis=-1, activation=act,
                                      implementation=impl)
    y, pullback = jax.vjp(f, x, gamma, beta)
    stats = jn.group_norm_fwd(x.reshape(n, h * w, c), gamma, beta, n, c, h * w, g,
                              channels_last=True, implementation=impl)[1:]
    return (y,) + tuple(stats) + tuple(pullback(ct))

  ours, ref = jax.jit(lambda: run(None))(), jax.jit(lambda: run("xla"))()
  names = ("y", "mean", "rstd", "dx", "dgamma", "dbeta")
  out = []
  for name, a, e in zip(names, ours, ref):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    out.append((name, float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args(argv)
  bad = 0
  print(f"device: {jax.devices()[0].device_kind}")
  for shape in SMOKE_SHAPES if args.smoke else SHAPES:
    for dtype in (jnp.float32, jnp.bfloat16):
      errs = check(shape, dtype)
      over = [n for n, e in errs if e > BOUND[jnp.dtype(dtype)]]
      bad += bool(over)
      print(f"{'x'.join(map(str, shape[:4]))}/{shape[4]} {shape[5] or ''} {jnp.dtype(dtype).name}: "
            + " ".join(f"{n} {e:.1e}" for n, e in errs) + (f"  OVER: {over}" if over else ""))
  print("nhwc check: " + ("FAILED" if bad else "ok"))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
