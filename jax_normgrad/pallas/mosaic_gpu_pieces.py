"""Mosaic GPU LayerNorm / RMSNorm rows too long for SMEM: pieces, statistics through XLA.

A row longer than SMEM holds (``mosaic_gpu_plan`` None) is cut into
``pieces`` pieces of ``plan.padded`` elements (the last one zero-padded),
each a row to the kernels, the parameters of piece j being columns
``[j * L, (j + 1) * L)``; x (and dy) are read twice:

* forward: the moments of each piece (the GroupNorm sums kernel, the last
  piece's count masked), merged over the pieces in order (Chan) in XLA,
  then the row kernel with these statistics given writes y;
* backward: ``sum g`` and ``sum g * xhat`` of each piece, summed over the
  pieces in order in XLA (c1, c2), then the row kernel with c1, c2 given
  writes dx and its float32 partials per (parameter row, piece, CTA).

Stands on ``mosaic_gpu_rows`` (the row kernels, ``given``),
``mosaic_gpu_group_norm`` (its sums kernel, over the pieces as rows) and
``mosaic_gpu_pipeline``; ``mosaic_gpu`` calls ``forward`` / ``backward``
here when ``config.mosaic_gpu_plan`` is None.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_normgrad.pallas import common, config, mosaic_gpu_group_norm, mosaic_gpu_rows
from jax_normgrad.pallas import mosaic_gpu_pipeline as pipeline

F32 = jnp.float32


class PieceRows:
  """The pieces of long rows as the rows of the sums kernel (one scalar pair per piece)."""

  per_row = True

  def __init__(self, seg: common.Segments, pieces: int, length: int):
    self.rows = common.Segments("rows", seg.n * pieces, 1, length, groups=1, param_groups=1)
    self.spatial = length

  def coef(self, a):
    return None if a is None else jnp.repeat(a.reshape(-1), self.rows.n // a.size).reshape(-1, 1)


def _pieces(a, pieces, plan):
  """``(rows, h)`` -> ``(rows, pieces, chunks, width)``, zero-padded."""
  pad = pieces * plan.padded - a.shape[-1]
  if pad:
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
  return a.reshape(a.shape[0], pieces, plan.chunks, plan.width)


def _piece_sums(seg, pieces, plan, x4, dy4, mean, rstd, gamma4, *, interpret, r4=None,
                h_dtype=None):
  """The sums kernel over the pieces: two ``(rows, pieces)`` float32 arrays.

  ``r4`` (forward): the residual's pieces; the moments are of ``h = x + residual`` as stored
  in ``h_dtype``.
  """
  rows = PieceRows(seg, pieces, plan.padded)
  backward = dy4 is not None
  launch = pipeline.Launch(rows.rows, plan, interpret)
  flat = lambda a: None if a is None else a.reshape(rows.rows.n, plan.chunks, plan.width)
  scratch = [launch.smem(plan.stages, x4.dtype)]
  if r4 is not None:
    scratch.append(launch.smem(plan.stages, r4.dtype))
  if backward:
    scratch.append(launch.smem(plan.stages, dy4.dtype))
  scratch.append(pipeline.barrier(1 + backward + (r4 is not None), plan.stages))
  out = jax.ShapeDtypeStruct((rows.rows.n, 1), F32)
  gamma = None if gamma4 is None else gamma4.reshape(-1, plan.chunks, plan.width)
  kernel = functools.partial(mosaic_gpu_group_norm.sums_kernel, launch=launch, rows=rows,
                             backward=backward, pieces=pieces,
                             tail=seg.minor - (pieces - 1) * plan.padded,
                             param_rows=None if gamma is None else seg.per_group,
                             has_residual=r4 is not None, h_dtype=h_dtype)
  a, b = launch.call(kernel, [out, out], scratch, flat(x4), flat(r4), flat(dy4), rows.coef(mean),
                     rows.coef(rstd), gamma, interpret=interpret,
                     name="jax_normgrad_norm_bwd_sums" if backward else "jax_normgrad_norm_fwd_stats")
  return a.reshape(seg.n, pieces), b.reshape(seg.n, pieces)


def forward_plans(seg: common.Segments, itemsize: int, *, params: int, extra_bytes: int = 0,
                  residual_bytes: int = 0):
  """``(pieces, plan of the kernel writing y, plan of the moments kernel)`` of rows too long
  for one CTA's SMEM; ``extra_bytes`` the residual form's rows (residual and h), of which the
  moments kernel streams the residual's (``residual_bytes``)."""
  pieces, plan = config.mosaic_gpu_pieces(seg.minor, itemsize, backward=False, params=params,
                                          extra_bytes=extra_bytes)
  sums_plan = config.mosaic_gpu_plan(plan.padded, itemsize, backward=False, params=0, outputs=0,
                                     extra_bytes=residual_bytes)
  return pieces, plan, sums_plan


def backward_plans(seg: common.Segments, itemsize: int, *, has_gamma: bool, mask,
                   extra_bytes: int = 0):
  """``(pieces, plan of the kernel writing dx and the partials, plan of the sums kernel | None)``
  of rows too long for one CTA's SMEM; the sums kernel (c1, c2) runs where dx is asked for.
  ``extra_bytes``: dh's bytes per element."""
  pieces, plan = config.mosaic_gpu_pieces(seg.minor, itemsize, backward=True,
                                          params=int(has_gamma), outputs=int(mask[0]),
                                          partials=mask[1] + mask[2], extra_bytes=extra_bytes)
  sums_plan = None
  if mask[0]:
    sums_plan = config.mosaic_gpu_plan(plan.padded, itemsize, backward=True, params=0, outputs=0,
                                       partials=0)
  return pieces, plan, sums_plan


def forward(x, residual, weight, bias, *, seg: common.Segments, eps: float, interpret,
            h_dtype=None):
  """``(y, mean | None, rstd)`` of rows too long for one CTA's SMEM.

  The residual form (``residual``, ``h_dtype``): the pieces' moments are of
  ``h = x + residual`` as stored in ``h_dtype``, and the kernel writing y writes h too;
  ``(y, mean | None, rstd, h)``.
  """
  n_params = (weight is not None) + (bias is not None)
  has_residual = residual is not None
  pieces, plan, sums_plan = forward_plans(
      seg, x.dtype.itemsize, params=n_params,
      extra_bytes=mosaic_gpu_rows.residual_bytes(residual, h_dtype),
      residual_bytes=residual.dtype.itemsize if has_residual else 0)
  length = plan.padded
  x4 = _pieces(x.reshape(seg.n, seg.minor), pieces, plan)
  r4 = _pieces(residual.reshape(seg.n, seg.minor), pieces, plan) if has_residual else None
  means, m2s = _piece_sums(seg, pieces, sums_plan, x4, None, None, None, None,
                           interpret=interpret, r4=r4, h_dtype=h_dtype)
  counts = [float(length)] * (pieces - 1) + [float(seg.minor - (pieces - 1) * length)]
  if seg.centered:
    state = (counts[0], means[:, 0], m2s[:, 0])
    for j in range(1, pieces):  # Chan's merge, in piece order
      state = common.combine_moments(state, (counts[j], means[:, j], m2s[:, j]))
    mean, m2 = state[1], state[2]
  else:  # the sum of squares: M2 + n * mean^2 per piece
    mean, m2 = None, common.ordered_sum(m2s + jnp.asarray(counts, F32) * means * means, 1)
  rstd = lax.rsqrt(m2 / seg.minor + jnp.float32(eps))
  stats = [a.reshape(seg.n, 1) for a in (mean, rstd) if a is not None]
  launch = pipeline.Launch(seg, plan, interpret, pieces=pieces)
  params = [None if a is None else _pieces(a, pieces, plan).reshape(-1, plan.chunks, plan.width)
            for a in (weight, bias)]
  scratch = mosaic_gpu_rows.fwd_scratch(launch, plan, x.dtype, n_params,
                                        *((residual.dtype, h_dtype) if has_residual else ()))
  kernel = functools.partial(mosaic_gpu_rows.fwd_kernel, launch=launch, eps=eps,
                             has_weight=weight is not None, has_bias=bias is not None, given=True,
                             has_residual=has_residual)
  out_shape = [jax.ShapeDtypeStruct(x4.shape, x.dtype)]
  if has_residual:
    out_shape.append(jax.ShapeDtypeStruct(x4.shape, h_dtype))
  outs = launch.call(kernel, out_shape, scratch, x4, r4, *params, *stats, interpret=interpret,
                     name="jax_normgrad_norm_fwd")
  y, *h = [a.reshape(seg.n, pieces * length)[:, :seg.minor].reshape(x.shape) for a in outs]
  return (y, (stats[0] if seg.centered else None), stats[-1], *h)


def backward(dy, x, mean, rstd, gamma, dh=None, *, seg: common.Segments, mask, interpret):
  """``(dx | None, dgamma | None, dbeta | None)`` of rows too long for one CTA's SMEM.

  ``dh`` (the residual form): added to dx by the kernel writing it, in float32.
  """
  has_gamma = gamma is not None
  n_acc = mask[1] + mask[2]
  pieces, plan, sums_plan = backward_plans(seg, x.dtype.itemsize, has_gamma=has_gamma, mask=mask,
                                           extra_bytes=0 if dh is None else dh.dtype.itemsize)
  length = plan.padded
  x4 = _pieces(x.reshape(seg.n, seg.minor), pieces, plan)
  dy4 = _pieces(dy.reshape(seg.n, seg.minor), pieces, plan)
  dh4 = None if dh is None else _pieces(dh.reshape(seg.n, seg.minor), pieces, plan)
  gamma4 = None if gamma is None else _pieces(gamma, pieces, plan)
  cs = []
  if mask[0]:
    m = mean if seg.centered else jnp.zeros_like(rstd)
    s1, s2 = _piece_sums(seg, pieces, sums_plan, x4, dy4, m, rstd, gamma4, interpret=interpret)
    if seg.centered:
      cs.append((common.ordered_sum(s1, 1) / seg.minor).reshape(seg.n, 1))
    cs.append((common.ordered_sum(s2, 1) / seg.minor).reshape(seg.n, 1))
  launch = pipeline.Launch(seg, plan, interpret, pieces=pieces)
  scratch = mosaic_gpu_rows.bwd_scratch(launch, plan, x.dtype, dy.dtype, mask, has_gamma, n_acc,
                                        None if dh is None else dh.dtype)
  groups = seg.param_groups * pieces
  partial = jax.ShapeDtypeStruct((groups, launch.ctas, plan.chunks, plan.width), F32)
  out_shape = ([jax.ShapeDtypeStruct(x4.shape, x.dtype)] if mask[0] else []) + [partial] * n_acc
  outs = list(launch.call(
      functools.partial(mosaic_gpu_rows.bwd_kernel, launch=launch, mask=mask, has_gamma=has_gamma,
                        given=True, has_dh=dh is not None),
      out_shape, scratch, dy4, x4, mean, rstd,
      None if gamma4 is None else gamma4.reshape(-1, plan.chunks, plan.width), *cs, dh4,
      interpret=interpret, name="jax_normgrad_norm_bwd"))
  dx = None
  if mask[0]:
    dx = outs.pop(0).reshape(seg.n, pieces * length)[:, :seg.minor].reshape(x.shape)
  sums = []
  for want in mask[1:]:
    if not want:
      sums.append(None)
      continue
    part = outs.pop(0).reshape(seg.param_groups, pieces, launch.ctas, length)
    part = jnp.moveaxis(part, 1, 2).reshape(seg.param_groups, launch.ctas, pieces * length)
    sums.append(common.ordered_sum(part[..., :seg.minor], 1))
  return (dx, *sums)
