"""Pure-JAX reference math on the primitives' canonical layouts (the "xla" implementation).

This is the oracle the kernels are tested against (besides the float64 NumPy
reference of the tests) and the lowering used by ``implementation="xla"`` and
on platforms without a kernel. Everything accumulates in float32.

Canonical layouts (the primitives reshape to these; reshapes are free):

* LayerNorm / RMSNorm: ``x`` is ``(M, H)``; statistics ``(M,)``; parameters
  ``(W, H)``, float32 or x's dtype (used in float32), where the rows form
  ``W`` equal contiguous groups (``W`` is 1 except under ``vmap`` with
  per-example parameters).
* GroupNorm: ``x`` is ``(N, C, HW)`` or, channels-last, ``(N, HW, C)``;
  statistics ``(N, G)``; parameters ``(W, C)`` float32, samples in ``W`` groups.

Each function returns its primitive's outputs (``jax_normgrad._outputs``) as
the list the primitive returns.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_normgrad import _activations, _operands, _outputs
from jax_normgrad._outputs import GroupNormBwdOut, GroupNormFwdOut, NormBwdOut, NormFwdOut

F32 = jnp.float32


def float32_or_none(a):
  """``a`` as float32 (a parameter in x's dtype or float32: the math runs in float32); None stays None."""
  return None if a is None else a.astype(F32)


def _grouped(a, groups):
  """(M, ...) -> (W, M/W, ...)."""
  return a.reshape((groups, a.shape[0] // groups) + a.shape[1:])


# ----------------------------------------------------------------------------
# LayerNorm (centered=True) and RMSNorm (centered=False)


def layer_norm_fwd(x, weight=None, bias=None, *, eps, centered, param_groups, write_xhat=False,
                   y_dtype=None, residual=None, h_dtype=None):
  """Returns ``[y, mean, rstd]`` (``[y, rstd]`` when not centered), then ``xhat`` if ``write_xhat``, then ``h``.

  y is rounded once to ``y_dtype`` (None: x's dtype); xhat is in x's dtype.
  With a ``residual`` the input is ``h = x + residual`` as it is stored:
  summed in float32 and rounded once to ``h_dtype`` (None: x's dtype), the
  statistics and y from that h (docs/spec.md, the residual form), which is
  also returned.
  """
  m, h = x.shape
  weight, bias = float32_or_none(weight), float32_or_none(bias)
  x32 = x.astype(F32)
  h_out = None
  if residual is not None:
    h_out = (x32 + residual.astype(F32)).astype(h_dtype or x.dtype)
    x32 = h_out.astype(F32)
  if centered:
    mean = jnp.mean(x32, axis=1)
    xc = x32 - mean[:, None]
  else:
    mean = None
    xc = x32
  rstd = 1.0 / jnp.sqrt(jnp.mean(xc * xc, axis=1) + jnp.float32(eps))
  xhat = xc * rstd[:, None]
  y = _grouped(xhat, param_groups)
  if weight is not None:
    y = y * weight[:, None, :]
  if bias is not None:
    y = y + bias[:, None, :]
  y = y.reshape(m, h).astype(y_dtype or x.dtype)
  outs = NormFwdOut(y, mean, rstd, xhat.astype(x.dtype) if write_xhat else None, h_out)
  _, operands = _operands.pack(_operands.NormFwd(x, residual, weight, bias))
  return _outputs.pack(outs, _outputs.norm_fwd_names(operands=operands, centered=centered,
                                                     write_xhat=write_xhat))


def layer_norm_bwd(ops, *, centered, output_mask, param_groups, normalized=False,
                   write_xhat=False, write_dx_dy=False):
  """Returns the outputs of ``output_mask`` among ``[dx, dweight, dbias]``, then ``xhat`` if ``write_xhat``.

  ``ops``: the operands (``_operands.NormBwd``: dy, x, mean, rstd,
  weight, dh). ``xhat = (x - mean) * rstd``, ``g = dy * weight``,
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (no ``mean(g)`` when
  not centered), ``dweight = sum_rows dy * xhat``, ``dbias = sum_rows dy``.
  ``normalized``: ``x`` is ``xhat`` already (no ``mean``) and ``rstd`` only
  scales ``dx`` (it is empty when ``dx`` is masked out). ``dy`` is in x's
  dtype or float32; dx and xhat are in x's dtype. ``dh`` (x's dtype, the
  cotangent of the residual form's ``h``, whose ``x`` operand is h) is added
  to dx in float32 before its one rounding. ``dy`` may also be 16-bit with a
  float32 x (the residual form's float32 h); ``write_dx_dy`` then adds, right
  after dx, dx rounded once to dy's dtype.
  """
  dy, x, mean, rstd, dh = ops.dy, ops.x, ops.mean, ops.rstd, ops.dh
  weight = float32_or_none(ops.weight)
  mask = _outputs.output_mask(output_mask)
  m, h = x.shape
  w = param_groups
  dy32 = _grouped(dy.astype(F32), w)
  x32 = _grouped(x.astype(F32), w)
  rstd_g = _grouped(rstd.astype(F32), w)[..., None] if mask[0] or not normalized else None
  if normalized:
    xhat = x32
  elif centered:
    xhat = (x32 - _grouped(mean.astype(F32), w)[..., None]) * rstd_g
  else:
    xhat = x32 * rstd_g
  dx = dx_dy = dweight = dbias = xhat_out = None
  if mask[0]:
    g = dy32 * weight[:, None, :] if weight is not None else dy32
    c2 = jnp.mean(g * xhat, axis=-1, keepdims=True)
    inner = g - xhat * c2
    if centered:
      inner = inner - jnp.mean(g, axis=-1, keepdims=True)
    dx32 = (rstd_g * inner).reshape(m, h)
    if dh is not None:
      dx32 = dx32 + dh.astype(F32)
    dx = dx32.astype(x.dtype)
    if write_dx_dy:
      dx_dy = dx32.astype(dy.dtype)
  if mask[1]:
    dweight = jnp.sum(dy32 * xhat, axis=1)
  if mask[2]:
    dbias = jnp.sum(dy32, axis=1)
  if write_xhat:
    xhat_out = xhat.reshape(m, h).astype(x.dtype)
  return _outputs.pack(NormBwdOut(dx, dx_dy, dweight, dbias, xhat_out),
                       _outputs.norm_bwd_names(output_mask=mask, write_xhat=write_xhat,
                                               write_dx_dy=write_dx_dy))


# ----------------------------------------------------------------------------
# GroupNorm


def _gn_blocks(a, group, channels_last):
  """(N, C, HW) -> (N, G, C/G, HW); (N, HW, C) -> (N, HW, G, C/G)."""
  if channels_last:
    n, hw, c = a.shape
    return a.reshape(n, hw, group, c // group)
  n, c, hw = a.shape
  return a.reshape(n, group, c // group, hw)


def _gn_axes(channels_last):
  """(block reduction axes, axis of G, broadcast of an (N, G) stat)."""
  return ((1, 3), (slice(None), None, slice(None), None)) if channels_last else (
      (2, 3), (slice(None), slice(None), None, None))


def _gn_param(p, n, group, channels_last):
  """(W, C) parameters -> broadcastable against the block view of x."""
  w, c = p.shape
  p = jnp.repeat(p, n // w, axis=0) if w > 1 else p
  p = p.reshape(p.shape[0], group, c // group)
  return p[:, None, :, :] if channels_last else p[:, :, :, None]


def group_norm_fwd(x, weight=None, bias=None, *, eps, group, channels_last, param_groups,
                   y_dtype=None, activation=None):
  """Returns ``[y, mean, rstd]`` with ``mean``/``rstd`` of shape ``(N, G)``; y in ``y_dtype`` (None: x's).

  With an ``activation`` (``_activations``) y is ``act(xhat * weight + bias)``.
  """
  del param_groups  # The (W, C) parameter shape carries it.
  n = x.shape[0]
  axes, bcast = _gn_axes(channels_last)
  xb = _gn_blocks(x.astype(F32), group, channels_last)
  mean = jnp.mean(xb, axis=axes)
  xc = xb - mean[bcast]
  rstd = 1.0 / jnp.sqrt(jnp.mean(xc * xc, axis=axes) + jnp.float32(eps))
  y = xc * rstd[bcast]
  if weight is not None:
    y = y * _gn_param(weight, n, group, channels_last)
  if bias is not None:
    y = y + _gn_param(bias, n, group, channels_last)
  y = _activations.apply(y, activation)
  return _outputs.pack(GroupNormFwdOut(y.reshape(x.shape).astype(y_dtype or x.dtype), mean, rstd),
                       _outputs.group_norm_fwd_names())


def group_norm_bwd(ops, *, group, channels_last, output_mask, param_groups, activation=None):
  """Returns the outputs of ``output_mask`` among ``[dx, dweight, dbias]``.

  ``ops``: the operands (``_operands.GroupNormBwd``: dy, x, mean,
  rstd, weight, bias). Per ``(n, g)`` block, ``g = dy * weight[c]``:
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``;
  ``dweight[c] = sum_{n, hw} dy * xhat``, ``dbias[c] = sum_{n, hw} dy``.
  With an ``activation``, ``dy`` is the cotangent of ``act(z)``,
  ``z = xhat * weight + bias``, and ``dz = dy * act'(z)`` stands for dy above.
  """
  dy, x, mean, rstd, weight, bias = ops
  n = x.shape[0]
  c = x.shape[2] if channels_last else x.shape[1]
  axes, bcast = _gn_axes(channels_last)
  dyb = _gn_blocks(dy.astype(F32), group, channels_last)
  xb = _gn_blocks(x.astype(F32), group, channels_last)
  rs = rstd.astype(F32)[bcast]
  xhat = (xb - mean.astype(F32)[bcast]) * rs
  if activation is not None:
    z = xhat * _gn_param(weight.astype(F32), n, group, channels_last) if weight is not None else xhat
    if bias is not None:
      z = z + _gn_param(bias.astype(F32), n, group, channels_last)
    dyb = dyb * _activations.grad(z, activation)
  mask = _outputs.output_mask(output_mask)
  dx = dweight = dbias = None
  if mask[0]:
    g = dyb * _gn_param(weight, n, group, channels_last) if weight is not None else dyb
    c1 = jnp.mean(g, axis=axes, keepdims=True)
    c2 = jnp.mean(g * xhat, axis=axes, keepdims=True)
    dx = (rs * (g - c1 - xhat * c2)).reshape(x.shape).astype(x.dtype)
  hw_axis = 1 if channels_last else 3

  def per_channel(v):  # (N, ...) block view -> (W, C) summed over hw and samples
    s = jnp.sum(v, axis=hw_axis).reshape(n, c)
    return s.reshape(param_groups, n // param_groups, c).sum(axis=1)

  if mask[1]:
    dweight = per_channel(dyb * xhat)
  if mask[2]:
    dbias = per_channel(dyb)
  return _outputs.pack(GroupNormBwdOut(dx, dweight, dbias),
                       _outputs.group_norm_bwd_names(output_mask=mask))
