"""Pallas lowerings of the LayerNorm / RMSNorm primitives (rows of ``(M, H)``, one segment each)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_normgrad import _implementation, reference
from jax_normgrad.pallas import common

F32 = jnp.float32


def _rows(x, centered, param_groups):
  m, h = x.shape
  return common.Segments("rows", m, 1, h, groups=1, param_groups=param_groups, centered=centered)


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


def _warn_residual_unfused():
  _implementation._warn_once(  # pylint: disable=protected-access
      "jax_normgrad: the Pallas kernels do not fuse the residual add yet: add_layer_norm / "
      "add_rms_norm run h = x + residual (and the backward's add of h's cotangent) as XLA "
      "fusions around the Pallas LayerNorm kernels, on float32 copies (same results, more "
      "memory traffic than the CPU kernels' one pass).")


def layer_norm_fwd(x, *params, eps, centered, has_weight, has_bias, param_groups, write_xhat,
                   y_dtype, interpret, gpu_backend=common.TRITON, has_residual=False, h_dtype=None):
  """``[y, mean, rstd]`` (``[y, rstd]`` when not centered) of ``x`` ``(M, H)``, then xhat if asked.

  Per row, in float32: ``mean = sum(x) / H`` (0 for RMSNorm),
  ``rstd = 1 / sqrt(sum((x - mean)^2) / H + eps)``,
  ``y = (x - mean) * rstd * weight + bias``, in ``y_dtype`` (None: x's).
  ``has_residual``: the first parameter operand is a residual; the kernel
  normalizes the float32 sum ``x + residual`` (y rounded once to x's dtype)
  and ``h`` (in ``h_dtype``) follows the other outputs.
  """
  if has_residual:
    _warn_residual_unfused()
    residual, *params = params
    h32 = x.astype(F32) + residual.astype(F32)
    outs = layer_norm_fwd(h32, *params, eps=eps, centered=centered, has_weight=has_weight,
                          has_bias=has_bias, param_groups=param_groups, write_xhat=write_xhat,
                          y_dtype=None, interpret=interpret, gpu_backend=gpu_backend)
    outs[0] = outs[0].astype(y_dtype or x.dtype)
    return outs + [h32.astype(h_dtype or x.dtype)]
  # The tiles compute in float32; 16-bit parameters are converted first.
  weight, bias = map(reference.float32_or_none, common.unpack(params, has_weight, has_bias))
  seg = _rows(x, centered, param_groups)
  y, mean, rstd = common.forward(seg, x.reshape(seg.n, 1, seg.b), weight, bias, eps=eps,
                                 interpret=interpret, y_dtype=y_dtype, gpu_backend=gpu_backend,
                                 op="layer_norm_fwd")
  mean = mean.reshape(seg.n) if centered else None
  rstd = rstd.reshape(seg.n)
  outs = [y.reshape(x.shape)] + ([mean, rstd] if centered else [rstd])
  return outs + ([_xhat(x, mean, rstd)] if write_xhat else [])


def layer_norm_bwd(dy, x, *rest, centered, has_weight, output_mask, param_groups, normalized,
                   write_xhat, interpret, gpu_backend=common.TRITON, has_dh=False):
  """The ``output_mask``'ed of ``[dx, dweight, dbias]``, then xhat if asked (see ``reference.layer_norm_bwd``).

  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` per row (no
  ``mean(g)`` for RMSNorm), ``g = dy * weight``; ``dweight = sum_rows dy * xhat``,
  ``dbias = sum_rows dy``, per parameter group, float32.

  ``normalized``: x holds xhat already (no mean operand; rstd, present only when
  dx is asked for, scales dx alone).
  ``has_dh``: a last operand dh is added to dx, in float32 before dx's one
  rounding (the kernel then runs on float32 x and dy). The kernel then runs with mean 0 and rstd
  1, which reproduces xhat exactly, and dx is scaled by rstd in an XLA fusion.
  """
  if has_dh:
    _warn_residual_unfused()
    *rest, dh = rest
    outs = layer_norm_bwd(dy.astype(F32), x.astype(F32), *rest, centered=centered,
                          has_weight=has_weight, output_mask=output_mask,
                          param_groups=param_groups, normalized=normalized,
                          write_xhat=write_xhat, interpret=interpret, gpu_backend=gpu_backend)
    outs[0] = (outs[0] + dh.astype(F32)).astype(x.dtype)
    if write_xhat:
      outs[-1] = outs[-1].astype(x.dtype)
    return outs
  mask = tuple(output_mask) + (False,) * (3 - len(output_mask))
  m = x.shape[0]
  mean, rstd, weight = reference.split_ln_bwd_operands(rest, centered, has_weight, normalized)
  weight = reference.float32_or_none(weight)  # as in layer_norm_fwd
  kernel_rstd = rstd
  kx, kdy = x, dy
  if normalized:
    mean, kernel_rstd = (jnp.zeros((m,), F32) if centered else None), jnp.ones((m,), F32)
    if mask[0] and x.dtype != F32:
      kx, kdy = x.astype(F32), dy.astype(F32)
  seg = _rows(x, centered, param_groups)
  view = (seg.n, 1, seg.b)
  outs = common.backward(seg, kdy.reshape(view), kx.reshape(view),
                         None if mean is None else mean.reshape(seg.n, 1),
                         kernel_rstd.reshape(seg.n, 1), weight, mask, interpret=interpret,
                         gpu_backend=gpu_backend, op="layer_norm_bwd")
  dx = None if outs[0] is None else outs[0].reshape(x.shape)
  if dx is not None and normalized:
    dx = (dx.astype(F32) * rstd[:, None]).astype(x.dtype)
  result = [o for o, m_ in zip((dx,) + tuple(outs[1:]), mask) if m_]
  if write_xhat:
    result.append(x if normalized else _xhat(x, mean, rstd))
  return result
