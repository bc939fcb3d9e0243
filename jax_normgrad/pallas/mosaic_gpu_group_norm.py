"""Mosaic GPU GroupNorm: a sums kernel, a fixed-order combination in XLA, an apply kernel.

A GroupNorm segment (sample i, group g) is not a row: in NCHW it is cg rows
of HW (one per channel), in channels-last HW rows of C restricted to cg
columns, and a sample of either is usually larger than SMEM. So both
layouts are two streaming passes over rows, each row read by TMA into SMEM
as in the row kernels (``mosaic_gpu_rows``):

1. Sums per (sample, channel) over the spatial axis: the moments (mean and
   sum of squared deviations) forward; ``sum dy`` and ``sum dy * xhat``
   backward. NCHW: a row is one (i, c), reduced in SMEM (two passes for the
   variance, exact). Channels-last: a row is one (i, hw); the CTAs of sample
   i each own a range of its rows and keep per-column float32 accumulators
   in SMEM (Welford's update forward, exact to rounding), stored once as the
   CTA's partial row.
2. In XLA, on (N, C)-sized arrays, in a fixed order (``common.ordered_sum``, Chan's
   merge ``common.combine_moments``): CTA partials -> per (i, c) -> per group
   (statistics; ``c1``, ``c2``) and -> per parameter group (dgamma, dbeta).
   No atomics: bitwise deterministic.
3. The apply kernel: ``out = (x - M) * Q + R [+ dy * P]`` with per-(i, c)
   coefficients (a scalar per NCHW row; per channels-last sample a vector,
   staged in SMEM once per CTA): y, or dx = rstd * (dy * gamma - c1 - xhat * c2).

x (and dy) are read twice there. An NCHW segment of cg * HW elements often
fits SMEM (320 channels in 32 groups at 32x32: 40 KiB in float32); where it
does and HW is a multiple of 128 (``whole_segments``), each segment is
instead one row of the row kernels (``mosaic_gpu_rows``, with
``ChannelChunks``: per-channel parameters, statistics and parameter
gradients, the activation), and x and dy are read once, one kernel each
way.

Both kernels (``sums_kernel``, ``_gn_apply_kernel``) are row kernels over
``GroupRows``, the GroupNorm segment as rows. ``sums_kernel`` also gives the
pieces of long LayerNorm rows their moments and sums (``mosaic_gpu_pieces``).

Stands on ``mosaic_gpu_rows`` and ``mosaic_gpu_pipeline`` (and ``common``,
``config``); ``mosaic_gpu`` calls ``forward`` / ``backward`` here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_normgrad import _activations, _compat
from jax_normgrad.pallas import common, config, mosaic_gpu_rows
from jax_normgrad.pallas import mosaic_gpu_pipeline as pipeline

F32 = jnp.float32


class GroupRows:
  """GroupNorm ``seg`` as rows for the row kernels.

  NCHW ``(N, C, HW)``: ``N * C`` rows ``(i, c)`` of HW; a per-(i, c) quantity
  is a scalar per row (``per_row``). Channels-last ``(N, HW, C)``: ``N * HW``
  rows ``(i, hw)`` of C; a per-(i, c) quantity is a vector per sample, and the
  sample is the rows' parameter group (``Segments.param_groups``), so no CTA
  crosses samples.

  NCHW rows longer than SMEM holds are cut in ``pieces`` (``plans``), each a
  row of its own with its (i, c)'s coefficients; the per-piece sums are
  merged in piece order in XLA (``per_channel``).
  """

  def __init__(self, seg: common.Segments):
    self.gn = seg
    self.per_row = seg.chan_axis == 1
    self.pieces = 1
    self.rows = common.Segments("rows", seg.n * seg.major, 1, seg.minor, groups=1,
                                param_groups=1 if self.per_row else seg.n)
    self.spatial = seg.minor if self.per_row else seg.major

  def _cut(self, pieces: int, length: int):
    seg = self.gn
    self.pieces = pieces
    self.rows = common.Segments("rows", seg.n * seg.major * pieces, 1, length, groups=1,
                                param_groups=1)
    self.tail = seg.minor - (pieces - 1) * length

  def plans(self, itemsize: int, *, backward: bool, mask=(True, True, True), has_r: bool = True):
    """``(sums plan, apply plan | None)``: the SMEM layouts of the two kernels' rows.

    None when a row does not fit (a CTA holds a whole row). Channels-last
    counts the coefficient rows staged in SMEM (the activation's gamma, beta
    and rstd backward at most).
    """
    h = self.rows.minor
    coefs = 0 if self.per_row else 1
    act = 2 if backward and self.gn.activation is not None else 0
    sums_kw = dict(backward=backward, inputs=1 + backward, outputs=0,
                   params=(2 + act) * backward * coefs, partials=2 * (not self.per_row))
    apply_kw = None
    if not backward or mask[0]:
      apply_kw = dict(backward=backward, inputs=1 + backward, outputs=1,
                      params=(2 + has_r + backward + act + bool(act)) * coefs, partials=0)
    sums = config.mosaic_gpu_plan(h, itemsize, **sums_kw)
    apply = apply_kw and config.mosaic_gpu_plan(h, itemsize, **apply_kw)
    if sums is not None and (apply is not None or apply_kw is None):
      return sums, apply
    if not self.per_row:
      return None
    cut = config.mosaic_gpu_pieces(h, itemsize, **(apply_kw or sums_kw))
    if cut is None:
      return None
    pieces, plan = cut
    self._cut(pieces, plan.padded)
    sums = config.mosaic_gpu_plan(plan.padded, itemsize, **sums_kw)
    return sums, (plan if apply_kw else None)

  def coef(self, a):
    """A per-(i, c) ``(N, C)`` float32 array as a kernel operand (None stays None)."""
    if a is None:
      return None
    if not self.per_row:
      return a
    a = a.reshape(-1)
    return (a if self.pieces == 1 else jnp.repeat(a, self.pieces)).reshape(-1, 1)

  def rows_of(self, a):
    """x or dy ``(N, a, b)`` as the kernels' rows ``(rows, length)`` (pieces zero-padded)."""
    a = a.reshape(-1, self.gn.minor)
    pad = self.pieces * self.rows.minor - self.gn.minor
    if pad:
      a = jnp.pad(a, [(0, 0), (0, pad)])
    return a.reshape(self.rows.n, self.rows.minor)

  def per_channel(self, launch, out):
    """Per-(i, c) sums from the sums kernel's outputs: ``(N, C)`` float32.

    ``(N, C, pieces)`` for NCHW rows in pieces (merged by the caller).
    """
    seg = self.gn
    if self.per_row:
      return out.reshape((seg.n, seg.channels) + ((self.pieces,) if self.pieces > 1 else ()))
    return out.reshape(out.shape[:2] + (launch.plan.padded,))[..., :seg.channels]

  def counts(self):
    """Elements of each piece of an NCHW row (the last one is short)."""
    return [float(self.rows.minor)] * (self.pieces - 1) + [float(self.tail)]

  def expand(self, a):
    """``(N, G)`` -> ``(N, C)``: a per-group value for each of the group's channels."""
    return jnp.repeat(a, self.gn.cg, axis=1)

  def per_sample(self, p):
    """``(W, C)`` parameters (None: ones) -> ``(N, C)`` float32, sample i's parameter row."""
    seg = self.gn
    if p is None:
      return None
    return jnp.repeat(p.astype(F32), seg.per_group, axis=0)


def _coef_reader(launch, rows: GroupRows, refs, buf, barrier, w):
  """``at_row(i)`` -> ``read(k)``: the coefficient refs' values for row i, chunk k (None where absent).

  NCHW: the scalars of row i, loaded once per row. Channels-last: chunk k of
  sample w's vectors (``pipeline.params``: staged in SMEM or read from GMEM).
  """
  if rows.per_row:
    def at_row(i):
      values = [None if r is None else r[i, 0] for r in refs]
      return lambda k: values
    return at_row
  read = pipeline.params(launch, refs, buf, barrier, w)
  return lambda i: read


def sums_kernel(*refs, launch: pipeline.Launch, rows: GroupRows, backward: bool,
                    pieces: int = 1, tail: int = 0, param_rows: int | None = None,
                    activation: str | None = None, act_params: tuple[bool, bool] = (False, False),
                    has_residual: bool = False, h_dtype=None):
  """Per (sample, channel): moments forward, ``sum dy`` and ``sum dy * xhat`` backward.

  NCHW: one row, reduced in SMEM, two scalars stored per row. Channels-last:
  float32 column accumulators in SMEM across the CTA's rows of one sample,
  stored once as its partial rows (forward: Welford's mean and M2, all of
  the CTA's rows counting alike; backward: sums).

  Also the pieces of long LayerNorm rows (``pieces`` rows per data row, the
  last ``tail`` long; per row): the moments of each piece, or (with the
  parameter rows ``param_rows``, ``(W * pieces, chunks, width)`` read from
  GMEM) ``sum g`` and ``sum g * xhat``, ``g = dy * gamma``.

  GroupNorm's fused ``activation``: dy is first ``dy * act'(z)``,
  ``z = xhat * gamma + beta`` with the per-(i, c) gamma and beta coefficients
  present as ``act_params`` says.

  ``has_residual`` (forward): the moments are of h as it is stored, the
  float32 sum of x's rows and the residual's (streamed beside them) rounded
  to ``h_dtype`` (the residual form's long rows).
  """
  columns = not rows.per_row
  has_gamma = param_rows is not None
  n_coef = (2 + sum(act_params)) * backward
  staged = columns and launch.staged(n_coef)
  (x_ref, r_ref, dy_ref, m_ref, s_ref, ag_ref, ab_ref, g_ref, out0, out1, xs, rs, dys, cs, accs,
   bar, cbar) = common.unpack(refs, True, has_residual, backward, backward, backward,
                              act_params[0], act_params[1], has_gamma, True, True, True,
                              has_residual, backward, staged, columns, True, staged)
  w, p, start, end = launch.rows()
  at_row = _coef_reader(launch, rows, (m_ref, s_ref, ag_ref, ab_ref), cs, cbar, w)
  length = launch.seg.minor
  if columns:
    zeros = jnp.zeros((launch.plan.width,), F32)

    def clear(k, carry):
      accs[0, k] = zeros
      accs[1, k] = zeros
      return carry

    launch.loop(clear, 0)

  def row(i, slot, out):
    del out  # no output rows: sums only
    load = pipeline.row_loader(xs, rs, slot, h_dtype)
    coefs = at_row(i)

    if has_gamma:  # the parameter row of this piece
      q = lax.div(i, pieces)
      gamma_row = lax.div(q, param_rows) * pieces + (i - q * pieces)

    def grads(k):  # padded columns: dy = 0
      m, s, ag, ab = coefs(k)
      dy = dys[slot, k].astype(F32)
      xhat = (load(k) - m) * s
      dy = _pre_activation(dy, xhat, ag, ab, activation)
      if has_gamma:
        dy = dy * g_ref[gamma_row, k]
      return dy, dy * xhat

    if rows.per_row:
      if backward:
        a, b = launch.sum_chunks(grads)
        out0[i, 0], out1[i, 0] = jnp.sum(a), jnp.sum(b)
      else:
        valid = None
        if pieces > 1 and tail != length:
          last = lax.rem(i, pieces) == pieces - 1
          valid = jnp.where(last, jnp.int32(tail), jnp.int32(length))
        count = length if valid is None else lax.convert_element_type(valid, F32)
        mean = jnp.sum(launch.sum_chunks(lambda k: (load(k),))[0]) / count

        def square(k):
          d = load(k) - mean
          ok = launch.in_row(k, valid)
          d = d if ok is None else jnp.where(ok, d, 0.0)
          return (d * d,)

        out0[i, 0] = mean
        out1[i, 0] = jnp.sum(launch.sum_chunks(square)[0])
      return
    if backward:
      def add(k, carry):
        a, b = grads(k)
        accs[0, k] = accs[0, k] + a
        accs[1, k] = accs[1, k] + b
        return carry
    else:
      inv = 1.0 / lax.convert_element_type(i - start + 1, F32)

      def add(k, carry):  # Welford: padded columns stay 0
        x = load(k)
        mean = accs[0, k]
        d = x - mean
        new = mean + d * inv
        accs[0, k] = new
        accs[1, k] = accs[1, k] + d * (x - new)
        return carry

    launch.loop(add, 0)

  pipeline.stream(launch, (x_ref, r_ref, dy_ref), (xs, rs, dys), bar, start, end, row)
  plgpu = _compat.plgpu()
  if columns:
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(accs.at[0], out0.at[w, p])
    plgpu.copy_smem_to_gmem(accs.at[1], out1.at[w, p])
  plgpu.wait_smem_to_gmem(0)


def _pre_activation(dy, xhat, gamma, beta, activation):
  """``dy * act'(xhat * gamma + beta)`` (``common.pre_activation_grad``); dy without activation."""
  if activation is None:
    return dy
  z = xhat if gamma is None else xhat * gamma
  if beta is not None:
    z = z + beta
  return dy * _activations.grad(z, activation)


def _gn_sums(rows: GroupRows, plan, x, dy, m, s, *, interpret, activation=None, ag=None,
             ab=None):
  """The sums kernel: two ``(N, C)`` float32 arrays, and the CTAs' row counts (channels-last).

  Channels-last returns the CTA partials ``(N, P, C)`` and their row counts ``(P,)``.
  ``activation``, ``ag``, ``ab``: GroupNorm's fused activation and its per-(i, c) gamma, beta.
  """
  backward = dy is not None
  launch = pipeline.Launch(rows.rows, plan, interpret)
  n_coef = (2 + (ag is not None) + (ab is not None)) * backward
  staged = not rows.per_row and launch.staged(n_coef)
  view = lambda a: launch.view(rows.rows_of(a))
  scratch = [launch.smem(plan.stages, x.dtype)]
  if backward:
    scratch.append(launch.smem(plan.stages, dy.dtype))
  if staged:
    scratch.append(launch.smem(n_coef, F32))
  if not rows.per_row:
    scratch.append(launch.smem(2, F32))
  scratch.append(pipeline.barrier(1 + backward, plan.stages))
  if staged:
    scratch.append(pipeline.barrier(n_coef))
  if rows.per_row:
    out = jax.ShapeDtypeStruct((rows.rows.n, 1), F32)
  else:
    out = jax.ShapeDtypeStruct((rows.gn.n, launch.ctas, plan.chunks, plan.width), F32)
  coef = rows.coef if rows.per_row else launch.view
  kernel = functools.partial(sums_kernel, launch=launch, rows=rows, backward=backward,
                             activation=activation, act_params=(ag is not None, ab is not None),
                             pieces=rows.pieces, tail=getattr(rows, "tail", 0))
  a, b = launch.call(
      kernel, [out, out], scratch, view(x), None if dy is None else view(dy),
      *(coef(a) for a in (m, s, ag, ab)), interpret=interpret,
      name="jax_normgrad_norm_bwd_sums" if backward else "jax_normgrad_norm_fwd_stats")
  counts = [min(launch.per_cta, rows.spatial - p * launch.per_cta) for p in range(launch.ctas)]
  return rows.per_channel(launch, a), rows.per_channel(launch, b), counts


def _gn_apply_kernel(*refs, launch: pipeline.Launch, rows: GroupRows, has_dy: bool, has_r: bool,
                     activation: str | None = None, act_params: tuple[bool, bool, bool] = (
                         False, False, False)):
  """``out = (x - M) * Q + R [+ dy * P]`` with per-(sample, channel) coefficients.

  With an ``activation``: forward, ``act`` of that; backward, dy is first
  ``dy * act'(z)``, ``z = (x - M) * S * G + B`` (``act_params``: which of S,
  G, B are operands; S, rstd, is whenever dy is).
  """
  columns = not rows.per_row
  n_coef = 2 + has_r + has_dy + sum(act_params)
  staged = columns and launch.staged(n_coef)
  (x_ref, dy_ref, m_ref, q_ref, r_ref, p_ref, s_ref, ag_ref, ab_ref, out_ref, xs, dys, outs, cs,
   bar, cbar) = common.unpack(refs, True, has_dy, True, True, has_r, has_dy, *act_params, True,
                              True, has_dy, True, staged, True, staged)
  w, _, start, end = launch.rows()
  at_row = _coef_reader(launch, rows, (m_ref, q_ref, r_ref, p_ref, s_ref, ag_ref, ab_ref), cs,
                        cbar, w)

  def row(i, slot, out):
    coefs = at_row(i)
    pipeline.wait_output_slot(launch)

    def write(k, carry):
      m, q, r, p, s, ag, ab = coefs(k)
      x = xs[slot, k].astype(F32)
      v = (x - m) * q
      if r is not None:
        v = v + r
      if p is not None:
        dy = dys[slot, k].astype(F32)
        if activation is not None:
          dy = _pre_activation(dy, (x - m) * s, ag, ab, activation)
        v = v + dy * p
      elif activation is not None:
        v = _activations.apply(v, activation)
      outs[out, k] = v.astype(outs.dtype)
      return carry

    launch.loop(write, 0)
    pipeline.store_row(launch, (outs,), out, (out_ref,), i)

  srcs = (x_ref, dy_ref) if has_dy else (x_ref,)
  pipeline.stream(launch, srcs, (xs, dys) if has_dy else (xs,), bar, start, end, row)
  _compat.plgpu().wait_smem_to_gmem(0)


def _gn_apply(rows: GroupRows, plan, x, dy, m, q, r, p, *, interpret, activation=None,
              act=(None, None, None)):
  """The apply kernel over x's rows (and dy's): a result like x.

  ``act``: the per-(i, c) rstd, gamma, beta of the backward's activation.
  """
  has_dy = dy is not None
  launch = pipeline.Launch(rows.rows, plan, interpret)
  act_params = tuple(a is not None for a in act)
  n_coef = 2 + (r is not None) + has_dy + sum(act_params)
  staged = not rows.per_row and launch.staged(n_coef)
  view = lambda a: launch.view(rows.rows_of(a))
  scratch = [launch.smem(plan.stages, x.dtype)]
  if has_dy:
    scratch.append(launch.smem(plan.stages, dy.dtype))
  scratch.append(launch.smem(plan.out_stages, x.dtype))
  if staged:
    scratch.append(launch.smem(n_coef, F32))
  scratch.append(pipeline.barrier(1 + has_dy, plan.stages))
  if staged:
    scratch.append(pipeline.barrier(n_coef))
  coef = rows.coef if rows.per_row else launch.view
  out, = launch.call(
      functools.partial(_gn_apply_kernel, launch=launch, rows=rows, has_dy=has_dy,
                        has_r=r is not None, activation=activation, act_params=act_params),
      [jax.ShapeDtypeStruct((rows.rows.n, plan.chunks, plan.width), x.dtype)], scratch,
      view(x), None if dy is None else view(dy), *(coef(a) for a in (m, q, r, p) + tuple(act)),
      interpret=interpret, name="jax_normgrad_norm_bwd" if has_dy else "jax_normgrad_norm_fwd")
  out = out.reshape(-1, rows.pieces * plan.padded)[:, :rows.gn.minor]
  return out.reshape(x.shape)


def _moments(rows: GroupRows, a, b, counts):
  """Per (i, c) ``(mean, M2)`` over the spatial axis from the sums kernel's forward outputs.

  Channels-last: the CTA partials merged in a fixed order (Chan's formula,
  ``common.fixed_order``); NCHW rows in pieces: the pieces, in order.
  """
  if rows.per_row:
    if rows.pieces == 1:
      return a, b
    counts = rows.counts()
    state = (counts[0], a[..., 0], b[..., 0])
    for j in range(1, rows.pieces):
      state = common.combine_moments(state, (counts[j], a[..., j], b[..., j]))
    return state[1], state[2]
  counts = jnp.asarray(counts, F32).reshape(-1, 1, 1)
  _, mean, m2 = common.fixed_order((counts, jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0)),
                                   common.combine_moments)
  return mean, m2


# ----------------------------------------------------------------------------
# NCHW segments held whole: one pass each way


def whole_segments(seg: common.Segments, itemsize: int, *, backward: bool,
                    mask=(True, True, True)):
  """``(ChannelChunks, plan)`` where each NCHW segment is one row of the row kernels, else None.

  Needs HW a multiple of 128 (a chunk in one channel) and a segment in SMEM
  with two stages or more (the plain forward writes y over x where that
  gives it more; a single stage would read no row ahead, and the two-pass
  kernels do, several rows of HW each).
  """
  if seg.chan_axis != 1:
    return None
  width = next((w for w in (256, 128) if seg.minor % w == 0), None)
  if width is None:
    return None
  length = seg.cg * seg.minor
  if backward:
    plan = config.mosaic_gpu_plan(length, itemsize, backward=True, params=0,
                                  outputs=int(mask[0]), partials=mask[1] + mask[2], width=width)
  else:
    plan = config.mosaic_gpu_plan(length, itemsize, backward=False, params=0, in_place=True,
                                  width=width)
  if plan is None or plan.stages < 2:
    return None
  return mosaic_gpu_rows.ChannelChunks(groups=seg.groups, cg=seg.cg, cpc=seg.minor // width), plan


def segment_launch(seg: common.Segments, plan, interpret):
  """The row kernels' launch over the segments: rows of ``cg * HW``, a piece per group."""
  rows = common.Segments("rows", seg.n, 1, seg.cg * seg.minor, groups=1,
                         param_groups=seg.param_groups, activation=seg.activation)
  return pipeline.Launch(rows, plan, interpret, pieces=seg.groups)


def _per_channel(a, seg: common.Segments):
  """A ``(C,)`` or ``(W, C)`` parameter as the kernels' float32 ``(W, C)`` rows (None stays)."""
  return None if a is None else a.astype(F32).reshape(seg.param_groups, seg.channels)


def _forward_whole(x, weight, bias, channels, plan, *, seg, eps, interpret):
  """``(y, mean, rstd)``: each segment read once, its statistics and y from SMEM."""
  launch = segment_launch(seg, plan, interpret)
  x4 = x.reshape(seg.n, seg.groups, plan.chunks, plan.width)
  stats = jax.ShapeDtypeStruct((seg.n, seg.groups), F32)
  kernel = functools.partial(mosaic_gpu_rows.fwd_kernel, launch=launch, eps=eps,
                             has_weight=weight is not None, has_bias=bias is not None,
                             channels=channels)
  y, mean, rstd = launch.call(
      kernel, [jax.ShapeDtypeStruct(x4.shape, x.dtype), stats, stats],
      mosaic_gpu_rows.fwd_scratch(launch, plan, x.dtype, 0), x4, None,
      _per_channel(weight, seg), _per_channel(bias, seg), interpret=interpret,
      name="jax_normgrad_norm_fwd")
  return y.reshape(x.shape), mean, rstd


def _backward_whole(dy, x, mean, rstd, gamma, beta, channels, plan, *, seg, mask, interpret):
  """``(dx | None, dgamma | None, dbeta | None)``: each segment's x and dy read once.

  The kernel leaves per-(CTA, channel) partial sums; XLA adds them over the
  CTAs in a fixed order.
  """
  launch = segment_launch(seg, plan, interpret)
  view = lambda a: a.reshape(seg.n, seg.groups, plan.chunks, plan.width)
  n_acc = mask[1] + mask[2]
  has_beta = seg.activation is not None and beta is not None
  partial = jax.ShapeDtypeStruct((seg.param_groups * seg.groups, launch.ctas, seg.cg), F32)
  out_shape = ([jax.ShapeDtypeStruct(view(x).shape, x.dtype)] if mask[0] else []) + (
      [partial] * n_acc)
  outs = list(launch.call(
      functools.partial(mosaic_gpu_rows.bwd_kernel, launch=launch, mask=mask,
                        has_gamma=gamma is not None, has_beta=has_beta, channels=channels),
      out_shape, mosaic_gpu_rows.bwd_scratch(launch, plan, x.dtype, dy.dtype, mask, False, n_acc),
      view(dy), view(x), mean, rstd, _per_channel(gamma, seg),
      _per_channel(beta, seg) if has_beta else None, interpret=interpret,
      name="jax_normgrad_norm_bwd"))
  dx = outs.pop(0).reshape(x.shape) if mask[0] else None
  sums = []
  for want in mask[1:]:
    part = outs.pop(0).reshape(seg.param_groups, seg.groups, launch.ctas, seg.cg) if want else None
    sums.append(None if part is None else
                common.ordered_sum(part, 2).reshape(seg.param_groups, seg.channels))
  return (dx, *sums)


# ----------------------------------------------------------------------------
# The entry points


def forward(x, weight, bias, *, seg: common.Segments, eps: float, interpret):
  """GroupNorm ``(y, mean, rstd)``: sums, statistics in XLA, then y (or NCHW segments whole)."""
  whole = whole_segments(seg, x.dtype.itemsize, backward=False)
  if whole is not None:
    return _forward_whole(x, weight, bias, *whole, seg=seg, eps=eps, interpret=interpret)
  rows = GroupRows(seg)
  has_r = bias is not None
  sums_plan, apply_plan = rows.plans(x.dtype.itemsize, backward=False, has_r=has_r)
  a, b, counts = _gn_sums(rows, sums_plan, x, None, None, None, interpret=interpret)
  mean_c, m2_c = _moments(rows, a, b, counts)
  # Groups: cg parts of equal count (HW) each, merged exactly.
  shape = (seg.n, seg.groups, seg.cg)
  mc = mean_c.reshape(shape)
  mean = common.ordered_sum(mc, 2) / seg.cg
  m2 = common.ordered_sum(m2_c.reshape(shape) + rows.spatial * jnp.square(mc - mean[..., None]),
                          2)
  rstd = lax.rsqrt(m2 / seg.count + jnp.float32(eps))
  q = rows.expand(rstd)
  weight = rows.per_sample(weight)
  if weight is not None:
    q = q * weight
  y = _gn_apply(rows, apply_plan, x, None, rows.expand(mean), q, rows.per_sample(bias), None,
                interpret=interpret, activation=seg.activation)
  return y, mean, rstd


def backward(dy, x, mean, rstd, gamma, beta, *, seg: common.Segments, mask, interpret):
  """GroupNorm ``(dx | None, dgamma | None, dbeta | None)``: sums, reductions in XLA, then dx.

  With a fused activation both kernels take dy as ``dy * act'(z)``, z
  recomputed from x and the per-(i, c) rstd, gamma, beta; dgamma and dbeta
  are then of z's cotangent, as the primitive defines them.
  """
  whole = whole_segments(seg, x.dtype.itemsize, backward=True, mask=mask)
  if whole is not None:
    return _backward_whole(dy, x, mean, rstd, gamma, beta, *whole, seg=seg, mask=mask,
                           interpret=interpret)
  rows = GroupRows(seg)
  sums_plan, apply_plan = rows.plans(x.dtype.itemsize, backward=True, mask=mask)
  m, s = rows.expand(mean), rows.expand(rstd)
  activation = seg.activation
  ag = ab = None
  if activation is not None:
    ag, ab = rows.per_sample(gamma), rows.per_sample(beta)
  s_dy, s_dyx, _ = _gn_sums(rows, sums_plan, x, dy, m, s, interpret=interpret,
                            activation=activation, ag=ag, ab=ab)
  if not rows.per_row:  # CTA partials, in a fixed order
    s_dy, s_dyx = common.ordered_sum(s_dy, 1), common.ordered_sum(s_dyx, 1)
  elif rows.pieces > 1:  # pieces, in order
    s_dy, s_dyx = common.ordered_sum(s_dy, 2), common.ordered_sum(s_dyx, 2)
  per_group = lambda a: common.ordered_sum(a.reshape(seg.param_groups, seg.per_group, -1), 1)
  dgamma = per_group(s_dyx) if mask[1] else None
  dbeta = per_group(s_dy) if mask[2] else None
  dx = None
  if mask[0]:
    g = rows.per_sample(gamma)
    s_g, s_gx = (s_dy, s_dyx) if g is None else (s_dy * g, s_dyx * g)
    shape = (seg.n, seg.groups, seg.cg)
    c1 = rows.expand(common.ordered_sum(s_g.reshape(shape), 2) / seg.count)
    c2 = rows.expand(common.ordered_sum(s_gx.reshape(shape), 2) / seg.count)
    # dx = rstd * (dy * gamma - c1 - xhat * c2), xhat = (x - mean) * rstd.
    p = s if g is None else s * g
    act = (s, ag, ab) if activation is not None else (None, None, None)
    dx = _gn_apply(rows, apply_plan, x, dy, m, -(s * s * c2), -(s * c1), p, interpret=interpret,
                   activation=activation, act=act)
  return dx, dgamma, dbeta

