"""LayerNorm backward in the vendors' other forms (AscendC's variance/res_for_gamma pair, InfiniOp's from-xhat), on the backward kernel."""

from __future__ import annotations

import jax.numpy as jnp

from jax_normgrad import _validation as v
from jax_normgrad.ops._common import F32
from jax_normgrad.ops._layer_norm_core import bwd


def _check_rows(pairs, x_name, x):
  """Row-wise tensors: arrays of x's float dtype and shape, x at least 1-D."""
  v.check_float_dtype(x_name, x)
  v.normalized_shape_of(None, x, x_name=x_name)
  for name, a in pairs:
    v.check_same_dtype(name, a, x_name, x)
    v.check_same_shape(name, a, x_name, x)


def _rstd_of(stat, eps=None):
  """Float32 (M,) rstd from a per-row variance (``1/sqrt(var + eps)``) or std (``1/std``)."""
  s = stat.reshape(-1).astype(F32)
  return 1.0 / (s if eps is None else jnp.sqrt(s + jnp.float32(eps)))


def layer_norm_grad(dy, x, variance, mean, gamma, epsilon, *, implementation=None):
  """AscendC LayerNormGrad: grad_input from the variance, and xhat for LayerNormGradBeta.

  Over the last axis (``H`` elements per row), with ``rstd = (variance +
  epsilon)^-0.5`` and ``pd_xl = dy * gamma``, AscendC's step-by-step formula
  (docs/spec.md#layer_norm_grad-layer_norm_grad_beta)::

      pd_var  = sum(-0.5 * pd_xl * (x - mean) * rstd^3)
      pd_mean = sum(-pd_xl * rstd) + pd_var * (1/H) * sum(-2 * (x - mean))
      pd_x    = pd_xl * rstd + pd_var * (2/H) * (x - mean) + pd_mean * (1/H)
      res_for_gamma = (x - mean) * rstd

  computed in its compact form ``pd_x = rstd * (pd_xl - mean(pd_xl) - xhat *
  mean(pd_xl * xhat))`` on the LayerNorm backward kernel, accumulating in
  float32. The two are equal when ``mean`` is the rows' exact mean; a
  ``mean`` rounded to 16 bits leaves ``sum(x - mean)`` non-zero, and
  AscendC's formula then adds ``rstd * mean(pd_xl * xhat) * mean(xhat)``, a
  term of the order of that rounding, which the compact form leaves out.

  Args:
    dy: the cotangent of y, shape ``A + (H,)`` (``[B, S, H]`` in AscendC's; any
      leading dims), float32, float16 or bfloat16.
    x: the forward input; dy's shape and dtype.
    variance, mean: per-row statistics, shape ``A`` or ``A + (1,)``, dy's dtype.
    gamma: the weight, shape ``(H,)``, dy's dtype; None means ones.
    epsilon: static float >= 0 added to ``variance``.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(pd_x, res_for_gamma)``, both with x's shape and dtype.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  dy = v.as_array("dy", dy)
  x = v.as_array("x", x)
  variance = v.as_array("variance", variance)
  mean = v.as_array("mean", mean)
  gamma = v.optional_array("gamma", gamma)
  _check_rows((("dy", dy),), "x", x)
  for name, s in (("variance", variance), ("mean", mean)):
    v.check_same_dtype(name, s, "x", x)
    v.check_row_stats_shape(name, s, "x", x)
  if gamma is not None:
    v.check_same_dtype("gamma", gamma, "x", x)
    v.check_shape("gamma", gamma, x.shape[-1:], "(H,), x's last dim")
  epsilon = v.check_eps(epsilon, "epsilon")
  implementation = v.check_implementation(implementation)
  g = bwd(dy, x, mean, _rstd_of(variance, epsilon), gamma, (True, False, False), 1,
          implementation, write_xhat=True)
  return g.dx, g.xhat


def layer_norm_grad_beta(dy, res_for_gamma, normalized_shape=None, *, implementation=None):
  """AscendC LayerNormGradBeta: the parameter gradients from LayerNormGrad's res_for_gamma::

      pd_gamma = sum over rows of dy * res_for_gamma
      pd_beta  = sum over rows of dy

  on the LayerNorm backward kernel (reading ``res_for_gamma`` as xhat),
  accumulated in float32.

  Args:
    dy: the cotangent of y, float32, float16 or bfloat16, shape ``A + R``.
    res_for_gamma: xhat from :func:`layer_norm_grad`; dy's shape and dtype.
    normalized_shape: int or tuple ``R``, the trailing dims reduced into the
      parameters' shape; None: the last dim (``[H]`` as in AscendC's).
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(pd_gamma, pd_beta)``: float32, shape ``normalized_shape``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  dy = v.as_array("dy", dy)
  res_for_gamma = v.as_array("res_for_gamma", res_for_gamma)
  _check_rows((("dy", dy),), "res_for_gamma", res_for_gamma)
  norm_shape = v.normalized_shape_of(normalized_shape, res_for_gamma, x_name="res_for_gamma")
  implementation = v.check_implementation(implementation)
  g = bwd(dy, res_for_gamma, None, None, None, (False, True, True), len(norm_shape),
          implementation, normalized=True)
  return g.dweight, g.dbias


def layer_norm_backward_from_normalized(grad_output, weight, input_standardization,
                                        input_std_deviation, *, implementation=None):
  """InfiniOp LayerNormBackward: the backward from xhat and std instead of x, mean, rstd.

  Over the last axis, with ``xhat = input_standardization = (x - mean) / std``,
  ``std = input_std_deviation = sqrt(var + eps)`` and ``g = grad_output *
  weight`` (weight None: ones)::

      grad_input  = (g - mean(g) - xhat * mean(g * xhat)) / std
      grad_weight = sum over rows of grad_output * xhat
      grad_bias   = sum over rows of grad_output

  on the LayerNorm backward kernel (reading its x as xhat), accumulated in
  float32. ``x`` itself is never needed: the memory-saving form that
  ``layer_norm(..., save="normalized")`` uses.

  Args:
    grad_output: the cotangent of y, shape ``A + (L,)``, float32, float16 or
      bfloat16.
    weight: shape ``(L,)``, the inputs' dtype or float32 (with 16-bit inputs);
      None means ones.
    input_standardization: xhat, grad_output's shape and dtype.
    input_std_deviation: per-row std, shape ``A`` or ``A + (1,)``, the inputs'
      dtype or float32.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(grad_input, grad_weight, grad_bias)``: grad_input with the inputs' shape
    and dtype; grad_weight/grad_bias of shape ``(L,)`` in weight's dtype (the
    inputs' when None).

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  grad_output = v.as_array("grad_output", grad_output)
  xhat = v.as_array("input_standardization", input_standardization)
  std = v.as_array("input_std_deviation", input_std_deviation)
  weight = v.optional_array("weight", weight)
  _check_rows((("grad_output", grad_output),), "input_standardization", xhat)
  v.check_stats_dtype("input_std_deviation", std, xhat)
  v.check_row_stats_shape("input_std_deviation", std, "input_standardization", xhat)
  if weight is not None:
    v.check_param_dtype("weight", weight, xhat)
    v.check_shape("weight", weight, xhat.shape[-1:], "(L,), the inputs' last dim")
  implementation = v.check_implementation(implementation)
  g = bwd(grad_output, xhat, None, _rstd_of(std), weight, (True, True, True), 1, implementation,
          normalized=True)
  pdtype = v.param_grad_dtype(weight, None, xhat)
  return g.dx, g.dweight.astype(pdtype), g.dbias.astype(pdtype)
