"""GroupNorm primitives: forward with statistics and backward, NCHW and channels-last.

The operands, named by ``jax_normgrad._operands`` (``GroupNormFwd``,
``GroupNormBwd``; canonical layouts: ``jax_normgrad.reference``): ``x``, ``dy`` of shape
``(N, C, HW)`` or, with ``channels_last``, ``(N, HW, C)``; ``mean``, ``rstd``
of shape ``(N, G)`` float32; ``weight``/``bias`` of shape ``(W, C)`` float32,
``W = param_groups``. As for LayerNorm, the forward's ``y_dtype`` (None: x's
dtype, or float32) is y's dtype, and ``dy`` is in x's dtype or float32.
The outputs are named by ``jax_normgrad._outputs`` (``GroupNormFwdOut``,
``GroupNormBwdOut``).

``activation`` (None, "silu", "gelu", "relu"; ``jax_normgrad._activations``)
fuses an activation: the forward's y is ``act(xhat * gamma + beta)``, and
the backward's ``dy`` is the cotangent of that y; it reads the bias as well
to recompute the pre-activation value.
"""

from __future__ import annotations

from jax_normgrad import _ffi, _lowering, _outputs, reference
from jax_normgrad.pallas import group_norm as pallas_gn
from jax_normgrad.primitives._common import make_primitive, shaped
from jax_normgrad._operands import GroupNormBwd, GroupNormFwd, unpack
from jax_normgrad._outputs import GroupNormBwdOut, GroupNormFwdOut


# ----------------------------------------------------------------------------
# Forward with statistics: GroupNormFwd(x, [weight], [bias]) -> (y, mean, rstd)


def _fwd_abstract(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation,
                  implementation):
  del eps, channels_last, param_groups, activation, implementation
  types = _outputs.group_norm_fwd_types(unpack(GroupNormFwd, args, operands), group=group,
                                        y_dtype=y_dtype)
  return [shaped(t.shape, t.dtype) for t in _outputs.pack(types, _outputs.group_norm_fwd_names())]


def _fwd_xla(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation):
  o = unpack(GroupNormFwd, args, operands)
  return reference.group_norm_fwd(o.x, o.weight, o.bias, eps=eps, group=group,
                                  channels_last=channels_last, param_groups=param_groups,
                                  y_dtype=y_dtype, activation=activation)


def _fwd_ffi(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation):
  x, weight, bias = o = unpack(GroupNormFwd, args, operands)
  types = _outputs.group_norm_fwd_types(o, group=group, y_dtype=y_dtype)
  attrs = dict(group=group, param_groups=param_groups, has_weight=weight is not None,
               has_bias=bias is not None, activation=_ffi.ACTIVATION_CODES[activation])
  if not channels_last:
    outs = _ffi.call("jax_normgrad_group_norm_fwd", list(types), x, weight, bias, eps=eps,
                     channels_last=channels_last, **attrs)
    return _outputs.pack(GroupNormFwdOut(*outs), _outputs.group_norm_fwd_names())
  # Channels-last statistics need a pass over the whole sample before y's
  # pass, so the forward is two calls: the statistics (an empty y), then y.
  # XLA drops the second where y is unused, as it does for jnp code: jax.grad
  # of a loss whose gradient needs only the statistics (a one-pass forward).
  _, mean, rstd = _ffi.call("jax_normgrad_group_norm_fwd",
                            _outputs.slots(types, ("mean", "rstd"), GroupNormFwdOut._fields), x,
                            weight, bias, eps=eps, channels_last=True, **attrs)
  y = _ffi.call("jax_normgrad_group_norm_apply", [types.y], x, mean, rstd, weight, bias,
                **attrs)[0]
  return _outputs.pack(GroupNormFwdOut(y, mean, rstd), _outputs.group_norm_fwd_names())


def _roles(channels_last):
  """Axis names of each operand and output for the partitioning rule.

  Samples "r", channels "c", spatial "s", groups "g", parameter rows "w".
  """
  x, stats, param = ("r", "s", "c") if channels_last else ("r", "c", "s"), ("r", "g"), ("w", "c")
  return {"x": x, "dy": x, "mean": stats, "rstd": stats, "weight": param, "bias": param,
          "y": x, "dx": x, "dweight": param, "dbias": param}


def _fwd_roles(*, operands, channels_last, **params):
  roles = _roles(channels_last)
  return ([roles[name] for name in operands],
          [roles[name] for name in _outputs.group_norm_fwd_names(**params)])


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
  types = _outputs.group_norm_bwd_types(unpack(GroupNormBwd, args, operands),
                                        channels_last=channels_last, param_groups=param_groups)
  return [shaped(t.shape, t.dtype)
          for t in _outputs.pack(types, _outputs.group_norm_bwd_names(output_mask=output_mask))]


def _bwd_xla(*args, operands, group, channels_last, activation, output_mask, param_groups):
  return reference.group_norm_bwd(unpack(GroupNormBwd, args, operands), group=group,
                                  channels_last=channels_last, activation=activation,
                                  output_mask=output_mask, param_groups=param_groups)


def _bwd_ffi(*args, operands, group, channels_last, activation, output_mask, param_groups):
  o = unpack(GroupNormBwd, args, operands)
  mask = _outputs.output_mask(output_mask)
  names = _outputs.group_norm_bwd_names(output_mask=mask)
  types = _outputs.group_norm_bwd_types(o, channels_last=channels_last,
                                        param_groups=param_groups)
  # The C++ backward writes the three in the structure's order, the absent ones empty.
  outs = _ffi.call("jax_normgrad_group_norm_bwd",
                   _outputs.slots(types, names, GroupNormBwdOut._fields), o.dy, o.x, o.mean,
                   o.rstd, o.weight, o.bias, group=group, param_groups=param_groups,
                   channels_last=channels_last, has_gamma=o.weight is not None,
                   has_beta=o.bias is not None, activation=_ffi.ACTIVATION_CODES[activation],
                   compute_dx=mask[0], compute_dgamma=mask[1], compute_dbeta=mask[2])
  return _outputs.pack(_outputs.unpack(GroupNormBwdOut, outs, GroupNormBwdOut._fields), names)


def _bwd_roles(*, operands, channels_last, **params):
  roles = _roles(channels_last)
  return ([roles[name] for name in operands],
          [roles[name] for name in _outputs.group_norm_bwd_names(**params)])


group_norm_bwd_p = make_primitive(
    "jax_normgrad_group_norm_bwd", _bwd_abstract,
    _lowering.Lowerings(xla=_bwd_xla, ffi=_bwd_ffi, pallas=pallas_gn.group_norm_bwd,
                        problem=pallas_gn.group_norm_bwd_problem), roles=_bwd_roles)
