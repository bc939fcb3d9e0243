"""The LayerNorm family's shared core: argument checks, the forward and backward on the primitives, and the differentiable layer.

``ops/layer_norm.py`` (LayerNorm), ``ops/rms_norm.py`` (RMSNorm,
``centered=False``), ``ops/add_norm.py`` (the residual form) and
``ops/layer_norm_grad.py`` (the vendors' backward forms) stand on it.
:func:`fwd` and :func:`bwd` return the primitives' outputs by name
(``jax_normgrad._outputs``), in x's shape.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_normgrad import _outputs, _sharding, _validation as v
from jax_normgrad._operands import NormBwd, NormFwd, pack
from jax_normgrad._outputs import NormBwdOut, NormFwdOut
from jax_normgrad.ops._common import F32, as_f32, kernel_params
from jax_normgrad.primitives.layer_norm import layer_norm_bwd_p, layer_norm_fwd_p


def check_params(weight, bias, x, norm_shape):
  weight = v.optional_array("weight", weight)
  bias = v.optional_array("bias", bias)
  for name, p in (("weight", weight), ("bias", bias)):
    if p is not None:
      v.check_param_dtype(name, p, x)
      v.check_shape(name, p, norm_shape, "normalized_shape")
  v.check_params_share_dtype("weight", weight, "bias", bias)
  return weight, bias


def check_forward_args(x, normalized_shape, weight, bias):
  """The checks of every forward entry point: x, a non-empty normalized_shape, weight and bias.

  Returns ``(x, normalized_shape, weight, bias)`` as arrays / a tuple.
  """
  x = v.as_array("x", x)
  v.check_float_dtype("x", x)
  norm_shape = v.normalized_shape_of(normalized_shape, x)
  v.check_positive_size("normalized_shape", math.prod(norm_shape), "number of elements")
  weight, bias = check_params(weight, bias, x, norm_shape)
  return x, norm_shape, weight, bias


def check_stats(names_and_stats, x, rows):
  """Statistics: ``rows`` elements in any shape, float32 or x's dtype, all of one dtype."""
  first_name, first = names_and_stats[0]
  for name, s in names_and_stats:
    v.check_stats_dtype(name, s, x)
    v.check_size(name, s, rows, "the product of x's leading, non-normalized dims")
    v.check_same_dtype(name, s, first_name, first)


def stats_shape(x, norm_ndim):
  """``A + (1,) * len(R)``: the statistics' shape, broadcastable against x."""
  return x.shape[:x.ndim - norm_ndim] + (1,) * norm_ndim


def _reshaped(a, shape):
  """``a`` viewed as ``shape`` (``_sharding.reshape``: a sharded dim it would merge into a
  minor position is gathered first); None stays None."""
  return None if a is None else _sharding.reshape(a, shape)


def _rows_and_width(x, norm_ndim):
  """(M, H): x viewed as M rows of the H normalized elements."""
  lead = x.ndim - norm_ndim
  return math.prod(x.shape[:lead]), math.prod(x.shape[lead:])


def fwd(x, weight, bias, norm_ndim, eps, implementation, *, centered=True, scale_offset=0.0,
        write_xhat=False, y_dtype=None, residual=None, h_dtype=None,
        forward="kernel") -> NormFwdOut:
  """Canonical forward (LayerNorm, or RMSNorm when not ``centered``).

  Returns the ``NormFwdOut`` ``(y, mean, rstd, xhat, h)``: y with x's shape,
  in ``y_dtype`` (None: x's dtype; else see ``v.check_out_dtype``); float32
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
  params = dict(operands=operands, eps=eps, centered=centered, param_groups=1,
                write_xhat=write_xhat, y_dtype=y_dtype,
                h_dtype=None if residual is None else h_dtype, implementation=implementation,
                forward=forward)
  outs = _outputs.unpack(NormFwdOut, _sharding.bind(layer_norm_fwd_p, *args,
                                                    lead=len(lead_shape), **params),
                         _outputs.norm_fwd_names(**params))
  to_x = lambda a: None if a is None else a.reshape(x.shape)
  to_lead = lambda a: None if a is None else a.reshape(x.shape[:lead])
  return NormFwdOut(to_x(outs.y), to_lead(outs.mean), to_lead(outs.rstd), to_x(outs.xhat),
                    to_x(outs.h))


def bwd(dy, x, mean, rstd, weight, output_mask, norm_ndim, implementation, *, centered=True,
        scale_offset=0.0, normalized=False, write_xhat=False, dh=None,
        dx_dy=False) -> NormBwdOut:
  """Canonical backward on the backward kernel, every LayerNorm / RMSNorm form of it.

  ``mean``/``rstd``: any shape with M elements (``mean`` ignored when not
  centered or ``normalized``). ``normalized``: ``x`` is xhat and ``rstd`` only
  scales grad_input (it may be None when ``output_mask[0]`` is False).
  ``dy`` is in x's dtype or float32 (the cotangent of a float32 y), or any
  float dtype with a float32 x (the residual form's float32 h).
  Returns the ``NormBwdOut`` ``(dx, dx_dy, dweight, dbias, xhat)``, None
  where not computed: those of ``output_mask`` (two or three bools: dx,
  dweight, dbias), dx with x's shape and dtype, the parameter gradients
  float32 with the normalized shape; xhat (x's shape and dtype) when
  ``write_xhat``. ``dh`` (x's shape and dtype; needs dx): added into dx in
  float32 (the residual form, whose x is h). As in :func:`fwd`, x's
  leading dims are merged into rows on each device. ``dx_dy`` (needs dx; dy
  may be 16-bit with a float32 x, the residual form's float32 h): dx is also
  written rounded to dy's dtype.
  """
  lead = x.ndim - norm_ndim
  norm_shape = x.shape[lead:]
  _, h = _rows_and_width(x, norm_ndim)
  lead_shape = x.shape[:lead] or (1,)  # as in fwd
  rows = lead_shape + (h,)
  mean = as_f32(mean, lead_shape) if centered and not normalized else None
  # An unused rstd travels as an empty operand (the kernel checks it is one).
  rstd = jnp.zeros((0,), F32) if rstd is None else as_f32(rstd, lead_shape)
  args, operands = pack(NormBwd(_reshaped(dy, rows), _reshaped(x, rows), mean, rstd,
                                kernel_params(weight, None, (1, h), scale_offset)[0],
                                _reshaped(dh, rows)))
  params = dict(operands=operands, centered=centered,
                output_mask=_outputs.output_mask(output_mask), param_groups=1,
                normalized=normalized, write_xhat=write_xhat, write_dx_dy=dx_dy,
                implementation=implementation)
  outs = _outputs.unpack(NormBwdOut, _sharding.bind(layer_norm_bwd_p, *args,
                                                    lead=len(lead_shape), **params),
                         _outputs.norm_bwd_names(**params))
  to_x = lambda a: None if a is None else a.reshape(x.shape)
  to_param = lambda a: None if a is None else a.reshape(norm_shape)
  dx_dy = to_x(outs.dx_dy)
  return NormBwdOut(to_x(outs.dx), dx_dy, to_param(outs.dweight), to_param(outs.dbias),
                    to_x(outs.xhat))


# ----------------------------------------------------------------------------
# The differentiable layer, shared by layer_norm and rms_norm.


class LayerConfig(NamedTuple):
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
def norm_layer(x, weight, bias, cfg: LayerConfig):
  """``y`` of the LayerNorm / RMSNorm layer ``cfg``; its gradient runs the backward kernel."""
  return fwd(x, weight, bias, cfg.norm_ndim, cfg.eps, cfg.implementation, centered=cfg.centered,
             scale_offset=cfg.scale_offset, y_dtype=cfg.out_dtype, forward=cfg.forward).y


def _norm_layer_fwd(x, weight, bias, cfg):
  normalized = cfg.save == "normalized"
  # Without weight and bias y is xhat, bit for bit (in x's dtype): save it
  # instead of a copy.
  write_xhat = normalized and (weight is not None or bias is not None or cfg.out_dtype is not None)
  f = fwd(x, weight, bias, cfg.norm_ndim, cfg.eps, cfg.implementation, centered=cfg.centered,
          scale_offset=cfg.scale_offset, write_xhat=write_xhat, y_dtype=cfg.out_dtype,
          forward=cfg.forward)
  # Residuals: x or xhat in x's dtype, float32 (M,) statistics and the small
  # parameters; no float32 copy of anything tensor-sized.
  if normalized:
    return f.y, (f.y if f.xhat is None else f.xhat, None, f.rstd, weight, bias)
  return f.y, (x, f.mean, f.rstd, weight, bias)


def _norm_layer_bwd(cfg, res, dy):
  x_or_xhat, mean, rstd, weight, bias = res
  mask = (True, weight is not None, bias is not None)
  g = bwd(dy, x_or_xhat, mean, rstd, weight, mask, cfg.norm_ndim, cfg.implementation,
          centered=cfg.centered, scale_offset=cfg.scale_offset,
          normalized=cfg.save == "normalized")
  dw = None if g.dweight is None else g.dweight.astype(weight.dtype)
  db = None if g.dbias is None else g.dbias.astype(bias.dtype)
  # Under shard_map a replicated weight's gradient is the psum of the local ones.
  return (_sharding.cotangent_like(g.dx, x_or_xhat), _sharding.cotangent_like(dw, weight),
          _sharding.cotangent_like(db, bias))


norm_layer.defvjp(_norm_layer_fwd, _norm_layer_bwd)
