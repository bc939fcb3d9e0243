"""LayerNorm: the differentiable layer, the forward with statistics and the backward op.

On the LayerNorm family's core (``ops/_layer_norm_core.py``), which RMSNorm,
the residual form and the vendors' backward forms share.
"""

from __future__ import annotations

import math

from jax_normgrad import _validation as v
from jax_normgrad.ops._layer_norm_core import (LayerConfig, bwd, check_forward_args, check_params,
                                               check_stats, fwd, norm_layer, stats_shape)


def layer_norm_fwd(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, scale_offset=0.0,
                   implementation=None):
  """LayerNorm forward that also returns the statistics the backward needs.

  Over the trailing dims ``R = normalized_shape`` of ``x`` (shape ``A + R``),
  per row of ``H = prod(R)`` elements, in float32::

      mean = sum(x) / H,  var = sum((x - mean)^2) / H,  rstd = 1 / sqrt(var + eps)
      y = (x - mean) * rstd * (weight + scale_offset) + bias

  Args:
    x: float32, float16 or bfloat16 array of shape ``A + R``.
    normalized_shape: int or tuple ``R``, the trailing dims of ``x``; non-empty.
    weight, bias: optional, shape ``R``, in x's dtype or float32, the same dtype
      when both are given.
    eps: float >= 0 added to the variance.
    scale_offset: static float added to ``weight`` in float32 (``1.0`` for
      Gemma-style zero-centered weights); must be 0 without a weight.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(y, mean, rstd)``: ``y`` with x's shape and dtype; ``mean``, ``rstd``
    float32 of shape ``A + (1,) * len(R)``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x, norm_shape, weight, bias = check_forward_args(x, normalized_shape, weight, bias)
  eps = v.check_eps(eps)
  scale_offset = v.check_scale_offset(scale_offset, weight)
  implementation = v.check_implementation(implementation)
  f = fwd(x, weight, bias, len(norm_shape), eps, implementation, scale_offset=scale_offset)
  shape = stats_shape(x, len(norm_shape))
  return f.y, f.mean.reshape(shape), f.rstd.reshape(shape)


def layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight=None, bias=None,
                        output_mask=(True, True, True), *, scale_offset=0.0,
                        implementation=None):
  """LayerNorm backward (aclnnLayerNormBackward semantics).

  With ``xhat = (x - mean) * rstd`` and ``g = grad_out * (weight +
  scale_offset)`` (weight absent: ones), per row of ``H =
  prod(normalized_shape)`` elements::

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
    scale_offset: static float the forward added to ``weight`` (see
      :func:`layer_norm_fwd`); grad_weight does not depend on it.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

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
  check_stats((("mean", mean), ("rstd", rstd)), x, rows)
  weight, bias = check_params(weight, bias, x, norm_shape)
  mask = v.check_output_mask(output_mask)
  scale_offset = v.check_scale_offset(scale_offset, weight)
  implementation = v.check_implementation(implementation)
  pdtype = v.param_grad_dtype(weight, bias, x)
  if not any(mask):
    return (None, None, None)
  g = bwd(grad_out, x, mean, rstd, weight, mask, len(norm_shape), implementation,
          scale_offset=scale_offset)
  cast = lambda a: None if a is None else a.astype(pdtype)
  return g.dx, cast(g.dweight), cast(g.dbias)


def layer_norm(x, weight=None, bias=None, *, normalized_shape=None, eps=1e-5, scale_offset=0.0,
               save="input", out_dtype=None, forward=None, implementation=None):
  """Differentiable LayerNorm whose backward runs the backward kernel.

  ``y = (x - mean) * rstd * (weight + scale_offset) + bias`` over the
  trailing dims ``normalized_shape`` (see :func:`layer_norm_fwd`). Under
  ``jax.grad`` the backward is :func:`layer_norm_backward`'s kernel; works
  under ``jit``, ``vmap`` (any ``in_axes``, batched weight included), nested
  ``vmap`` and higher-order reverse mode and forward-over-reverse
  (``grad(grad)``, ``jax.hessian``, ``jvp(grad)``). A first-order ``jax.jvp``
  of the layer itself is refused by JAX (a ``custom_vjp`` has no forward
  mode); use :func:`layer_norm_fwd` for that. The gradient of ``weight`` is
  ``sum dy * xhat`` whatever ``scale_offset``.

  Args:
    x: float32, float16 or bfloat16 array.
    weight, bias: optional, shape ``normalized_shape``, x's dtype or float32.
    normalized_shape: int or tuple of x's trailing dims; None: ``x.shape[-1:]``.
    eps: float >= 0.
    scale_offset: static float added to ``weight`` (``1.0`` for Gemma-style
      zero-centered weights); must be 0 without a weight.
    save: what the forward keeps for the backward. ``"input"`` (default):
      x, float32 mean and rstd. ``"normalized"``: xhat in x's dtype and float32
      rstd (InfiniOp's form, see :func:`layer_norm_backward_from_normalized`):
      x need not be kept alive, e.g. when the next layer saves y anyway; with
      no weight and bias xhat is y itself and costs nothing. The backward then
      works from the rounded xhat, so 16-bit gradients are a little less exact.
    out_dtype: y's dtype: None (x's dtype), float32, or with a float32 x
      bfloat16 or float16. float32 with a 16-bit x and float32 parameters is
      what Flax and PyTorch autocast give: y rounded once to float32, its
      cotangent read as float32 by the backward kernel, the gradient of x in
      x's dtype; x is never copied to float32 on CPU. A 16-bit y from a
      float32 x is the norm of a float32 residual stream feeding 16-bit
      matmuls (``layer_norm(h).astype(bfloat16)`` in one kernel): y computed
      in float32 and rounded once, its 16-bit cotangent read as it is, the
      gradient of x in float32; no float32 y is written or read.
    forward: what computes the forward (the backward is the kernel either
      way). ``"kernel"``: the forward kernel, a custom call. ``"xla"``: the
      jnp forward, which XLA fuses with the ops around it (the activation,
      a residual add, the casts), keeping the same float32 statistics for
      the backward kernel. None: the platform's default
      (``jax_normgrad.LAYER_FORWARD_DEFAULT``; see docs/api.md).
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``y`` with x's shape, in ``out_dtype`` (None: x's dtype).

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x, norm_shape, weight, bias = check_forward_args(x, normalized_shape, weight, bias)
  cfg = LayerConfig(len(norm_shape), v.check_eps(eps), True,
                    v.check_scale_offset(scale_offset, weight), v.check_save(save),
                    v.check_implementation(implementation),
                    v.check_out_dtype(out_dtype, x, narrowing=True), v.check_forward(forward))
  return norm_layer(x, weight, bias, cfg)
