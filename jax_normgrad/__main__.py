"""``python -m jax_normgrad``: platform report, correctness check of every op, timing against XLA."""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _bench, _ffi, _implementation


def _report_platform() -> dict:
  platform = jax.default_backend()
  impls = {name: _implementation.default_for(name, platform)
           for name in _implementation.primitive_names()}
  return {"platform": platform, "devices": [str(d) for d in jax.devices()],
          "implementations": impls, "cpu_kernel_isa": _ffi.isa(), "versions": _bench.versions()}


def _max_rel_err(a, b) -> float:
  a = np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b).astype(jnp.float32), np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0


# Relative error (to the output's max) allowed between the kernel and the
# float32 reference: a couple of roundings of the output dtype.
_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1.6e-2, jnp.dtype(jnp.float16): 2e-3}


def _checks():
  """Each op's default implementation against the pure-JAX reference ("xla")."""
  key = jax.random.split(jax.random.key(0), 4)
  results = []

  def check(name, fn, dtype):
    ours = jax.tree.leaves(fn(None))
    ref = jax.tree.leaves(fn("xla"))
    err = max(_max_rel_err(a, b) for a, b in zip(ours, ref))
    results.append({"op": name, "dtype": jnp.dtype(dtype).name, "max_rel_err": err,
                    "ok": bool(err <= _TOL[jnp.dtype(dtype)])})

  for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(key[0], (37, 300)).astype(dtype)
    dy = jax.random.normal(key[1], (37, 300)).astype(dtype)
    w = (1 + jax.random.normal(key[2], (300,))).astype(dtype)
    b = jax.random.normal(key[3], (300,)).astype(dtype)
    _, m, r = jn.layer_norm_fwd(x, 300, w, b, implementation="xla")
    check("layer_norm_fwd", lambda i: jn.layer_norm_fwd(x, 300, w, b, implementation=i), dtype)
    check("layer_norm_backward",
          lambda i: jn.layer_norm_backward(dy, x, 300, m, r, w, b, implementation=i), dtype)
    check("grad(layer_norm)", lambda i: jax.grad(
        lambda x, w, b: jnp.vdot(jn.layer_norm(x, w, b, implementation=i).astype(jnp.float32),
                                 dy.astype(jnp.float32)), argnums=(0, 1, 2))(x, w, b), dtype)
    for cl in (False, True):
      layout = "NHWC" if cl else "NCHW"
      gx = jax.random.normal(key[0], (3, 24, 50)).astype(dtype)
      gdy = jax.random.normal(key[1], (3, 24, 50)).astype(dtype)
      g = (1 + jax.random.normal(key[2], (24,))).astype(dtype)
      _, gm, gr = jn.group_norm_fwd(gx, g, g, 3, 24, 50, 6, channels_last=cl, implementation="xla")
      check(f"group_norm_fwd {layout}", lambda i: jn.group_norm_fwd(
          gx, g, g, 3, 24, 50, 6, channels_last=cl, implementation=i), dtype)
      check(f"group_norm_backward {layout}", lambda i: jn.group_norm_backward(
          gdy, gx, gm, gr, g, 3, 24, 50, 6, channels_last=cl, implementation=i), dtype)
      # The layer on x as (N, C, HW) or (N, HW, C).
      shape = (3, 50, 24) if cl else (3, 24, 50)
      check(f"grad(group_norm) {layout}", lambda i: jax.grad(
          lambda x, g: jnp.vdot(jn.group_norm(x, 6, g, g, channel_axis=-1 if cl else 1,
                                              implementation=i).astype(jnp.float32),
                                gdy.reshape(shape).astype(jnp.float32)),
          argnums=(0, 1))(gx.reshape(shape), g), dtype)
  return results


def _timings(quick: bool, progress):
  workloads = [
      lambda: _bench.layer_norm_workload(8192, 1024, jnp.float32),
      lambda: _bench.layer_norm_workload(8192, 1024, jnp.bfloat16),
      lambda: _bench.layer_norm_workload(64, 65536, jnp.float32),
      lambda: _bench.group_norm_workload(4, 512, 64, 64, 32, jnp.float32),
  ]
  if quick:
    workloads = workloads[:1]
  rows = []
  for i, make in enumerate(workloads):
    wl = make()
    progress(f"[{i + 1}/{len(workloads)}] {wl.name}")
    row = {"workload": wl.name}
    for kind in ("bwd", "grad"):
      ours = _bench.time_variant(getattr(wl, f"ours_{kind}"))
      xla = _bench.time_variant(getattr(wl, f"xla_{kind}"))
      row[f"{kind}_ours_ms"], row[f"{kind}_xla_ms"], row[f"{kind}_speedup"] = ours, xla, xla / ours
    rows.append(row)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jax_normgrad",
      description="Report the platform and implementations, check every op against the pure-JAX "
                  "reference, and time the backward against XLA's autodiff of a jnp layer.")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
  parser.add_argument("--quick", action="store_true", help="time one shape only")
  parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
  args = parser.parse_args(argv)

  say = (lambda *a: None) if args.json else print
  progress = (lambda msg: None) if args.json else (lambda msg: print("  timing " + msg, flush=True))
  info = _report_platform()
  say(f"jax_normgrad {jn.__version__} on {info['platform']} ({', '.join(info['devices'])}); "
      f"jax {info['versions']['jax']}")
  say(f"CPU kernels built for: {info['cpu_kernel_isa']}")
  say("Implementation in use (implementation=None):")
  for name, impl in info["implementations"].items():
    say(f"  {name:32s} {impl}")

  checks = _checks()
  say("\nCorrectness against the pure-JAX reference:")
  for c in checks:
    say(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['op']:30s} {c['dtype']:9s} max rel err {c['max_rel_err']:.2e}")

  timings = [] if args.no_timing else _timings(args.quick, progress)
  if timings:
    say("\nMedian ms (jit, after warm-up); speedup = XLA autodiff / jax_normgrad:")
    say(f"  {'workload':34s} {'backward ours':>13s} {'XLA':>8s} {'speedup':>8s}   "
        f"{'grad ours':>9s} {'XLA':>8s} {'speedup':>8s}")
    for r in timings:
      say(f"  {r['workload']:34s} {r['bwd_ours_ms']:13.2f} {r['bwd_xla_ms']:8.2f} "
          f"{r['bwd_speedup']:7.1f}x   {r['grad_ours_ms']:9.2f} {r['grad_xla_ms']:8.2f} "
          f"{r['grad_speedup']:7.1f}x")
  ok = all(c["ok"] for c in checks)
  if args.json:
    print(json.dumps({**info, "checks": checks, "timings": timings, "ok": ok}, indent=2))
  else:
    say("\nAll checks passed." if ok else "\nSOME CHECKS FAILED.")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
