"""``python -m jax_normgrad``: platform report, correctness check of every op, timing against XLA."""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp

import jax_normgrad as jn
from jax_normgrad import _bench, _explain, _ffi, _platforms, _settings


#: The public functions each primitive serves (RMSNorm and the AscendC / InfiniOp
#: forms run on the LayerNorm primitives).
PRIMITIVE_OPS = {
    "jax_normgrad_layer_norm_fwd": "layer_norm, layer_norm_fwd, rms_norm, rms_norm_fwd",
    "jax_normgrad_layer_norm_bwd": "layer_norm, layer_norm_backward, rms_norm, rms_norm_backward, "
                                   "layer_norm_grad, layer_norm_grad_beta, "
                                   "layer_norm_backward_from_normalized",
    "jax_normgrad_group_norm_fwd": "group_norm, group_norm_fwd",
    "jax_normgrad_group_norm_bwd": "group_norm, group_norm_backward",
}


def _report_platform() -> dict:
  platform = _platforms.default_platform()
  choices = _explain.default_choices(platform)
  impls = {name: c.implementation for name, c in choices.items()}
  return {"platform": platform, "devices": [str(d) for d in jax.devices()],
          "implementations": impls,
          "why": {name: c.why + "".join(f"; passed over {n}: {r}" for n, r in c.skipped)
                  for name, c in choices.items()},
          "settings": dict(_settings.current().variables()),
          "primitive_ops": {name: PRIMITIVE_OPS.get(name, "") for name in impls},
          "cpu_kernel_isa": _ffi.isa(), "versions": _bench.versions()}


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
    err = max(_bench.max_rel_err(a, b) for a, b in zip(ours, ref))
    ok = math.isfinite(err) and err <= _TOL[jnp.dtype(dtype)]
    # JSON has no NaN: a non-finite error is reported as null (and fails).
    results.append({"op": name, "dtype": jnp.dtype(dtype).name,
                    "max_rel_err": err if math.isfinite(err) else None, "ok": bool(ok)})

  def vdot(y, ct):
    return jnp.vdot(y.astype(jnp.float32), ct.astype(jnp.float32))

  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    x = jax.random.normal(key[0], (37, 300)).astype(dtype)
    dy = jax.random.normal(key[1], (37, 300)).astype(dtype)
    w = (1 + jax.random.normal(key[2], (300,))).astype(dtype)
    b = jax.random.normal(key[3], (300,)).astype(dtype)
    _, m, r = jn.layer_norm_fwd(x, 300, w, b, implementation="xla")
    check("layer_norm_fwd", lambda i: jn.layer_norm_fwd(x, 300, w, b, implementation=i), dtype)
    check("layer_norm_backward",
          lambda i: jn.layer_norm_backward(dy, x, 300, m, r, w, b, implementation=i), dtype)
    check("grad(layer_norm)", lambda i: jax.grad(
        lambda x, w, b: vdot(jn.layer_norm(x, w, b, implementation=i), dy),
        argnums=(0, 1, 2))(x, w, b), dtype)
    # The AscendC pair and InfiniOp's backward from the normalized input.
    var = 1 / jnp.square(r.reshape(37)) - 1e-5
    check("layer_norm_grad", lambda i: jn.layer_norm_grad(
        dy, x, var.astype(dtype), m.reshape(37).astype(dtype), w, 1e-5, implementation=i), dtype)
    xhat = ((x.astype(jnp.float32) - m) * r).astype(dtype)
    check("layer_norm_grad_beta", lambda i: jn.layer_norm_grad_beta(dy, xhat, implementation=i),
          dtype)
    check("layer_norm_backward_from_normalized", lambda i: jn.layer_norm_backward_from_normalized(
        dy, w, xhat, (1 / r).astype(dtype), implementation=i), dtype)
    _, rr = jn.rms_norm_fwd(x, 300, w, implementation="xla")
    check("rms_norm_fwd", lambda i: jn.rms_norm_fwd(x, 300, w, implementation=i), dtype)
    check("rms_norm_backward",
          lambda i: jn.rms_norm_backward(dy, x, 300, rr, w, implementation=i), dtype)
    check("grad(rms_norm)", lambda i: jax.grad(
        lambda x, w: vdot(jn.rms_norm(x, w, implementation=i), dy), argnums=(0, 1))(x, w), dtype)
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
          lambda x, g: vdot(jn.group_norm(x, 6, g, g, channel_axis=-1 if cl else 1,
                                          implementation=i), gdy.reshape(shape)),
          argnums=(0, 1))(gx.reshape(shape), g), dtype)
  return results


def _workloads(quick: bool):
  """Constructors of the timed workloads (built lazily: each allocates its inputs)."""
  if quick:
    return [lambda: _bench.layer_norm_workload(8192, 1024, jnp.float32)]
  return [
      lambda: _bench.layer_norm_workload(8192, 1024, jnp.float32),
      lambda: _bench.layer_norm_workload(8192, 1024, jnp.bfloat16),
      lambda: _bench.layer_norm_workload(8192, 1024, jnp.float16),
      lambda: _bench.layer_norm_workload(64, 65536, jnp.float32),
      lambda: _bench.rms_norm_workload(8192, 1024, jnp.float32),
      lambda: _bench.group_norm_workload(4, 512, 64, 64, 32, jnp.float32),
  ]


class _TextProgress:
  """A text progress bar on stderr, for when tqdm is not installed or stderr is no terminal.

  In a terminal: one line rewritten in place (``\\r``). Otherwise (a log file,
  a pipe, CI): one plain line per step, so a log holds no ``\\r`` frames.
  """

  def __init__(self, total: int, desc: str, tty: bool = True):
    self.total, self.desc, self.n, self.note, self.tty = total, desc, 0, "", tty

  def set_postfix_str(self, s: str) -> None:
    self.note = s

  def update(self, k: int = 1) -> None:
    self.n += k
    if not self.tty:
      print(f"{self.desc} {self.n}/{self.total} {self.note}", file=sys.stderr, flush=True)
      return
    done = 20 * self.n // max(self.total, 1)
    # \r rewrites the line in a terminal; the last update ends it.
    print(f"\r{self.desc} [{'#' * done}{'.' * (20 - done)}] {self.n}/{self.total} {self.note}",
          end="\n" if self.n >= self.total else "", file=sys.stderr, flush=True)

  def close(self) -> None:
    pass


class _NoProgress:
  """The progress bar's interface, doing nothing (--no-progress)."""

  def set_postfix_str(self, s: str) -> None:
    pass

  def update(self, k: int = 1) -> None:
    pass

  def close(self) -> None:
    pass


def _progress_bar(total: int, enabled: bool):
  """On a terminal, tqdm when it is installed, else a text bar; elsewhere one line per step.

  A no-op when disabled (--no-progress).
  """
  if not enabled:
    return _NoProgress()
  if not sys.stderr.isatty():
    return _TextProgress(total, "timing", tty=False)
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return _TextProgress(total, "timing")
  return tqdm(total=total, desc="timing", unit="run", file=sys.stderr, leave=False)


def _timings(quick: bool, show_progress: bool):
  """Median ms of our backward and jax.grad against XLA's autodiff, per workload."""
  makers = _workloads(quick)
  bar = _progress_bar(len(makers) * 2 * len(_bench.KINDS), show_progress)
  try:
    return [_bench.time_workload(make(), bar) for make in makers]
  finally:
    bar.close()


def _have_matplotlib() -> bool:
  try:
    import matplotlib.figure  # noqa: F401
  except ImportError:
    return False
  return True


def main(argv=None) -> int:
  """Runs the command line; returns the exit status (0: every check passed)."""
  parser = argparse.ArgumentParser(
      prog="python -m jax_normgrad",
      description="Report the platform and implementations, check every op against the pure-JAX "
                  "reference, and time the backward against XLA's autodiff of a jnp layer.")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object (platform, implementations, checks, timings) "
                           "instead of tables; progress still goes to stderr")
  parser.add_argument("--quick", action="store_true", help="time one shape only")
  parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  parser.add_argument("--plot", metavar="FILE",
                      help="write the timing table as a PNG bar chart to FILE (needs matplotlib)")
  args = parser.parse_args(argv)
  if args.plot:
    if args.no_timing:
      parser.error("--plot draws the timings: drop --no-timing")
    if not _have_matplotlib():
      parser.error("--plot needs matplotlib, which is not installed: "
                   "pip install matplotlib (or 'jax_normgrad[notebooks]')")

  say = (lambda *a: None) if args.json else print
  info = _report_platform()
  say(f"jax_normgrad {jn.__version__} on {info['platform']} ({', '.join(info['devices'])}); "
      f"jax {info['versions']['jax']}")
  say(f"CPU kernels built for: {info['cpu_kernel_isa']}")
  say("Implementation in use (implementation=None), and why; jax_normgrad.explain(f, *args) "
      "answers for a function of yours:")
  for name, impl in info["implementations"].items():
    say(f"  {name:30s} {impl:10s} {info['why'][name]}\n  {'':30s} {'':10s} serves "
        f"{info['primitive_ops'][name]}")
  say("Settings: " + ", ".join(f"{k}={v or '(unset)'}" for k, v in info["settings"].items()))

  checks = _checks()
  say("\nCorrectness against the pure-JAX reference:")
  for c in checks:
    err = "nan" if c["max_rel_err"] is None else f"{c['max_rel_err']:.2e}"
    say(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['op']:36s} {c['dtype']:9s} max rel err {err}")

  timings = [] if args.no_timing else _timings(args.quick, not args.no_progress)
  if timings:
    say("\nMedian ms (jit, after warm-up); speedup = XLA autodiff / jax_normgrad:")
    say(f"  {'workload':34s} {'backward ours':>13s} {'XLA':>8s} {'speedup':>8s}   "
        f"{'grad ours':>9s} {'XLA':>8s} {'speedup':>8s}")
    for r in timings:
      say(f"  {r['workload']:34s} {r['bwd_ours_ms']:13.2f} {r['bwd_xla_ms']:8.2f} "
          f"{r['bwd_speedup']:7.1f}x   {r['grad_ours_ms']:9.2f} {r['grad_xla_ms']:8.2f} "
          f"{r['grad_speedup']:7.1f}x")
  if args.plot:
    title = (f"jax_normgrad {jn.__version__} on {info['platform']} ({info['cpu_kernel_isa']}), "
             f"jax {info['versions']['jax']}")
    _bench.plot_timings(timings, title).savefig(args.plot, dpi=120)
    say(f"\nPlot written to {args.plot}")
  ok = all(c["ok"] for c in checks)
  if args.json:
    report = {**info, "checks": checks, "timings": timings, "plot": args.plot, "ok": ok}
    print(json.dumps(report, indent=2, allow_nan=False))
  else:
    say("\nAll checks passed." if ok else "\nSOME CHECKS FAILED.")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
