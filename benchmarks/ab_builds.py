"""Two builds of the CPU kernels timed against each other in one process.

    python benchmarks/ab_builds.py OTHER.so                      # the default rows
    python benchmarks/ab_builds.py OTHER.so --rows layer_norm:2048x512:fwd,group_norm:8x32x32x64:bwd
    python benchmarks/ab_builds.py OTHER.so --rows add_layer_norm:2048x512:fwd:bfloat16:float32
    python benchmarks/ab_builds.py OTHER.so --rows group_norm+silu:8x32x32x320:bwd,group_norm_nchw+gelu:8x320x32x32:fwd

OTHER.so is another build of ``jax_normgrad/_jax_normgrad*.so`` (the old one:
copy the installed file aside before rebuilding). On this project's shared
2-core VMs a process's medians move by 20-40% from one process to the next,
more than most kernel changes, so processes that alternate between builds
need many pairs to see a 10% change. Here both builds live in one process:
OTHER.so is loaded a second time under its own path and its FFI targets are
registered again with the suffix ``_other``; each row is lowered twice, once
with the package's calls routed to those targets, and the two executables are
timed in alternating rounds (medians of ``--iters`` calls after a short
warm-up, order swapped every round). Printed per row: each build's median,
and the per-round time ratios installed / other with their median. Run it
once with the installed file as OTHER: that A/A run's ratios show how far
the machine alone moves them (on the 2-core VM, medians of 0.99-1.05 over
12 rounds, 0.64-1.11 over 4-8, single rounds off by up to 74%).

A measuring tool, not library code: it reaches into ``jax_normgrad._ffi`` (its
``call``, which every CPU lowering goes through) to route the calls, because
no public API registers a second copy of the kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.machinery
import importlib.util
import os
import shutil
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jng
from jax_normgrad import _bench, _ffi

SUFFIX = "_other"
DEFAULT_ROWS = ("layer_norm:2048x512:fwd,layer_norm:2048x512:bwd,rms_norm:2048x512:fwd,"
                "add_layer_norm:2048x512:fwd,group_norm:8x32x32x64:grad")


def load_other(path: str) -> None:
  """Loads the extension at ``path`` and registers its targets as ``<name>_other``."""
  # A copy, so that the dynamic loader opens it apart from the installed
  # file even when ``path`` is that file; the init symbol comes from the
  # module name, not the file name.
  copy = os.path.join(tempfile.mkdtemp(prefix="jng_ab_"), "other.so")
  shutil.copy(path, copy)
  loader = importlib.machinery.ExtensionFileLoader("_jax_normgrad", copy)
  module = importlib.util.module_from_spec(
      importlib.util.spec_from_file_location("_jax_normgrad", copy, loader=loader))
  loader.exec_module(module)
  for target, capsule in module.registrations().items():
    jax.ffi.register_ffi_target(target + SUFFIX, capsule, platform="cpu")


@contextlib.contextmanager
def routed_to(suffix: str):
  """The package's FFI calls go to the targets named ``<name><suffix>`` meanwhile."""
  installed = _ffi.call
  _ffi.call = lambda target, *args, **kwargs: installed(target + suffix, *args, **kwargs)
  try:
    yield
  finally:
    _ffi.call = installed


def compiled_pair(fn, args):
  """``fn`` compiled with the installed kernels and with the other build's."""
  out = {}
  for build, suffix in (("installed", ""), ("other", SUFFIX)):
    jax.clear_caches()  # a fresh lowering, not the other build's from the cache
    with routed_to(suffix):
      lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
    text = lowered.as_text()
    if "custom_call @jax_normgrad_" not in text or (SUFFIX in text) != bool(suffix):
      raise RuntimeError(f"the {build} build's kernels are not the ones lowered")
    out[build] = lowered.compile()
  return out


DTYPES = ("float32", "bfloat16", "float16")


def row(spec: str):
  """``(fn, args)`` of a row ``op:shape:pass[:dtype[:residual dtype]]`` (pass: fwd, bwd or
  grad; x's dtype, default float32; the add ops' residual and h dtype, default x's: an
  argument, ``0.5 * x``); the parameters are float32. ``group_norm+ACT`` (ACT: silu, gelu,
  relu) is GroupNorm with that activation fused, channels-last like ``group_norm``;
  ``group_norm_nchw+ACT`` the same with x as N x C x H x W."""
  parts = spec.split(":")
  op, shape, kind = (parts + ["", "", ""])[:3]
  dtype = parts[3] if len(parts) > 3 else "float32"
  res_dtype = parts[4] if len(parts) > 4 else dtype
  norms = {
      "layer_norm": lambda x, r, w, b: jng.layer_norm(x, w, b),
      "rms_norm": lambda x, r, w, b: jng.rms_norm(x, w),
      "add_layer_norm": lambda x, r, w, b: jng.add_layer_norm(x, r, w, b,
                                                              residual_dtype=r.dtype)[0],
      "add_rms_norm": lambda x, r, w, b: jng.add_rms_norm(x, r, w, residual_dtype=r.dtype)[0],
      "group_norm": lambda x, r, w, b: jng.group_norm(x, 32, w, b, channel_axis=-1),
  }
  # GroupNorm with a fused activation, channels-last (SHAPE: N x H x W x C) and channels-first
  # (group_norm_nchw: N x C x H x W).
  for act in ("silu", "gelu", "relu"):
    norms[f"group_norm+{act}"] = functools.partial(
        lambda x, r, w, b, act: jng.group_norm(x, 32, w, b, channel_axis=-1, activation=act),
        act=act)
    norms[f"group_norm_nchw+{act}"] = functools.partial(
        lambda x, r, w, b, act: jng.group_norm(x, 32, w, b, activation=act), act=act)
  if (op not in norms or kind not in ("fwd", "bwd", "grad") or len(parts) > 5
      or dtype not in DTYPES or res_dtype not in (dtype, "float32")
      or (res_dtype != dtype and not op.startswith("add_"))):
    raise ValueError(f"row {spec!r}: expected OP:SHAPE:PASS[:DTYPE[:RESIDUAL_DTYPE]], OP one of "
                     f"{sorted(norms)}, PASS fwd, bwd or grad, DTYPE one of {DTYPES}, "
                     "RESIDUAL_DTYPE (add ops) x's or float32")
  dims = tuple(int(d) for d in shape.split("x"))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(dims), dtype)
  r = (0.5 * x.astype(jnp.float32)).astype(res_dtype)
  ct = jnp.asarray(rng.standard_normal(dims), dtype)
  c = dims[1] if op.startswith("group_norm_nchw") else dims[-1]
  w = jnp.asarray(1 + 0.1 * rng.standard_normal(c), jnp.float32)
  b = jnp.asarray(0.1 * rng.standard_normal(c), jnp.float32)
  norm = norms[op]
  if kind == "fwd":
    fn = lambda x, r, w, b, ct: norm(x, r, w, b)
  elif kind == "bwd":
    fn = lambda x, r, w, b, ct: jax.vjp(lambda x, w, b: norm(x, r, w, b), x, w, b)[1](ct)
  else:
    fn = lambda x, r, w, b, ct: jax.grad(
        lambda x, w, b: jnp.vdot(norm(x, r, w, b).astype(jnp.float32), ct.astype(jnp.float32)),
        argnums=(0, 1, 2))(x, w, b)
  return fn, (x, r, w, b, ct)


def measure(spec: str, rounds: int, iters: int) -> dict:
  fn, args = row(spec)
  fns = compiled_pair(fn, args)
  times = {"installed": [], "other": []}
  for r in range(rounds):
    for build in (("installed", "other") if r % 2 == 0 else ("other", "installed")):
      f = fns[build]
      _bench.warm_up(lambda: jax.block_until_ready(f(*args)), 1, 20)
      times[build].append(statistics.median(_bench.call_times_ms(f, *args, warmup=0, iters=iters)))
  ratios = [a / b for a, b in zip(times["installed"], times["other"])]
  return dict(installed_ms=statistics.median(times["installed"]),
              other_ms=statistics.median(times["other"]), ratios=ratios,
              ratio_median=statistics.median(ratios))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("other", help="another build's _jax_normgrad*.so")
  parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated OP:SHAPE:PASS")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--iters", type=int, default=40, help="calls per build per round")
  parser.add_argument("--keep-freed-memory", action="store_true",
                      help="jax_normgrad.keep_freed_memory() first (no fresh-page faults)")
  a = parser.parse_args(argv)
  if a.keep_freed_memory:
    jng.keep_freed_memory()
  load_other(a.other)
  print(f"installed {_ffi._ext.__file__} against {a.other}; jax {jax.__version__}, "  # noqa: SLF001
        f"{a.rounds} rounds of {a.iters} calls, ms")
  for spec in a.rows.split(","):
    m = measure(spec, a.rounds, a.iters)
    print(f"{spec}: installed {m['installed_ms']:.4f} other {m['other_ms']:.4f}  installed/other "
          f"by round: median {m['ratio_median']:.3f} [{' '.join(f'{q:.2f}' for q in m['ratios'])}]",
          flush=True)


if __name__ == "__main__":
  main()
