"""Pallas lowerings of the GroupNorm primitives, NCHW ``(N, C, HW)`` and channels-last ``(N, HW, C)``."""

from __future__ import annotations

from jax_normgrad import _outputs
from jax_normgrad.pallas import common, kernels
from jax_normgrad._operands import GroupNormBwd, GroupNormFwd, unpack
from jax_normgrad._outputs import GroupNormBwdOut, GroupNormFwdOut


def _groups(x, group, channels_last, param_groups, activation):
  n, a, b = x.shape
  return common.Segments("channels_last" if channels_last else "channels_first", n, a, b,
                         groups=group, param_groups=param_groups, activation=activation)


def group_norm_fwd_problem(*args, operands, group, channels_last, param_groups, y_dtype,
                           activation, **unused) -> kernels.Problem:
  """The kernels' problem of ``group_norm_fwd`` with these operands (shapes and dtypes)."""
  del unused
  o = unpack(GroupNormFwd, args, operands)
  return kernels.forward_problem(_groups(o.x, group, channels_last, param_groups, activation),
                                 o.x.dtype, size=o.x.size, y_dtype=y_dtype,
                                 params=(o.weight is not None, o.bias is not None))


def group_norm_bwd_problem(*args, operands, group, channels_last, activation, output_mask,
                           param_groups, **unused) -> kernels.Problem:
  """The kernels' problem of ``group_norm_bwd`` with these operands (shapes and dtypes)."""
  del unused
  o = unpack(GroupNormBwd, args, operands)
  return kernels.backward_problem(_groups(o.x, group, channels_last, param_groups, activation),
                                  o.x.dtype, _outputs.output_mask(output_mask), size=o.x.size,
                                  dy_dtype=o.dy.dtype,
                                  params=(o.weight is not None,
                                          activation is not None and o.bias is not None))


def group_norm_fwd(*args, operands, eps, group, channels_last, param_groups, y_dtype, activation,
                   interpret, backend="triton"):
  """``[y, mean, rstd]``, statistics ``(N, G)`` over each ``C/G * HW`` block, in float32.

  ``y = act((x - mean) * rstd * weight[c] + bias[c])`` in ``y_dtype`` (None:
  x's; ``act`` the identity without an ``activation``); x is read in its
  layout, never transposed (see ``kernels.forward`` for a float32 y from a
  16-bit x).
  """
  x, weight, bias = unpack(GroupNormFwd, args, operands)
  seg = _groups(x, group, channels_last, param_groups, activation)
  outs = kernels.forward(seg, x, weight, bias, eps=eps, interpret=interpret, y_dtype=y_dtype,
                         backend=backend)
  return _outputs.pack(GroupNormFwdOut(*outs), _outputs.group_norm_fwd_names())


def group_norm_bwd(*args, operands, group, channels_last, activation, output_mask, param_groups,
                   interpret, backend="triton"):
  """The ``output_mask``'ed of ``[dx, dweight, dbias]`` (see ``reference.group_norm_bwd``).

  Per ``(n, g)`` block, ``g = dy * weight[c]``:
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``;
  ``dweight[c] = sum_{n, hw} dy * xhat``, ``dbias[c] = sum_{n, hw} dy``, float32;
  with an ``activation``, ``dy * act'(xhat * weight + bias)`` in place of dy.
  """
  dy, x, mean, rstd, weight, bias = unpack(GroupNormBwd, args, operands)
  seg = _groups(x, group, channels_last, param_groups, activation)
  mask = _outputs.output_mask(output_mask)
  outs = kernels.backward(seg, dy, x, mean, rstd, weight, mask, interpret=interpret,
                          backend=backend, bias=bias)
  return _outputs.pack(GroupNormBwdOut(*outs), _outputs.group_norm_bwd_names(output_mask=mask))
