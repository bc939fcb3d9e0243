"""LayerNorm and RMSNorm primitives: forward with statistics and backward.

Canonical operands (see ``jax_normgrad.reference``): ``x``, ``dy`` of shape
``(M, H)``, dy in x's dtype or float32 (any with a float32 x); ``mean``, ``rstd`` of shape ``(M,)`` float32; ``weight``, ``bias``
of shape ``(W, H)``, ``W = param_groups``, float32 or x's dtype (the two
alike; every lowering computes in float32, and the CPU kernels read 16-bit
parameters without a float32 copy). ``centered=False`` is
RMSNorm (no mean: no ``mean`` operand or output, no ``mean(g)`` term).
The forward's ``y_dtype`` (None: x's dtype, float32, or a 16-bit dtype with a
float32 x) is y's dtype: a 16-bit x with float32 parameters gives a float32
y, read and computed without a float32 copy of x; its backward then takes a
float32 ``dy``. A float32 x with a 16-bit y (a float32 residual stream's
norm feeding 16-bit matmuls) has a 16-bit ``dy``, which the backward reads
as it is.

Two flags serve the vendor forms of the backward on the same kernels:
``write_xhat`` adds ``xhat = (x - mean) * rstd`` (in x's dtype) as a last
output of either primitive, and ``normalized`` makes the backward read its
``x`` operand as ``xhat`` (no ``mean`` operand; ``rstd`` only scales ``dx`` and
is an empty ``(0,)`` array when ``dx`` is masked out).

The residual form (``add_layer_norm`` / ``add_rms_norm``) runs on the same
primitives: the forward's ``has_residual`` adds a ``residual`` operand after
x (x's dtype or float32), normalizes ``h = x + residual`` summed in float32
and returns h (in ``h_dtype``, None: x's dtype) as a last output; the
backward's ``has_dh`` adds a last operand ``dh`` (the cotangent of h, in the
dtype of the backward's x operand, which is then h) that is added into dx.
With a float32 h under a 16-bit y (``residual_dtype=float32``) the backward
takes dy in its 16-bit dtype, and ``write_dx_dy`` (with dx) adds a
result right after dx: dx rounded to dy's dtype, the gradient of the 16-bit
x. The kernels read and write those directly, as XLA's fusion of the jnp
form does, instead of an XLA pass widening dy before them and another
rounding dx after. Those are the only dtypes of the two flags (TypeError
otherwise, on every backend): ``has_dh`` with dy in x's dtype or 16-bit
with a float32 x, ``write_dx_dy`` with a float32 x and a 16-bit dy; the CPU
kernels are compiled for these only.
``write_xhat`` is refused with ``has_residual`` on every backend: the
residual form's backward works from h, which the forward writes anyway (the
next block reads it), so an xhat would be a second tensor-sized write that
no caller reads; the xhat-based (``normalized``) backward serves the vendor
forms of plain LayerNorm only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_normgrad import _dispatch, _ffi, reference
from jax_normgrad.pallas import layer_norm as pallas_ln
from jax_normgrad.primitives._common import make_primitive, shaped

F32 = jnp.float32


# ----------------------------------------------------------------------------
# Forward with statistics: (x, [residual], [weight], [bias]) -> (y, [mean], rstd, [xhat], [h])


def _fwd_abstract(x, *params, eps, centered, has_weight, has_bias, param_groups, write_xhat,
                  y_dtype, implementation, has_residual=False, h_dtype=None):
  del params, eps, has_weight, has_bias, param_groups, implementation
  if has_residual and write_xhat:
    raise ValueError("write_xhat: not available with has_residual (the residual form's backward "
                     "reads h, which it writes anyway; see the module docstring)")
  m = x.shape[0]
  stats = [shaped((m,), F32)] * (2 if centered else 1)
  return ([shaped(x.shape, y_dtype or x.dtype)] + stats
          + [shaped(x.shape, x.dtype)] * write_xhat + [shaped(x.shape, h_dtype or x.dtype)] * has_residual)


def _split_params(params, has_weight, has_bias):
  params = list(params)
  weight = params.pop(0) if has_weight else None
  bias = params.pop(0) if has_bias else None
  return weight, bias


def _split_residual(params, has_weight, has_bias, has_residual):
  """(residual | None, weight | None, bias | None) from the forward's operands after x."""
  residual, params = (params[0], params[1:]) if has_residual else (None, params)
  return (residual,) + _split_params(params, has_weight, has_bias)


def _fwd_xla(x, *params, eps, centered, has_weight, has_bias, param_groups, write_xhat, y_dtype,
             has_residual=False, h_dtype=None):
  residual, weight, bias = _split_residual(params, has_weight, has_bias, has_residual)
  return reference.layer_norm_fwd(x, weight, bias, eps=eps, centered=centered,
                                  param_groups=param_groups, write_xhat=write_xhat,
                                  y_dtype=y_dtype, residual=residual, h_dtype=h_dtype)


def _fwd_ffi(x, *params, eps, centered, has_weight, has_bias, param_groups, write_xhat, y_dtype,
             has_residual=False, h_dtype=None):
  residual, weight, bias = _split_residual(params, has_weight, has_bias, has_residual)
  m = x.shape[0]
  out_types = [jax.ShapeDtypeStruct(x.shape, y_dtype or x.dtype),
               jax.ShapeDtypeStruct((m if centered else 0,), F32),
               jax.ShapeDtypeStruct((m,), F32),
               jax.ShapeDtypeStruct(x.shape if write_xhat else (0,), x.dtype),
               jax.ShapeDtypeStruct(x.shape if has_residual else (0,), h_dtype or x.dtype)]
  y, mean, rstd, xhat, h = _ffi.call(
      "jax_normgrad_layer_norm_fwd", out_types, x, residual, weight, bias, eps=eps,
      param_groups=param_groups, has_weight=has_weight, has_bias=has_bias, centered=centered,
      write_xhat=write_xhat, has_residual=has_residual)
  return ([y] + ([mean] if centered else []) + [rstd] + ([xhat] if write_xhat else [])
          + ([h] if has_residual else []))


# Axis names for the partitioning rule (``_sharding.register_roles``): rows
# "r", the normalized width "h", parameter rows "w".
_ROWS, _STATS, _PARAM = ("r", "h"), ("r",), ("w", "h")


def _fwd_roles(n_in, *, centered, write_xhat, has_residual=False, **params):
  del params
  return ([_ROWS] * (1 + has_residual) + [_PARAM] * (n_in - 1 - has_residual),
          [_ROWS] + [_STATS] * (1 + centered) + [_ROWS] * (write_xhat + has_residual))


layer_norm_fwd_p = make_primitive(
    "jax_normgrad_layer_norm_fwd", _fwd_abstract,
    _dispatch.Lowerings(xla=_fwd_xla, ffi=_fwd_ffi, pallas=pallas_ln.layer_norm_fwd,
                        problem=pallas_ln.layer_norm_fwd_problem), roles=_fwd_roles)


# ----------------------------------------------------------------------------
# Backward: (dy, x, [mean], rstd, [weight], [dh]) -> the output_mask'ed of (dx, [dx in dy's dtype],
# dweight, dbias), [xhat]


def _bwd_abstract(dy, x, *rest, centered, has_weight, output_mask, param_groups, normalized,
                  write_xhat, implementation, has_dh=False, write_dx_dy=False):
  del rest, centered, has_weight, normalized, implementation
  if has_dh and not output_mask[0]:
    raise ValueError("has_dh: dh is added into dx, which output_mask leaves out")
  if write_dx_dy and not output_mask[0]:
    raise ValueError("write_dx_dy: a second dx, which output_mask leaves out")
  if dy.dtype != x.dtype and dy.dtype != F32 and x.dtype != F32:
    raise TypeError(f"dy: expected x's dtype ({x.dtype}) or float32, got {dy.dtype}")
  # The residual form's dtypes (ops/add_norm.py), the only ones its kernels are built for.
  if has_dh and dy.dtype == F32 and x.dtype != F32:
    raise TypeError(f"has_dh: expected dy in x's dtype ({x.dtype}) or a 16-bit dy with a "
                    f"float32 x, got a float32 dy with a {x.dtype} x")
  if write_dx_dy and not (x.dtype == F32 and dy.dtype != F32):
    raise TypeError(f"write_dx_dy: expected a float32 x and a 16-bit dy, got x {x.dtype} and "
                    f"dy {dy.dtype}")
  outs = []
  if output_mask[0]:
    outs.append(shaped(x.shape, x.dtype))
    if write_dx_dy:
      outs.append(shaped(x.shape, dy.dtype))
  outs += [shaped((param_groups, x.shape[1]), F32)] * sum(output_mask[1:])
  if write_xhat:
    outs.append(shaped(x.shape, x.dtype))
  return outs


def _bwd_xla(dy, x, *rest, centered, has_weight, output_mask, param_groups, normalized,
             write_xhat, has_dh=False, write_dx_dy=False):
  return reference.layer_norm_bwd(dy, x, *rest, centered=centered, has_weight=has_weight,
                                  output_mask=output_mask, param_groups=param_groups,
                                  normalized=normalized, write_xhat=write_xhat, has_dh=has_dh,
                                  write_dx_dy=write_dx_dy)


def _bwd_ffi(dy, x, *rest, centered, has_weight, output_mask, param_groups, normalized,
             write_xhat, has_dh=False, write_dx_dy=False):
  rest, dh = reference.split_dh(rest, has_dh)
  mean, rstd, weight = reference.split_ln_bwd_operands(rest, centered, has_weight, normalized)
  mask = tuple(output_mask) + (False,) * (3 - len(output_mask))
  h = x.shape[1]
  out_types = [jax.ShapeDtypeStruct(x.shape if mask[0] else (0,), x.dtype),
               jax.ShapeDtypeStruct((param_groups, h) if mask[1] else (0,), F32),
               jax.ShapeDtypeStruct((param_groups, h) if mask[2] else (0,), F32),
               jax.ShapeDtypeStruct(x.shape if write_xhat else (0,), x.dtype),
               jax.ShapeDtypeStruct(x.shape if write_dx_dy else (0,), dy.dtype)]
  outs = _ffi.call("jax_normgrad_layer_norm_bwd", out_types, dy, x, mean, rstd, weight, dh,
                   param_groups=param_groups, has_weight=has_weight, compute_dx=mask[0],
                   compute_dweight=mask[1], compute_dbias=mask[2], centered=centered,
                   normalized=normalized, write_xhat=write_xhat, has_dh=has_dh,
                   write_dx_dy=write_dx_dy)
  dx, dw, db, xhat, dx_dy = outs
  ordered = (dx, dx_dy, dw, db, xhat)
  return [o for o, m in zip(ordered, (mask[0], write_dx_dy) + mask[1:] + (write_xhat,)) if m]


def _bwd_roles(n_in, *, has_weight, output_mask, write_xhat, has_dh=False, write_dx_dy=False,
               **params):
  del params
  n_stats = n_in - 2 - has_weight - has_dh
  return ([_ROWS, _ROWS] + [_STATS] * n_stats + [_PARAM] * has_weight + [_ROWS] * has_dh,
          [_ROWS] * (output_mask[0] + write_dx_dy) + [_PARAM] * sum(output_mask[1:])
          + [_ROWS] * write_xhat)


layer_norm_bwd_p = make_primitive(
    "jax_normgrad_layer_norm_bwd", _bwd_abstract,
    _dispatch.Lowerings(xla=_bwd_xla, ffi=_bwd_ffi, pallas=pallas_ln.layer_norm_bwd,
                        problem=pallas_ln.layer_norm_bwd_problem), roles=_bwd_roles)
