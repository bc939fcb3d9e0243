"""LayerNorm and RMSNorm primitives: forward with statistics and backward.

The operands, named by ``jax_normgrad._operands`` (``NormFwd``, ``NormBwd``;
canonical layouts: ``jax_normgrad.reference``): ``x``, ``dy`` of shape
``(M, H)``, dy in x's dtype or float32 (any with a float32 x); ``mean``,
``rstd`` of shape ``(M,)`` float32; ``weight``, ``bias`` of shape ``(W,
H)``, ``W = param_groups``, float32 or x's dtype (the two
alike; every lowering computes in float32, and the CPU kernels read 16-bit
parameters without a float32 copy). ``centered=False`` is
RMSNorm (no mean: no ``mean`` operand or output, no ``mean(g)`` term).
The outputs, named by ``jax_normgrad._outputs`` (``NormFwdOut``,
``NormBwdOut``), are those the parameters ask for, in their fields' order.
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
primitives: the forward's ``residual`` operand (x's dtype or float32) makes
it normalize ``h = x + residual`` as it is stored, summed in float32 and
rounded to ``h_dtype`` (None: x's dtype), the statistics and y those of
that rounded h, which it returns as a last output (docs/spec.md, the
residual form: the backward, reading the stored h, then differentiates
what the forward computed); the backward's ``dh``
operand (the cotangent of h, in the dtype of the backward's x operand,
which is then h) is added into dx.
With a float32 h under a 16-bit y (``residual_dtype=float32``) the backward
takes dy in its 16-bit dtype, and ``write_dx_dy`` (with dx) adds a
result right after dx: dx rounded to dy's dtype, the gradient of the 16-bit
x. The kernels read and write those directly, as XLA's fusion of the jnp
form does, instead of an XLA pass widening dy before them and another
rounding dx after. Those are the only dtypes of the two (TypeError
otherwise, on every backend): ``dh`` with dy in x's dtype or 16-bit
with a float32 x, ``write_dx_dy`` with a float32 x and a 16-bit dy; the CPU
kernels are compiled for these only.
``write_xhat`` is refused with a ``residual`` on every backend: the
residual form's backward works from h, which the forward writes anyway (the
next block reads it), so an xhat would be a second tensor-sized write that
no caller reads; the xhat-based (``normalized``) backward serves the vendor
forms of plain LayerNorm only.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_normgrad import _ffi, _lowering, _outputs, reference
from jax_normgrad.pallas import layer_norm as pallas_ln
from jax_normgrad.primitives._common import make_primitive, shaped
from jax_normgrad._operands import NormBwd, NormFwd, unpack
from jax_normgrad._outputs import NormBwdOut, NormFwdOut

F32 = jnp.float32


# ----------------------------------------------------------------------------
# Forward with statistics: NormFwd(x, [residual], [weight], [bias]) -> (y, [mean], rstd, [xhat], [h])


def _fwd_abstract(*args, operands, eps, centered, param_groups, write_xhat, y_dtype,
                  implementation, h_dtype=None):
  del eps, param_groups, implementation
  o = unpack(NormFwd, args, operands)
  if o.residual is not None and write_xhat:
    raise ValueError("write_xhat: not available with a residual (the residual form's backward "
                     "reads h, which it writes anyway; see the module docstring)")
  names = _outputs.norm_fwd_names(operands=operands, centered=centered, write_xhat=write_xhat)
  return [shaped(t.shape, t.dtype)
          for t in _outputs.pack(_outputs.norm_fwd_types(o, y_dtype=y_dtype, h_dtype=h_dtype),
                                 names)]


def _fwd_xla(*args, operands, eps, centered, param_groups, write_xhat, y_dtype, h_dtype=None):
  o = unpack(NormFwd, args, operands)
  return reference.layer_norm_fwd(o.x, o.weight, o.bias, eps=eps, centered=centered,
                                  param_groups=param_groups, write_xhat=write_xhat,
                                  y_dtype=y_dtype, residual=o.residual, h_dtype=h_dtype)


#: The results of the C++ forward, in its order (every one written; the absent ones empty).
_FFI_FWD_ORDER = ("y", "mean", "rstd", "xhat", "h")


def _fwd_ffi(*args, operands, eps, centered, param_groups, write_xhat, y_dtype, h_dtype=None):
  o = unpack(NormFwd, args, operands)
  names = _outputs.norm_fwd_names(operands=operands, centered=centered, write_xhat=write_xhat)
  types = _outputs.norm_fwd_types(o, y_dtype=y_dtype, h_dtype=h_dtype)
  outs = _ffi.call(
      "jax_normgrad_layer_norm_fwd", _outputs.slots(types, names, _FFI_FWD_ORDER), o.x,
      o.residual, o.weight, o.bias, eps=eps, param_groups=param_groups,
      has_weight=o.weight is not None, has_bias=o.bias is not None, centered=centered,
      write_xhat=write_xhat, has_residual=o.residual is not None)
  return _outputs.pack(_outputs.unpack(NormFwdOut, outs, _FFI_FWD_ORDER), names)


# Axis names of the operands and outputs for the partitioning rule
# (``_sharding.register_roles``): rows "r", the normalized width "h",
# parameter rows "w".
_ROWS, _STATS, _PARAM = ("r", "h"), ("r",), ("w", "h")
_ROLES = {"x": _ROWS, "residual": _ROWS, "dy": _ROWS, "dh": _ROWS, "mean": _STATS,
          "rstd": _STATS, "weight": _PARAM, "bias": _PARAM, "y": _ROWS, "xhat": _ROWS,
          "h": _ROWS, "dx": _ROWS, "dx_dy": _ROWS, "dweight": _PARAM, "dbias": _PARAM}


def _fwd_roles(*, operands, **params):
  return ([_ROLES[name] for name in operands],
          [_ROLES[name] for name in _outputs.norm_fwd_names(operands=operands, **params)])


layer_norm_fwd_p = make_primitive(
    "jax_normgrad_layer_norm_fwd", _fwd_abstract,
    _lowering.Lowerings(xla=_fwd_xla, ffi=_fwd_ffi, pallas=pallas_ln.layer_norm_fwd,
                        problem=pallas_ln.layer_norm_fwd_problem), roles=_fwd_roles)


# ----------------------------------------------------------------------------
# Backward: NormBwd(dy, x, [mean], rstd, [weight], [dh]) -> the output_mask'ed of
# (dx, [dx in dy's dtype], dweight, dbias), [xhat]


def _bwd_abstract(*args, operands, centered, output_mask, param_groups, normalized, write_xhat,
                  implementation, write_dx_dy=False):
  del centered, normalized, implementation
  o = unpack(NormBwd, args, operands)
  dy, x, has_dh = o.dy, o.x, o.dh is not None
  compute_dx = _outputs.output_mask(output_mask)[0]
  if has_dh and not compute_dx:
    raise ValueError("dh: added into dx, which output_mask leaves out")
  if write_dx_dy and not compute_dx:
    raise ValueError("write_dx_dy: a second dx, which output_mask leaves out")
  if dy.dtype != x.dtype and dy.dtype != F32 and x.dtype != F32:
    raise TypeError(f"dy: expected x's dtype ({x.dtype}) or float32, got {dy.dtype}")
  # The residual form's dtypes (ops/add_norm.py), the only ones its kernels are built for.
  if has_dh and dy.dtype == F32 and x.dtype != F32:
    raise TypeError(f"dh: expected dy in x's dtype ({x.dtype}) or a 16-bit dy with a "
                    f"float32 x, got a float32 dy with a {x.dtype} x")
  if write_dx_dy and not (x.dtype == F32 and dy.dtype != F32):
    raise TypeError(f"write_dx_dy: expected a float32 x and a 16-bit dy, got x {x.dtype} and "
                    f"dy {dy.dtype}")
  names = _outputs.norm_bwd_names(output_mask=output_mask, write_xhat=write_xhat,
                                  write_dx_dy=write_dx_dy)
  return [shaped(t.shape, t.dtype)
          for t in _outputs.pack(_outputs.norm_bwd_types(o, param_groups=param_groups), names)]


def _bwd_xla(*args, operands, centered, output_mask, param_groups, normalized, write_xhat,
             write_dx_dy=False):
  return reference.layer_norm_bwd(unpack(NormBwd, args, operands), centered=centered,
                                  output_mask=output_mask, param_groups=param_groups,
                                  normalized=normalized, write_xhat=write_xhat,
                                  write_dx_dy=write_dx_dy)


#: The results of the C++ backward, in its order (every one written; the absent ones empty).
_FFI_BWD_ORDER = ("dx", "dweight", "dbias", "xhat", "dx_dy")


def _bwd_ffi(*args, operands, centered, output_mask, param_groups, normalized, write_xhat,
             write_dx_dy=False):
  o = unpack(NormBwd, args, operands)
  mask = _outputs.output_mask(output_mask)
  names = _outputs.norm_bwd_names(output_mask=mask, write_xhat=write_xhat,
                                  write_dx_dy=write_dx_dy)
  types = _outputs.norm_bwd_types(o, param_groups=param_groups)
  outs = _ffi.call("jax_normgrad_layer_norm_bwd", _outputs.slots(types, names, _FFI_BWD_ORDER),
                   o.dy, o.x, o.mean, o.rstd, o.weight, o.dh, param_groups=param_groups,
                   has_weight=o.weight is not None, compute_dx=mask[0], compute_dweight=mask[1],
                   compute_dbias=mask[2], centered=centered, normalized=normalized,
                   write_xhat=write_xhat, has_dh=o.dh is not None, write_dx_dy=write_dx_dy)
  return _outputs.pack(_outputs.unpack(NormBwdOut, outs, _FFI_BWD_ORDER), names)


def _bwd_roles(*, operands, **params):
  return ([_ROLES[name] for name in operands],
          [_ROLES[name] for name in _outputs.norm_bwd_names(**params)])


layer_norm_bwd_p = make_primitive(
    "jax_normgrad_layer_norm_bwd", _bwd_abstract,
    _lowering.Lowerings(xla=_bwd_xla, ffi=_bwd_ffi, pallas=pallas_ln.layer_norm_bwd,
                        problem=pallas_ln.layer_norm_bwd_problem), roles=_bwd_roles)
