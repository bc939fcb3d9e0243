"""Drop-in ``flax.nnx`` LayerNorm, GroupNorm and RMSNorm (subclasses of flax's) whose backward runs the jax_normgrad kernels."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jax_normgrad import _layers

# Subclassing flax.nnx's classes keeps their ``__init__`` (``num_features`` first,
# keyword ``rngs``), their ``nnx.Param`` s and attributes, so ``nnx.state`` and
# checkpoints are the original's; ``__init__`` only gains ``implementation``. Needs the
# ``flax`` extra; ``import jax_normgrad`` does not import this module.
__all__ = ["AddLayerNorm", "AddRMSNorm", "GroupNorm", "LayerNorm", "RMSNorm", "patch"]

# flax.nnx's classes, bound once at import: ``patch()`` replaces ``flax.nnx.LayerNorm``
# and the others, so a drop-in reaches the class it subclasses through these, never
# through the module attribute at call time (that would call itself).
_LayerNorm, _RMSNorm, _GroupNorm = nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm


def _value(p):
  """A parameter's array, or None for an absent one (``use_scale=False``)."""
  return None if p is None else p[...]


def _common_reason(mdl, x, mask):
  """The fallback reason shared by the three layers (mask, devices, statistics dtype), else None."""
  if mask is not None:
    return "mask"
  if mdl.axis_name is not None:
    return "axis_name (cross-device statistics)"
  stats_dtype = jnp.promote_types(mdl.dtype if mdl.dtype is not None else x.dtype, jnp.float32)
  if jnp.dtype(stats_dtype) != _layers.F32:
    return f"statistics dtype {jnp.dtype(stats_dtype)}"
  return None


def _nnx_norm(mdl, original, x, mask, *, centered: bool):
  """LayerNorm / RMSNorm ``__call__``: the kernels, or ``original``'s own code where they do not apply."""
  if centered:
    xp, scale, bias = mdl.promote_dtype((x, _value(mdl.scale), _value(mdl.bias)), dtype=mdl.dtype)
  else:  # RMSNorm: no bias, and its promote_dtype takes (x, scale).
    xp, scale = mdl.promote_dtype((x, _value(mdl.scale)), dtype=mdl.dtype)
    bias = None
  begin, feat, axes_reason = _layers.plan_axes(xp, mdl.reduction_axes, mdl.feature_axes)
  feature_shape = [1] * xp.ndim
  for a in feat:
    feature_shape[a] = xp.shape[a]
  reason = _common_reason(mdl, xp, mask) or axes_reason
  out_dtype = nnx_dtypes.canonicalize_dtype(xp, scale, bias, dtype=mdl.dtype)
  if reason is None:
    reason = _layers.unsupported_dtypes(x=xp.dtype, scale=_dtype(scale), bias=_dtype(bias),
                                        result=out_dtype)
  params = [p for p in (scale, bias) if p is not None]
  if reason is None and any(p.size != math.prod(feature_shape) for p in params):
    return original.__call__(mdl, x, mask=mask)  # flax raises its own error.
  if reason is not None:
    _layers.warn_fallback(f"jax_normgrad.nnx.{original.__name__}", reason,
                          f"flax.nnx.{original.__name__}")
    return original.__call__(mdl, x, mask=mask)
  trailing = tuple(feature_shape[begin:])
  scale, bias = (None if p is None else p.reshape(trailing) for p in (scale, bias))
  return _layers.norm(_kernel_x(mdl, x, xp), scale, bias, begin=begin, eps=mdl.epsilon,
                      centered=centered, out_dtype=out_dtype,
                      implementation=mdl.implementation, forward=mdl.forward)


def _dtype(a):
  return None if a is None else a.dtype


def _kernel_x(mdl, x, xp):
  """The x the kernels read: ``x`` itself where nnx's default ``promote_dtype`` only widened it.

  nnx promotes a 16-bit x with float32 parameters to a float32 copy. The
  widening is exact, and the kernels read the 16-bit x with a float32 result
  (``out_dtype``) themselves, without that copy. A custom ``promote_dtype``
  may compute anything, so its output is used as it is.
  """
  x = jnp.asarray(x)
  if (mdl.promote_dtype is nnx_dtypes.promote_dtype and xp.dtype == _layers.F32
      and x.dtype in (jnp.bfloat16, jnp.float16)):
    return x
  return xp


_COMMON_CASES = [
    "``mask`` given, or ``axis_name`` set (masked or cross-device statistics)",
    "a dtype (of x after ``promote_dtype``, the parameters, or the result) other than float32, "
    "float16, bfloat16, e.g. float64 or complex",
    "a zero-sized normalized axis",
]


def _doc(original, axes_case, fast_variance=True):
  return _layers.norm_doc(original, [axes_case] + _COMMON_CASES, fast_variance)


class LayerNorm(_LayerNorm):
  __doc__ = f"""``flax.nnx.LayerNorm`` whose backward runs the jax_normgrad kernels.

  ``LayerNorm(num_features, *, epsilon=1e-6, dtype=None, param_dtype=float32,
  use_bias=True, use_scale=True, ..., rngs, implementation=None)``: flax's
  arguments and defaults, plus ``implementation`` and ``forward``. Over ``reduction_axes``
  (default: the last axis), statistics in float32, after the layer's
  ``promote_dtype`` of (x, scale, bias)::

      y = (x - mean) / sqrt(var + epsilon) * scale + bias

  Call: ``layer(x, *, mask=None)``; y has x's shape and flax's dtype.
  {_doc("flax.nnx.LayerNorm", "``reduction_axes`` not the trailing axes of x, or ``feature_axes`` outside them")}
  Raises: what ``flax.nnx.LayerNorm`` raises; see :func:`jax_normgrad.layer_norm`.
  """

  __init__ = _layers.init_with_implementation(_LayerNorm)

  def __call__(self, x, *, mask=None):
    return _nnx_norm(self, _LayerNorm, x, mask, centered=True)


class RMSNorm(_RMSNorm):
  __doc__ = f"""``flax.nnx.RMSNorm`` whose backward runs the jax_normgrad kernels.

  ``RMSNorm(num_features, *, epsilon=1e-6, dtype=None, param_dtype=float32,
  use_scale=True, ..., rngs, implementation=None)``: flax's arguments and
  defaults, plus ``implementation`` and ``forward``. Over ``reduction_axes`` (default: the
  last axis), statistics in float32::

      y = x / sqrt(mean(x^2) + epsilon) * scale

  Call: ``layer(x, mask=None)`` (positional mask, as flax's).
  {_doc("flax.nnx.RMSNorm", "``reduction_axes`` not the trailing axes of x, or ``feature_axes`` outside them", fast_variance=False)}
  Raises: what ``flax.nnx.RMSNorm`` raises; see :func:`jax_normgrad.rms_norm`.
  """

  __init__ = _layers.init_with_implementation(_RMSNorm)

  def __call__(self, x, mask=None):
    return _nnx_norm(self, _RMSNorm, x, mask, centered=False)


class GroupNorm(_GroupNorm):
  __doc__ = f"""``flax.nnx.GroupNorm`` whose backward runs the jax_normgrad kernels.

  ``GroupNorm(num_features, num_groups=32, group_size=None, *, epsilon=1e-6,
  ..., rngs, implementation=None, activation=None)``: flax's arguments,
  defaults and constructor checks, plus ``implementation``, ``forward`` and
  ``activation`` (None, "silu", "gelu" or "relu", fused into the kernels:
  ``nnx.swish(GroupNorm(...)(x))`` as one layer; see
  :class:`jax_normgrad.flax.GroupNorm`). Channels last: x is
  ``(batch, ..., num_features)``; statistics per sample and group over every
  axis but the first (``reduction_axes``), in float32; ``scale``/``bias`` per
  channel::

      y = (x - mean_group) / sqrt(var_group + epsilon) * scale[c] + bias[c]

  Runs :func:`jax_normgrad.group_norm` on x viewed as ``(N, HxW, C)`` (no
  transpose).
  {_doc("flax.nnx.GroupNorm", "``reduction_axes`` other than 1, ..., last (flax.nnx repeats the statistics along axis 1; other layouts keep its own semantics)")}
  Raises: what ``flax.nnx.GroupNorm`` raises.
  """

  __init__ = _layers.init_with_implementation(_GroupNorm, extra=("activation",))

  def __call__(self, x, *, mask=None):
    axes = (self.reduction_axes if self.reduction_axes is not None
            else list(range(1, x.ndim - 1)) + [-1])
    channels = self.num_groups * self.group_size
    if x.ndim < 2 or x.shape[-1] != channels:
      # flax's own result or error.
      return _layers.activate(_GroupNorm.__call__(self, x, mask=mask), self.activation)
    xp, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                         dtype=self.dtype)
    begin, _, axes_reason = _layers.plan_axes(xp, axes)
    if axes_reason is None and begin != 1:
      # flax.nnx repeats the statistics along axis 1: only one sample axis is its GroupNorm.
      axes_reason = f"reduction_axes={self.reduction_axes!r} (not the axes 1, ..., {x.ndim - 1})"
    reason = _common_reason(self, xp, mask) or axes_reason
    out_dtype = nnx_dtypes.canonicalize_dtype(xp, scale, bias, dtype=self.dtype)
    if reason is None:
      reason = _layers.unsupported_dtypes(x=xp.dtype, scale=_dtype(scale), bias=_dtype(bias),
                                          result=out_dtype)
    if reason is not None:
      _layers.warn_fallback("jax_normgrad.nnx.GroupNorm", reason, "flax.nnx.GroupNorm")
      return _layers.activate(_GroupNorm.__call__(self, x, mask=mask), self.activation)
    return _layers.group_norm(_kernel_x(self, x, xp), self.num_groups, scale, bias, batch_ndim=1,
                              channels_last=True, eps=self.epsilon, out_dtype=out_dtype,
                              implementation=self.implementation, forward=self.forward,
                              activation=self.activation)


def _nnx_add_norm(mdl, plain, x, residual, *, centered: bool):
  """AddLayerNorm / AddRMSNorm ``__call__``: the fused kernels, or the add before the plain drop-in."""
  x = jnp.asarray(x)
  scale, bias = _value(mdl.scale), (_value(mdl.bias) if centered else None)
  begin, feat, reason = _layers.plan_axes(x, mdl.reduction_axes, mdl.feature_axes)
  reason = _common_reason(mdl, x, None) or reason
  if reason is None and set(feat) != set(range(begin, x.ndim)):
    reason = f"feature_axes={mdl.feature_axes!r} not every reduction axis"
  if reason is None and mdl.promote_dtype is not nnx_dtypes.promote_dtype:
    reason = "a custom promote_dtype"
  if reason is None:
    out = nnx_dtypes.canonicalize_dtype(x, scale, bias, dtype=mdl.dtype)
    reason = _layers.unsupported_dtypes(x=x.dtype, scale=_dtype(scale), bias=_dtype(bias),
                                        result=out)
    if reason is None and jnp.dtype(out) != x.dtype:
      reason = f"a result dtype {jnp.dtype(out)} other than x's {x.dtype}"
  trailing = x.shape[begin:] if begin is not None else None
  if reason is None:
    scale, bias = (None if p is None else p.reshape(trailing) for p in (scale, bias))
  return _layers.add_norm(f"jax_normgrad.nnx.{type(mdl).__name__}", x, residual, scale, bias,
                          begin=begin, eps=mdl.epsilon, centered=centered,
                          residual_dtype=mdl.residual_dtype,
                          implementation=mdl.implementation, forward=mdl.forward,
                          reason=reason, plain=lambda h: plain.__call__(mdl, h))


_ADD_DOC = _layers.ADD_NORM_INTRO + """
      y, h = self.norm(attn_out, h)   # was: h = h + attn_out; y = self.norm(h)

  ``{cls}(num_features, *, residual_dtype=None, **kwargs)``: the plain
  drop-in's (``{base}``'s) arguments, parameters and state, plus
  ``residual_dtype``. Where the fused kernels do not apply (reduction or
  feature axes other than the trailing ones, ``axis_name``, a custom
  ``promote_dtype``, a result dtype other than x's, e.g. float32 parameters
  with a 16-bit x and ``dtype=None``) a one-time ``FallbackWarning`` says
  so and the add runs before the plain drop-in (y then normalizes the
  rounded h).
"""


class AddLayerNorm(LayerNorm):
  __doc__ = "Residual add + :class:`LayerNorm` fused (flax.nnx)." + _ADD_DOC.format(
      fn="add_layer_norm", cls="AddLayerNorm", base="flax.nnx.LayerNorm")

  def __init__(self, num_features, *, residual_dtype=None, **kwargs):
    super().__init__(num_features, **kwargs)
    self.residual_dtype = residual_dtype

  def __call__(self, x, residual):  # pylint: disable=arguments-differ
    return _nnx_add_norm(self, LayerNorm, x, residual, centered=True)


class AddRMSNorm(RMSNorm):
  __doc__ = "Residual add + :class:`RMSNorm` fused (flax.nnx)." + _ADD_DOC.format(
      fn="add_rms_norm", cls="AddRMSNorm", base="flax.nnx.RMSNorm")

  def __init__(self, num_features, *, residual_dtype=None, **kwargs):
    super().__init__(num_features, **kwargs)
    self.residual_dtype = residual_dtype

  def __call__(self, x, residual):  # pylint: disable=arguments-differ
    return _nnx_add_norm(self, RMSNorm, x, residual, centered=False)


def patch() -> _layers.Patch:
  """Replaces flax.nnx's LayerNorm, RMSNorm and GroupNorm with these drop-ins, process-wide.

  Every name flax.nnx holds them under (``flax.nnx.X``,
  ``flax.nnx.nn.normalization.X``, ``flax.nnx.nn.attention.LayerNorm``) then
  refers to the drop-in. Idempotent.
  Returns an undo callable that is also a context manager. Patch before the
  model's code is imported: ``from flax.nnx import LayerNorm`` done earlier
  keeps flax's class.
  """
  return _layers.Patch("flax.nnx", (LayerNorm, RMSNorm, GroupNorm))
