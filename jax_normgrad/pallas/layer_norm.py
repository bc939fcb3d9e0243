"""Pallas lowerings of the LayerNorm / RMSNorm primitives (rows of ``(M, H)``, one segment each)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_normgrad import _outputs, reference
from jax_normgrad.pallas import common, kernels
from jax_normgrad._operands import NormBwd, NormFwd, unpack
from jax_normgrad._outputs import NormBwdOut, NormFwdOut

F32 = jnp.float32


def _rows(x, centered, param_groups):
  m, h = x.shape
  return common.Segments("rows", m, 1, h, groups=1, param_groups=param_groups, centered=centered)


def _kernel_x_dtype(x_dtype, normalized, mask):
  """The dtype the backward kernel reads x (and dy) in: float32 for a ``normalized`` backward
  with dx (its xhat operand is widened, and dx scaled after the kernel), else x's."""
  if normalized and mask[0] and x_dtype != F32:
    return jnp.dtype(F32)
  return jnp.dtype(x_dtype)


def layer_norm_fwd_problem(*args, operands, centered, param_groups, y_dtype, h_dtype=None,
                           **unused) -> kernels.Problem:
  """The kernels' problem of ``layer_norm_fwd`` with these operands (shapes and dtypes)."""
  del unused
  o = unpack(NormFwd, args, operands)
  return kernels.forward_problem(_rows(o.x, centered, param_groups), o.x.dtype, size=o.x.size,
                                 y_dtype=y_dtype, h_dtype=h_dtype,
                                 residual_dtype=None if o.residual is None else o.residual.dtype,
                                 params=(o.weight is not None, o.bias is not None))


def layer_norm_bwd_problem(*args, operands, centered, output_mask, param_groups, normalized,
                           write_dx_dy=False, **unused) -> kernels.Problem:
  """The kernels' problem of ``layer_norm_bwd`` with these operands (shapes and dtypes)."""
  del unused
  o = unpack(NormBwd, args, operands)
  mask = _outputs.output_mask(output_mask)
  dh_dtype = o.dh.dtype if o.dh is not None and not normalized else None
  x_dtype = _kernel_x_dtype(o.x.dtype, normalized, mask)
  dy_dtype = x_dtype if x_dtype != o.x.dtype else o.dy.dtype  # widened together
  return kernels.backward_problem(_rows(o.x, centered, param_groups), x_dtype, mask,
                                  size=o.x.size, dh_dtype=dh_dtype, dy_dtype=dy_dtype,
                                  dx_dy=write_dx_dy and not normalized,
                                  params=(o.weight is not None, False))


def _xhat(x, mean, rstd):
  """xhat = (x - mean) * rstd in x's dtype, as an XLA elementwise fusion.

  The Pallas kernels do not write xhat themselves; the AscendC
  ``res_for_gamma`` and ``layer_norm(save="normalized")`` paths that ask for it
  pay one extra elementwise pass on GPU/TPU.
  """
  x32 = x.astype(F32)
  if mean is not None:
    x32 = x32 - mean[:, None]
  return (x32 * rstd[:, None]).astype(x.dtype)


def layer_norm_fwd(*args, operands, eps, centered, param_groups, write_xhat, y_dtype, interpret,
                   backend="triton", h_dtype=None):
  """The outputs (``_outputs.NormFwdOut``) of ``x`` ``(M, H)`` that the parameters ask for.

  Per row, in float32: ``mean = sum(x) / H`` (0 for RMSNorm),
  ``rstd = 1 / sqrt(sum((x - mean)^2) / H + eps)``,
  ``y = (x - mean) * rstd * weight + bias``, in ``y_dtype`` (None: x's).
  With a ``residual`` (x's shape) the kernels normalize ``h = x + residual``
  as it is stored (the float32 sum rounded to ``h_dtype``) tile by tile and
  also write ``h``, which follows the other outputs (``write_xhat`` is
  refused with it: see the primitive).
  """
  x, residual, weight, bias = unpack(NormFwd, args, operands)
  # The tiles compute in float32; 16-bit parameters are converted first.
  weight, bias = map(reference.float32_or_none, (weight, bias))
  seg = _rows(x, centered, param_groups)
  view = (seg.n, 1, seg.minor)
  extra = {} if residual is None else dict(residual=residual.reshape(view), h_dtype=h_dtype)
  y, mean, rstd, *h = kernels.forward(seg, x.reshape(view), weight, bias, eps=eps,
                                      interpret=interpret, y_dtype=y_dtype, backend=backend,
                                      **extra)
  mean = mean.reshape(seg.n) if centered else None
  rstd = rstd.reshape(seg.n)
  outs = NormFwdOut(y.reshape(x.shape), mean, rstd, _xhat(x, mean, rstd) if write_xhat else None,
                    h[0].reshape(x.shape) if h else None)
  return _outputs.pack(outs, _outputs.norm_fwd_names(operands=operands, centered=centered,
                                                     write_xhat=write_xhat))


def layer_norm_bwd(*args, operands, centered, output_mask, param_groups, normalized, write_xhat,
                   interpret, backend="triton", write_dx_dy=False):
  """The outputs (``_outputs.NormBwdOut``) the parameters ask for (see ``reference.layer_norm_bwd``).

  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` per row (no
  ``mean(g)`` for RMSNorm), ``g = dy * weight``; ``dweight = sum_rows dy * xhat``,
  ``dbias = sum_rows dy``, per parameter group, float32.

  ``normalized``: x holds xhat already (no mean operand; rstd, present only when
  dx is asked for, scales dx alone).
  The kernel then runs with mean 0 and rstd 1, which reproduces xhat
  exactly, and dx is scaled by rstd in an XLA fusion.
  ``dh`` (x's shape) is added to dx in float32 before dx's one rounding, in the kernels' output pass (in the XLA fusion that
  scales a ``normalized`` dx). ``write_dx_dy``: dx a second time, right
  after dx, rounded to dy's dtype (``kernels.backward``).
  """
  dy, x, mean, rstd, weight, dh = unpack(NormBwd, args, operands)
  mask = _outputs.output_mask(output_mask)
  m = x.shape[0]
  weight = reference.float32_or_none(weight)  # as in layer_norm_fwd
  kernel_rstd = rstd
  kx, kdy = x, dy
  if normalized:
    mean, kernel_rstd = (jnp.zeros((m,), F32) if centered else None), jnp.ones((m,), F32)
    if _kernel_x_dtype(x.dtype, normalized, mask) != x.dtype:
      kx, kdy = x.astype(F32), dy.astype(F32)
  seg = _rows(x, centered, param_groups)
  view = (seg.n, 1, seg.minor)
  kernel_dh = None if dh is None or normalized else dh.reshape(view)
  kernel_dx_dy = write_dx_dy and not normalized
  outs = kernels.backward(seg, kdy.reshape(view), kx.reshape(view),
                          None if mean is None else mean.reshape(seg.n, 1),
                          kernel_rstd.reshape(seg.n, 1), weight, mask, interpret=interpret,
                          backend=backend, dh=kernel_dh, dx_dy=kernel_dx_dy)
  dx, dweight, dbias = outs[:3]
  dx = None if dx is None else dx.reshape(x.shape)
  dx_dy = outs[3].reshape(x.shape) if kernel_dx_dy else None
  if dx is not None and normalized:
    dx32 = dx.astype(F32) * rstd[:, None]
    dx32 = dx32 if dh is None else dx32 + dh.astype(F32)
    dx = dx32.astype(x.dtype)
    dx_dy = dx32.astype(dy.dtype) if write_dx_dy else None
  xhat = (x if normalized else _xhat(x, mean, rstd)) if write_xhat else None
  return _outputs.pack(NormBwdOut(dx, dx_dy, dweight, dbias, xhat),
                       _outputs.norm_bwd_names(output_mask=mask, write_xhat=write_xhat,
                                               write_dx_dy=write_dx_dy))
