"""Pallas Triton kernels for CUDA and ROCm: persistent programs that loop over their samples.

Backend choice: Triton is the default GPU backend. It lowers for every
recent NVIDIA GPU (A100 as well as H100) and for ROCm, and its masked loads
of power-of-two tiles are how rows that are not powers of two are handled.
JAX deprecates it from 0.11 in favour of Mosaic GPU, which needs Hopper or
newer and does not run on ROCm: ``mosaic_gpu.py`` holds the Mosaic GPU
kernels (LayerNorm, RMSNorm and GroupNorm), chosen with
``implementation="mosaic_gpu"`` or ``JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu``
(``jax_normgrad._dispatch``); they passed their suite on an H100 and become the
default on sm_90+ once timed there at least as fast as these. Every
``pallas_call`` here passes ``pltriton.CompilerParams``, so the backend does
not depend on the ``jax_pallas_use_mosaic_gpu`` default.

Launch: programs ``(w, g, p)``, flattened to one grid axis; program ``p`` of
parameter group ``w`` and channel group ``g`` handles a contiguous range of
that parameter group's samples, a few programs per SM in all (a persistent
grid: ``config.gpu_programs``). Refs are whole arrays in global memory;
tiles are loaded with masks, so nothing is padded or transposed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax_normgrad.pallas import common, config

F32 = jnp.float32
#: The forward takes ``residual`` / ``h_dtype`` and the backward ``dh``
#: (``kernels.forward``, ``kernels.backward``).
FUSES_RESIDUAL = True
#: The backward reads dy and x each in its own dtype and can write dx twice
#: (x's dtype and dy's: ``dx_dy``); see ``kernels.backward``.
MIXED_DTYPES = True


def _loop(lower, upper, body, init):
  """``lax.fori_loop``, or a plain call for a single static iteration (fused tiles)."""
  if isinstance(lower, int) and isinstance(upper, int) and upper - lower == 1:
    return body(lower, init)
  return lax.fori_loop(lower, upper, body, init)


def _span(first, size: int):
  """Indices ``first + [0, size)`` of a masked window, as an array.

  Tiles are powers of two and may overhang the array; their out-of-range
  elements are masked. An overhanging ``pl.ds`` is refused by Pallas (jax
  >= 0.12 checks static slice bounds); an index array is what JAX's own
  Triton kernels use for masked windows, and it lowers to the same pointer
  block (an ``arange`` plus the offset).
  """
  return first + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _load(ref, mask):
  """Masked load as float32; masked-off elements read as 0."""
  return pltriton.load(ref, mask=mask, other=0).astype(F32)


class _Launch:
  """Static geometry of one launch: the programs, their samples, the tiles of a segment."""

  def __init__(self, seg: common.Segments, plan: config.GpuPlan, interpret: bool):
    self.seg, self.plan = seg, plan
    per_group = max(config.gpu_programs(plan, interpret=interpret)
                    // (seg.param_groups * seg.groups), 1)
    self.programs, self.per_program = config.split(seg.per_group, per_group)
    self.grid = (seg.param_groups * seg.groups * self.programs,)
    c = seg.chan_axis - 1  # the tile axis along the channels
    self.chan_tile = plan.tile[c]
    self.chan_chunks, self.space_chunks = plan.chunks[c], plan.chunks[1 - c]

  def program(self):
    """``(w, g, p, start, end)``: this program's groups and its samples ``[start, end)``."""
    seg = self.seg
    pid = pl.program_id(0)
    # lax.div/rem: C semantics are right for these non-negative ints, and unlike
    # jnp's floor semantics they lower to one Triton op.
    p = lax.rem(pid, self.programs)
    g = lax.rem(lax.div(pid, self.programs), seg.groups)
    w = lax.div(pid, self.programs * seg.groups)
    start = w * seg.per_group + p * self.per_program
    return w, g, p, start, jnp.minimum(start + self.per_program, (w + 1) * seg.per_group)

  def chunk(self, k):
    """``(kc, ks)``: flat chunk index k of a segment, channel chunks outermost."""
    if self.space_chunks == 1:
      return k, 0
    if self.chan_chunks == 1:
      return 0, k
    return lax.div(k, self.space_chunks), lax.rem(k, self.space_chunks)

  def window(self, g, kc, ks):
    """Ref indices and in-segment mask of the tile (channel chunk kc, other chunk ks) of group g."""
    seg = self.seg
    ta, tb = self.plan.tile
    ka, kb = (kc, ks) if seg.chan_axis == 1 else (ks, kc)
    a, b = _span(ka * ta, ta)[:, None], _span(kb * tb, tb)[None, :]
    mask = (a < seg.shape[0]) & (b < seg.shape[1])
    if seg.chan_axis == 1:
      a = a + g * seg.cg
    else:
      b = b + g * seg.cg
    return (a, b), mask

  def channels(self, g, kc):
    """Ref index and mask of the channel vector of chunk kc of group g."""
    idx = _span(kc * self.chan_tile, self.chan_tile)
    return g * self.seg.cg + idx, idx < self.seg.cg

  def per_channel(self, v):
    """A channel vector, broadcastable against a tile."""
    return v[:, None] if self.seg.chan_axis == 1 else v[None, :]

  def channel_sum(self, tile):
    """A tile summed over its non-channel axis."""
    return jnp.sum(tile, axis=2 - self.seg.chan_axis)

  def params(self, refs, w, g, kc):
    """The per-channel parameter tiles (None where a ref is absent) of chunk kc."""
    idx, mask = self.channels(g, kc)
    return [None if r is None else self.per_channel(_load(r.at[w, idx], mask)) for r in refs]

  def call(self, kernel, out_shape, *operands, interpret: bool, name: str,
           num_warps: int | None = None):
    """``pallas_call`` over this launch's grid; None operands are left out."""
    return _call(kernel, out_shape, operands, grid=self.grid, interpret=interpret, name=name,
                 num_warps=num_warps or self.plan.num_warps, num_stages=self.plan.num_stages)


def _call(kernel, out_shape, operands, *, grid, interpret: bool, name: str, num_warps: int,
          num_stages: int):
  """``pallas_call`` of a Triton kernel over ``grid``; None operands are left out."""
  params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  operands = [a for a in operands if a is not None]
  return pl.pallas_call(kernel, out_shape=common.typed_like(out_shape, operands), grid=grid,
                        interpret=interpret, compiler_params=params, name=name)(*operands)


# ----------------------------------------------------------------------------
# Forward: y, mean, rstd


def _fwd_kernel(*refs, launch: _Launch, eps: float, has_weight: bool, has_bias: bool,
                has_residual: bool):
  """Per segment: statistics (from the registers, or chunk by chunk), then ``y``.

  Chunked segments merge per-chunk moments (``common.combine_moments``) in a
  first pass and write ``y`` in a second. With a residual, each tile is h as
  it is stored: the float32 sum of the x and residual tiles rounded to h's
  dtype (``common.stored_sum``), the statistics and y come from it, and the
  pass that writes y also writes it as h.
  """
  seg = launch.seg
  x_ref, r_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref, h_ref = common.unpack(
      refs, True, has_residual, has_weight, has_bias, True, seg.centered, True, has_residual)
  w, g, _, start, end = launch.program()
  chunks = launch.chan_chunks * launch.space_chunks

  def tile(i, k):
    idx, mask = launch.window(g, *launch.chunk(k))
    x = _load(x_ref.at[(i,) + idx], mask)
    if has_residual:
      x = common.stored_sum(x, _load(r_ref.at[(i,) + idx], mask), h_ref.dtype)
    return idx, mask, x

  def write(i, k, mean, rstd, params, loaded=None):
    idx, mask, x = loaded or tile(i, k)
    if has_residual:
      pltriton.store(h_ref.at[(i,) + idx], x.astype(h_ref.dtype), mask=mask)
    xc = x - mean if seg.centered else x
    y = common.normalize(xc, rstd, *params, activation=seg.activation)
    pltriton.store(y_ref.at[(i,) + idx], y.astype(y_ref.dtype), mask=mask)

  fused_params = launch.params((w_ref, b_ref), w, g, 0) if launch.plan.fused else None

  def sample(i, carry):
    if launch.plan.fused:
      loaded = tile(i, 0)
      _, mask, x = loaded
      mean = jnp.sum(x) / seg.count if seg.centered else None
      xc = jnp.where(mask, x - mean, 0.0) if seg.centered else x
      rstd = common.inv_std(jnp.sum(xc * xc) / seg.count, eps)
      write(i, 0, mean, rstd, fused_params, loaded if has_residual else None)
    else:
      def moments(k, state):
        _, mask, x = tile(i, k)
        if not seg.centered:  # RMSNorm: the sum of squares is all it needs.
          return state[:2] + (state[2] + jnp.sum(x * x),)
        n = jnp.sum(mask.astype(F32))
        m = jnp.sum(x) / n
        d = jnp.where(mask, x - m, 0.0)
        return common.combine_moments(state, (n, m, jnp.sum(d * d)))

      _, mean, m2 = _loop(0, chunks, moments, (jnp.float32(0),) * 3)
      mean = mean if seg.centered else None
      rstd = common.inv_std(m2 / seg.count, eps)

      def write_chunk(k, c):
        write(i, k, mean, rstd, launch.params((w_ref, b_ref), w, g, launch.chunk(k)[0]))
        return c

      _loop(0, chunks, write_chunk, 0)
    if seg.centered:
      mean_ref[i, g] = mean
    rstd_ref[i, g] = rstd
    return carry

  _loop(start, end, sample, 0)


def forward(x, *operands, seg: common.Segments, eps: float, interpret: bool, h_dtype=None,
            y_dtype=None):
  """``(y, mean | None, rstd)``, or with a residual ``(x, residual, weight, bias)`` and
  ``h_dtype``, ``(y, mean | None, rstd, h)``; see ``kernels.forward``. y in
  ``y_dtype`` (None: x's; a 16-bit one with a float32 x)."""
  has_residual = h_dtype is not None
  residual, weight, bias = operands if has_residual else (None, *operands)
  nhwc = _nhwc_plan(seg, x.dtype.itemsize, backward=False)
  if nhwc is not None and not has_residual:
    return _nhwc_forward(x, weight, bias, seg=seg, plan=nhwc, eps=eps, interpret=interpret,
                         y_dtype=y_dtype)
  launch = _Launch(seg, config.gpu_plan(seg.shape, x.dtype.itemsize, backward=False,
                                        residual=has_residual), interpret)
  stats = jax.ShapeDtypeStruct((seg.n, seg.groups), F32)
  kernel = functools.partial(_fwd_kernel, launch=launch, eps=eps, has_weight=weight is not None,
                             has_bias=bias is not None, has_residual=has_residual)
  h_out = [jax.ShapeDtypeStruct(x.shape, h_dtype)] if has_residual else []
  y, *st = launch.call(kernel, [jax.ShapeDtypeStruct(x.shape, y_dtype or x.dtype)]
                       + [stats] * (1 + seg.centered) + h_out, x, residual, weight, bias,
                       interpret=interpret, name="jax_normgrad_norm_fwd")
  if not seg.centered:
    st.insert(0, None)
  return (y, *st)


# ----------------------------------------------------------------------------
# Backward: dx and the parameter gradients


def _segment_means(g, xhat, seg):
  """``(c1, c2) = (mean(g), mean(g * xhat))`` over a whole (masked) segment tile."""
  c1 = jnp.sum(g) / seg.count if seg.centered else None
  return c1, jnp.sum(g * xhat) / seg.count


def _bwd_stats_kernel(*refs, launch: _Launch, has_gamma: bool, has_beta: bool):
  """``c1``, ``c2`` of segments too long for one tile, one chunk at a time."""
  seg = launch.seg
  dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, c1_ref, c2_ref = common.unpack(
      refs, True, True, seg.centered, True, has_gamma, has_beta, seg.centered, True)
  w, g, _, start, end = launch.program()

  def sample(i, carry):
    mean = mean_ref[i, g] if seg.centered else None
    rstd = rstd_ref[i, g]

    # Tile-shaped partial sums, reduced across the block once per segment rather than
    # once per chunk (a block-wide reduction is a barrier). Masked-off elements are 0.
    def chunk(k, sums):
      kc, ks = launch.chunk(k)
      idx, mask = launch.window(g, kc, ks)
      gamma, beta = launch.params((gamma_ref, beta_ref), w, g, kc)
      x = _load(x_ref.at[(i,) + idx], mask)
      dy = common.pre_activation_grad(_load(dy_ref.at[(i,) + idx], mask), x, mean, rstd, gamma,
                                      beta, seg.activation)
      xhat, gg = common.xhat_and_g(x, dy, mean, rstd, gamma)
      s2 = sums[-1] + gg * xhat
      return (sums[0] + gg, s2) if seg.centered else (s2,)

    zeros = jnp.zeros(launch.plan.tile, F32)
    sums = _loop(0, launch.chan_chunks * launch.space_chunks, chunk,
                 (zeros,) * (1 + seg.centered))  # RMSNorm carries no sum of g
    if seg.centered:
      c1_ref[i, g] = jnp.sum(sums[0]) / seg.count
    c2_ref[i, g] = jnp.sum(sums[-1]) / seg.count
    return carry

  _loop(start, end, sample, 0)


def _bwd_kernel(*refs, launch: _Launch, mask: tuple[bool, bool, bool], has_gamma: bool,
                has_beta: bool, has_dh: bool, dx_dy: bool):
  """The fused backward: x and dy read once per tile, partials accumulated in registers.

  For each channel chunk (one, unless a segment's channels exceed a tile),
  the program walks its samples; for each it recomputes xhat from
  mean/rstd, writes dx (with c1, c2 from the tile itself when the segment is
  one tile, else from the stats kernel) and adds ``sum dy * xhat`` and ``sum
  dy`` over the non-channel axis to float32 accumulators, stored once per
  program as its partial row. No atomics: the partials are summed later.
  The residual form adds h's cotangent ``dh`` to dx before its rounding
  and adds the partials before computing dx, so that dy is dead when dx and
  dh take registers: its LayerNorm float32 tile of 4096 compiled to 86
  registers the other way round, 61 this way (two programs per SM instead of
  one). The plain form keeps the order its registers were measured with.
  dy and x are read in their own dtypes; ``dx_dy`` writes dx a second time,
  rounded to dy's dtype. With a fused activation dy is first ``dy * act'(z)``
  (``common.pre_activation_grad``).
  """
  seg = launch.seg
  precomputed = mask[0] and not launch.plan.fused
  (dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, c1_ref, c2_ref, dh_ref,
   dx_ref, dx2_ref, parts_ref) = common.unpack(
       refs, True, True, seg.centered, True, has_gamma, has_beta, precomputed and seg.centered,
       precomputed, has_dh, mask[0], dx_dy, any(mask[1:]))
  n_acc = mask[1] + mask[2]
  w, g, p, start, end = launch.program()

  def channel_chunk(kc, carry):
    gamma, beta = launch.params((gamma_ref, beta_ref), w, g, kc)

    def sample(i, acc):
      mean = mean_ref[i, g] if seg.centered else None
      rstd = rstd_ref[i, g]
      c = None
      if precomputed:
        c = (c1_ref[i, g] if seg.centered else None, c2_ref[i, g])

      def chunk(ks, acc):
        idx, m = launch.window(g, kc, ks)
        x = _load(x_ref.at[(i,) + idx], m)
        dy = _load(dy_ref.at[(i,) + idx], m)  # 0 where masked: no term below sees padding
        dy = common.pre_activation_grad(dy, x, mean, rstd, gamma, beta, seg.activation)
        xhat, gg = common.xhat_and_g(x, dy, mean, rstd, gamma)

        def partials(acc):
          terms = [t for t, want in ((dy * xhat, mask[1]), (dy, mask[2])) if want]
          return tuple(a + launch.channel_sum(t) for a, t in zip(acc, terms))

        if has_dh:  # the partials first (see the docstring: registers)
          acc = partials(acc)
        if mask[0]:
          c1, c2 = c if c is not None else _segment_means(gg, xhat, seg)
          dx = common.grad_input(gg, xhat, c1, c2, rstd)
          if has_dh:
            dx = dx + _load(dh_ref.at[(i,) + idx], m)
          pltriton.store(dx_ref.at[(i,) + idx], dx.astype(dx_ref.dtype), mask=m)
          if dx_dy:
            pltriton.store(dx2_ref.at[(i,) + idx], dx.astype(dx2_ref.dtype), mask=m)
        return acc if has_dh else partials(acc)

      return _loop(0, launch.space_chunks, chunk, acc)

    zeros = tuple(jnp.zeros((launch.chan_tile,), F32) for _ in range(n_acc))
    acc = _loop(start, end, sample, zeros)
    idx, ok = launch.channels(g, kc)
    for j, a in enumerate(acc):
      pltriton.store(parts_ref.at[j, w, p, idx], a, mask=ok)
    return carry

  _loop(0, launch.chan_chunks, channel_chunk, 0)


def _sum_partials_kernel(part_ref, out_ref, *, blocks: int, width: int, rows: int):
  """out[w, cols] = sum over p of part[w, p, cols], in a fixed order.

  Each step loads ``rows`` partial rows as one ``(rows, width)`` tile (masked
  past the last) and adds it to a tile-shaped float32 accumulator; the
  accumulator's rows are summed once at the end. Row slot s thus sums the
  partials p = s mod rows in increasing p, and the slots are summed in a fixed
  tree: the same order at every call, with no atomics.
  """
  pid = pl.program_id(0)
  w, first = lax.div(pid, blocks), lax.rem(pid, blocks) * width
  cols = _span(first, width)
  ok = cols < part_ref.shape[2]
  count = part_ref.shape[1]

  def step(k, acc):
    r = _span(k * rows, rows)[:, None]
    return acc + _load(part_ref.at[w, r, cols[None, :]], (r < count) & ok[None, :])

  acc = lax.fori_loop(0, config.cdiv(count, rows), step, jnp.zeros((rows, width), F32))
  pltriton.store(out_ref.at[w, cols], jnp.sum(acc, axis=0), mask=ok)


def _param_grads(parts, mask, *, interpret: bool):
  """``(dgamma | None, dbeta | None)`` from a backward kernel's partials ``(n, W, P, C)``.

  The n (one or two) partial arrays are one operand, so both parameter
  gradients take one launch of ``_sum_partials``: launches, not bytes, are
  what a norm costs inside a model's step on the GPU (BENCHMARKS.md). With
  ``gpu_partials_in_xla`` XLA sums them (``config.TritonConfig``).
  """
  if parts is None:
    return (None, None)
  n, w, p, c = parts.shape
  if config.triton().gpu_partials_in_xla:
    sums = iter(common.ordered_sum(parts, 2))
  else:
    sums = iter(_sum_partials(parts.reshape(n * w, p, c), interpret=interpret).reshape(n, w, c))
  return tuple(next(sums) if m else None for m in mask[1:])


def _partials_shape(seg: common.Segments, programs: int, mask):
  """The backward kernels' one partials output: ``(dgamma, dbeta)`` rows per program, as asked."""
  return jax.ShapeDtypeStruct((mask[1] + mask[2], seg.param_groups, programs, seg.channels), F32)


def _sum_partials(partials, *, interpret: bool):
  """``(W, P, C)`` -> ``(W, C)``: the second, small, fixed-order reduction."""
  w, p, c = partials.shape
  t = config.triton()
  width = min(pl.next_power_of_2(c), t.gpu_partials_cols)
  rows = min(pl.next_power_of_2(p), max(t.gpu_partials_tile // width, 1))
  blocks = config.cdiv(c, width)
  return pl.pallas_call(
      functools.partial(_sum_partials_kernel, blocks=blocks, width=width, rows=rows),
      out_shape=common.typed_like([jax.ShapeDtypeStruct((w, c), F32)], [partials])[0],
      grid=(w * blocks,), interpret=interpret,
      compiler_params=pltriton.CompilerParams(
          num_warps=max(min(t.gpu_partials_warps, rows * width // 32), 1),
          num_stages=t.gpu_partials_stages),
      name="jax_normgrad_sum_partials")(partials)


def backward(dy, x, mean, rstd, gamma, beta=None, dh=None, *, seg: common.Segments, mask,
             interpret: bool, dx_dy: bool = False):
  """``(dx | None, dgamma | None, dbeta | None)``, [dx in dy's dtype]; see ``kernels.backward``."""
  nhwc = _nhwc_plan(seg, max(x.dtype.itemsize, dy.dtype.itemsize), backward=True)
  if nhwc is not None and dh is None and not dx_dy:
    return _nhwc_backward(dy, x, mean, rstd, gamma, beta, seg=seg, plan=nhwc, mask=mask,
                          interpret=interpret)
  plan = config.gpu_plan(seg.shape, max(x.dtype.itemsize, dy.dtype.itemsize), backward=True)
  launch = _Launch(seg, plan, interpret)
  flags = dict(has_gamma=gamma is not None, has_beta=beta is not None)
  c1 = c2 = None
  if mask[0] and not plan.fused:
    stats = jax.ShapeDtypeStruct((seg.n, seg.groups), F32)
    cs = launch.call(functools.partial(_bwd_stats_kernel, launch=launch, **flags),
                     [stats] * (1 + seg.centered), dy, x, mean, rstd, gamma, beta,
                     interpret=interpret, name="jax_normgrad_norm_bwd_stats",
                     num_warps=plan.stats_warps)
    c1, c2 = cs if seg.centered else (None, cs[0])
  out_shape = ([jax.ShapeDtypeStruct(x.shape, x.dtype)] if mask[0] else []) + (
      [jax.ShapeDtypeStruct(x.shape, dy.dtype)] if dx_dy else []) + (
      [_partials_shape(seg, launch.programs, mask)] if any(mask[1:]) else [])
  outs = list(launch.call(
      functools.partial(_bwd_kernel, launch=launch, mask=mask, has_dh=dh is not None,
                        dx_dy=dx_dy, **flags),
      out_shape, dy, x, mean, rstd, gamma, beta, c1, c2, dh, interpret=interpret,
      name="jax_normgrad_norm_bwd"))
  dx = outs.pop(0) if mask[0] else None
  dx2 = (outs.pop(0),) if dx_dy else ()
  return (dx, *_param_grads(outs.pop(0) if outs else None, mask, interpret=interpret), *dx2)


# ----------------------------------------------------------------------------
# Channels-last GroupNorm with narrow groups: sample-wide tiles


def _nhwc_plan(seg: common.Segments, itemsize: int, *, backward: bool):
  """The sample-wide plan (``config.gpu_nhwc_plan``) of a channels-last GroupNorm, else None."""
  if seg.kind != "channels_last":
    return None
  return config.gpu_nhwc_plan(seg.major, seg.channels, seg.cg, itemsize, backward=backward)


class _NhwcLaunch:
  """The sample-wide kernels' grid and tiles: a sample is a whole ``(HW, C)`` block, in tiles of
  ``plan.rows`` pixels by all ``plan.cols`` channels.

  Every load is of whole rows of the sample's contiguous channels; the
  groups are the tile viewed as ``(rows, groups, cg)``, so a statistic is a
  sum over its first and last axes (``group_sum``), spread back to the
  channels with a broadcast (``spread``). Padding channels (``cols > C``)
  form whole padding groups, masked on every load and store.

  With one part (``config.gpu_nhwc_parts``) the programs are persistent, a
  few per SM, each walking a range of one parameter group's samples; with
  more, a program per (sample, part), each a contiguous range of the
  sample's tiles, and partial statistics pass between two kernels
  (``(N, parts, G)`` float32 arrays, combined in part order).
  """

  def __init__(self, seg: common.Segments, plan: config.GpuNhwcPlan, interpret: bool):
    self.seg, self.plan = seg, plan
    self.parts = config.gpu_nhwc_parts(plan, seg.n, interpret=interpret)
    self.chunks_per_part = config.cdiv(plan.chunks, self.parts)
    if self.parts == 1:
      target = max(config.gpu_programs(plan, interpret=interpret) // seg.param_groups, 1)
      self.programs, self.per_program = config.split(seg.per_group, target)
    else:
      self.programs, self.per_program = seg.per_group * self.parts, 1
    self.grid = (seg.param_groups * self.programs,)

  def program(self):
    """``(w, p, part, start, end, k0, k1)``: parameter group, program (its partial row), part
    of its samples (0 with one part), the samples ``[start, end)`` and their tiles ``[k0, k1)``.

    Called once, at the top of a kernel (the interpreter gives ``program_id`` no value inside
    a loop's body)."""
    seg = self.seg
    pid = pl.program_id(0)
    w, p = lax.div(pid, self.programs), lax.rem(pid, self.programs)
    if self.parts == 1:
      start = w * seg.per_group + p * self.per_program
      return (w, p, 0, start, jnp.minimum(start + self.per_program, (w + 1) * seg.per_group), 0,
              self.plan.chunks)
    part = lax.rem(p, self.parts)
    i = w * seg.per_group + lax.div(p, self.parts)
    k0 = part * self.chunks_per_part
    return w, p, part, i, i + 1, k0, jnp.minimum(k0 + self.chunks_per_part, self.plan.chunks)

  def part_count(self, part):
    """Elements of each group in part ``part`` (pixels of its tiles times ``cg``), float32."""
    first = part * self.chunks_per_part * self.plan.rows
    last = jnp.minimum(first + self.chunks_per_part * self.plan.rows, self.seg.major)
    return ((last - first) * self.plan.cg).astype(F32)

  def columns(self):
    """The tile's channel indices and their mask."""
    cols = _span(0, self.plan.cols)
    return cols, cols < self.seg.channels

  def window(self, k):
    """Ref indices (pixels, channels) and mask of tile k of a sample."""
    rows = _span(k * self.plan.rows, self.plan.rows)[:, None]
    cols, ok = self.columns()
    return (rows, cols[None, :]), (rows < self.seg.major) & ok[None, :]

  def group_sum(self, tile):
    """``(rows, cols)`` -> ``(groups,)``: each group's sum over its pixels and channels."""
    p = self.plan
    if p.odd_groups:  # the column sums, then each group's columns picked out by a 0/1 matrix
      return jnp.sum(jnp.sum(tile, axis=0)[:, None] * self._members(), axis=0)
    return jnp.sum(tile.reshape(p.rows, p.groups, p.cg), axis=(0, 2))

  def spread(self, v):
    """``(groups,)`` -> ``(1, cols)``: each group's value on each of its channels."""
    p = self.plan
    if p.odd_groups:
      return jnp.sum(self._members() * v[None, :], axis=1).reshape(1, p.cols)
    return jnp.broadcast_to(v[:, None], (p.groups, p.cg)).reshape(1, p.cols)

  def _members(self):
    """``(cols, groups)`` float32: 1 where the channel is one of the group's (odd groups: ``cg``
    not a power of two); padding channels fall in a padding group or in none."""
    p = self.plan
    channel = lax.broadcasted_iota(jnp.int32, (p.cols, p.groups), 0)
    group = lax.broadcasted_iota(jnp.int32, (p.cols, p.groups), 1)
    return jnp.where(lax.div(channel, p.cg) == group, 1.0, 0.0).astype(F32)

  def groups(self):
    """The statistics' group indices and mask."""
    g = _span(0, self.plan.groups)
    return g, g < self.seg.groups

  def params(self, refs, w):
    """The per-channel parameter rows ``(1, cols)`` of parameter group w (None where absent)."""
    cols, ok = self.columns()
    return [None if r is None else _load(r.at[w, cols], ok)[None, :] for r in refs]

  def partial_stats(self):
    """The ``(N, parts, G)`` float32 arrays that pass between a split grid's two kernels."""
    return jax.ShapeDtypeStruct((self.seg.n, self.parts, self.seg.groups), F32)

  def store_part(self, ref, i, part, v):
    g, ok = self.groups()
    pltriton.store(ref.at[i, part, g], v, mask=ok)

  def load_parts(self, ref, i):
    """Each part's ``(groups,)`` vector of sample i, in part order."""
    g, ok = self.groups()
    return [_load(ref.at[i, s, g], ok) for s in range(self.parts)]

  def call(self, kernel, out_shape, *operands, interpret: bool, name: str):
    return _call(kernel, out_shape, operands, grid=self.grid, interpret=interpret, name=name,
                 num_warps=self.plan.num_warps, num_stages=1)


def _nhwc_fwd_kernel(*refs, launch: _NhwcLaunch, eps: float, has_weight: bool, has_bias: bool,
                     stage: str):
  """The forward, by ``stage``:

  * "whole" (one part): per sample, the groups' means, then their variances
    (the two-pass formula), then y. A sample of one tile is read once, a
    longer one three times (the second and third reads mostly from L2), each
    pass adding tile-shaped float32 sums that are reduced once.
  * "moments" (a split grid's first kernel): the same two passes over this
    program's part, written as the part's group means and squared deviations.
  * "apply" (its second): the sample's parts merged in part order
    (``common.combine_moments``), the same in every program of the sample,
    then y of this part; part 0 writes the statistics.
  """
  seg, plan = launch.seg, launch.plan
  x_ref, w_ref, b_ref = common.unpack(refs, True, has_weight, has_bias)
  outs = list(refs[1 + has_weight + has_bias:])
  w, _, part, start, end, k0, k1 = launch.program()
  weight, bias = launch.params((w_ref, b_ref), w)
  gidx, gok = launch.groups()
  zeros = jnp.zeros((plan.rows, plan.cols), F32)

  def tile(i, k):
    idx, mask = launch.window(k)
    return idx, mask, _load(x_ref.at[(i,) + idx], mask)

  def write(i, k, mean_c, rstd_c, y_ref, loaded=None):
    idx, mask, x = loaded or tile(i, k)
    y = common.normalize(x - mean_c, rstd_c, weight, bias, activation=seg.activation)
    pltriton.store(y_ref.at[(i,) + idx], y.astype(y_ref.dtype), mask=mask)

  def moments(i, count, loaded=None):
    """The group means and squared deviations of tiles [k0, k1) of sample i (the fused tile:
    ``loaded``)."""
    if plan.fused:
      _, mask, x = loaded
      mean = launch.group_sum(x) / count
      d = jnp.where(mask, x - launch.spread(mean), 0.0)
      return mean, launch.group_sum(d * d)
    mean = launch.group_sum(_loop(k0, k1, lambda k, acc: acc + tile(i, k)[2], zeros)) / count
    mean_c = launch.spread(mean)

    def squares(k, acc):
      _, mask, x = tile(i, k)
      d = jnp.where(mask, x - mean_c, 0.0)
      return acc + d * d

    return mean, launch.group_sum(_loop(k0, k1, squares, zeros))

  def sample(i, carry):
    if stage == "moments":
      mean_p, m2_p = outs
      mean, m2 = moments(i, launch.part_count(part))  # never fused: split
      launch.store_part(mean_p, i, part, mean)
      launch.store_part(m2_p, i, part, m2)
      return carry
    if stage == "whole":
      y_ref, mean_ref, rstd_ref = outs
      loaded = tile(i, 0) if plan.fused else None  # the fused tile, read once
      mean, m2 = moments(i, float(seg.count), loaded)
    else:
      mean_p, m2_p, y_ref, mean_ref, rstd_ref = outs
      state = (jnp.zeros_like(gok, F32),) * 3
      for s, (m, q) in enumerate(zip(launch.load_parts(mean_p, i), launch.load_parts(m2_p, i))):
        state = common.combine_moments(state, (launch.part_count(s), m, q))
      _, mean, m2 = state
      loaded = None
    rstd = common.inv_std(m2 / seg.count, eps)
    mean_c, rstd_c = launch.spread(mean), launch.spread(rstd)
    if loaded is not None:
      write(i, 0, mean_c, rstd_c, y_ref, loaded)
    else:
      _loop(k0, k1, lambda k, c: (write(i, k, mean_c, rstd_c, y_ref), c)[1], 0)
    ok = gok if stage == "whole" else gok & (part == 0)
    pltriton.store(mean_ref.at[i, gidx], mean, mask=ok)
    pltriton.store(rstd_ref.at[i, gidx], rstd, mask=ok)
    return carry

  _loop(start, end, sample, 0)


def _nhwc_forward(x, weight, bias, *, seg, plan, eps, interpret, y_dtype=None):
  """``(y, mean, rstd)`` of a channels-last GroupNorm by the sample-wide kernels."""
  launch = _NhwcLaunch(seg, plan, interpret)
  stats = jax.ShapeDtypeStruct((seg.n, seg.groups), F32)
  outs = [jax.ShapeDtypeStruct(x.shape, y_dtype or x.dtype), stats, stats]
  kw = dict(launch=launch, eps=eps, has_weight=weight is not None, has_bias=bias is not None)
  if launch.parts == 1:
    return tuple(launch.call(functools.partial(_nhwc_fwd_kernel, stage="whole", **kw), outs,
                             x, weight, bias, interpret=interpret,
                             name="jax_normgrad_norm_fwd_nhwc"))
  parts = launch.call(functools.partial(_nhwc_fwd_kernel, stage="moments", **kw),
                      [launch.partial_stats()] * 2, x, weight, bias, interpret=interpret,
                      name="jax_normgrad_norm_fwd_nhwc_moments")
  return tuple(launch.call(functools.partial(_nhwc_fwd_kernel, stage="apply", **kw), outs,
                           x, weight, bias, *parts, interpret=interpret,
                           name="jax_normgrad_norm_fwd_nhwc"))


def _nhwc_bwd_kernel(*refs, launch: _NhwcLaunch, mask: tuple[bool, bool, bool],
                     has_gamma: bool, has_beta: bool, stage: str):
  """The backward, by ``stage``:

  * "whole" (one part): per sample, the groups' ``mean(g)`` and ``mean(g *
    xhat)`` (a pass of their own unless the sample is one tile), then dx.
  * "sums" (a split grid's first kernel): this part's ``sum(g)`` and ``sum(g
    * xhat)`` per group.
  * "dx" (its second): the sample's parts added in part order, then dx of
    this part.

  ``sum dy * xhat`` and ``sum dy`` per channel go to tile-shaped float32
  sums over the program's tiles, stored once as its partial row (no
  atomics: ``_sum_partials`` adds the rows in a fixed order).
  """
  seg, plan = launch.seg, launch.plan
  dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, beta_ref = common.unpack(
      refs, True, True, True, True, has_gamma, has_beta)
  outs = list(refs[4 + has_gamma + has_beta:])
  w, p, part, start, end, k0, k1 = launch.program()
  gamma, beta = launch.params((gamma_ref, beta_ref), w)
  count = float(seg.count)
  gidx, gok = launch.groups()
  zeros = jnp.zeros((plan.rows, plan.cols), F32)
  s1_p = s2_p = None
  if stage == "dx" and mask[0]:
    s1_p, s2_p = outs[:2]
    outs = outs[2:]
  dx_ref, parts_ref = common.unpack(outs, mask[0], any(mask[1:])) if stage != "sums" else (
      None, None)
  n_acc = (mask[1] + mask[2]) if stage != "sums" else 0

  def sample(i, acc):
    mean_c = launch.spread(_load(mean_ref.at[i, gidx], gok))
    rstd_c = launch.spread(_load(rstd_ref.at[i, gidx], gok))

    def terms(k):
      idx, m = launch.window(k)
      x = _load(x_ref.at[(i,) + idx], m)
      dy = _load(dy_ref.at[(i,) + idx], m)  # 0 where masked, and so is every term below
      dy = common.pre_activation_grad(dy, x, mean_c, rstd_c, gamma, beta, seg.activation)
      xhat, g = common.xhat_and_g(x, dy, mean_c, rstd_c, gamma)
      return idx, m, dy, xhat, g

    def sums():
      def add(k, s):
        _, _, _, xhat, g = terms(k)
        return s[0] + g, s[1] + g * xhat

      s1, s2 = _loop(k0, k1, add, (zeros, zeros))
      return launch.group_sum(s1), launch.group_sum(s2)

    if stage == "sums":
      s1, s2 = sums()
      launch.store_part(outs[0], i, part, s1)
      launch.store_part(outs[1], i, part, s2)
      return acc
    cs = None
    if mask[0] and stage == "dx":
      s1 = s2 = None
      for a, b in zip(launch.load_parts(s1_p, i), launch.load_parts(s2_p, i)):
        s1, s2 = (a, b) if s1 is None else (s1 + a, s2 + b)
      cs = launch.spread(s1 / count), launch.spread(s2 / count)
    elif mask[0] and not plan.fused:
      s1, s2 = sums()
      cs = launch.spread(s1 / count), launch.spread(s2 / count)

    def chunk(k, acc):
      idx, m, dy, xhat, g = terms(k)
      if mask[0]:
        c1, c2 = cs or (launch.spread(launch.group_sum(g) / count),
                        launch.spread(launch.group_sum(g * xhat) / count))
        dx = common.grad_input(g, xhat, c1, c2, rstd_c)
        pltriton.store(dx_ref.at[(i,) + idx], dx.astype(dx_ref.dtype), mask=m)
      new = [t for t, want in ((dy * xhat, mask[1]), (dy, mask[2])) if want]
      return tuple(a + t for a, t in zip(acc, new))

    return _loop(k0, k1, chunk, acc)

  acc = _loop(start, end, sample, tuple(zeros for _ in range(n_acc)))
  cols, ok = launch.columns()
  for j, a in enumerate(acc):
    pltriton.store(parts_ref.at[j, w, p, cols], jnp.sum(a, axis=0), mask=ok)


def _nhwc_backward(dy, x, mean, rstd, gamma, beta, *, seg, plan, mask, interpret):
  """``(dx | None, dgamma | None, dbeta | None)`` of a channels-last GroupNorm, sample-wide."""
  launch = _NhwcLaunch(seg, plan, interpret)
  mask = tuple(mask)
  out_shape = ([jax.ShapeDtypeStruct(x.shape, x.dtype)] if mask[0] else []) + (
      [_partials_shape(seg, launch.programs, mask)] if any(mask[1:]) else [])
  kw = dict(launch=launch, mask=mask, has_gamma=gamma is not None, has_beta=beta is not None)
  operands = (dy, x, mean, rstd, gamma, beta)
  if launch.parts == 1:
    outs = launch.call(functools.partial(_nhwc_bwd_kernel, stage="whole", **kw), out_shape,
                       *operands, interpret=interpret, name="jax_normgrad_norm_bwd_nhwc")
  else:
    parts = ()
    if mask[0]:
      parts = launch.call(functools.partial(_nhwc_bwd_kernel, stage="sums", **kw),
                          [launch.partial_stats()] * 2, *operands, interpret=interpret,
                          name="jax_normgrad_norm_bwd_nhwc_sums")
    outs = launch.call(functools.partial(_nhwc_bwd_kernel, stage="dx", **kw), out_shape,
                       *operands, *parts, interpret=interpret, name="jax_normgrad_norm_bwd_nhwc")
  outs = list(outs)
  dx = outs.pop(0) if mask[0] else None
  return (dx, *_param_grads(outs.pop(0) if outs else None, mask, interpret=interpret))
