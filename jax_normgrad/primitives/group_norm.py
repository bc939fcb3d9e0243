"""GroupNorm primitives: forward with statistics and backward, NCHW and channels-last.

The operands, named by ``jax_normgrad._operands`` (``GroupNormFwd``,
``GroupNormBwd``; canonical layouts: ``jax_normgrad.reference``): ``x``, ``dy`` of shape
``(N, C, HW)`` or, with ``channels_last``, ``(N, HW, C)``; ``mean``, ``rstd``
of shape ``(N, G)`` float32; ``weight``/``bias`` of shape ``(W, C)`` float32,
``W = param_groups``. As for LayerNorm, the forward's ``y_dtype`` (None: x's
dtype, or float32) is y's dtype, and ``dy`` is in x's dtype or float32.

``activation`` (None, "silu", "gelu", "relu"; ``jax_normgrad._activations``)
fuses an activation: the forward's y is ``act(xhat * gamma + beta)``, and
the backward's ``dy`` is the cotangent of that y; it reads the bias as well
to recompute the pre-activation value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_normgrad import _ffi, _lowering, reference
from jax_normgrad.pallas import group_norm as pallas_gn
from jax_normgrad.primitives._common import make_primitive, shaped
from jax_normgrad._operands import GroupNormBwd, GroupNormFwd, unpack

F32 = jnp.float32


def _channels(x, channels_last):
  return x.shape[2] if channels_last else x.shape[1]


# ----------------------------------------------------------------------------
# Forward with statistics: GroupNormFwd(x, [weight], [bias]) -> (y, mean, rstd)


def _fwd_abstract(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation,
                  implementation):
  del eps, channels_last, param_groups, activation, implementation
  x = unpack(GroupNormFwd, args, operands).x
  return [shaped(x.shape, y_dtype or x.dtype), shaped((x.shape[0], group), F32),
          shaped((x.shape[0], group), F32)]


def _fwd_xla(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation):
  o = unpack(GroupNormFwd, args, operands)
  return reference.group_norm_fwd(o.x, o.weight, o.bias, eps=eps, group=group,
                                  channels_last=channels_last, param_groups=param_groups,
                                  y_dtype=y_dtype, activation=activation)


def _fwd_ffi(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation):
  x, weight, bias = unpack(GroupNormFwd, args, operands)
  stats = jax.ShapeDtypeStruct((x.shape[0], group), F32)
  y_type = jax.ShapeDtypeStruct(x.shape, y_dtype or x.dtype)
  attrs = dict(group=group, param_groups=param_groups, has_weight=weight is not None,
               has_bias=bias is not None, activation=_ffi.ACTIVATION_CODES[activation])
  if not channels_last:
    return list(_ffi.call("jax_normgrad_group_norm_fwd", [y_type, stats, stats], x, weight, bias,
                          eps=eps, channels_last=channels_last, **attrs))
  # Channels-last statistics need a pass over the whole sample before y's
  # pass, so the forward is two calls: the statistics (an empty y), then y.
  # XLA drops the second where y is unused, as it does for jnp code: jax.grad
  # of a loss whose gradient needs only the statistics (a one-pass forward).
  _, mean, rstd = _ffi.call("jax_normgrad_group_norm_fwd",
                            [jax.ShapeDtypeStruct((0,), y_type.dtype), stats, stats], x, weight,
                            bias, eps=eps, channels_last=True, **attrs)
  y = _ffi.call("jax_normgrad_group_norm_apply", [y_type], x, mean, rstd, weight, bias, **attrs)[0]
  return [y, mean, rstd]


def _roles(channels_last):
  """Axis names of each operand for the partitioning rule.

  Samples "r", channels "c", spatial "s", groups "g", parameter rows "w".
  """
  x = ("r", "s", "c") if channels_last else ("r", "c", "s")
  return {"x": x, "dy": x, "mean": ("r", "g"), "rstd": ("r", "g"), "weight": ("w", "c"),
          "bias": ("w", "c")}


def _fwd_roles(*, operands, channels_last, **params):
  del params
  roles = _roles(channels_last)
  return [roles[name] for name in operands], [roles["x"], roles["mean"], roles["rstd"]]


group_norm_fwd_p = make_primitive(
    "jax_normgrad_group_norm_fwd", _fwd_abstract,
    _lowering.Lowerings(xla=_fwd_xla, ffi=_fwd_ffi, pallas=pallas_gn.group_norm_fwd,
                        problem=pallas_gn.group_norm_fwd_problem), roles=_fwd_roles)


# ----------------------------------------------------------------------------
# Backward: GroupNormBwd(dy, x, mean, rstd, [weight], [bias]) -> the output_mask'ed of
# (dx, dweight, dbias)


def _bwd_abstract(*args, operands, group, channels_last, activation, output_mask, param_groups,
                  implementation):
  del group, activation, implementation
  x = unpack(GroupNormBwd, args, operands).x
  outs = [shaped(x.shape, x.dtype)] if output_mask[0] else []
  return outs + [shaped((param_groups, _channels(x, channels_last)), F32)] * sum(output_mask[1:])


def _bwd_xla(*args, operands, group, channels_last, activation, output_mask, param_groups):
  return reference.group_norm_bwd(unpack(GroupNormBwd, args, operands), group=group,
                                  channels_last=channels_last, activation=activation,
                                  output_mask=output_mask, param_groups=param_groups)


def _bwd_ffi(*args, operands, group, channels_last, activation, output_mask, param_groups):
  dy, x, mean, rstd, weight, bias = unpack(GroupNormBwd, args, operands)
  c = _channels(x, channels_last)
  param_shape = (param_groups, c)
  out_types = [jax.ShapeDtypeStruct(x.shape if output_mask[0] else (0,), x.dtype),
               jax.ShapeDtypeStruct(param_shape if output_mask[1] else (0,), F32),
               jax.ShapeDtypeStruct(param_shape if output_mask[2] else (0,), F32)]
  outs = _ffi.call("jax_normgrad_group_norm_bwd", out_types, dy, x, mean, rstd, weight, bias,
                   group=group, param_groups=param_groups, channels_last=channels_last,
                   has_gamma=weight is not None, has_beta=bias is not None,
                   activation=_ffi.ACTIVATION_CODES[activation],
                   compute_dx=output_mask[0], compute_dgamma=output_mask[1],
                   compute_dbeta=output_mask[2])
  return [o for o, m in zip(outs, output_mask) if m]


def _bwd_roles(*, operands, channels_last, output_mask, **params):
  del params
  roles = _roles(channels_last)
  return ([roles[name] for name in operands],
          [roles["x"]] * output_mask[0] + [roles["weight"]] * sum(output_mask[1:]))


group_norm_bwd_p = make_primitive(
    "jax_normgrad_group_norm_bwd", _bwd_abstract,
    _lowering.Lowerings(xla=_bwd_xla, ffi=_bwd_ffi, pallas=pallas_gn.group_norm_bwd,
                        problem=pallas_gn.group_norm_bwd_problem), roles=_bwd_roles)
