"""LayerNorm: the differentiable layer, the forward with statistics and the backward op (shared with RMSNorm)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_normgrad import _sharding, _validation as v
from jax_normgrad._operands import NormBwd, NormFwd, pack
from jax_normgrad.ops._common import F32, as_f32, kernel_params, unmask
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


def _check_forward_args(x, normalized_shape, weight, bias):
  """The checks of every forward entry point: x, a non-empty normalized_shape, weight and bias.

  Returns ``(x, normalized_shape, weight, bias)`` as arrays / a tuple.
  """
  x = v.as_array("x", x)
  v.check_float_dtype("x", x)
  norm_shape = v.normalized_shape_of(normalized_shape, x)
  v.check_positive_size("normalized_shape", math.prod(norm_shape), "number of elements")
  weight, bias = _check_params(weight, bias, x, norm_shape)
  return x, norm_shape, weight, bias


def _reshaped(a, shape):
  """``a`` viewed as ``shape`` (``_sharding.reshape``: a sharded dim it would merge into a
  minor position is gathered first); None stays None."""
  return None if a is None else _sharding.reshape(a, shape)


def _rows_and_width(x, norm_ndim):
  """(M, H): x viewed as M rows of the H normalized elements."""
  lead = x.ndim - norm_ndim
  return math.prod(x.shape[:lead]), math.prod(x.shape[lead:])


def _fwd(x, weight, bias, norm_ndim, eps, implementation, *, centered=True, scale_offset=0.0,
         write_xhat=False, y_dtype=None, residual=None, h_dtype=None, forward="kernel"):
  """Canonical forward (LayerNorm, or RMSNorm when not ``centered``).

  Returns ``(y, mean, rstd, xhat, h)``: y with x's shape, in ``y_dtype`` (None:
  x's dtype; else see ``v.check_out_dtype``); float32
  mean (None when not centered) and rstd of shape ``A``, x's leading dims;
  xhat with x's shape and dtype when ``write_xhat``, else None. With a
  ``residual`` (x's shape) the normalized input is ``h = x + residual``,
  summed in float32 and returned as ``h`` in ``h_dtype`` (None: x's
  dtype); else ``h`` is None. The leading
  dims are merged into rows on each device (see ``_sharding.bind``), so a
  sharded batch or sequence dim stays sharded. ``forward``: what lowers it,
  "kernel" (``implementation``), "xla" or "auto" (a layer's default, see
  ``_dispatch.choose``).
  """
  lead = x.ndim - norm_ndim
  _, h = _rows_and_width(x, norm_ndim)
  # No leading dims: one row, as a unit dim (a (0,) row operand would read as
  # an empty placeholder to the sharding wrapper).
  lead_shape = x.shape[:lead] or (1,)
  rows = lead_shape + (h,)
  weight, bias = kernel_params(weight, bias, (1, h), scale_offset)
  args, operands = pack(NormFwd(_reshaped(x, rows), _reshaped(residual, rows), weight, bias))
  outs = list(_sharding.bind(
      layer_norm_fwd_p, *args, lead=len(lead_shape), operands=operands, eps=eps,
      centered=centered, param_groups=1, write_xhat=write_xhat, y_dtype=y_dtype,
      h_dtype=None if residual is None else h_dtype, implementation=implementation,
      forward=forward))
  y = outs.pop(0).reshape(x.shape)
  mean = outs.pop(0).reshape(x.shape[:lead]) if centered else None
  rstd = outs.pop(0).reshape(x.shape[:lead])
  xhat = outs.pop(0).reshape(x.shape) if write_xhat else None
  h_out = outs.pop(0).reshape(x.shape) if residual is not None else None
  return y, mean, rstd, xhat, h_out


def _bwd(dy, x, mean, rstd, weight, output_mask, norm_ndim, implementation, *, centered=True,
         scale_offset=0.0, normalized=False, write_xhat=False, dh=None, dx_dy=False):
  """Canonical backward on the backward kernel, every LayerNorm / RMSNorm form of it.

  ``mean``/``rstd``: any shape with M elements (``mean`` ignored when not
  centered or ``normalized``). ``normalized``: ``x`` is xhat and ``rstd`` only
  scales grad_input (it may be None when ``output_mask[0]`` is False).
  ``dy`` is in x's dtype or float32 (the cotangent of a float32 y), or any
  float dtype with a float32 x (the residual form's float32 h).
  Returns the masked ``(dx, dweight, dbias)``, dx with x's shape and dtype,
  the parameter gradients float32 with the normalized shape; then xhat (x's
  shape and dtype) when ``write_xhat``. ``dh`` (x's shape and dtype; needs
  dx): added into dx in float32 (the residual form, whose x is h). As in
  ``_fwd``, x's leading dims are merged into rows on each device.
  ``dx_dy`` (needs dx; dy may be 16-bit with a float32 x, the residual
  form's float32 h): dx is also written rounded to dy's dtype, returned last.
  """
  lead = x.ndim - norm_ndim
  norm_shape = x.shape[lead:]
  _, h = _rows_and_width(x, norm_ndim)
  output_mask = tuple(output_mask) + (False,) * (3 - len(output_mask))
  lead_shape = x.shape[:lead] or (1,)  # as in _fwd
  rows = lead_shape + (h,)
  mean = as_f32(mean, lead_shape) if centered and not normalized else None
  # An unused rstd travels as an empty operand (the kernel checks it is one).
  rstd = jnp.zeros((0,), F32) if rstd is None else as_f32(rstd, lead_shape)
  args, operands = pack(NormBwd(_reshaped(dy, rows), _reshaped(x, rows), mean, rstd,
                                kernel_params(weight, None, (1, h), scale_offset)[0],
                                _reshaped(dh, rows)))
  outs = _sharding.bind(
      layer_norm_bwd_p, *args, lead=len(lead_shape), operands=operands, centered=centered,
      output_mask=output_mask, param_groups=1, normalized=normalized, write_xhat=write_xhat,
      write_dx_dy=dx_dy, implementation=implementation)
  to_x = lambda a: a.reshape(x.shape)
  to_param = lambda a: a.reshape(norm_shape)
  outs = list(outs)
  narrow = (to_x(outs.pop(1)),) if dx_dy else ()
  return unmask(outs, output_mask + (True,) * write_xhat,
                (to_x, to_param, to_param, to_x)) + narrow


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
  x, norm_shape, weight, bias = _check_forward_args(x, normalized_shape, weight, bias)
  eps = v.check_eps(eps)
  scale_offset = v.check_scale_offset(scale_offset, weight)
  implementation = v.check_implementation(implementation)
  y, mean, rstd, _, _ = _fwd(x, weight, bias, len(norm_shape), eps, implementation,
                          scale_offset=scale_offset)
  stats_shape = _stats_shape(x, len(norm_shape))
  return y, mean.reshape(stats_shape), rstd.reshape(stats_shape)


def _stats_shape(x, norm_ndim):
  """``A + (1,) * len(R)``: the statistics' shape, broadcastable against x."""
  return x.shape[:x.ndim - norm_ndim] + (1,) * norm_ndim


def _check_stats(names_and_stats, x, rows):
  """Statistics: ``rows`` elements in any shape, float32 or x's dtype, all of one dtype."""
  first_name, first = names_and_stats[0]
  for name, s in names_and_stats:
    v.check_stats_dtype(name, s, x)
    v.check_size(name, s, rows, "the product of x's leading, non-normalized dims")
    v.check_same_dtype(name, s, first_name, first)


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
  _check_stats((("mean", mean), ("rstd", rstd)), x, rows)
  weight, bias = _check_params(weight, bias, x, norm_shape)
  mask = v.check_output_mask(output_mask)
  scale_offset = v.check_scale_offset(scale_offset, weight)
  implementation = v.check_implementation(implementation)
  pdtype = v.param_grad_dtype(weight, bias, x)
  if not any(mask):
    return (None, None, None)
  dx, dw, db = _bwd(grad_out, x, mean, rstd, weight, mask, len(norm_shape), implementation,
                    scale_offset=scale_offset)
  cast = lambda a: None if a is None else a.astype(pdtype)
  return dx, cast(dw), cast(db)


# ----------------------------------------------------------------------------
# The differentiable layer, shared by layer_norm and rms_norm.


class _LayerConfig(NamedTuple):
  """The static configuration of one normalization layer call."""
  norm_ndim: int
  eps: float
  centered: bool  # False: RMSNorm.
  scale_offset: float
  save: str  # "input": x, mean, rstd; "normalized": xhat, rstd.
  implementation: str | None
  out_dtype: jnp.dtype | None = None  # None: x's dtype; else v.check_out_dtype's.
  forward: str = "auto"  # v.check_forward's: "kernel", "xla" or "auto".


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm_layer(x, weight, bias, cfg):
  return _fwd(x, weight, bias, cfg.norm_ndim, cfg.eps, cfg.implementation, centered=cfg.centered,
              scale_offset=cfg.scale_offset, y_dtype=cfg.out_dtype, forward=cfg.forward)[0]


def _norm_layer_fwd(x, weight, bias, cfg):
  normalized = cfg.save == "normalized"
  # Without weight and bias y is xhat, bit for bit (in x's dtype): save it
  # instead of a copy.
  write_xhat = normalized and (weight is not None or bias is not None or cfg.out_dtype is not None)
  y, mean, rstd, xhat, _ = _fwd(x, weight, bias, cfg.norm_ndim, cfg.eps, cfg.implementation,
                             centered=cfg.centered, scale_offset=cfg.scale_offset,
                             write_xhat=write_xhat, y_dtype=cfg.out_dtype, forward=cfg.forward)
  # Residuals: x or xhat in x's dtype, float32 (M,) statistics and the small
  # parameters; no float32 copy of anything tensor-sized.
  if normalized:
    return y, (y if xhat is None else xhat, None, rstd, weight, bias)
  return y, (x, mean, rstd, weight, bias)


def _norm_layer_bwd(cfg, res, dy):
  x_or_xhat, mean, rstd, weight, bias = res
  mask = (True, weight is not None, bias is not None)
  dx, dw, db = _bwd(dy, x_or_xhat, mean, rstd, weight, mask, cfg.norm_ndim, cfg.implementation,
                    centered=cfg.centered, scale_offset=cfg.scale_offset,
                    normalized=cfg.save == "normalized")
  dw = None if dw is None else dw.astype(weight.dtype)
  db = None if db is None else db.astype(bias.dtype)
  # Under shard_map a replicated weight's gradient is the psum of the local ones.
  return (_sharding.cotangent_like(dx, x_or_xhat), _sharding.cotangent_like(dw, weight),
          _sharding.cotangent_like(db, bias))


_norm_layer.defvjp(_norm_layer_fwd, _norm_layer_bwd)


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
  x, norm_shape, weight, bias = _check_forward_args(x, normalized_shape, weight, bias)
  cfg = _LayerConfig(len(norm_shape), v.check_eps(eps), True,
                     v.check_scale_offset(scale_offset, weight), v.check_save(save),
                     v.check_implementation(implementation),
                     v.check_out_dtype(out_dtype, x, narrowing=True), v.check_forward(forward))
  return _norm_layer(x, weight, bias, cfg)
