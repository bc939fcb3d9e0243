"""Pallas lowerings of the GroupNorm primitives, NCHW ``(N, C, HW)`` and channels-last ``(N, HW, C)``."""

from __future__ import annotations

from jax_normgrad.pallas import common


def _groups(x, group, channels_last, param_groups):
  n, a, b = x.shape
  return common.Segments("channels_last" if channels_last else "channels_first", n, a, b,
                         groups=group, param_groups=param_groups)


def group_norm_fwd(x, *params, eps, group, channels_last, has_weight, has_bias, param_groups,
                   y_dtype, interpret, gpu_backend=common.TRITON):
  """``[y, mean, rstd]``, statistics ``(N, G)`` over each ``C/G * HW`` block, in float32.

  ``y = (x - mean) * rstd * weight[c] + bias[c]`` in ``y_dtype`` (None: x's);
  x is read in its layout, never transposed (see ``common.forward`` for a
  float32 y from a 16-bit x).
  """
  weight, bias = common.unpack(params, has_weight, has_bias)
  seg = _groups(x, group, channels_last, param_groups)
  return list(common.forward(seg, x, weight, bias, eps=eps, interpret=interpret,
                             y_dtype=y_dtype, gpu_backend=gpu_backend, op="group_norm_fwd"))


def group_norm_bwd(dy, x, mean, rstd, *gamma, group, channels_last, has_gamma, output_mask,
                   param_groups, interpret, gpu_backend=common.TRITON):
  """The ``output_mask``'ed of ``[dx, dgamma, dbeta]`` (see ``reference.group_norm_bwd``).

  Per ``(n, g)`` block, ``g = dy * gamma[c]``:
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``;
  ``dgamma[c] = sum_{n, hw} dy * xhat``, ``dbeta[c] = sum_{n, hw} dy``, float32.
  """
  gamma, = common.unpack(gamma, has_gamma)
  seg = _groups(x, group, channels_last, param_groups)
  outs = common.backward(seg, dy, x, mean, rstd, gamma, tuple(output_mask), interpret=interpret,
                         gpu_backend=gpu_backend, op="group_norm_bwd")
  return [o for o, m in zip(outs, output_mask) if m]
