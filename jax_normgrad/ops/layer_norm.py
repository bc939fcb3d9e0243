"""LayerNorm: the differentiable layer, the forward with statistics and the backward op."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_normgrad import _validation as v
from jax_normgrad.ops._common import F32, as_f32, present, unmask
from jax_normgrad.primitives.layer_norm import layer_norm_bwd_p, layer_norm_fwd_p


def _check_params(weight, bias, x, norm_shape):
  weight = v.optional_array("weight", weight)
  bias = v.optional_array("bias", bias)
  for name, p in (("weight", weight), ("bias", bias)):
    if p is not None:
      v.check_param_dtype(name, p, x)
      v.check_shape(name, p, norm_shape, "normalized_shape")
  v.check_params_share_dtype("weight", weight, "bias", bias)
  return weight, bias


def _rows_and_width(x, norm_ndim):
  """(M, H): x viewed as M rows of the H normalized elements."""
  lead = x.ndim - norm_ndim
  return math.prod(x.shape[:lead]), math.prod(x.shape[lead:])


def _fwd(x, weight, bias, norm_ndim, eps, implementation):
  """Canonical forward: returns y (x.shape) and float32 mean, rstd of shape (M,)."""
  m, h = _rows_and_width(x, norm_ndim)
  y, mean, rstd = layer_norm_fwd_p.bind(
      x.reshape(m, h), *present(as_f32(weight, (1, h)), as_f32(bias, (1, h))), eps=eps,
      centered=True, has_weight=weight is not None, has_bias=bias is not None, param_groups=1,
      implementation=implementation)
  return y.reshape(x.shape), mean, rstd


def _bwd(dy, x, mean, rstd, weight, output_mask, norm_ndim, implementation):
  """Canonical backward: float32 (M,) statistics; returns masked (dx, dweight, dbias) in float32 / x dtype."""
  norm_shape = x.shape[x.ndim - norm_ndim:]
  m, h = _rows_and_width(x, norm_ndim)
  outs = layer_norm_bwd_p.bind(
      dy.reshape(m, h), x.reshape(m, h), as_f32(mean, (m,)), as_f32(rstd, (m,)),
      *present(as_f32(weight, (1, h))), centered=True, has_weight=weight is not None,
      output_mask=output_mask, param_groups=1, implementation=implementation)
  return unmask(outs, output_mask, (lambda a: a.reshape(x.shape),
                                    lambda a: a.reshape(norm_shape),
                                    lambda a: a.reshape(norm_shape)))


def layer_norm_fwd(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, implementation=None):
  """LayerNorm forward that also returns the statistics the backward needs.

  Over the trailing dims ``R = normalized_shape`` of ``x`` (shape ``A + R``),
  per row of ``H = prod(R)`` elements, in float32::

      mean = sum(x) / H,  var = sum((x - mean)^2) / H,  rstd = 1 / sqrt(var + eps)
      y = (x - mean) * rstd * weight + bias

  Args:
    x: float32, float16 or bfloat16 array of shape ``A + R``.
    normalized_shape: int or tuple ``R``, the trailing dims of ``x``; non-empty.
    weight, bias: optional, shape ``R``, in x's dtype or float32, the same dtype
      when both are given.
    eps: float >= 0 added to the variance.
    implementation: None (the platform's kernel), "xla", "ffi" or "pallas".

  Returns:
    ``(y, mean, rstd)``: ``y`` with x's shape and dtype; ``mean``, ``rstd``
    float32 of shape ``A + (1,) * len(R)``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x = v.as_array("x", x)
  v.check_float_dtype("x", x)
  norm_shape = v.normalized_shape_of(normalized_shape, x)
  v.check_positive_size("normalized_shape", math.prod(norm_shape), "number of elements")
  weight, bias = _check_params(weight, bias, x, norm_shape)
  eps = v.check_eps(eps)
  implementation = v.check_implementation(implementation)
  y, mean, rstd = _fwd(x, weight, bias, len(norm_shape), eps, implementation)
  stats_shape = x.shape[:x.ndim - len(norm_shape)] + (1,) * len(norm_shape)
  return y, mean.reshape(stats_shape), rstd.reshape(stats_shape)


def layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight=None, bias=None,
                        output_mask=(True, True, True), *, implementation=None):
  """LayerNorm backward (aclnnLayerNormBackward semantics).

  With ``xhat = (x - mean) * rstd`` and ``g = grad_out * weight`` (weight
  absent: ones), per row of ``H = prod(normalized_shape)`` elements::

      grad_input  = rstd * (g - mean(g) - xhat * mean(g * xhat))
      grad_weight = sum over rows of grad_out * xhat
      grad_bias   = sum over rows of grad_out

  accumulated in float32 and cast once at the end.

  Args:
    grad_out: the cotangent of y; x's shape and dtype.
    x: float32, float16 or bfloat16, shape ``A + normalized_shape``.
    normalized_shape: int or non-empty tuple, the trailing dims of ``x``.
    mean, rstd: any shape with ``prod(A)`` elements, float32 or x's dtype (not
      narrower than x), the same dtype.
    weight: optional, shape ``normalized_shape``, x's dtype or float32.
    bias: optional; only its shape and dtype are checked (it sets the dtype of
      the parameter gradients when weight is absent).
    output_mask: three bools: which of (grad_input, grad_weight, grad_bias) to
      compute. Masked outputs are returned as None and not computed.
    implementation: None (the platform's kernel), "xla", "ffi" or "pallas".

  Returns:
    ``(grad_input, grad_weight, grad_bias)``: grad_input with x's shape and
    dtype; grad_weight/grad_bias of shape ``normalized_shape`` in weight's
    dtype, else bias's, else x's. None where masked.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  grad_out = v.as_array("grad_out", grad_out)
  x = v.as_array("x", x)
  mean = v.as_array("mean", mean)
  rstd = v.as_array("rstd", rstd)
  v.check_float_dtype("x", x)
  v.check_same_dtype("grad_out", grad_out, "x", x)
  v.check_shape("grad_out", grad_out, x.shape, "x.shape")
  norm_shape = v.normalized_shape_of(normalized_shape, x)
  rows = math.prod(x.shape[:x.ndim - len(norm_shape)])
  for name, s in (("mean", mean), ("rstd", rstd)):
    v.check_stats_dtype(name, s, x)
    v.check_size(name, s, rows, "the product of x's leading, non-normalized dims")
  v.check_same_dtype("rstd", rstd, "mean", mean)
  weight, bias = _check_params(weight, bias, x, norm_shape)
  mask = v.check_output_mask(output_mask)
  implementation = v.check_implementation(implementation)
  pdtype = v.param_grad_dtype(weight, bias, x)
  if not any(mask):
    return (None, None, None)
  dx, dw, db = _bwd(grad_out, x, mean, rstd, weight, mask, len(norm_shape), implementation)
  cast = lambda a: None if a is None else a.astype(pdtype)
  return dx, cast(dw), cast(db)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, weight, bias, norm_ndim, eps, implementation):
  return _fwd(x, weight, bias, norm_ndim, eps, implementation)[0]


def _layer_norm_vjp_fwd(x, weight, bias, norm_ndim, eps, implementation):
  y, mean, rstd = _fwd(x, weight, bias, norm_ndim, eps, implementation)
  # Residuals: x in its own dtype, float32 (M,) statistics, and the small
  # parameters; no float32 copy of anything tensor-sized.
  return y, (x, mean, rstd, weight, bias)


def _layer_norm_vjp_bwd(norm_ndim, eps, implementation, res, dy):
  del eps
  x, mean, rstd, weight, bias = res
  mask = (True, weight is not None, bias is not None)
  dx, dw, db = _bwd(dy, x, mean, rstd, weight, mask, norm_ndim, implementation)
  dw = None if dw is None else dw.astype(weight.dtype)
  db = None if db is None else db.astype(bias.dtype)
  return dx, dw, db


_layer_norm.defvjp(_layer_norm_vjp_fwd, _layer_norm_vjp_bwd)


def layer_norm(x, weight=None, bias=None, *, normalized_shape=None, eps=1e-5, implementation=None):
  """Differentiable LayerNorm whose backward runs the backward kernel.

  ``y = (x - mean) * rstd * weight + bias`` over the trailing dims
  ``normalized_shape`` (see :func:`layer_norm_fwd`). Under ``jax.grad`` the
  backward is :func:`layer_norm_backward`'s kernel; works under ``jit``,
  ``vmap`` (any ``in_axes``, batched weight included) and nested ``vmap``.
  The forward saves only x, float32 mean/rstd and the parameters.

  Args:
    x: float32, float16 or bfloat16 array.
    weight, bias: optional, shape ``normalized_shape``, x's dtype or float32.
    normalized_shape: int or tuple of x's trailing dims; None: ``x.shape[-1:]``.
    eps: float >= 0.
    implementation: None (the platform's kernel), "xla", "ffi" or "pallas".

  Returns:
    ``y`` with x's shape and dtype.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x = v.as_array("x", x)
  v.check_float_dtype("x", x)
  norm_shape = v.normalized_shape_of(normalized_shape, x)
  v.check_positive_size("normalized_shape", math.prod(norm_shape), "number of elements")
  weight, bias = _check_params(weight, bias, x, norm_shape)
  eps = v.check_eps(eps)
  implementation = v.check_implementation(implementation)
  return _layer_norm(x, weight, bias, len(norm_shape), eps, implementation)
