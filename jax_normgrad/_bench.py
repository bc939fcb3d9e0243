"""Timing helpers and the comparison workloads shared by the CLI and benchmarks/.

A workload builds jitted callables for this package and for XLA's autodiff of
the equivalent jnp layer on the same inputs; ``median_ms`` times them.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import math
import os
import re
import statistics
import tempfile
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


# ----------------------------------------------------------------------------
# The residual form (add_layer_norm / add_rms_norm): benchmarks/bench_cpu.py and bench_gpu.py
# --residual.


def residual_variants(kind, dtype, residual_dtype=None):
  """Forward + backward of a pre-norm block's residual add and norm, three ways: ``{name: fn}``.

  Each ``fn(x, r, w, b, dy, dh)`` returns y, h and the gradients of x, r
  and the parameters for the cotangents ``dy`` (of y) and ``dh`` (of h,
  from the next block): ``fused`` is :func:`jax_normgrad.add_layer_norm` /
  ``add_rms_norm``; ``unfused`` is this package's ``layer_norm(x +
  residual)`` (the add and the backward's ``dx + dh`` as XLA passes around
  the kernels); ``xla`` is XLA's autodiff of the jnp code (float32 math,
  as _bench's jnp layers). ``residual_dtype`` float32 with a 16-bit
  ``dtype`` (flash-attn's ``residual_in_fp32``): the residual and h are
  float32; the unfused forms add in float32 and the norm's y is rounded
  to ``dtype`` (by the kernel: ``out_dtype``; by XLA in the jnp form).
  """
  centered = kind == "ln"
  stream = jnp.dtype(residual_dtype or dtype)
  fused = (lambda x, r, w, b: jn.add_layer_norm(x, r, w, b, residual_dtype=residual_dtype)) if (
      centered) else (lambda x, r, w, b: jn.add_rms_norm(x, r, w, residual_dtype=residual_dtype))

  def unfused(x, r, w, b):
    h = x.astype(stream) + r
    # out_dtype: the kernel rounds y to x's dtype itself (a float32 stream's norm).
    return (jn.layer_norm(h, w, b, out_dtype=dtype) if centered
            else jn.rms_norm(h, w, out_dtype=dtype)), h

  def xla(x, r, w, b):
    h = x.astype(stream) + r
    return (jnp_layer_norm(h, w, b) if centered else jnp_rms_norm(h, w)).astype(dtype), h

  def step(f):
    def run(x, r, w, b, dy, dh):
      out, vjp = jax.vjp(f, x, r, w, b)
      return out, vjp((dy, dh))
    return jax.jit(run)

  return {name: step(f) for name, f in (("fused", fused), ("unfused", unfused), ("xla", xla))}


def residual_inputs(shape, dtype, residual_dtype=None):
  """The residual rows' operands ``(x, r, w, b, dy, dh)``: x and dy in ``dtype``; the residual,
  h's cotangent and the parameters in the stream's dtype (``residual_dtype``, None: ``dtype``)."""
  stream = jnp.dtype(residual_dtype or dtype)
  k = jax.random.split(jax.random.key(0), 6)
  x, r, dy, dh = (jax.random.normal(ki, shape, jnp.float32).astype(d)
                  for ki, d in zip(k[:4], (dtype, stream, dtype, stream)))
  w = (1 + 0.1 * jax.random.normal(k[4], shape[-1:], jnp.float32)).astype(stream)
  b = (0.1 * jax.random.normal(k[5], shape[-1:], jnp.float32)).astype(stream)
  return x, r, w, b, dy, dh


def measure_residual(kind, shape, dtype, iters, rounds=3, settle_s=0.0, batch_ms=0.0,
                     residual_dtype=None):
  """One residual row: each variant's median over interleaved rounds, and the ratios to fused.

  ``batch_ms``: passed to :func:`call_times_ms` (the GPU benchmark times calls back to back).
  ``residual_dtype``: the residual stream's dtype (:func:`residual_variants`;
  the residual, h's cotangent and the parameters are then in it).
  """
  rows_, hidden = shape
  stream = jnp.dtype(residual_dtype or dtype)
  x, r, w, b, dy, dh = residual_inputs(shape, dtype, residual_dtype)
  variants = residual_variants(kind, dtype, residual_dtype)
  per_round = max(1, -(-iters // rounds))
  samples = {name: [] for name in variants}
  for rnd in range(rounds):
    for name, fn in variants.items():
      time.sleep(settle_s)
      samples[name] += call_times_ms(fn, x, r, w, b, dy, dh, warmup=3 if rnd == 0 else 1,
                                     iters=per_round, batch_ms=batch_ms)
  row = {"workload": f"add_{'layer' if kind == 'ln' else 'rms'}_norm {rows_}x{hidden} "
                     f"{jnp.dtype(dtype).name}"
                     + (f", {stream.name} residual stream" if stream != dtype else ""),
         "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "residual_dtype": stream.name, "rounds": rounds}
  for name, times in samples.items():
    row[f"{name}_ms"] = float(np.median(times))
  row["unfused_vs_fused"] = row["unfused_ms"] / row["fused_ms"]
  row["xla_vs_fused"] = row["xla_ms"] / row["fused_ms"]
  return row


STACK_VARIANTS = ("fused", "unfused", "xla")
# The stack's benchmark rows: (dtype, residual stream dtype; None: dtype's). bfloat16 with a
# float32 stream is flash-attn's residual_in_fp32.
STACK_ROWS = ((jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.float32))


def mlp_stack_step(variant, layers, hidden, ffn, dtype, tokens=4096, residual_dtype=None):
  """A pre-norm stack of MLP blocks (RMSNorm, dense, gelu, dense, residual add): its jitted SGD step.

  ``variant`` (STACK_VARIANTS): "fused", each block's residual add and the
  next norm one :func:`jax_normgrad.add_rms_norm`; "unfused", ``h = h +
  out`` then :func:`jax_normgrad.rms_norm` (this package's kernels either
  way); "xla", ``h = h + out`` then the jnp RMSNorm (XLA's autodiff).
  ``residual_dtype``: the residual stream's dtype (None: ``dtype``;
  float32 with a 16-bit ``dtype`` is flash-attn's ``residual_in_fp32``:
  the unfused forms add in float32 and the norm writes y in ``dtype`` for
  the next dense, ``out_dtype``).
  Returns ``(step, params, batch)``; ``step(params, batch)`` is the jitted
  ``value_and_grad`` of the mean-square loss of the last norm's output
  plus the SGD update of the parameters.
  """
  if variant not in STACK_VARIANTS:
    raise ValueError(f"variant: expected one of {STACK_VARIANTS}, got {variant!r}")
  stream = jnp.dtype(residual_dtype or dtype)
  k = jax.random.split(jax.random.key(0), 2 * layers + 1)
  params = {"norm": [jnp.ones((hidden,), jnp.float32) for _ in range(layers + 1)],
            "w1": [(jax.random.normal(k[2 * i], (hidden, ffn), jnp.float32) / hidden ** 0.5)
                   for i in range(layers)],
            "w2": [(jax.random.normal(k[2 * i + 1], (ffn, hidden), jnp.float32) / ffn ** 0.5)
                   for i in range(layers)]}

  def norm(h, w):
    if variant == "xla":
      return jnp_rms_norm(h, w).astype(dtype)
    return jn.rms_norm(h, w, out_dtype=dtype)  # y rounded to the matmuls' dtype by the kernel

  def loss(params, x):
    h = x.astype(stream)
    y = norm(h, params["norm"][0].astype(stream))
    for i in range(layers):
      out = jax.nn.gelu(y @ params["w1"][i].astype(dtype)) @ params["w2"][i].astype(dtype)
      if variant == "fused":
        y, h = jn.add_rms_norm(out, h, params["norm"][i + 1].astype(dtype),
                               residual_dtype=residual_dtype)
      else:
        h = h + out.astype(stream)
        y = norm(h, params["norm"][i + 1].astype(stream))
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  @jax.jit
  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

  return step, params, jax.random.normal(k[-1], (tokens, hidden), jnp.float32).astype(dtype)


def _op_names(hlo_text: str) -> tuple[set[str], set[str]]:
  """``(every instruction, the matmuls)`` of a compiled module's text, by name.

  The matmuls: dots and convolutions, and fusions that contain one.
  """
  bodies, cur = {}, None
  for line in hlo_text.splitlines():
    if line and not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
      cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      bodies[cur] = []
    elif cur is not None:
      bodies[cur].append(line)
  heavy = {name for name, lines in bodies.items()
           if any(re.search(r" (dot|convolution)\(", x) for x in lines)}
  names, matmuls = set(), set()
  for lines in bodies.values():
    for x in lines:
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", x)
      if not m:
        continue
      names.add(m.group(1))
      called = re.search(r"calls=%?([\w.\-]+)", x)
      if m.group(2) in ("dot", "convolution") or (
          m.group(2) == "fusion" and called is not None and called.group(1) in heavy):
        matmuls.add(m.group(1))
  return names, matmuls


def trace_events(fn, args, calls: int) -> list[dict]:
  """The ``jax.profiler`` trace events of ``calls`` blocked calls of ``fn(*args)``."""
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    path, = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      return json.load(f)["traceEvents"]


#: GPU kernels that are matrix products or convolutions, by name (cuBLAS, cuDNN, CUTLASS and
#: XLA's GEMM fusions; not "conv", which would take XLA's convert fusions).
GPU_MATMUL_KERNEL = re.compile(r"gemm|xmma|cutlass|cudnn|wgmma|nvjet|cublas|sm\d\d_", re.IGNORECASE)
#: This package's GPU kernels (the Pallas kernels' names).
GPU_NORM_KERNEL = "jax_normgrad"


def _gpu_pids(events: list[dict]) -> set:
  """The trace's GPU device processes (empty on a CPU run)."""
  return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}


def step_op_ms(step, args, calls: int = 5, top: int = 0, hlo_text: str | None = None) -> dict:
  """Where a jitted step's time goes, from a profile of ``calls`` calls: ms per call.

  ``ops`` is the time of the compiled module's operations (XLA:CPU's thunks,
  including custom calls; on a GPU the device's kernels), ``matmul`` that of
  the dots and convolutions (and fusions containing one; on a GPU the
  kernels named as ``GPU_MATMUL_KERNEL``), ``other`` the rest: the
  memory-bound passes a norm's implementation changes. On a GPU also
  ``norm``, this package's kernels (part of ``other``), ``launches``, the
  kernels (and memsets) run per call, and with ``top``
  the ``top`` largest kernels as ``kernels``: ``[name, us per call,
  launches per call]``. Summed op durations, not wall time (ops the runtime
  runs concurrently both count). Uses a ``jax.profiler`` trace
  (:func:`trace_events`), so it needs a backend whose runtime emits per-op
  trace events (XLA:CPU and XLA:GPU do). ``hlo_text``: the compiled
  module's text, where the caller has it (``step`` may then be a compiled
  executable); else ``step`` is lowered and compiled again for it.
  """
  names, matmuls = _op_names(hlo_text if hlo_text is not None
                             else step.lower(*args).compile().as_text())
  events = trace_events(step, args, calls)
  gpus = _gpu_pids(events)
  ops = matmul = norm = 0.0
  per_kernel, launches = collections.Counter(), collections.Counter()
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X":
      continue
    if gpus:
      if e["pid"] not in gpus:
        continue
      per_kernel[name] += e["dur"]
      launches[name] += 1
      matmul += e["dur"] if GPU_MATMUL_KERNEL.search(name) else 0.0
      norm += e["dur"] if name.startswith(GPU_NORM_KERNEL) else 0.0
    elif name not in names:
      continue  # Python frames, runtime spans: op events are named by their instruction
    elif name in matmuls:
      matmul += e["dur"]
    ops += e["dur"]
  out = {"ops": ops / calls / 1e3, "matmul": matmul / calls / 1e3,
         "other": (ops - matmul) / calls / 1e3}
  if gpus:
    out["norm"] = norm / calls / 1e3
    out["launches"] = sum(launches.values()) / calls
  if top:
    out["kernels"] = [[k, round(v / calls, 2), launches[k] / calls]
                      for k, v in per_kernel.most_common(top)]
  return out


def measure_stack(dtype, iters, rounds=3, settle_s=0.0, layers=4, hidden=1024, ffn=256,
                  tokens=4096, residual_dtype=None, profile=False):
  """The MLP stack's training step in each of STACK_VARIANTS, interleaved rounds.

  ``profile``: also each variant's op time split into matmul and other
  (:func:`step_op_ms`) as ``{variant}_{ops,matmul,other}_ms``: the dots are
  the same in every variant and most of the step, so the norms' effect is
  read more precisely in ``other`` than in the wall time.

  Besides each variant's median, ``unfused_vs_fused`` and ``xla_vs_fused``
  are the medians of the per-round ratios (each round times the variants
  back to back, so a ratio sees one machine state: on a shared machine
  these are steadier than the ratio of the medians).
  """
  variants = {name: mlp_stack_step(name, layers, hidden, ffn, dtype, tokens, residual_dtype)
              for name in STACK_VARIANTS}
  per_round = max(1, -(-iters // rounds))
  samples = {name: [] for name in variants}
  per_round_ms = {name: [] for name in variants}
  for rnd in range(rounds):
    for name, (step, params, x) in variants.items():
      time.sleep(settle_s)
      times = call_times_ms(step, params, x, warmup=2 if rnd == 0 else 1, iters=per_round)
      samples[name] += times
      per_round_ms[name].append(float(np.median(times)))
  stream = "" if residual_dtype is None else f", {jnp.dtype(residual_dtype).name} residual stream"
  row = {"workload": f"mlp stack step {layers}x({tokens}x{hidden}, ffn {ffn}) "
                     f"{jnp.dtype(dtype).name}{stream}",
         "dtype": jnp.dtype(dtype).name, "rounds": rounds,
         "residual_dtype": None if residual_dtype is None else jnp.dtype(residual_dtype).name}
  for name, times in samples.items():
    row[f"{name}_ms"] = float(np.median(times))
  for name in ("unfused", "xla"):
    ratios = np.array(per_round_ms[name]) / np.array(per_round_ms["fused"])
    row[f"{name}_vs_fused"] = float(np.median(ratios))
    row[f"{name}_vs_fused_rounds"] = [round(float(r), 4) for r in ratios]
  if profile:
    for name, (step, params, x) in variants.items():
      for key, ms in step_op_ms(step, (params, x)).items():
        row[f"{name}_{key}_ms"] = ms
  return row


def print_residual_rows(rows):
  """One line per residual / stack row: fused, unfused (and XLA) ms and their ratios to fused."""
  for r in rows:
    xla = f" {r['xla_ms']:8.2f}  {r['xla_vs_fused']:5.2f}x" if "xla_ms" in r else ""
    print(f"{r['workload']:48s} fused {r['fused_ms']:8.2f}  unfused {r['unfused_ms']:8.2f} "
          f" {r['unfused_vs_fused']:5.2f}x" + (f" | XLA{xla}" if xla else ""), flush=True)
    if "fused_other_ms" in r:
      other = "  ".join(f"{name} {r[f'{name}_other_ms']:7.2f}" for name in STACK_VARIANTS)
      matmul = "  ".join(f"{r[f'{name}_matmul_ms']:7.2f}" for name in STACK_VARIANTS)
      print(f"{'':48s} op time besides the matmuls, ms: {other} (matmuls: {matmul})", flush=True)


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
