"""Mosaic GPU LayerNorm / RMSNorm kernels over rows that fit a CTA's shared memory whole.

Per row: the statistics (forward) or ``c1``, ``c2`` (backward) from the row
in SMEM, then y, or dx and the float32 parameter-gradient partials, in one
more pass (``mosaic_gpu`` has the design). The kernels also take the
statistics or ``c1``, ``c2`` as inputs (``given``), for the pieces of long
rows (``mosaic_gpu_pieces``), and the residual form's rows (the residual
and h forward, dh backward). With ``channels`` (``ChannelChunks``) a row is
a GroupNorm NCHW segment held whole (``mosaic_gpu_group_norm``): per-channel
parameters, statistics and parameter gradients, the fused activation.

Stands on ``mosaic_gpu_pipeline`` (and ``common``); ``mosaic_gpu`` chooses
the plan and calls ``forward`` / ``backward`` here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_normgrad import _compat
from jax_normgrad.pallas import common
from jax_normgrad.pallas import mosaic_gpu_pipeline as pipeline

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelChunks:
  """Rows that are GroupNorm NCHW segments ``(i, g)``: ``cg`` channels of ``cpc`` chunks each.

  The launch has ``groups`` pieces per row (``pipeline.Launch(pieces=)``): its
  CTA row ``w`` is parameter group ``w // groups``, GroupNorm group ``w %
  groups``, and x is viewed as ``(N, groups, chunks, width)``. A chunk lies
  in one channel (``width`` divides HW), so the parameters are per-chunk
  scalars, read from the float32 ``(W, C)`` rows in GMEM; the statistics are
  ``(N, groups)``; the parameter gradients are reduced per channel once per
  CTA, from its per-column sums (``store_partials``).
  """

  groups: int
  cg: int
  cpc: int

  def params(self, refs, w):
    """``read(k)``: the scalars of chunk k's channel, one per ref (None where absent)."""
    wg, g = lax.div(w, self.groups), lax.rem(w, self.groups)

    def read(k):
      c = g * self.cg + lax.div(k, self.cpc)
      return [None if r is None else r[wg, c] for r in refs]

    return read

  def store_partials(self, launch, accs, refs, w, p):
    """Each channel's sum of the CTA's per-column sums ``accs[j]`` to ``refs[j][w, p, c]``."""
    cpc = self.cpc

    def channel(c, carry):
      sums = launch.sum_chunks(lambda k: tuple(accs[j, c * cpc + k] for j in range(len(refs))),
                               cpc)
      for ref, a in zip(refs, sums):
        ref[w, p, c] = jnp.sum(a)
      return carry

    lax.fori_loop(0, self.cg, channel, 0)


def _cta(launch, channels, param_refs, buf, barrier):
  """``(w, p, start, end, piece, col, params)``: the CTA's rows (``launch.rows``), its piece,
  the column of its rows' statistics (the group's with ``ChannelChunks``, else 0) and the
  reader of its parameters (``params(k)``: chunk k's, one per ref)."""
  w, p, start, end = launch.rows()
  piece = launch.piece(w)
  if channels is None:
    return w, p, start, end, piece, 0, pipeline.params(launch, param_refs, buf, barrier, w)
  return w, p, start, end, piece, piece, channels.params(param_refs, w)


# ----------------------------------------------------------------------------
# Forward: y, mean, rstd


def fwd_kernel(*refs, launch: pipeline.Launch, eps: float, has_weight: bool, has_bias: bool,
               given: bool = False, has_residual: bool = False,
               channels: ChannelChunks | None = None):
  """Per row: statistics from the row in SMEM (two passes, exact), then ``y`` to SMEM and HBM.

  ``given``: the statistics are inputs (pieces of long rows, ``mosaic_gpu_pieces.forward``).
  ``has_residual``: the residual row is streamed beside x's; every pass
  reads h as it is stored (their float32 sum rounded to h's dtype), so the
  statistics and y are the stored h's, and the pass that writes y also
  writes h, stored with y. ``channels``: GroupNorm segments (``ChannelChunks``); y is
  ``seg.activation`` of the normalized row.
  """
  seg = launch.seg
  staged = channels is None and launch.staged(has_weight + has_bias)
  in_place = launch.plan.in_place  # y written over x's row (no residual)
  (x_ref, r_ref, w_ref, b_ref, gmean_ref, grstd_ref, y_ref, mean_ref, rstd_ref, h_ref, xs, rs, ys,
   hs, ps, bar, pbar) = common.unpack(
       refs, True, has_residual, has_weight, has_bias, given and seg.centered, given, True,
       not given and seg.centered, not given, has_residual, True, has_residual, not in_place,
       has_residual, staged, True, staged)
  ys = xs if in_place else ys
  _, _, start, end, piece, col, params = _cta(launch, channels, (w_ref, b_ref), ps, pbar)

  def row(i, slot, out):
    load = pipeline.row_loader(xs, rs, slot, hs.dtype if has_residual else None)
    if given:
      mean = gmean_ref[i, 0] if seg.centered else None
      rstd = grstd_ref[i, 0]
    elif seg.centered:
      mean = jnp.sum(launch.sum_chunks(lambda k: (load(k),))[0]) / seg.minor

      def square(k):
        d = load(k) - mean
        ok = launch.in_row(k)
        d = d if ok is None else jnp.where(ok, d, 0.0)
        return (d * d,)
    else:
      mean = None
      square = lambda k: (load(k) * load(k),)  # padding is 0
    if not given:
      # lax.rsqrt: Mosaic GPU has no sqrt (common.inv_std).
      rstd = lax.rsqrt(jnp.sum(launch.sum_chunks(square)[0]) / seg.minor + jnp.float32(eps))
    pipeline.wait_output_slot(launch)

    def write(k, carry):
      x = load(k)
      if has_residual:
        hs[out, k] = x.astype(hs.dtype)
      ys[out, k] = common.normalize(x - mean if seg.centered else x, rstd, *params(k),
                                    seg.activation).astype(ys.dtype)
      return carry

    launch.loop(write, 0)
    pipeline.store_row(launch, (ys, hs), out, (y_ref, h_ref), i, piece)
    if not given:
      if seg.centered:
        mean_ref[i, col] = mean
      rstd_ref[i, col] = rstd

  pipeline.stream(launch, (x_ref, r_ref), (xs, rs), bar, start, end, row, piece)
  _compat.plgpu().wait_smem_to_gmem(0)


def residual_bytes(residual, h_dtype) -> int:
  """Bytes per element of the residual form's further forward rows (residual, h): ``extra_bytes``."""
  if residual is None:
    return 0
  return residual.dtype.itemsize + jnp.dtype(h_dtype).itemsize


def fwd_scratch(launch: pipeline.Launch, plan, x_dtype, n_params: int, r_dtype=None,
                h_dtype=None):
  """The row forward kernel's SMEM: x (and residual) stages, y (and h) stages, the parameters,
  barriers (``r_dtype``, ``h_dtype``: the residual form's)."""
  scratch = [launch.smem(plan.stages, x_dtype)]
  if r_dtype is not None:
    scratch.append(launch.smem(plan.stages, r_dtype))
  if not plan.in_place:  # else y is written over x
    scratch.append(launch.smem(plan.out_stages, x_dtype))
  if r_dtype is not None:
    scratch.append(launch.smem(plan.out_stages, h_dtype))
  if launch.staged(n_params):
    scratch.append(launch.smem(n_params, F32))
  scratch.append(pipeline.barrier(1 + (r_dtype is not None), plan.stages))
  if launch.staged(n_params):
    scratch.append(pipeline.barrier(n_params))
  return scratch


def forward(x, residual, weight, bias, plan, *, seg: common.Segments, eps: float, interpret,
            h_dtype=None):
  """``(y, mean | None, rstd)`` of rows that ``plan`` (``config.mosaic_gpu_plan``) holds whole.

  The residual form (``residual``, ``h_dtype``): ``(y, mean | None, rstd, h)``;
  see ``mosaic_gpu.forward``.
  """
  has_residual = h_dtype is not None
  n_params = (weight is not None) + (bias is not None)
  launch = pipeline.Launch(seg, plan, interpret)
  view = lambda a: None if a is None else launch.view(a.reshape(seg.n, seg.minor))
  stats = jax.ShapeDtypeStruct((seg.n, 1), F32)
  out_rows = lambda dtype: jax.ShapeDtypeStruct((seg.n, plan.chunks, plan.width), dtype)
  scratch = fwd_scratch(launch, plan, x.dtype, n_params,
                        *((residual.dtype, h_dtype) if has_residual else ()))
  kernel = functools.partial(fwd_kernel, launch=launch, eps=eps, has_weight=weight is not None,
                             has_bias=bias is not None, has_residual=has_residual)
  y, *st = launch.call(
      kernel, [out_rows(x.dtype)] + [stats] * (1 + seg.centered)
      + ([out_rows(h_dtype)] if has_residual else []), scratch, view(x), view(residual),
      launch.view(weight), launch.view(bias), interpret=interpret, name="jax_normgrad_norm_fwd")
  y = launch.unview(y).reshape(x.shape)
  if has_residual:
    st[-1] = launch.unview(st[-1]).reshape(x.shape)
  return (y, *st) if seg.centered else (y, None, *st)


# ----------------------------------------------------------------------------
# Backward: dx and the parameter gradients


def bwd_kernel(*refs, launch: pipeline.Launch, mask: tuple[bool, bool, bool], has_gamma: bool,
               given: bool = False, has_dh: bool = False, has_beta: bool = False,
               channels: ChannelChunks | None = None):
  """Per row: ``c1``, ``c2`` from the row in SMEM, then dx and the partial sums in one pass.

  The partials of ``sum dy * xhat`` and ``sum dy`` live in SMEM (one row each,
  float32) across the CTA's rows and are stored once, as its partial row.
  ``given``: c1, c2 are inputs (pieces of long rows, ``mosaic_gpu_pieces.backward``).
  ``has_dh`` (needs ``mask[0]``): h's cotangent, streamed beside x and dy, is
  added to dx in float32 before dx's one rounding. ``channels``: GroupNorm
  segments (``ChannelChunks``): dy is first ``dy * act'(z)`` with
  ``seg.activation`` (beta, ``has_beta``, recomputes z), and the partials
  are stored per channel.
  """
  seg = launch.seg
  n_acc = mask[1] + mask[2]
  given = given and mask[0]
  staged = channels is None and launch.staged(has_gamma)
  (dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, c1_ref, c2_ref, dh_ref, dx_ref, dw_ref,
   db_ref, xs, dys, dhs, dxs, gs, accs, bar, pbar) = common.unpack(
       refs, True, True, seg.centered, True, has_gamma, has_beta, given and seg.centered, given,
       has_dh, *mask, True, True, has_dh, mask[0], staged, n_acc > 0, True, staged)
  w, p, start, end, piece, col, params = _cta(launch, channels, (gamma_ref, beta_ref), gs, pbar)
  width = launch.plan.width
  zeros = jnp.zeros((width,), F32)
  if n_acc:
    def clear(k, carry):
      for j in range(n_acc):
        accs[j, k] = zeros
      return carry
    launch.loop(clear, 0)

  def row(i, slot, out):
    mean = mean_ref[i, col] if seg.centered else None
    rstd = rstd_ref[i, col]

    def tile(k):
      gamma, beta = params(k)
      x = xs[slot, k].astype(F32)
      dy = common.pre_activation_grad(dys[slot, k].astype(F32), x, mean, rstd, gamma, beta,
                                      seg.activation)
      xhat, g = common.xhat_and_g(x, dy, mean, rstd, gamma)
      return dy, xhat, g  # padded columns: dy = g = 0

    if given:
      c1 = c1_ref[i, 0] if seg.centered else None
      c2 = c2_ref[i, 0]
      pipeline.wait_output_slot(launch)
    elif mask[0]:
      def means(k):
        _, xhat, g = tile(k)
        return (g, g * xhat)
      s1, s2 = launch.sum_chunks(means)
      c1 = jnp.sum(s1) / seg.minor if seg.centered else None
      c2 = jnp.sum(s2) / seg.minor
      pipeline.wait_output_slot(launch)

    def chunk(k, carry):
      dy, xhat, g = tile(k)
      if mask[0]:
        dx = common.grad_input(g, xhat, c1, c2, rstd)
        if has_dh:
          dx = dx + dhs[slot, k].astype(F32)
        dxs[out, k] = dx.astype(dxs.dtype)
      terms = [t for t, want in ((dy * xhat, mask[1]), (dy, mask[2])) if want]
      for j, t in enumerate(terms):
        accs[j, k] = accs[j, k] + t
      return carry

    launch.loop(chunk, 0)
    if mask[0]:
      pipeline.store_row(launch, (dxs,), out, (dx_ref,), i, piece)

  pipeline.stream(launch, (x_ref, dy_ref, dh_ref), (xs, dys, dhs), bar, start, end, row, piece)
  plgpu = _compat.plgpu()
  partial_refs = [r for r in (dw_ref, db_ref) if r is not None]
  if n_acc and channels is not None:
    channels.store_partials(launch, accs, partial_refs, w, p)
  elif n_acc:
    plgpu.commit_smem()
    for j, ref in enumerate(partial_refs):
      plgpu.copy_smem_to_gmem(accs.at[j], ref.at[w, p])
  plgpu.wait_smem_to_gmem(0)


def bwd_scratch(launch: pipeline.Launch, plan, x_dtype, dy_dtype, mask, has_gamma: bool,
                n_acc: int, dh_dtype=None):
  """The row backward kernel's SMEM: x, dy (and dh, dx) stages, gamma, the partials, barriers."""
  scratch = [launch.smem(plan.stages, x_dtype), launch.smem(plan.stages, dy_dtype)]
  if dh_dtype is not None:
    scratch.append(launch.smem(plan.stages, dh_dtype))
  if mask[0]:
    scratch.append(launch.smem(plan.out_stages, x_dtype))
  if launch.staged(has_gamma):
    scratch.append(launch.smem(1, F32))
  if n_acc:
    scratch.append(launch.smem(n_acc, F32))
  scratch.append(pipeline.barrier(2 + (dh_dtype is not None), plan.stages))
  if launch.staged(has_gamma):
    scratch.append(pipeline.barrier(1))
  return scratch


def backward(dy, x, mean, rstd, gamma, dh, plan, *, seg: common.Segments, mask, interpret):
  """``(dx | None, dgamma | None, dbeta | None)`` of rows whose ``plan`` holds them whole.

  ``dh`` (the residual form; needs ``mask[0]``): added to dx in float32
  before its rounding; see ``mosaic_gpu.backward``.
  """
  has_gamma = gamma is not None
  n_acc = mask[1] + mask[2]
  launch = pipeline.Launch(seg, plan, interpret)
  view = lambda a: None if a is None else launch.view(a.reshape(seg.n, seg.minor))
  scratch = bwd_scratch(launch, plan, x.dtype, dy.dtype, mask, has_gamma, n_acc,
                        None if dh is None else dh.dtype)
  partial = jax.ShapeDtypeStruct((seg.param_groups, launch.ctas, plan.chunks, plan.width), F32)
  out_shape = ([jax.ShapeDtypeStruct((seg.n, plan.chunks, plan.width), x.dtype)]
               if mask[0] else []) + [partial] * n_acc
  outs = list(launch.call(
      functools.partial(bwd_kernel, launch=launch, mask=mask, has_gamma=has_gamma,
                        has_dh=dh is not None), out_shape,
      scratch, view(dy), view(x), mean, rstd, launch.view(gamma), view(dh), interpret=interpret,
      name="jax_normgrad_norm_bwd"))
  dx = launch.unview(outs.pop(0)).reshape(x.shape) if mask[0] else None
  sums = []
  for m in mask[1:]:
    if m:
      part = outs.pop(0)
      part = part.reshape(part.shape[:2] + (plan.padded,))[..., :seg.minor]
      sums.append(common.ordered_sum(part, 1))
    else:
      sums.append(None)
  return (dx, *sums)
