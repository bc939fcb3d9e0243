"""RMSNorm: the differentiable layer, the forward with statistics and the backward op (LayerNorm's kernels and core, centered=False)."""

from __future__ import annotations

import math

from jax_normgrad import _validation as v
from jax_normgrad.ops._layer_norm_core import (LayerConfig, bwd, check_forward_args, check_params,
                                               check_stats, fwd, norm_layer, stats_shape)


def rms_norm_fwd(x, normalized_shape, weight=None, eps=1e-6, *, scale_offset=0.0,
                 implementation=None):
  """RMSNorm forward that also returns the statistic the backward needs.

  Over the trailing dims ``R = normalized_shape`` of ``x`` (shape ``A + R``),
  per row of ``H = prod(R)`` elements, in float32 (no mean subtraction)::

      rstd = 1 / sqrt(sum(x^2) / H + eps)
      y    = x * rstd * (weight + scale_offset)

  Args:
    x: float32, float16 or bfloat16 array of shape ``A + R``.
    normalized_shape: int or tuple ``R``, the trailing dims of ``x``; non-empty.
    weight: optional (None: ones), shape ``R``, x's dtype or float32.
    eps: float >= 0 added to the mean square.
    scale_offset: static float added to ``weight`` in float32 (``1.0`` for
      Gemma-style zero-centered weights); must be 0 without a weight.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(y, rstd)``: ``y`` with x's shape and dtype; ``rstd`` float32 of shape
    ``A + (1,) * len(R)``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x, norm_shape, weight, _ = check_forward_args(x, normalized_shape, weight, None)
  eps = v.check_eps(eps)
  scale_offset = v.check_scale_offset(scale_offset, weight)
  implementation = v.check_implementation(implementation)
  f = fwd(x, weight, None, len(norm_shape), eps, implementation, centered=False,
          scale_offset=scale_offset)
  return f.y, f.rstd.reshape(stats_shape(x, len(norm_shape)))


def rms_norm_backward(grad_out, x, normalized_shape, rstd, weight=None, output_mask=(True, True),
                      *, scale_offset=0.0, implementation=None):
  """RMSNorm backward on the LayerNorm backward kernel (no mean terms).

  With ``xhat = x * rstd`` and ``g = grad_out * (weight + scale_offset)``
  (weight absent: ones), per row of ``H = prod(normalized_shape)`` elements::

      grad_input  = rstd * (g - xhat * mean(g * xhat))
      grad_weight = sum over rows of grad_out * xhat

  accumulated in float32 and cast once at the end.

  Args:
    grad_out: the cotangent of y; x's shape and dtype.
    x: float32, float16 or bfloat16, shape ``A + normalized_shape``.
    normalized_shape: int or non-empty tuple, the trailing dims of ``x``.
    rstd: any shape with ``prod(A)`` elements, float32 or x's dtype.
    weight: optional, shape ``normalized_shape``, x's dtype or float32.
    output_mask: two bools: which of (grad_input, grad_weight) to compute.
      Masked outputs are returned as None and not computed.
    scale_offset: static float the forward added to ``weight``; grad_weight
      does not depend on it.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(grad_input, grad_weight)``: grad_input with x's shape and dtype;
    grad_weight of shape ``normalized_shape`` in weight's dtype (x's when
    None). None where masked.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  grad_out = v.as_array("grad_out", grad_out)
  x = v.as_array("x", x)
  rstd = v.as_array("rstd", rstd)
  v.check_float_dtype("x", x)
  v.check_same_dtype("grad_out", grad_out, "x", x)
  v.check_shape("grad_out", grad_out, x.shape, "x.shape")
  norm_shape = v.normalized_shape_of(normalized_shape, x)
  rows = math.prod(x.shape[:x.ndim - len(norm_shape)])
  check_stats((("rstd", rstd),), x, rows)
  weight, _ = check_params(weight, None, x, norm_shape)
  mask = v.check_output_mask(output_mask, length=2)
  scale_offset = v.check_scale_offset(scale_offset, weight)
  implementation = v.check_implementation(implementation)
  if not any(mask):
    return (None, None)
  g = bwd(grad_out, x, None, rstd, weight, mask, len(norm_shape), implementation, centered=False,
          scale_offset=scale_offset)
  pdtype = v.param_grad_dtype(weight, None, x)
  return g.dx, None if g.dweight is None else g.dweight.astype(pdtype)


def rms_norm(x, weight=None, *, normalized_shape=None, eps=1e-6, scale_offset=0.0,
             out_dtype=None, forward=None, implementation=None):
  """Differentiable RMSNorm whose backward runs the backward kernel.

  ``y = x * rstd * (weight + scale_offset)``, ``rstd = 1 / sqrt(mean(x^2) +
  eps)`` over the trailing dims ``normalized_shape`` (see
  :func:`rms_norm_fwd`); backward: :func:`rms_norm_backward`'s kernel. Works
  under ``jit``, ``vmap`` (batched weight included), ``grad(grad)``,
  ``jax.hessian`` and ``jvp(grad)``; like every ``custom_vjp``, not under a
  first-order ``jax.jvp`` of the layer itself (use :func:`rms_norm_fwd`).
  The forward saves x, float32 rstd and the weight.

  Args:
    x: float32, float16 or bfloat16 array.
    weight: optional (None: ones), shape ``normalized_shape``, x's dtype or
      float32.
    normalized_shape: int or tuple of x's trailing dims; None: ``x.shape[-1:]``.
    eps: float >= 0.
    scale_offset: static float added to ``weight`` (``1.0`` for Gemma-style
      zero-centered weights); must be 0 without a weight. The gradient of
      ``weight`` is ``sum dy * xhat`` whatever the offset.
    out_dtype: y's dtype: None (x's dtype), float32 (a 16-bit x with
      float32 parameters, y rounded once), or with a float32 x bfloat16 or
      float16 (a float32 residual stream feeding 16-bit matmuls, y rounded
      once by the kernel); see :func:`jax_normgrad.layer_norm`.
    forward: None (the platform's default), ``"kernel"`` or ``"xla"`` (the
      jnp forward, fused by XLA with its neighbours; the backward is the
      kernel either way); see :func:`jax_normgrad.layer_norm`.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``y`` with x's shape, in ``out_dtype`` (None: x's dtype).

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x, norm_shape, weight, _ = check_forward_args(x, normalized_shape, weight, None)
  cfg = LayerConfig(len(norm_shape), v.check_eps(eps), False,
                    v.check_scale_offset(scale_offset, weight), "input",
                    v.check_implementation(implementation),
                    v.check_out_dtype(out_dtype, x, narrowing=True), v.check_forward(forward))
  return norm_layer(x, weight, None, cfg)
