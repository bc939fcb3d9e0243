"""Timing helpers and the op workloads of the command line (``python -m jax_normgrad``).

A workload builds jitted callables for this package and for XLA's autodiff of
the equivalent jnp layer on the same inputs; ``median_ms`` times them. The
benchmark scripts use these too; their heavier workloads (the residual form,
the MLP stack) and the profile parsing are ``benchmarks/bench_lib.py``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn


def warm_up(call: Callable[[], Any], count: int, ms: float = 0.0) -> None:
  """Calls ``call()`` ``count`` times, then more until ``ms`` have passed since the first."""
  t0 = time.perf_counter()
  for _ in range(count):
    call()
  while 1e3 * (time.perf_counter() - t0) < ms:
    call()


def call_times_ms(fn: Callable, *args, warmup: int = 3, iters: int = 15,
                  min_time_s: float = 0.0, batch_ms: float = 0.0,
                  warmup_ms: float = 0.0, block: Callable | None = None) -> list[float]:
  """Wall times of ``iters`` calls ``fn(*args)`` (and more until ``min_time_s``), ms, after warm-up.

  The warm-up is ``warmup`` calls, then more until ``warmup_ms`` have
  passed since the first (see ``WARMUP_MS``).

  By default each call is blocked on and timed alone. ``batch_ms`` > 0: each
  sample is the mean of ``k`` calls issued back to back and blocked once,
  ``k`` (1 to 100) chosen after the warm-up so that a sample lasts about
  ``batch_ms``. On a GPU a call's dispatch and synchronisation cost tens of
  microseconds, about as long as a norm kernel over 100 MB; issued back to
  back, the calls queue on the device and the sample is the kernels' time.
  ``fn`` must not donate its arguments. ``block(results)`` waits for the
  results (default ``jax.block_until_ready``; another framework's calls,
  such as PyTorch's, pass its synchronize, and are timed the same way).
  """
  block = block or jax.block_until_ready
  warm_up(lambda: block(fn(*args)), warmup, warmup_ms)
  k = 1
  if batch_ms > 0:
    t0 = time.perf_counter()
    block([fn(*args) for _ in range(5)])
    per_call_ms = 1e3 * (time.perf_counter() - t0) / 5
    k = max(1, min(100, math.ceil(batch_ms / max(per_call_ms, 1e-3))))
  times = []
  start = time.perf_counter()
  while len(times) < iters or time.perf_counter() - start < min_time_s:
    t0 = time.perf_counter()
    block(fn(*args) if k == 1 else [fn(*args) for _ in range(k)])
    times.append(1e3 * (time.perf_counter() - t0) / k)
  return times


#: A warm-up long enough for a steady state after an idle pause, ms. On the
#: project's 2-core VM the first calls of a kernel on a few MiB after an idle
#: pause of 50 ms run up to 2.5x slower and take about ten calls to recover:
#: LayerNorm 2048x1024 float32 backward, the 8 calls after each of 8
#: pauses, medians 2.55 2.21 2.03 2.00 1.94 1.72 1.79 1.71 ms; after the
#: pause and 20 ms of calls 0.83-1.32 ms; with no pause 0.86-0.96 (XLA's
#: backward: 4.1, 4.3 and 3.5 ms in the three cases). A layer inside a model
#: reads what the op before it has just written; one call of warm-up timed
#: the kernel in the slow state instead.
WARMUP_MS = 20.0


def max_rel_err(a, b) -> float:
  """``max |a - b|`` over ``max |b|`` (0 for empty arrays), both read as float32."""
  a = np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b).astype(jnp.float32), np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0


def median_ms(fn: Callable, *args, **kw) -> float:
  """Median wall time of ``fn(*args)`` in milliseconds (see :func:`call_times_ms` for ``kw``)."""
  return statistics.median(call_times_ms(fn, *args, **kw))


def time_variant(variant, **kw) -> float:
  """Times a ``(jitted fn, args)`` pair of a :class:`Workload`."""
  fn, args = variant
  return median_ms(fn, *args, **kw)


# ----------------------------------------------------------------------------
# jnp layers: what a JAX user writes today; XLA's autodiff differentiates them.


def jnp_layer_norm(x, weight, bias, eps=1e-5):
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * weight + bias
  return y.astype(x.dtype)


def jnp_group_norm(x, groups, weight, bias, eps=1e-5, channels_last=False):
  """GroupNorm of NCHW ``x`` (NHWC with ``channels_last``)."""
  if channels_last:
    n, c = x.shape[0], x.shape[-1]
    xb = x.reshape(n, -1, groups, c // groups).astype(jnp.float32)
    axes, shape = (1, 3), (1,) * (x.ndim - 1) + (c,)
  else:
    n, c = x.shape[:2]
    xb = x.reshape(n, groups, -1).astype(jnp.float32)
    axes, shape = (2,), (1, c) + (1,) * (x.ndim - 2)
  mean = jnp.mean(xb, axis=axes, keepdims=True)
  var = jnp.mean(jnp.square(xb - mean), axis=axes, keepdims=True)
  y = ((xb - mean) * jax.lax.rsqrt(var + eps)).reshape(x.shape)
  return (y * weight.reshape(shape) + bias.reshape(shape)).astype(x.dtype)


def jnp_rms_norm(x, weight, eps=1e-6):
  x32 = x.astype(jnp.float32)
  ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return (x32 * jax.lax.rsqrt(ms + eps) * weight).astype(x.dtype)


@dataclasses.dataclass
class Workload:
  """One shape: jitted (fn, args) pairs for each measured variant."""

  name: str
  nbytes_bwd: int  # bytes a backward must move: read x, dy; write dx.
  nbytes_fwd: int  # bytes a forward must move: read x; write y.
  ours_bwd: tuple
  xla_bwd: tuple
  ours_fwd: tuple
  xla_fwd: tuple
  ours_grad: tuple
  xla_grad: tuple
  # One XLA elementwise pass over the forward's data, ``x * weight + bias``
  # (read x, write y; no reduction): the speed of XLA's own fusions at the
  # shape, so xla_fwd / xla_pass is the most a forward running as fast as
  # XLA's one pass could lead XLA's forward by.
  xla_pass: tuple | None = None


def _call_vjp(vjp_fn, ct):
  return vjp_fn(ct)


def _pure_backward(f, primals, ct):
  """XLA's autodiff backward alone: residuals computed once, the pullback jitted."""
  _, vjp_fn = jax.vjp(f, *primals)
  return jax.jit(_call_vjp), (vjp_fn, ct)


def layer_norm_workload(rows: int, hidden: int, dtype=jnp.float32, seed: int = 0) -> Workload:
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (rows, hidden), jnp.float32).astype(dtype)
  dy = jax.random.normal(k[1], (rows, hidden), jnp.float32).astype(dtype)
  w = (1 + 0.1 * jax.random.normal(k[2], (hidden,))).astype(dtype)
  b = (0.1 * jax.random.normal(k[3], (hidden,))).astype(dtype)
  _, mean, rstd = jn.layer_norm_fwd(x, hidden, w, b)
  ours_bwd = jax.jit(lambda dy, x, m, r, w, b: jn.layer_norm_backward(dy, x, hidden, m, r, w, b))
  ours_fwd = jax.jit(lambda x, w, b: jn.layer_norm_fwd(x, hidden, w, b))
  loss = lambda f: lambda x, w, b, dy: jnp.vdot(f(x, w, b).astype(jnp.float32), dy.astype(jnp.float32))
  grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))
  ours = lambda x, w, b: jn.layer_norm(x, w, b)
  return Workload(
      name=f"LayerNorm {rows}x{hidden} {jnp.dtype(dtype).name}",
      nbytes_bwd=3 * x.size * x.dtype.itemsize,
      nbytes_fwd=2 * x.size * x.dtype.itemsize,
      ours_bwd=(ours_bwd, (dy, x, mean, rstd, w, b)),
      xla_bwd=_pure_backward(jnp_layer_norm, (x, w, b), dy),
      ours_fwd=(ours_fwd, (x, w, b)),
      xla_fwd=(jax.jit(jnp_layer_norm), (x, w, b)),
      ours_grad=(grad(ours), (x, w, b, dy)),
      xla_grad=(grad(jnp_layer_norm), (x, w, b, dy)),
      xla_pass=(jax.jit(lambda x, w, b: x * w + b), (x, w, b)),
  )


def rms_norm_workload(rows: int, hidden: int, dtype=jnp.float32, seed: int = 0) -> Workload:
  """RMSNorm over the last axis with a weight (no bias: RMSNorm has none)."""
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (rows, hidden), jnp.float32).astype(dtype)
  dy = jax.random.normal(k[1], (rows, hidden), jnp.float32).astype(dtype)
  w = (1 + 0.1 * jax.random.normal(k[2], (hidden,))).astype(dtype)
  _, rstd = jn.rms_norm_fwd(x, hidden, w)
  ours_bwd = jax.jit(lambda dy, x, r, w: jn.rms_norm_backward(dy, x, hidden, r, w))
  ours_fwd = jax.jit(lambda x, w: jn.rms_norm_fwd(x, hidden, w))
  loss = lambda f: lambda x, w, dy: jnp.vdot(f(x, w).astype(jnp.float32), dy.astype(jnp.float32))
  grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1)))
  ours = lambda x, w: jn.rms_norm(x, w)
  return Workload(
      name=f"RMSNorm {rows}x{hidden} {jnp.dtype(dtype).name}",
      nbytes_bwd=3 * x.size * x.dtype.itemsize,
      nbytes_fwd=2 * x.size * x.dtype.itemsize,
      ours_bwd=(ours_bwd, (dy, x, rstd, w)),
      xla_bwd=_pure_backward(jnp_rms_norm, (x, w), dy),
      ours_fwd=(ours_fwd, (x, w)),
      xla_fwd=(jax.jit(jnp_rms_norm), (x, w)),
      ours_grad=(grad(ours), (x, w, dy)),
      xla_grad=(grad(jnp_rms_norm), (x, w, dy)),
      xla_pass=(jax.jit(lambda x, w: x * w), (x, w)),
  )


def group_norm_workload(n: int, c: int, h: int, w_: int, groups: int, dtype=jnp.float32,
                        seed: int = 0, channels_last: bool = False) -> Workload:
  """GroupNorm of an ``(n, c, h, w_)`` NCHW tensor, or ``(n, h, w_, c)`` with ``channels_last``."""
  k = jax.random.split(jax.random.key(seed), 4)
  shape = (n, h, w_, c) if channels_last else (n, c, h, w_)
  x = jax.random.normal(k[0], shape, jnp.float32).astype(dtype)
  dy = jax.random.normal(k[1], shape, jnp.float32).astype(dtype)
  g = (1 + 0.1 * jax.random.normal(k[2], (c,))).astype(dtype)
  b = (0.1 * jax.random.normal(k[3], (c,))).astype(dtype)
  hw = h * w_
  cl = dict(channels_last=channels_last)
  _, mean, rstd = jn.group_norm_fwd(x, g, b, n, c, hw, groups, **cl)
  ours_bwd = jax.jit(lambda dy, x, m, r, g: jn.group_norm_backward(dy, x, m, r, g, n, c, hw, groups,
                                                                   **cl))
  ours_fwd = jax.jit(lambda x, g, b: jn.group_norm_fwd(x, g, b, n, c, hw, groups, **cl))
  ref = lambda x, g, b: jnp_group_norm(x, groups, g, b, **cl)
  ours = lambda x, g, b: jn.group_norm(x, groups, g, b, channel_axis=-1 if channels_last else 1)
  loss = lambda f: lambda x, g, b, dy: jnp.vdot(f(x, g, b).astype(jnp.float32), dy.astype(jnp.float32))
  grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))
  layout = "x".join(map(str, shape)) + (" NHWC" if channels_last else "")
  pshape = (c,) if channels_last else (c, 1, 1)
  return Workload(
      name=f"GroupNorm {layout} g{groups} {jnp.dtype(dtype).name}",
      nbytes_bwd=3 * x.size * x.dtype.itemsize,
      nbytes_fwd=2 * x.size * x.dtype.itemsize,
      ours_bwd=(ours_bwd, (dy, x, mean, rstd, g)),
      xla_bwd=_pure_backward(ref, (x, g, b), dy),
      ours_fwd=(ours_fwd, (x, g, b)),
      xla_fwd=(jax.jit(ref), (x, g, b)),
      ours_grad=(grad(ours), (x, g, b, dy)),
      xla_grad=(grad(ref), (x, g, b, dy)),
      xla_pass=(jax.jit(lambda x, g, b: x * g.reshape(pshape) + b.reshape(pshape)), (x, g, b)),
  )


#: What a timing row measures: the backward alone, and jax.grad of the layer.
KINDS = ("bwd", "grad")


def time_workload(wl: Workload, progress=None, **kw) -> dict:
  """Times a workload's backward and ``jax.grad``, ours against XLA's autodiff.

  Args:
    wl: the workload.
    progress: optional tqdm-like bar (``set_postfix_str``, ``update``),
      advanced once per timed variant (4 per workload).
    **kw: passed to :func:`median_ms` (``warmup``, ``iters``, ``min_time_s``).

  Returns:
    ``{"workload", "nbytes_bwd", "<kind>_ours_ms", "<kind>_xla_ms",
    "<kind>_speedup"}`` for kind in ``KINDS``; speedup = XLA / ours.
  """
  row = {"workload": wl.name, "nbytes_bwd": wl.nbytes_bwd}
  for kind in KINDS:
    for who in ("ours", "xla"):
      if progress is not None:
        progress.set_postfix_str(f"{wl.name}: {kind} {who}")
      row[f"{kind}_{who}_ms"] = time_variant(getattr(wl, f"{who}_{kind}"), **kw)
      if progress is not None:
        progress.update(1)
    row[f"{kind}_speedup"] = row[f"{kind}_xla_ms"] / row[f"{kind}_ours_ms"]
  return row


def plot_timings(rows: list[dict], title: str = ""):
  """A matplotlib Figure of :func:`time_workload` rows: ours against XLA, per workload.

  Uses ``matplotlib.figure.Figure`` directly (no pyplot, no GUI backend);
  save it with ``fig.savefig(path)`` or show it as a notebook cell's value.
  Raises ImportError without matplotlib.
  """
  from matplotlib.figure import Figure
  fig = Figure(figsize=(11, 1.6 + 0.7 * len(rows)), layout="constrained")
  axes = fig.subplots(1, len(KINDS), sharey=True)
  ys = np.arange(len(rows))
  titles = {"bwd": "backward alone", "grad": "jax.grad of the layer"}
  for ax, kind in zip(axes, KINDS):
    ours = [r[f"{kind}_ours_ms"] for r in rows]
    xla = [r[f"{kind}_xla_ms"] for r in rows]
    ax.barh(ys - 0.2, xla, height=0.4, label="XLA autodiff of the jnp layer", color="#bbbbbb")
    ax.barh(ys + 0.2, ours, height=0.4, label="jax_normgrad", color="#1f77b4")
    for y, o, x in zip(ys, ours, xla):
      ax.text(o, y + 0.2, f" {x / o:.1f}x", va="center", fontsize=8)
    ax.set_title(titles[kind])
    ax.set_xlabel("median ms (lower is better)")
    ax.set_yticks(ys, [r["workload"] for r in rows])
  axes[0].invert_yaxis()  # the first workload on top; the y axis is shared: once for both
  fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2,
             fontsize=8)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig



def versions() -> dict:
  import platform
  import os
  return {
      "jax": jax.__version__,
      "jaxlib": jax.lib.__version__ if hasattr(jax, "lib") else "?",
      "jax_normgrad": jn.__version__,
      "numpy": np.__version__,
      "python": platform.python_version(),
      "machine": platform.machine(),
      "cpus": os.cpu_count(),
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }
