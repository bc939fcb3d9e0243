"""Drop-in ``flax.linen`` LayerNorm, GroupNorm and RMSNorm (subclasses of flax's) whose backward runs the jax_normgrad kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen import dtypes as flax_dtypes

from jax_normgrad import _layers

# Subclassing flax's classes makes the constructor, attributes, defaults, parameter
# names and tree and the auto-generated module names (``LayerNorm_0``) flax's own, so
# checkpoints load unchanged and a fallback can call flax's ``__call__``. Only
# ``__call__`` differs. Needs the ``flax`` extra; ``import jax_normgrad`` does not
# import this module.
__all__ = ["AddLayerNorm", "AddRMSNorm", "GroupNorm", "LayerNorm", "RMSNorm", "patch"]

# flax's classes, bound once at import: ``patch()`` replaces ``flax.linen.LayerNorm``
# and the others, so a drop-in reaches the class it subclasses through these, never
# through the module attribute at call time (that would call itself).
_LayerNorm, _RMSNorm, _GroupNorm = nn.LayerNorm, nn.RMSNorm, nn.GroupNorm

_COMMON_CASES = [
    "``mask`` given, or ``axis_name`` set (masked or cross-device statistics)",
    "``force_float32_reductions=False`` (statistics in a 16-bit dtype)",
    "a dtype (of x, the parameters, or the result) other than float32, float16, bfloat16, "
    "e.g. float64 or complex",
    "a zero-sized normalized axis",
]


def _doc(original, axes_case, fast_variance=True):
  return _layers.norm_doc(original, [axes_case] + _COMMON_CASES, fast_variance)


def _linen_norm(mdl, original, x, mask, *, centered: bool):
  """LayerNorm / RMSNorm ``__call__``: the kernels, or ``original``'s own code where they do not apply."""
  layer = f"jax_normgrad.flax.{original.__name__}"
  x = jnp.asarray(x)  # as flax's jnp code sees it (a NumPy float64 x is float32 without x64)
  begin, feat, axes_reason = _layers.plan_axes(x, mdl.reduction_axes, mdl.feature_axes)
  reason = _option_reason(mdl, mask) or axes_reason
  param_shape = [x.shape[a] for a in feat]
  names = [("scale", mdl.scale_init, mdl.use_scale)]
  if centered:  # RMSNorm has no bias.
    names.append(("bias", mdl.bias_init, mdl.use_bias))
  if reason is None:
    reason = _unsupported_dtypes(mdl, x, param_shape, names)
  if reason is not None:
    _layers.warn_fallback(layer, reason, f"flax.linen.{original.__name__}")
    return original.__call__(mdl, x, mask=mask)
  params = {name: mdl.param(name, init, param_shape, mdl.param_dtype)
            for name, init, used in names if used}
  out_dtype = flax_dtypes.canonicalize_dtype(x, *params.values(), dtype=mdl.dtype)
  # flax reshapes the parameters to x's rank, ones off the feature axes; the
  # kernels take them over the normalized (trailing) axes.
  feature_shape = [1] * x.ndim
  for a in feat:
    feature_shape[a] = x.shape[a]
  trailing = tuple(feature_shape[begin:])
  scale, bias = (params[n].reshape(trailing) if n in params else None for n in ("scale", "bias"))
  return _layers.norm(x, scale, bias, begin=begin, eps=mdl.epsilon, centered=centered,
                      out_dtype=out_dtype, implementation=mdl.implementation, forward=mdl.forward)


def _option_reason(mdl, mask):
  """The fallback reason for a call option the kernels do not cover, else None."""
  if mask is not None:
    return "mask"
  if mdl.axis_name is not None:
    return "axis_name (cross-device statistics)"
  if not mdl.force_float32_reductions:
    return "force_float32_reductions=False"
  return None


def _unsupported_dtypes(mdl, x, param_shape, names):
  """The fallback reason for dtypes the kernels do not compute in (x, parameters, result), else None."""
  param_dtypes = {name: _param_dtype(mdl, name, init, param_shape)
                  for name, init, used in names if used}
  stats_dtype = jnp.promote_types(mdl.dtype if mdl.dtype is not None else x.dtype, jnp.float32)
  if jnp.dtype(stats_dtype) != _layers.F32:
    return f"statistics dtype {jnp.dtype(stats_dtype)}"
  # canonicalize_dtype takes arrays: NumPy scalars stand in (no traced ops).
  out_dtype = flax_dtypes.canonicalize_dtype(
      np.zeros((), x.dtype), *(np.zeros((), d) for d in param_dtypes.values()), dtype=mdl.dtype)
  return _layers.unsupported_dtypes(x=x.dtype, **param_dtypes, result=out_dtype)


def _param_dtype(mdl, name, init, shape):
  """The dtype ``mdl.param(name, ...)`` will return, without creating the parameter.

  A parameter exists already when applying (a checkpoint may hold another
  dtype than ``param_dtype``); at init the initializer's output dtype.
  """
  if mdl.has_variable("params", name):
    return jnp.asarray(mdl.get_variable("params", name)).dtype
  return jax.eval_shape(lambda k: init(k, shape, mdl.param_dtype), jax.random.key(0)).dtype


class LayerNorm(_LayerNorm):
  __doc__ = f"""``flax.linen.LayerNorm`` whose backward runs the jax_normgrad kernels.

  Layer normalization over ``reduction_axes`` (default: the last axis), with
  ``scale``/``bias`` over ``feature_axes``, statistics in float32::

      y = (x - mean) / sqrt(var + epsilon) * scale + bias

  Attributes, defaults and parameters are ``flax.linen.LayerNorm``'s
  (``epsilon=1e-6``, ``dtype=None``: the result dtype is promoted from x and
  the parameters, ``param_dtype=float32``, ...), plus ``implementation``
  and ``forward`` (None: the platform's kernel and default forward). Call: ``layer(x, *, mask=None)``; y has x's
  shape and flax's dtype. ``reduction_axes`` may be any trailing axes;
  ``feature_axes`` any of them (the parameters are broadcast over the rest).
  {_doc("flax.linen.LayerNorm", "``reduction_axes`` not the trailing axes of x, or ``feature_axes`` outside them")}
  Raises: what ``flax.linen.LayerNorm`` raises for bad arguments; see
  :func:`jax_normgrad.layer_norm` for the kernels' checks.
  """

  implementation: str | None = None
  forward: str | None = None

  @nn.compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    return _linen_norm(self, _LayerNorm, x, mask, centered=True)


class RMSNorm(_RMSNorm):
  __doc__ = f"""``flax.linen.RMSNorm`` whose backward runs the jax_normgrad kernels.

  Root-mean-square normalization over ``reduction_axes`` (default: the last
  axis), with ``scale`` over ``feature_axes``, statistics in float32::

      y = x / sqrt(mean(x^2) + epsilon) * scale

  Attributes, defaults and parameters are ``flax.linen.RMSNorm``'s
  (``epsilon=1e-6``, ``use_scale=True``, ...; ``use_fast_variance`` has no
  effect, as in flax), plus ``implementation`` and ``forward``. Call: ``layer(x, *,
  mask=None)``.
  {_doc("flax.linen.RMSNorm", "``reduction_axes`` not the trailing axes of x, or ``feature_axes`` outside them", fast_variance=False)}
  Raises: what ``flax.linen.RMSNorm`` raises; see :func:`jax_normgrad.rms_norm`.
  """

  implementation: str | None = None
  forward: str | None = None

  @nn.compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    return _linen_norm(self, _RMSNorm, x, mask, centered=False)


def _num_groups(num_groups, group_size, channels) -> int | None:
  """flax's group count from ``num_groups`` / ``group_size``; None where flax raises."""
  if (num_groups is None) == (group_size is None):
    return None
  if group_size is not None:
    return channels // group_size if group_size > 0 and channels % group_size == 0 else None
  if not isinstance(num_groups, int) or num_groups <= 0 or channels % num_groups != 0:
    return None
  return num_groups


class GroupNorm(_GroupNorm):
  __doc__ = f"""``flax.linen.GroupNorm`` whose backward runs the jax_normgrad kernels.

  Channels last: x is ``(batch, ..., C)``; the C channels form ``num_groups``
  groups (or groups of ``group_size``: exactly one of the two, flax's rule);
  statistics per sample and group over ``reduction_axes`` (default: every
  axis but the first), in float32; ``scale``/``bias`` per channel::

      y = (x - mean_group) / sqrt(var_group + epsilon) * scale[c] + bias[c]

  Attributes, defaults and parameters are ``flax.linen.GroupNorm``'s
  (``num_groups=32``, ``group_size=None``, ``epsilon=1e-6``, ...), plus
  ``implementation`` and ``activation``: None, "silu" (= ``nn.swish``),
  "gelu" (``nn.gelu``'s default tanh form) or "relu", fused into the
  kernels: ``GroupNorm(..., activation="silu")(x)`` computes
  ``nn.swish(nn.GroupNorm(...)(x))`` without writing or keeping the
  GroupNorm's output. Runs :func:`jax_normgrad.group_norm` on x viewed as
  ``(N, HxW, C)`` (no transpose): any number of leading sample axes, before
  the first reduction axis.
  {_doc("flax.linen.GroupNorm", "``reduction_axes`` not trailing axes ending with the channel axis")}
  Raises: flax's ``ValueError`` for both or neither of num_groups/group_size,
  a group count or size that does not divide C, reduction axes without the
  last one.
  """

  implementation: str | None = None
  forward: str | None = None
  activation: str | None = None

  @nn.compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    layer = "jax_normgrad.flax.GroupNorm"
    x = jnp.asarray(x)  # as flax's jnp code sees it
    axes = (self.reduction_axes if self.reduction_axes is not None
            else list(range(1, x.ndim - 1)) + [-1])
    groups = _num_groups(self.num_groups, self.group_size, x.shape[-1]) if x.ndim else None
    if groups is None or x.ndim - 1 not in _layers.canonical_axes(x.ndim, axes):
      # flax raises its own error.
      return _layers.activate(_GroupNorm.__call__(self, x, mask=mask), self.activation)
    begin, _, axes_reason = _layers.plan_axes(x, axes)
    reason = _option_reason(self, mask) or axes_reason
    names = [("scale", self.scale_init, self.use_scale), ("bias", self.bias_init, self.use_bias)]
    if reason is None:
      reason = _unsupported_dtypes(self, x, [x.shape[-1]], names)
    if reason is not None:
      _layers.warn_fallback(layer, reason, "flax.linen.GroupNorm")
      return _layers.activate(_GroupNorm.__call__(self, x, mask=mask), self.activation)
    params = [self.param(name, init, [x.shape[-1]], self.param_dtype) if used else None
              for name, init, used in names]
    out_dtype = flax_dtypes.canonicalize_dtype(x, *params, dtype=self.dtype)
    return _layers.group_norm(x, groups, *params, batch_ndim=begin, channels_last=True,
                              eps=self.epsilon, out_dtype=out_dtype,
                              implementation=self.implementation, forward=self.forward,
                              activation=self.activation)


def _linen_add_norm(mdl, plain, x, residual, *, centered: bool):
  """AddLayerNorm / AddRMSNorm ``__call__``: the fused kernels, or the add before the plain drop-in."""
  x = jnp.asarray(x)
  begin, feat, reason = _layers.plan_axes(x, mdl.reduction_axes, mdl.feature_axes)
  reason = _option_reason(mdl, None) or reason
  if reason is None and set(feat) != set(range(begin, x.ndim)):
    reason = f"feature_axes={mdl.feature_axes!r} not every reduction axis"
  names = [("scale", mdl.scale_init, mdl.use_scale)]
  if centered:
    names.append(("bias", mdl.bias_init, mdl.use_bias))
  param_shape = list(x.shape[begin:]) if begin is not None else []
  if reason is None:
    reason = _unsupported_dtypes(mdl, x, param_shape, names)
  if reason is None:
    dtypes = [_param_dtype(mdl, name, init, param_shape) for name, init, used in names if used]
    out = flax_dtypes.canonicalize_dtype(np.zeros((), x.dtype), *(np.zeros((), d) for d in dtypes),
                                         dtype=mdl.dtype)
    if jnp.dtype(out) != x.dtype:
      reason = f"a result dtype {jnp.dtype(out)} other than x's {x.dtype}"
  if reason is not None:
    return _layers.add_norm(f"jax_normgrad.flax.{type(mdl).__name__}", x, residual, None, None,
                            begin=begin, eps=mdl.epsilon, centered=centered,
                            residual_dtype=mdl.residual_dtype,
                            implementation=mdl.implementation, forward=mdl.forward,
                            reason=reason, plain=lambda h: plain.__call__(mdl, h))
  params = {name: mdl.param(name, init, param_shape, mdl.param_dtype)
            for name, init, used in names if used}
  return _layers.add_norm("", x, residual, params.get("scale"), params.get("bias"), begin=begin,
                          eps=mdl.epsilon, centered=centered, residual_dtype=mdl.residual_dtype,
                          implementation=mdl.implementation, forward=mdl.forward,
                          reason=None, plain=None)


_ADD_DOC = _layers.ADD_NORM_INTRO + """
      y, h = AddLayerNorm()(attn_out, h)   # was: h = h + attn_out; y = LayerNorm()(h)

  Attributes and parameters (names, shapes, checkpoints) are
  ``{base}``'s, plus ``residual_dtype``. Where the fused kernels do not
  apply (reduction or feature axes other than the trailing ones, a mask,
  ``axis_name``, flax's result dtype other than x's, e.g. float32
  parameters with a 16-bit x and ``dtype=None``) a one-time
  ``FallbackWarning`` says so and the add runs before the plain drop-in
  (y then normalizes the rounded h).
"""


class AddLayerNorm(LayerNorm):
  __doc__ = "Residual add + :class:`LayerNorm` fused (flax.linen)." + _ADD_DOC.format(
      fn="add_layer_norm", base="flax.linen.LayerNorm")

  residual_dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, residual):  # pylint: disable=arguments-differ
    return _linen_add_norm(self, LayerNorm, x, residual, centered=True)


class AddRMSNorm(RMSNorm):
  __doc__ = "Residual add + :class:`RMSNorm` fused (flax.linen)." + _ADD_DOC.format(
      fn="add_rms_norm", base="flax.linen.RMSNorm")

  residual_dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, residual):  # pylint: disable=arguments-differ
    return _linen_add_norm(self, RMSNorm, x, residual, centered=False)


def patch() -> _layers.Patch:
  """Replaces flax.linen's LayerNorm, RMSNorm and GroupNorm with these drop-ins, process-wide.

  Every name flax.linen holds them under (``flax.linen.X``,
  ``flax.linen.normalization.X``, and ``flax.linen.attention.LayerNorm``, its
  q/k normalization) then refers to the drop-in, so models built from flax's
  layers (a model zoo's, a library's) run the kernels with no change to their
  code. Idempotent. Returns an undo callable that is also a
  context manager (``with jax_normgrad.flax.patch(): ...``).

  Patch before the model's code is imported: a module that did ``from
  flax.linen import LayerNorm`` earlier holds flax's class and keeps it.
  Parameters, names and checkpoints are flax's (the drop-ins subclass its
  classes); see the drop-ins for the cases where flax's own code still runs.
  """
  return _layers.Patch("flax.linen", (LayerNorm, RMSNorm, GroupNorm))
