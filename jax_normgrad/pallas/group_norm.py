"""Pallas lowerings of the GroupNorm primitives, NCHW ``(N, C, HW)`` and channels-last ``(N, HW, C)``."""

from __future__ import annotations

from jax_normgrad.pallas import common, dispatch


def _groups(x, group, channels_last, param_groups, activation):
  n, a, b = x.shape
  return common.Segments("channels_last" if channels_last else "channels_first", n, a, b,
                         groups=group, param_groups=param_groups, activation=activation)


def group_norm_fwd(x, *params, eps, group, channels_last, has_weight, has_bias, param_groups,
                   y_dtype, activation, interpret, gpu_backend=dispatch.TRITON):
  """``[y, mean, rstd]``, statistics ``(N, G)`` over each ``C/G * HW`` block, in float32.

  ``y = act((x - mean) * rstd * weight[c] + bias[c])`` in ``y_dtype`` (None:
  x's; ``act`` the identity without an ``activation``); x is read in its
  layout, never transposed (see ``dispatch.forward`` for a float32 y from a
  16-bit x).
  """
  weight, bias = common.unpack(params, has_weight, has_bias)
  seg = _groups(x, group, channels_last, param_groups, activation)
  return list(dispatch.forward(seg, x, weight, bias, eps=eps, interpret=interpret,
                               y_dtype=y_dtype, gpu_backend=gpu_backend, op="group_norm_fwd"))


def group_norm_bwd(dy, x, mean, rstd, *params, group, channels_last, has_gamma, has_beta,
                   activation, output_mask, param_groups, interpret, gpu_backend=dispatch.TRITON):
  """The ``output_mask``'ed of ``[dx, dgamma, dbeta]`` (see ``reference.group_norm_bwd``).

  Per ``(n, g)`` block, ``g = dy * gamma[c]``:
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``;
  ``dgamma[c] = sum_{n, hw} dy * xhat``, ``dbeta[c] = sum_{n, hw} dy``, float32;
  with an ``activation``, ``dy * act'(xhat * gamma + beta)`` in place of dy.
  """
  gamma, beta = common.unpack(params, has_gamma, has_beta)
  seg = _groups(x, group, channels_last, param_groups, activation)
  outs = dispatch.backward(seg, dy, x, mean, rstd, gamma, tuple(output_mask),
                           interpret=interpret, gpu_backend=gpu_backend, op="group_norm_bwd",
                           beta=beta)
  return [o for o, m in zip(outs, output_mask) if m]
