"""The differential fuzz's norms and look-alikes (tests/test_rewrite_fuzz.py), and its float64 truth.

A :class:`Case` is plain data: a layout, dtypes and casts, the written forms of
the centering, the variance and the inverse square root, scale, offset,
residual, activation, a look-alike's defect, a wrapper, the shape and the
inputs' seed. :func:`build` writes it as jnp code, ``f(x, w, b, r) -> y``.

The truth is the same code with every float dtype float64 (``build(case,
truth=True)``), differentiated by jax with ``jax_enable_x64``: only in a
process of its own (run as a script, this module is that process: it reads
pickled requests on stdin and answers on stdout), never in the test's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import rewrite_corpus as rc

LAYOUTS = ("ln", "rms", "gn_nhwc", "gn_nchw")
#: Where the code casts: x up to float32 and y back ("up_down"), y left float32 ("up_keep"),
#: the normalized value rounded to x's dtype before the affine ("xhat_down", Llama's), or all
#: arithmetic in x's dtype ("native").
CASTS = ("up_down", "up_keep", "xhat_down", "native")
CENTERS = ("mean", "sum_n", "sum_times")
#: LayerNorm: mean((x - m)^2), mean(x^2) - m^2 (bare or clamped at 0), jnp.var;
#: RMSNorm: the square written as x * x, jnp.square, x ** 2 (the same three names).
VARIANCES = ("centered", "one_pass", "one_pass_max", "var")
INV_SQRTS = ("rsqrt", "one_over_sqrt", "pow", "div_sqrt")
SCALES = ("none", "w", "one_plus_w")
#: rewrite_corpus.ACTIVATION_FORMS' names, or none.
ACTIVATIONS = ("none",) + tuple(rc.ACTIVATION_FORMS)
#: A residual add before the norm: its sum read by the norm only, or also after it.
RESIDUALS = ("none", "add", "add_used")
#: Defects that make a look-alike of a norm: eps outside the square root, statistics over
#: another axis, a max where the mean is (of x; of the squares in an RMSNorm), the rsqrt a
#: custom_jvp function of its own rule.
LOOKALIKES = ("none", "eps_outside", "other_axis", "max_center", "custom_jvp_rsqrt")
#: The norm (its affine and activation) as a nested jit, checkpointed, or a custom_jvp function
#: of a straight-through rule (derivative the identity in h, none in w and b).
WRAPS = ("none", "jit", "checkpoint", "straight_through")
#: Look-alikes that must be left alone (``other_axis`` of a GroupNorm is a LayerNorm over
#: the channels, a norm after all).
NOT_NORMS = ("eps_outside", "max_center", "custom_jvp_rsqrt")


@dataclasses.dataclass(frozen=True)
class Case:
  layout: str = "ln"
  dtype: str = "float32"
  cast: str = "up_down"
  center: str = "mean"
  variance: str = "centered"
  inv_sqrt: str = "rsqrt"
  scale: str = "w"
  offset: bool = True
  activation: str = "none"
  residual: str = "none"
  lookalike: str = "none"
  wrap: str = "none"
  eps: float = 1e-5
  rows: int = 3  # LayerNorm's rows, GroupNorm's N
  width: int = 8  # LayerNorm's width; a GroupNorm's channels per group
  groups: int = 2
  spatial: tuple = (2, 3)
  shift: float = 0.0  # the inputs' mean (large: the one-pass variance cancels)
  spread: float = 1.5  # their standard deviation (small: eps weighs in the statistics)
  constant_row: bool = False  # row (sample) 0 all 1.0: y exactly 0, activations at a tie
  seed: int = 0

  @property
  def group(self) -> bool:
    return self.layout.startswith("gn")

  def shapes(self):
    """``(x's shape, the parameters' shape)``."""
    if not self.group:
      return (self.rows, self.width), (self.width,)
    c = self.groups * self.width
    h, w = self.spatial
    x = (self.rows, h, w, c) if self.layout == "gn_nhwc" else (self.rows, c, h, w)
    return x, (c,)

  def expected_ops(self):
    """The ops one of which must replace the norm; () where none may; None: either."""
    if self.lookalike in NOT_NORMS or (self.lookalike == "other_axis" and not self.group):
      return ()
    if self.lookalike != "none":
      return None
    if self.layout == "ln":
      return ("layer_norm", "add_layer_norm")
    if self.layout == "rms":
      return ("rms_norm", "add_rms_norm")
    # A GroupNorm of one group, or of one pixel, is a LayerNorm (its residual add fused).
    return ("group_norm", "layer_norm", "add_layer_norm")


def build(case: Case, truth: bool = False):
  """``f(x, w, b, r)``: the case written as jnp code; with ``truth``, every float dtype float64."""
  dt = (lambda name: jnp.float64) if truth else jnp.dtype
  xd, f32 = dt(case.dtype), dt("float32")
  cd = xd if case.cast == "native" else f32  # the dtype of the arithmetic
  pd = xd if case.cast in ("native", "xhat_down") else f32  # the parameters' in the affine

  def mean(a, axes):
    n = math.prod(a.shape[i] for i in axes)
    if case.center == "mean":
      return jnp.mean(a, axes, keepdims=True)
    if case.center == "sum_n":
      return jnp.sum(a, axes, keepdims=True) / n
    return jnp.sum(a, axes, keepdims=True) * (1.0 / n)

  def normalize(a, axes):
    eps = jnp.asarray(case.eps, cd)
    if case.layout == "rms":
      sq = {"centered": lambda: a * a, "one_pass": lambda: jnp.square(a),
            "one_pass_max": lambda: a ** 2, "var": lambda: jnp.square(a)}[case.variance]()
      # The look-alike's max: of the squares, for the mean of them.
      xc = a
      v = jnp.max(sq, axes, keepdims=True) if case.lookalike == "max_center" else mean(sq, axes)
    else:
      m = jnp.max(a, axes, keepdims=True) if case.lookalike == "max_center" else mean(a, axes)
      xc = a - m
      if case.variance == "centered":
        v = jnp.mean(xc * xc, axes, keepdims=True)
      elif case.variance == "var":
        v = jnp.var(a, axes, keepdims=True)
      else:
        v = jnp.mean(a * a, axes, keepdims=True) - m * m
        if case.variance == "one_pass_max":
          v = jnp.maximum(v, 0.0)
    if case.lookalike == "eps_outside":
      return xc / (jnp.sqrt(v) + eps)
    if case.lookalike == "custom_jvp_rsqrt":
      return xc * rc.damped_rsqrt(v + eps)
    return {"rsqrt": lambda: xc * jax.lax.rsqrt(v + eps),
            "one_over_sqrt": lambda: xc * (1.0 / jnp.sqrt(v + eps)),
            "pow": lambda: xc * (v + eps) ** -0.5,
            "div_sqrt": lambda: xc / jnp.sqrt(v + eps)}[case.inv_sqrt]()

  def norm(h, w, b):
    a = h.astype(cd)
    if not case.group:
      y = normalize(a, (0,) if case.lookalike == "other_axis" else (a.ndim - 1,))
      wb = lambda p: p
    elif case.layout == "gn_nhwc":
      n, hh, ww, c = a.shape
      g = a.reshape(n, hh, ww, case.groups, c // case.groups)
      y = normalize(g, (3, 4) if case.lookalike == "other_axis" else (1, 2, 4)).reshape(a.shape)
      wb = lambda p: p
    else:
      n, c, hh, ww = a.shape
      g = a.reshape(n, case.groups, c // case.groups, hh, ww)
      y = normalize(g, (1, 2) if case.lookalike == "other_axis" else (2, 3, 4)).reshape(a.shape)
      wb = lambda p: p[:, None, None]
    if case.cast == "xhat_down":
      y = y.astype(xd)
    if case.scale != "none":
      wc = wb(w.astype(pd))
      y = y * (wc if case.scale == "w" else 1.0 + wc)
    if case.offset:
      y = y + wb(b.astype(pd))
    if case.cast == "up_down":
      y = y.astype(xd)
    return y if case.activation == "none" else rc.ACTIVATION_FORMS[case.activation][0](y)

  if case.wrap == "jit":
    norm = jax.jit(norm)
  elif case.wrap == "checkpoint":
    norm = jax.checkpoint(norm)
  elif case.wrap == "straight_through":
    norm = _straight_through(norm)

  def f(x, w, b, r):
    if case.residual == "none":
      return norm(x, w, b)
    h = x + r
    y = norm(h, w, b)
    return y + h if case.residual == "add_used" else y

  return f


def _straight_through(fun):
  @jax.custom_jvp
  def st(h, w, b):
    return fun(h, w, b)

  @st.defjvp
  def _jvp(primals, tangents):
    y = st(*primals)
    return y, tangents[0].astype(y.dtype)

  return st


def inputs(case: Case):
  """``(x, w, b, r, ct)`` as NumPy arrays: x and r rounded to the case's dtype (float32 arrays
  of its values), the parameters and the cotangent float32 (ct of y's shape)."""
  rng = np.random.default_rng(case.seed)
  xs, ps = case.shapes()
  rnd = lambda a: np.asarray(jnp.asarray(a, case.dtype).astype(jnp.float32))
  x = rng.normal(size=xs) * case.spread + case.shift
  if case.constant_row:
    x[0] = 1.0
  r = rng.normal(size=xs) * 0.5
  if case.constant_row and case.residual != "none":
    r[0] = 0.0
  w = 1.0 + 0.3 * rng.normal(size=ps)
  b = 0.2 * rng.normal(size=ps)
  ct = rng.normal(size=xs)
  return rnd(x), w.astype(np.float32), b.astype(np.float32), rnd(r), ct.astype(np.float32)


def truth(case: Case, x, w, b, r, ct):
  """``(y, (dx, dw, db, dr))`` of the case's code in float64 (needs ``jax_enable_x64``)."""
  f = build(case, truth=True)
  args = [np.asarray(a, np.float64) for a in (x, w, b, r)]
  y, pull = jax.vjp(f, *args)
  grads = pull(jnp.asarray(np.asarray(ct, np.float64)))
  return np.asarray(y), tuple(np.asarray(g) for g in grads)


class TruthProcess:
  """A process with ``jax_enable_x64`` computing :func:`truth`, started once, asked per case."""

  def __init__(self):
    # The tests' folder on the path whatever starts it (under PYTHONSAFEPATH=1, as the version
    # stages run, Python puts no script's folder there): this file imports its siblings.
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu", PYTHONPATH=path)
    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)

  def __call__(self, case: Case, *arrays):
    pickle.dump((dataclasses.asdict(case), arrays), self.proc.stdin)
    self.proc.stdin.flush()
    status, value = pickle.load(self.proc.stdout)
    if status != "ok":
      raise RuntimeError(f"the float64 truth of {case} failed:\n{value}")
    return value

  def close(self):
    self.proc.stdin.close()  # the process ends at the end of its input
    self.proc.wait(timeout=30)
    self.proc.stdout.close()


def _serve():
  jax.config.update("jax_enable_x64", True)
  out, inp = sys.stdout.buffer, sys.stdin.buffer
  sys.stdout = sys.stderr  # nothing but the answers on the pipe
  while True:
    try:
      fields, arrays = pickle.load(inp)
    except EOFError:
      return
    try:
      fields["spatial"] = tuple(fields["spatial"])
      answer = ("ok", truth(Case(**fields), *arrays))
    except Exception:  # pylint: disable=broad-except
      answer = ("error", traceback.format_exc())
    pickle.dump(answer, out)
    out.flush()


if __name__ == "__main__":
  _serve()
