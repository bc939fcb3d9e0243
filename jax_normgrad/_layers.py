"""Framework-free machinery of the drop-in layers (``jax_normgrad.flax``, ``.nnx``, ``.equinox``)."""

from __future__ import annotations

import functools
import inspect
import math
import sys
import textwrap
from collections.abc import Iterable

import jax
import jax.numpy as jnp

import jax_normgrad as jn
from jax_normgrad import _validation as v
from jax_normgrad._fallback import warn_once
from jax_normgrad._validation import SUPPORTED_DTYPES

F32 = jnp.dtype(jnp.float32)


#: The docstring paragraph on flax's ``use_fast_variance``, shared by the flax and nnx drop-ins.
FAST_VARIANCE_NOTE = """
  ``use_fast_variance`` does not change the path: flax's ``True`` (its
  default) computes ``var = E[x^2] - E[x]^2``, the kernels always the
  two-pass ``E[(x - mean)^2]``. Both are the variance; they agree to float32
  rounding unless ``|mean|`` is large against the standard deviation, where
  flax's formula loses digits (and clips at zero) and the kernels' does not.
  For flax's exact fast-variance numbers use the flax class itself.
"""


def fallback_doc(original: str, cases: list[str]) -> str:
  """The docstring paragraph listing when a drop-in runs ``original``'s own code."""
  items = [textwrap.fill(c + (";" if i < len(cases) - 1 else "."), 78, initial_indent="  - ",
                         subsequent_indent="    ") for i, c in enumerate(cases)]
  intro = textwrap.fill(
      f"The kernels run whenever they compute what ``{original}`` computes. Otherwise "
      f"``{original}``'s own ``__call__`` runs (pure JAX, its exact numbers and gradients) "
      "and a one-time ``jax_normgrad.FallbackWarning`` says so:", 78, initial_indent="  ",
      subsequent_indent="  ")
  return "\n" + intro + "\n\n" + "\n".join(items) + "\n"


def norm_doc(original: str, cases: list[str], fast_variance: bool = True) -> str:
  """The fallback paragraph of a drop-in's docstring, plus the use_fast_variance note."""
  return fallback_doc(original, cases) + (FAST_VARIANCE_NOTE if fast_variance else "")


def canonical_axes(ndim: int, axes) -> tuple[int, ...]:
  """Flax's canonical form of ``axes``: non-negative and deduplicated.

  The order is the set's iteration order, exactly as flax computes it, so a
  parameter shape built from it is flax's.
  """
  if not isinstance(axes, Iterable):
    axes = (axes,)
  return tuple({ndim + a if a < 0 else a for a in axes})


def trailing_start(ndim: int, axes: tuple[int, ...]) -> int | None:
  """``k`` when ``axes`` are exactly the trailing axes ``k, ..., ndim - 1``; else None.

  The kernels normalize over trailing axes only; None (including for no axes
  at all) means the layer has to run the original's computation.
  """
  s = sorted(set(axes))
  if not s or s != list(range(s[0], ndim)):
    return None
  return s[0]


def plan_axes(x, reduction_axes, feature_axes=None):
  """Where a flax-style layer normalizes ``x``, and whether the kernels can.

  Args:
    x: the input.
    reduction_axes: flax's ``reduction_axes`` (int or sequence, negatives allowed).
    feature_axes: flax's ``feature_axes``, or None to skip their check.

  Returns:
    ``(begin, feat, reason)``: the first normalized axis (None when the axes
    are not trailing), the canonical feature axes, and the fallback reason
    (None: the kernels compute it).
  """
  red = canonical_axes(x.ndim, reduction_axes)
  feat = () if feature_axes is None else canonical_axes(x.ndim, feature_axes)
  begin = trailing_start(x.ndim, red)
  reason = None
  if begin is None:
    reason = f"reduction_axes={reduction_axes!r} (not the trailing axes of a {x.ndim}-D x)"
  elif not set(feat) <= set(red):
    reason = f"feature_axes={feature_axes!r} outside reduction_axes={reduction_axes!r}"
  elif empty_reduction(x, begin):
    reason = "a zero-sized normalized axis"
  return begin, feat, reason


def unsupported_dtypes(**dtypes) -> str | None:
  """A reason to fall back when a dtype is not one the kernels compute in, else None."""
  for name, dtype in dtypes.items():
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
      return (f"{name} dtype {jnp.dtype(dtype)} (the kernels take float32, float16 and "
              "bfloat16)")
  return None


def warn_fallback(layer: str, reason: str, original: str) -> None:
  """The library's one-time ``FallbackWarning`` for a drop-in running the original's code."""
  warn_once(
      f"{layer}: {reason} is not covered by the jax_normgrad kernels; running {original}'s own "
      "pure-JAX computation instead (the original's numbers, XLA's autodiff).")


def _kernel_io(x, out_dtype, narrowing=False):
  """``(x, out_dtype)`` for the layers' kernels so that y is rounded once, to ``out_dtype``.

  The kernels compute in float32 and write y in x's dtype or in float32 (a
  16-bit x with float32 parameters: flax's default promotion), reading x as
  it is; with ``narrowing`` (LayerNorm, RMSNorm) also a 16-bit y of a
  float32 x (``dtype=jnp.bfloat16`` on a float32 input). For any other
  result dtype x is widened to float32 (exactly) and the float32 y is cast.
  """
  if out_dtype in (x.dtype, F32) or (
      narrowing and x.dtype == F32 and jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16),
                                                                jnp.dtype(jnp.float16))):
    return x, out_dtype
  return x.astype(F32), None


def _param(p, shape):
  """A parameter as float32 (exactly: every supported dtype widens losslessly), broadcast to ``shape``.

  The kernels take float32 parameters with any x; the cast's transpose rounds
  the float32 parameter gradient once to the parameter's own dtype.
  """
  return None if p is None else jnp.broadcast_to(p.astype(F32), shape)


def norm(x, weight, bias, *, begin: int, eps: float, centered: bool, out_dtype, implementation,
         forward=None):
  """LayerNorm (``centered``) or RMSNorm of ``x`` over its axes ``begin, ...``, on the kernels.

  ``y = (x - mean) * rstd * weight + bias`` (RMSNorm: no mean), statistics in
  float32, y rounded once to ``out_dtype``.

  Args:
    x: float32, float16 or bfloat16 array.
    weight, bias: None or arrays broadcastable to ``x.shape[begin:]``, any
      supported dtype.
    begin: the first normalized axis; the normalized axes are the trailing ones.
    eps: float >= 0 added to the variance (mean square).
    centered: False for RMSNorm.
    out_dtype: y's dtype, one of the supported dtypes.
    implementation, forward: passed to :func:`jax_normgrad.layer_norm` / ``rms_norm``.

  Returns:
    y with x's shape, in ``out_dtype``.
  """
  norm_shape = x.shape[begin:]
  w, b = _param(weight, norm_shape), _param(bias, norm_shape)
  xk, kernel_out = _kernel_io(x, out_dtype, narrowing=centered or b is None)
  if centered:
    y = jn.layer_norm(xk, w, b, normalized_shape=norm_shape, eps=eps, out_dtype=kernel_out,
                      forward=forward, implementation=implementation)
  elif b is None:
    y = jn.rms_norm(xk, w, normalized_shape=norm_shape, eps=eps, out_dtype=kernel_out,
                    forward=forward, implementation=implementation)
  else:
    # rms_norm has no bias: a float32 y plus the bias in float32, so y is
    # still rounded once.
    y = jn.rms_norm(xk, w, normalized_shape=norm_shape, eps=eps, out_dtype=F32,
                    forward=forward, implementation=implementation) + b
  return y.astype(out_dtype)


def group_norm(x, num_groups: int, weight, bias, *, batch_ndim: int, channels_last: bool,
               eps: float, out_dtype, implementation, activation=None, forward=None):
  """GroupNorm of ``x`` on the kernels, statistics per (sample, group), y rounded once to ``out_dtype``.

  ``x`` is ``batch + (spatial..., C)`` (``channels_last``) or ``batch + (C,
  spatial...)``: the leading ``batch_ndim`` axes are samples (none: one
  sample), C channels, the rest spatial. It is viewed, without a transpose,
  as ``(N, HxW, C)`` or ``(N, C, HxW)``.

  Args:
    x: float32, float16 or bfloat16 array.
    num_groups: the number of groups; divides C.
    weight, bias: None or ``(C,)`` arrays of any supported dtype.
    batch_ndim: how many leading axes are samples.
    channels_last: channels on the last axis, else right after the samples.
    eps: float >= 0.
    out_dtype: y's dtype, one of the supported dtypes.
    implementation, forward: passed to :func:`jax_normgrad.group_norm`.
    activation: passed to :func:`jax_normgrad.group_norm` (fused).

  Returns:
    y with x's shape, in ``out_dtype``.
  """
  n = math.prod(x.shape[:batch_ndim])
  c = x.shape[-1] if channels_last else x.shape[batch_ndim]
  hw = math.prod(x.shape[batch_ndim:]) // c
  shape = (n, hw, c) if channels_last else (n, c, hw)
  xk, kernel_out = _kernel_io(x, out_dtype)
  y = jn.group_norm(xk.reshape(shape), num_groups, _param(weight, (c,)), _param(bias, (c,)),
                    eps=eps, channel_axis=-1 if channels_last else 1, out_dtype=kernel_out,
                    activation=activation, forward=forward, implementation=implementation)
  return y.reshape(x.shape).astype(out_dtype)


def activate(y, activation):
  """The drop-ins' ``activation`` applied after a library's own layer (their fallback path):
  ``jax.nn.silu``, ``jax.nn.gelu`` (tanh approximation) or ``jax.nn.relu``; None: y."""
  if activation is None:
    return y
  fns = {"silu": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=True),
         "relu": jax.nn.relu}
  return fns[v.check_activation(activation)](y)


def empty_reduction(x, begin: int) -> bool:
  """A zero-sized normalized axis: no statistics to compute (the kernels refuse it)."""
  return math.prod(x.shape[begin:]) == 0


def init_with_implementation(original, extra=()):
  """``original.__init__`` plus the keywords ``implementation=None`` and ``forward=None``.

  ``extra`` names more keywords (default None) kept the same way, e.g.
  GroupNorm's ``activation``. Its signature is shown as the original's with
  those keywords added, so ``inspect.signature`` and help() list the
  original's arguments and defaults.
  """
  names = ("implementation", "forward") + tuple(extra)

  def __init__(self, *args, **kwargs):
    values = {name: kwargs.pop(name, None) for name in names}
    original.__init__(self, *args, **kwargs)
    for name, value in values.items():
      setattr(self, name, value)

  sig = inspect.signature(original.__init__)
  params = list(sig.parameters.values())
  added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
           for name in names]
  # Keyword-only parameters go before a trailing **kwargs, if any.
  at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD),
            len(params))
  __init__.__signature__ = sig.replace(parameters=params[:at] + added + params[at:])
  __init__.__doc__ = original.__init__.__doc__
  return __init__


class Patch:
  """Drop-ins put in place of a library's classes, process-wide; calling it undoes that.

  Every module of ``package`` already imported (the package and its
  submodules, e.g. ``flax.linen``, ``flax.linen.normalization`` and
  ``flax.linen.attention``, which builds LayerNorms for its q/k normalization)
  whose attribute is one of the original classes gets the drop-in instead,
  so the library's public names and its own internal references agree.
  Creating a second Patch while one is in place changes nothing (no
  attribute holds an original any more), and its undo does nothing. Undo
  restores only the attributes that still hold the drop-in. Also a context
  manager: ``with patch(): ...`` undoes on exit.
  """

  def __init__(self, package: str, drop_ins):
    pairs = [(cls.__mro__[1], cls) for cls in drop_ins]  # (original, drop-in)
    self._replaced = []
    for name, module in list(sys.modules.items()):
      if module is None or not (name == package or name.startswith(package + ".")):
        continue
      for attr, value in list(vars(module).items()):
        for original, drop_in in pairs:
          if value is original:
            setattr(module, attr, drop_in)
            self._replaced.append((module, attr, original, drop_in))

  @property
  def replaced(self) -> list[str]:
    """``module.attribute`` of every name this patch replaced."""
    return [f"{m.__name__}.{attr}" for m, attr, _, _ in self._replaced]

  def __call__(self) -> None:
    for module, attr, original, drop_in in reversed(self._replaced):
      if getattr(module, attr, None) is drop_in:
        setattr(module, attr, original)
    self._replaced = []

  def __enter__(self) -> "Patch":
    return self

  def __exit__(self, *exc) -> None:
    self()


#: The opening of the residual-form drop-ins' docstrings (flax.linen and nnx); ``{fn}`` the op.
ADD_NORM_INTRO = """

  A pre-norm block's residual add and norm in one kernel pass each way
  (:func:`jax_normgrad.{fn}`): ``y, h = layer(x, residual)`` with ``h = x +
  residual`` summed in float32 and stored in ``residual_dtype`` (None: x's
  dtype), and ``y`` the norm of h as stored, in x's dtype. ``h`` is the next
  block's residual::
"""


def add_norm(layer, x, residual, weight, bias, *, begin: int, eps: float, centered: bool,
             residual_dtype, implementation, reason, plain, forward=None):
  """The residual-form drop-ins' ``(y, h)``: one fused kernel call, or the add before ``plain``.

  ``reason`` None: :func:`jax_normgrad.add_layer_norm` / ``add_rms_norm``
  over ``x.shape[begin:]`` (y in x's dtype). Otherwise a one-time
  ``FallbackWarning`` names it, ``h = x + residual`` is summed in float32
  and rounded to ``residual_dtype`` (None: x's dtype) by XLA, and
  ``plain(h)`` (the plain drop-in, itself on the kernels where they apply)
  normalizes that h, as the fused kernels do.
  """
  if reason is None:
    kw = dict(normalized_shape=x.shape[begin:], eps=eps, residual_dtype=residual_dtype,
              forward=forward, implementation=implementation)
    if centered:
      return jn.add_layer_norm(x, residual, weight, bias, **kw)
    return jn.add_rms_norm(x, residual, weight, **kw)
  warn_once(
      f"{layer}: {reason} is not covered by the fused residual kernels; the residual add runs "
      "before the plain layer instead (an extra pass).")
  h = (jnp.asarray(x).astype(F32) + jnp.asarray(residual).astype(F32)).astype(
      residual_dtype or jnp.asarray(x).dtype)
  return plain(h), h
