"""The residual form of LayerNorm / RMSNorm: ``h = x + residual``, ``y = norm(h)``, in one kernel pass each way."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_normgrad import _sharding, _validation as v
from jax_normgrad.ops._layer_norm_core import bwd, check_forward_args, fwd

F32 = jnp.float32


class _AddConfig(NamedTuple):
  """The static configuration of one residual-form call."""
  norm_ndim: int
  eps: float
  centered: bool  # False: RMSNorm.
  h_dtype: jnp.dtype | None  # None: x's dtype.
  x_dtype: jnp.dtype
  residual_dtype: jnp.dtype
  implementation: str | None
  forward: str = "auto"  # v.check_forward's: "kernel", "xla" or "auto".


def _forward(x, residual, weight, bias, cfg):
  f = fwd(x, weight, bias, cfg.norm_ndim, cfg.eps, cfg.implementation, centered=cfg.centered,
          residual=residual, h_dtype=cfg.h_dtype, forward=cfg.forward)
  return f.y, f.h, f.mean, f.rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _add_norm_layer(x, residual, weight, bias, cfg):
  return _forward(x, residual, weight, bias, cfg)[:2]


def _primal(a):
  """The value of a ``symbolic_zeros`` forward rule's argument (None stays None)."""
  return a.value if isinstance(a, jax.custom_derivatives.CustomVJPPrimal) else a


def _add_norm_layer_fwd(x, residual, weight, bias, cfg):
  x, residual, weight, bias = map(_primal, (x, residual, weight, bias))
  y, h, mean, rstd = _forward(x, residual, weight, bias, cfg)
  # The backward works from the stored h (the next block keeps it alive
  # anyway), float32 (M,) statistics and the small parameters: nothing else
  # tensor-sized is saved.
  return (y, h), (h, mean, rstd, weight, bias)


def _add_norm_layer_bwd(cfg, res, cotangents):
  h, mean, rstd, weight, bias = res
  dy, dh = cotangents
  # Symbolic zeros (defvjp(symbolic_zeros=True)): the last block's h, which
  # nothing reads, has a zero cotangent; the backward then runs without dh
  # instead of reading a materialized tensor of zeros.
  dh = None if isinstance(dh, jax.custom_derivatives.SymbolicZero) else dh
  if isinstance(dy, jax.custom_derivatives.SymbolicZero):
    # y unused: only h's cotangent flows back, and the parameters get none.
    dg, dg_narrow = (jnp.zeros(h.shape, F32) if dh is None else dh), None
    dw = None if weight is None else jnp.zeros_like(weight)
    db = None if bias is None else jnp.zeros_like(bias)
  else:
    # A 16-bit dy with a float32 h (residual_dtype=float32) is read as it is,
    # and the kernel writes the gradient twice: float32 and rounded to dy's
    # dtype (x's), each used where its dtype is wanted. No XLA pass widens dy
    # before the kernel or rounds the gradient after it.
    narrow = dy.dtype != h.dtype
    mask = (True, weight is not None, bias is not None)
    # A 16-bit weight with a float32 h is widened (small: cheap).
    kernel_weight = weight
    if weight is not None and weight.dtype not in (h.dtype, jnp.float32):
      kernel_weight = weight.astype(jnp.float32)
    g = bwd(dy, h, mean, rstd, kernel_weight, mask, cfg.norm_ndim, cfg.implementation,
            centered=cfg.centered, dh=None if dh is None else dh.astype(h.dtype), dx_dy=narrow)
    dg, dg_narrow = g.dx, g.dx_dy
    dw = None if g.dweight is None else g.dweight.astype(weight.dtype)
    db = None if g.dbias is None else g.dbias.astype(bias.dtype)
  # One gradient for x and residual (d h / d x = d h / d residual = 1), in each one's dtype.
  dx, dres = (_in_dtype(dg, dg_narrow, cfg.x_dtype), _in_dtype(dg, dg_narrow, cfg.residual_dtype))
  return (_sharding.cotangent_like(dx, h), _sharding.cotangent_like(dres, h),
          _sharding.cotangent_like(dw, weight), _sharding.cotangent_like(db, bias))


def _in_dtype(dg, dg_narrow, dtype):
  """The gradient in ``dtype``: the kernel's rounded copy (None: none) where it has that dtype."""
  if dg_narrow is not None and dg_narrow.dtype == dtype:
    return dg_narrow
  return dg.astype(dtype)


_add_norm_layer.defvjp(_add_norm_layer_fwd, _add_norm_layer_bwd, symbolic_zeros=True)


def _check_residual(residual, x):
  residual = v.as_array("residual", residual)
  v.check_float_dtype("residual", residual)
  v.check_param_dtype("residual", residual, x)
  v.check_same_shape("residual", residual, "x", x)
  return residual


def _add_norm(x, residual, weight, bias, normalized_shape, eps, residual_dtype, implementation,
              centered, forward=None):
  x, norm_shape, weight, bias = check_forward_args(x, normalized_shape, weight, bias)
  residual = _check_residual(residual, x)
  cfg = _AddConfig(len(norm_shape), v.check_eps(eps), centered,
                   v.check_out_dtype(residual_dtype, x, name="residual_dtype"), x.dtype,
                   residual.dtype, v.check_implementation(implementation), v.check_forward(forward))
  return _add_norm_layer(x, residual, weight, bias, cfg)


_SHARED_DOC = """
  ``h = x + residual`` is summed in float32 and rounded once to
  ``residual_dtype``, and ``y`` is the norm of ``h`` as stored: the
  statistics and ``y`` are computed (in float32) from the rounded ``h``, as
  the unfused ``norm(x + residual)`` computes them with the sum in x's dtype
  (and as vLLM's ``fused_add_rms_norm`` does). The backward works from the
  stored ``h`` with the forward's statistics (``h`` flows on to the next
  block, so nothing else tensor-sized is saved), so it is the derivative of
  what the forward computed; with the unrounded sum's statistics beside a
  16-bit stored ``h`` it would not be, and gradients over short rows with a
  large mean would be off (docs/spec.md, the residual form).
  ``residual_dtype=float32`` (flash-attn's ``residual_in_fp32``) keeps the
  float32 sum exact. The backward writes one gradient, ``dy``'s
  contribution plus the incoming cotangent of ``h``, which is the gradient
  of both ``x`` and ``residual`` (returned in each one's dtype), plus the
  parameter gradients. With a
  16-bit x and ``residual_dtype=float32`` the backward kernel reads the
  16-bit ``dy`` as it is and writes that gradient twice, in float32 (the
  residual's) and rounded once to x's dtype (x's), as XLA's fusion of the
  jnp form does: no pass around the kernel widens ``dy`` or rounds the
  gradient (CPU, Triton and TPU kernels; the Mosaic GPU kernels read one
  dtype, so there XLA converts around them). The forward
  is one kernel pass (read x and residual, write h and y) and the backward
  one pass of the LayerNorm kernels (dh added in its output pass), on CPU
  (FFI) and in the Pallas Triton, Mosaic GPU and TPU kernels (a row longer
  than Mosaic GPU's shared memory: its pieces' passes; a float16 h on TPU,
  whose kernels compute float16 in float32: XLA's rounded sum, then the
  plain forward kernel); works under ``jit``,
  ``vmap`` (batched residual, per-example weights), sharded ``jit`` /
  ``shard_map`` (rows sharded) and ``grad(grad)`` as :func:`jax_normgrad.layer_norm`.
"""


def add_layer_norm(x, residual, weight=None, bias=None, *, normalized_shape=None, eps=1e-5,
                   residual_dtype=None, forward=None, implementation=None):
  """Fused residual add + LayerNorm of a pre-norm block: ``h = x + residual``, ``y = layer_norm(h)``.
{shared}
  Args:
    x: float32, float16 or bfloat16 array (a block's output).
    residual: the residual stream, x's shape, in x's dtype or float32.
    weight, bias: optional, shape ``normalized_shape``, x's dtype or float32.
    normalized_shape: int or tuple of x's trailing dims; None: ``x.shape[-1:]``.
    eps: float >= 0.
    residual_dtype: ``h``'s dtype: None (x's dtype) or float32.
    forward: None (the platform's default), ``"kernel"`` or ``"xla"`` (the
      jnp add and norm, fused by XLA with its neighbours; the backward is
      the kernel either way); see :func:`jax_normgrad.layer_norm`.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(y, h)``: ``y`` with x's shape and dtype, ``h`` in ``residual_dtype``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  return _add_norm(x, residual, weight, bias, normalized_shape, eps, residual_dtype,
                   implementation, centered=True, forward=forward)


def add_rms_norm(x, residual, weight=None, *, normalized_shape=None, eps=1e-6, residual_dtype=None,
                 forward=None, implementation=None):
  """Fused residual add + RMSNorm of a pre-norm block: ``h = x + residual``, ``y = rms_norm(h)``.
{shared}
  Args:
    x: float32, float16 or bfloat16 array (a block's output).
    residual: the residual stream, x's shape, in x's dtype or float32.
    weight: optional (None: ones), shape ``normalized_shape``, x's dtype or float32.
    normalized_shape: int or tuple of x's trailing dims; None: ``x.shape[-1:]``.
    eps: float >= 0.
    residual_dtype: ``h``'s dtype: None (x's dtype) or float32.
    forward: None (the platform's default), ``"kernel"`` or ``"xla"`` (the
      jnp add and norm, fused by XLA with its neighbours; the backward is
      the kernel either way); see :func:`jax_normgrad.layer_norm`.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(y, h)``: ``y`` with x's shape and dtype, ``h`` in ``residual_dtype``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  return _add_norm(x, residual, weight, None, normalized_shape, eps, residual_dtype,
                   implementation, centered=False, forward=forward)


for _f in (add_layer_norm, add_rms_norm):
  if _f.__doc__:  # None under python -OO
    _f.__doc__ = _f.__doc__.format(shared=_SHARED_DOC)
