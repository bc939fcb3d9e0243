"""Pallas Mosaic GPU kernels (Hopper and newer, CUDA only): LayerNorm / RMSNorm rows, GroupNorm.

Mosaic GPU is the Pallas GPU backend JAX keeps (the Triton one is deprecated
from jax 0.11). It targets sm_90+ and runs one warpgroup (128 threads) per
CTA; data moves GMEM -> SMEM by TMA, SMEM -> registers by plain loads.

Design (``config.mosaic_gpu_plan`` has the numbers):

* Persistent grid: a few CTAs per SM (as many as their SMEM allows, at most
  ``mosaic_gpu_max_ctas_per_sm``); CTA ``p`` of parameter group ``w`` walks a
  contiguous range of that group's rows.
* Rows are streamed through SMEM by TMA, double-buffered: row ``i + 1`` is in
  flight while row ``i`` is computed (one buffer where two do not fit). A row
  is viewed as ``(chunks, width)``, width 128 or 256 (a TMA box side is at
  most 256 elements): one TMA copy per row and operand. The whole row sits in
  SMEM, so x (and dy) is read from HBM once; statistics and dx come from SMEM.
* Outputs (y, dx) are written to SMEM and stored by TMA, double-buffered too.
* dweight / dbias: float32 partial sums per CTA, kept in SMEM across its rows
  and stored once; the partials are summed over CTAs in a fixed order
  (``_fixed_order``: a pairwise tree in XLA, its HLO small for hundreds of
  CTAs): bitwise deterministic, no atomics.
* Rows whose length is not a multiple of the width are padded with zeros in
  XLA (the TMA box must match the SMEM buffer, and a copy must move a multiple
  of 128 bytes): an extra copy of x / dy for such shapes, none for the usual
  hidden sizes (multiples of 256). Padded columns are masked out of the
  variance; elsewhere their dy is 0 and contributes nothing.

Rows longer than SMEM holds (``mosaic_gpu_plan`` None beyond about 25K
elements forward and 10K backward in float32, 51K and 14K in 16-bit types)
are cut in pieces that fit (``config.mosaic_gpu_pieces``; "Long rows" below):
x and dy are then read twice, statistics (or c1, c2) first.

The residual form (``add_layer_norm`` / ``add_rms_norm``, ``FUSES_RESIDUAL``):
the forward streams the residual's row (x's dtype or float32) beside x's and
writes h (``h_dtype``) beside y, one TMA group per row; every pass reads the
float32 sum, so the statistics and y come from it unrounded and h is rounded
once. The backward streams dh beside x (here h) and dy and adds it to dx in
float32 before dx's rounding. The plans count these rows (``extra_bytes``),
so rows are single-buffered, or cut in pieces, sooner: whole rows up to
12.8K elements forward and 8.4K backward in float32 (25.6K and 12.8K in
16-bit types), double-buffered up to 5.1K and 4.6K (8.4K and 7.1K). The
pieces' forward moments are of the sum; their output kernels write h / add
dh. A budget too small even for pieces of 256 (``unsupported``) leaves the
problem to Triton, announced.

GroupNorm, both layouts (below), is two passes over rows (per-channel sums,
then the output), x read twice even where a segment would fit SMEM. NCHW rows
(HW) longer than SMEM holds are cut in pieces too; channels-last rows (C) must
fit SMEM whole (C beyond about 25K channels falls back to Triton).

Not here yet:

* The register chunk is one SMEM row (2 elements per thread); wider chunks
  (several SMEM rows per load) would cut loop overhead.
* Warp specialization (a producer warp issuing TMA, consumer warpgroups
  computing; ``emit_pipeline_warp_specialized``) would keep more bytes in
  flight than one warpgroup per CTA.

Blackwell (sm_100) would change little for a memory-bound kernel: the same
TMA and barriers apply; its larger L2 and TMA multicast over a CTA cluster
could share the parameter rows between CTAs, and TMEM is of no use without
matrix multiplies. On an H100 (jax 0.11.2) these kernels passed the op suites' default
classes; they have not been timed there yet (see docs/api.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_normgrad import _activations, _compat
from jax_normgrad.pallas import common, config

F32 = jnp.float32


#: The forward takes ``residual`` / ``h_dtype`` and the backward ``dh`` (``dispatch.forward``).
FUSES_RESIDUAL = True


def unsupported(seg: common.Segments, itemsize: int, *, backward: bool,
                extra_bytes: int = 0) -> str | None:
  """Why these kernels cannot run ``seg`` (None when they can).

  ``extra_bytes``: the residual form's further streamed rows, bytes per
  element (``config.mosaic_gpu_plan``; rows only).
  """
  missing = _compat.mosaic_gpu_api_missing()
  if missing:
    return missing
  if seg.kind != "rows":
    if _GroupRows(seg).plans(itemsize, backward=backward) is None:
      return (f"rows of {seg.b} elements (the {'HW' if seg.chan_axis == 1 else 'C'} of GroupNorm) "
              f"do not fit the Mosaic GPU kernels' shared memory")
    return None
  kw = dict(backward=backward, extra_bytes=extra_bytes)
  if (config.mosaic_gpu_plan(seg.b, itemsize, **kw) is None
      and config.mosaic_gpu_pieces(seg.b, itemsize, **kw) is None):
    what = " with the residual form's rows" if extra_bytes else ""
    return (f"rows of {seg.b} elements{what} are longer than the Mosaic GPU kernels' pieces "
            "allow")
  return None


class _Launch:
  """Static geometry of one launch: CTAs per parameter group, their rows, the row view."""

  def __init__(self, seg: common.Segments, plan: config.MosaicGpuPlan, interpret, pieces=1):
    self.seg, self.plan, self.interpret, self.pieces = seg, plan, bool(interpret), pieces
    target = config.mosaic_gpu_ctas(plan, interpret=self.interpret)
    groups = seg.param_groups * pieces
    self.ctas, self.per_cta = config.split(seg.per_group, max(target // groups, 1))
    self.grid = (groups * self.ctas,)

  def rows(self):
    """``(w, p, start, end)``: this CTA's parameter row, index and rows ``[start, end)``.

    With ``pieces`` (long rows), ``w = group * pieces + piece``: the CTA
    handles one piece of its rows, whose parameters are row w of the
    parameters viewed as ``(W * pieces, chunks, width)`` (``piece(w)``).
    """
    cta = lax.axis_index("cta")
    w, p = lax.div(cta, self.ctas), lax.rem(cta, self.ctas)
    group = w if self.pieces == 1 else lax.div(w, self.pieces)
    start = group * self.seg.per_group + p * self.per_cta
    return w, p, start, jnp.minimum(start + self.per_cta, (group + 1) * self.seg.per_group)

  def piece(self, w):
    """The piece of a row that CTA row ``w`` (from ``rows``) handles; None without pieces."""
    return None if self.pieces == 1 else lax.rem(w, self.pieces)

  def view(self, a):
    """``(..., b)`` -> ``(..., chunks, width)``, zero-padded to a whole number of chunks."""
    if a is None:
      return None
    pad = self.plan.padded - a.shape[-1]
    if pad:
      a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a.reshape(a.shape[:-1] + (self.plan.chunks, self.plan.width))

  def unview(self, a):
    """The inverse of ``view`` for a ``(rows, chunks, width)`` result."""
    return a.reshape(a.shape[0], self.plan.padded)[:, :self.seg.b]

  def staged(self, n_params) -> bool:
    """Whether the kernel has SMEM buffers (and a barrier) for its ``n_params`` parameter rows."""
    return bool(n_params) and self.plan.params_in_smem

  def smem(self, count, dtype):
    """``count`` SMEM buffers of one row each (leading axis), ``mosaic_gpu`` types."""
    plgpu = _compat.plgpu()
    return plgpu.SMEM((count, self.plan.chunks, self.plan.width), dtype)

  def call(self, kernel, out_shape, scratch, *operands, interpret, name):
    """``plgpu.kernel`` over this launch's grid; None operands are left out."""
    plgpu = _compat.plgpu()
    operands = [a for a in operands if a is not None]
    return plgpu.kernel(kernel, out_type=common.typed_like(out_shape, operands),
                        scratch_types=scratch, grid=self.grid, grid_names=("cta",),
                        interpret=_compat.mosaic_gpu_interpret(interpret),
                        kernel_name=name)(*operands)

  def loop(self, body, init):
    """``body(k, carry)`` over the chunks of a row."""
    return lax.fori_loop(0, self.plan.chunks, body, init)

  def sum_chunks(self, term):
    """``sum_k term(k)`` over the chunks of a row, elementwise (term: a tuple of arrays).

    The first term is the initial carry: a loop carry keeps its register
    layout, and a zeros array would have a different one (splat).
    """
    add = lambda k, acc: tuple(a + t for a, t in zip(acc, term(k)))
    return lax.fori_loop(1, self.plan.chunks, add, term(0))

  def in_row(self, k, length=None):
    """Mask of the chunk-k elements inside the (unpadded) row; None without padding.

    ``length``: the row's valid length where it varies (a traced scalar).
    """
    if length is None and self.plan.padded == self.seg.b:
      return None
    length = self.seg.b if length is None else length
    width = self.plan.width
    if self.interpret:  # GPU interpret mode has no rule for layout casts
      iota = lax.broadcasted_iota(jnp.int32, (width,), 0)
    else:  # the layout of a chunk loaded from SMEM: 128 threads, width / 128 each
      plgpu = _compat.plgpu()
      iota = plgpu.broadcasted_iota(jnp.int32, (width,), 0,
                                    layout=plgpu.Layout.WG_STRIDED((width,), width // 128))
    return iota < length - k * width


def _barrier(arrivals, count=1):
  plgpu = _compat.plgpu()
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=count)


def _params(launch, srcs, buf, barrier, w):
  """``read(k)``: chunk k of this CTA's parameter rows (None where absent).

  With ``plan.params_in_smem`` the rows are TMA-loaded into ``buf[j]`` once per
  CTA (waited for here); else each chunk is loaded from GMEM as it is needed
  (L2-resident: every CTA reads the same rows), which leaves the SMEM to the
  rows of long inputs.
  """
  plgpu = _compat.plgpu()
  present = [s for s in srcs if s is not None]
  if not launch.plan.params_in_smem:
    return lambda k: [None if s is None else s[w, k] for s in srcs]
  for j, src in enumerate(present):
    plgpu.copy_gmem_to_smem(src.at[w], buf.at[j], barrier.at[0])
  if present:
    plgpu.barrier_wait(barrier.at[0])

  def read(k):
    out, j = [], 0
    for src in srcs:
      out.append(None if src is None else buf[j, k])
      j += src is not None
    return out

  return read


def _stream(launch, srcs, bufs, barrier, start, end, body, piece=None):
  """Calls ``body(i, slot)`` for rows ``[start, end)`` with ``srcs[.][i]`` in ``bufs[.][slot]``.

  ``piece``: the sources are ``(rows, pieces, chunks, width)``; ``[i, piece]`` is streamed.
  A None source (an absent optional operand, such as the residual) is left
  out; ``barrier`` expects one arrival per present source.

  With two stages row ``i + 1`` is fetched by TMA while row ``i`` is
  computed; with one, after it. The slot being refilled was last read by the
  previous row, whose SMEM stores (Pallas places a warpgroup barrier after
  each) follow all its reads.
  """
  plgpu = _compat.plgpu()
  stages = launch.plan.stages
  srcs, bufs = zip(*[(s, b) for s, b in zip(srcs, bufs) if s is not None])

  def fetch(i, slot):
    for src, buf in zip(srcs, bufs):
      plgpu.copy_gmem_to_smem(_at(src, i, piece), buf.at[slot], barrier.at[slot])

  @pl.when(start < end)
  def _():
    fetch(start, 0)

  def row(i, carry):
    slot = lax.rem(i - start, stages)
    if stages == 2:
      @pl.when(i + 1 < end)
      def _():
        fetch(i + 1, 1 - slot)
    plgpu.barrier_wait(barrier.at[slot])
    body(i, slot)
    if stages == 1:
      @pl.when(i + 1 < end)
      def _():
        fetch(i + 1, 0)
    return carry

  lax.fori_loop(start, end, row, 0)


def _at(ref, i, piece):
  """``ref.at[i]``, or ``ref.at[i, piece]`` for a piece of a long row."""
  return ref.at[i] if piece is None else ref.at[i, piece]


def _store_row(launch, bufs, slot, dsts, i, piece=None):
  """TMA-stores the output rows in ``bufs[.][slot]`` to ``dsts[.][i]`` (waited for before reuse).

  None outputs are left out. The copies of one row form one bulk-copy group
  (the last commits it), so ``_wait_output_slot`` counts rows, however many
  outputs each has (y, and h in the residual form).
  """
  del launch
  plgpu = _compat.plgpu()
  pairs = [(b, d) for b, d in zip(bufs, dsts) if b is not None]
  plgpu.commit_smem()
  for j, (buf, dst) in enumerate(pairs):
    plgpu.copy_smem_to_gmem(buf.at[slot], _at(dst, i, piece), commit_group=j == len(pairs) - 1)


def _wait_output_slot(launch):
  """Before writing an output slot: the stores issued from it ``stages`` rows ago have read it."""
  _compat.plgpu().wait_smem_to_gmem(launch.plan.stages - 1, wait_read_only=True)


# ----------------------------------------------------------------------------
# Forward: y, mean, rstd


def _fwd_kernel(*refs, launch: _Launch, eps: float, has_weight: bool, has_bias: bool,
                given: bool = False, has_residual: bool = False):
  """Per row: statistics from the row in SMEM (two passes, exact), then ``y`` to SMEM and HBM.

  ``given``: the statistics are inputs (pieces of long rows, ``_long_forward``).
  ``has_residual``: the residual row is streamed beside x's; every pass
  reads their float32 sum, so the statistics and y come from it unrounded,
  and the pass that writes y also writes it as h (rounded once to h's dtype),
  stored with y.
  """
  seg = launch.seg
  staged = launch.staged(has_weight + has_bias)
  (x_ref, r_ref, w_ref, b_ref, gmean_ref, grstd_ref, y_ref, mean_ref, rstd_ref, h_ref, xs, rs, ys,
   hs, ps, bar, pbar) = common.unpack(
       refs, True, has_residual, has_weight, has_bias, given and seg.centered, given, True,
       not given and seg.centered, not given, has_residual, True, has_residual, True,
       has_residual, staged, True, staged)
  w, _, start, end = launch.rows()
  piece = launch.piece(w)
  params = _params(launch, (w_ref, b_ref), ps, pbar, w)

  def row(i, slot):
    load = _row_loader(xs, rs, slot)
    if given:
      mean = gmean_ref[i, 0] if seg.centered else None
      rstd = grstd_ref[i, 0]
    elif seg.centered:
      mean = jnp.sum(launch.sum_chunks(lambda k: (load(k),))[0]) / seg.b

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
      rstd = lax.rsqrt(jnp.sum(launch.sum_chunks(square)[0]) / seg.b + jnp.float32(eps))
    _wait_output_slot(launch)

    def write(k, carry):
      x = load(k)
      if has_residual:
        hs[slot, k] = x.astype(hs.dtype)
      ys[slot, k] = common.normalize(x - mean if seg.centered else x, rstd,
                                     *params(k)).astype(ys.dtype)
      return carry

    launch.loop(write, 0)
    _store_row(launch, (ys, hs), slot, (y_ref, h_ref), i, piece)
    if not given:
      if seg.centered:
        mean_ref[i, 0] = mean
      rstd_ref[i, 0] = rstd

  _stream(launch, (x_ref, r_ref), (xs, rs), bar, start, end, row, piece)
  _compat.plgpu().wait_smem_to_gmem(0)


def _row_loader(xs, rs, slot):
  """``load(k)``: chunk k of the row in ``xs[slot]`` as float32, plus the residual's (``rs``) if any."""
  if rs is None:
    return lambda k: xs[slot, k].astype(F32)
  return lambda k: xs[slot, k].astype(F32) + rs[slot, k].astype(F32)


def _residual_bytes(residual, h_dtype) -> int:
  """Bytes per element of the residual form's further forward rows (residual, h): ``extra_bytes``."""
  if residual is None:
    return 0
  return residual.dtype.itemsize + jnp.dtype(h_dtype).itemsize


def _fwd_scratch(launch: _Launch, plan, x_dtype, n_params: int, r_dtype=None, h_dtype=None):
  """The row forward kernel's SMEM: x (and residual) stages, y (and h) stages, the parameters,
  barriers (``r_dtype``, ``h_dtype``: the residual form's)."""
  scratch = [launch.smem(plan.stages, x_dtype)]
  if r_dtype is not None:
    scratch.append(launch.smem(plan.stages, r_dtype))
  scratch.append(launch.smem(plan.stages, x_dtype))
  if r_dtype is not None:
    scratch.append(launch.smem(plan.stages, h_dtype))
  if launch.staged(n_params):
    scratch.append(launch.smem(n_params, F32))
  scratch.append(_barrier(1 + (r_dtype is not None), plan.stages))
  if launch.staged(n_params):
    scratch.append(_barrier(n_params))
  return scratch


def forward(x, *operands, seg: common.Segments, eps: float, interpret, h_dtype=None,
            y_dtype=None):
  """``(y, mean | None, rstd)`` of LayerNorm / RMSNorm rows or GroupNorm; see ``dispatch.forward``.

  ``y_dtype`` (a 16-bit y of a float32 x): these kernels write y in x's
  dtype; it is rounded to ``y_dtype`` in an XLA pass after them.

  The residual form (rows): ``(x, residual, weight, bias)`` and ``h_dtype``
  give ``(y, mean | None, rstd, h)``, h = x + residual in float32 rounded
  once to ``h_dtype``, the statistics and y from the unrounded sum.
  """
  if y_dtype is not None:
    y, *rest = forward(x, *operands, seg=seg, eps=eps, interpret=interpret, h_dtype=h_dtype)
    return (y.astype(y_dtype), *rest)
  has_residual = h_dtype is not None
  residual, weight, bias = operands if has_residual else (None, *operands)
  if seg.kind != "rows":
    assert not has_residual, "the residual form is rows only"
    return _group_forward(x, weight, bias, seg=seg, eps=eps, interpret=interpret)
  n_params = (weight is not None) + (bias is not None)
  plan = config.mosaic_gpu_plan(seg.b, x.dtype.itemsize, backward=False, params=n_params,
                                extra_bytes=_residual_bytes(residual, h_dtype))
  if plan is None:
    return _long_forward(x, residual, weight, bias, seg=seg, eps=eps, interpret=interpret,
                         h_dtype=h_dtype)
  launch = _Launch(seg, plan, interpret)
  view = lambda a: None if a is None else launch.view(a.reshape(seg.n, seg.b))
  stats = jax.ShapeDtypeStruct((seg.n, 1), F32)
  out_rows = lambda dtype: jax.ShapeDtypeStruct((seg.n, plan.chunks, plan.width), dtype)
  scratch = _fwd_scratch(launch, plan, x.dtype, n_params,
                         *((residual.dtype, h_dtype) if has_residual else ()))
  kernel = functools.partial(_fwd_kernel, launch=launch, eps=eps, has_weight=weight is not None,
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


def _bwd_kernel(*refs, launch: _Launch, mask: tuple[bool, bool, bool], has_gamma: bool,
                given: bool = False, has_dh: bool = False):
  """Per row: ``c1``, ``c2`` from the row in SMEM, then dx and the partial sums in one pass.

  The partials of ``sum dy * xhat`` and ``sum dy`` live in SMEM (one row each,
  float32) across the CTA's rows and are stored once, as its partial row.
  ``given``: c1, c2 are inputs (pieces of long rows, ``_long_backward``).
  ``has_dh`` (needs ``mask[0]``): h's cotangent, streamed beside x and dy, is
  added to dx in float32 before dx's one rounding.
  """
  seg = launch.seg
  n_acc = mask[1] + mask[2]
  given = given and mask[0]
  (dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, c1_ref, c2_ref, dh_ref, dx_ref, dw_ref, db_ref,
   xs, dys, dhs, dxs, gs, accs, bar, pbar) = common.unpack(
       refs, True, True, seg.centered, True, has_gamma, given and seg.centered, given, has_dh,
       *mask, True, True, has_dh, mask[0], launch.staged(has_gamma), n_acc > 0, True,
       launch.staged(has_gamma))
  w, p, start, end = launch.rows()
  piece = launch.piece(w)
  params = _params(launch, (gamma_ref,), gs, pbar, w)
  width = launch.plan.width
  zeros = jnp.zeros((width,), F32)
  if n_acc:
    def clear(k, carry):
      for j in range(n_acc):
        accs[j, k] = zeros
      return carry
    launch.loop(clear, 0)

  def row(i, slot):
    mean = mean_ref[i, 0] if seg.centered else None
    rstd = rstd_ref[i, 0]

    def tile(k):
      gamma, = params(k)
      dy = dys[slot, k].astype(F32)
      xhat, g = common.xhat_and_g(xs[slot, k].astype(F32), dy, mean, rstd, gamma)
      return dy, xhat, g  # padded columns: dy = g = 0

    if given:
      c1 = c1_ref[i, 0] if seg.centered else None
      c2 = c2_ref[i, 0]
      _wait_output_slot(launch)
    elif mask[0]:
      def means(k):
        _, xhat, g = tile(k)
        return (g, g * xhat)
      s1, s2 = launch.sum_chunks(means)
      c1 = jnp.sum(s1) / seg.b if seg.centered else None
      c2 = jnp.sum(s2) / seg.b
      _wait_output_slot(launch)

    def chunk(k, carry):
      dy, xhat, g = tile(k)
      if mask[0]:
        dx = common.grad_input(g, xhat, c1, c2, rstd)
        if has_dh:
          dx = dx + dhs[slot, k].astype(F32)
        dxs[slot, k] = dx.astype(dxs.dtype)
      terms = [t for t, want in ((dy * xhat, mask[1]), (dy, mask[2])) if want]
      for j, t in enumerate(terms):
        accs[j, k] = accs[j, k] + t
      return carry

    launch.loop(chunk, 0)
    if mask[0]:
      _store_row(launch, (dxs,), slot, (dx_ref,), i, piece)

  _stream(launch, (x_ref, dy_ref, dh_ref), (xs, dys, dhs), bar, start, end, row, piece)
  plgpu = _compat.plgpu()
  if n_acc:
    plgpu.commit_smem()
    for j, ref in enumerate(r for r in (dw_ref, db_ref) if r is not None):
      plgpu.copy_smem_to_gmem(accs.at[j], ref.at[w, p])
  plgpu.wait_smem_to_gmem(0)


def _bwd_scratch(launch: _Launch, plan, x_dtype, dy_dtype, mask, has_gamma: bool, n_acc: int,
                 dh_dtype=None):
  """The row backward kernel's SMEM: x, dy (and dh, dx) stages, gamma, the partials, barriers."""
  scratch = [launch.smem(plan.stages, x_dtype), launch.smem(plan.stages, dy_dtype)]
  if dh_dtype is not None:
    scratch.append(launch.smem(plan.stages, dh_dtype))
  if mask[0]:
    scratch.append(launch.smem(plan.stages, x_dtype))
  if launch.staged(has_gamma):
    scratch.append(launch.smem(1, F32))
  if n_acc:
    scratch.append(launch.smem(n_acc, F32))
  scratch.append(_barrier(2 + (dh_dtype is not None), plan.stages))
  if launch.staged(has_gamma):
    scratch.append(_barrier(1))
  return scratch


def backward(dy, x, mean, rstd, gamma, beta=None, dh=None, *, seg: common.Segments, mask,
             interpret):
  """``(dx | None, dgamma | None, dbeta | None)`` of LayerNorm / RMSNorm rows or GroupNorm.

  See ``dispatch.backward``; ``beta`` only with GroupNorm's fused activation;
  ``dh`` (the residual form, rows; needs ``mask[0]``) is added to dx in
  float32 before its rounding.
  """
  if seg.kind != "rows":
    assert dh is None, "the residual form is rows only"
    return _group_backward(dy, x, mean, rstd, gamma, beta, seg=seg, mask=mask,
                           interpret=interpret)
  if dh is not None and not mask[0]:
    raise ValueError("dh needs dx (mask[0])")
  has_gamma = gamma is not None
  n_acc = mask[1] + mask[2]
  dh_bytes = 0 if dh is None else dh.dtype.itemsize
  plan = config.mosaic_gpu_plan(seg.b, x.dtype.itemsize, backward=True, params=int(has_gamma),
                                outputs=int(mask[0]), partials=n_acc, extra_bytes=dh_bytes)
  if plan is None:
    return _long_backward(dy, x, mean, rstd, gamma, dh, seg=seg, mask=mask, interpret=interpret)
  launch = _Launch(seg, plan, interpret)
  view = lambda a: None if a is None else launch.view(a.reshape(seg.n, seg.b))
  scratch = _bwd_scratch(launch, plan, x.dtype, dy.dtype, mask, has_gamma, n_acc,
                         None if dh is None else dh.dtype)
  partial = jax.ShapeDtypeStruct((seg.param_groups, launch.ctas, plan.chunks, plan.width), F32)
  out_shape = ([jax.ShapeDtypeStruct((seg.n, plan.chunks, plan.width), x.dtype)]
               if mask[0] else []) + [partial] * n_acc
  outs = list(launch.call(
      functools.partial(_bwd_kernel, launch=launch, mask=mask, has_gamma=has_gamma,
                        has_dh=dh is not None), out_shape,
      scratch, view(dy), view(x), mean, rstd, launch.view(gamma), view(dh), interpret=interpret,
      name="jax_normgrad_norm_bwd"))
  dx = launch.unview(outs.pop(0)).reshape(x.shape) if mask[0] else None
  sums = []
  for m in mask[1:]:
    if m:
      part = outs.pop(0)
      part = part.reshape(part.shape[:2] + (plan.padded,))[..., :seg.b]
      sums.append(_ordered_sum(part, 1))
    else:
      sums.append(None)
  return (dx, *sums)


# ----------------------------------------------------------------------------
# GroupNorm: a sums kernel, a fixed-order combination in XLA, an apply kernel.
#
# A GroupNorm segment (sample i, group g) is not a row: in NCHW it is cg rows
# of HW (one per channel), in channels-last HW rows of C restricted to cg
# columns, and a sample of either is usually larger than SMEM. So both
# layouts are two streaming passes over rows, each row read by TMA into SMEM
# as in the LayerNorm kernels:
#
# 1. Sums per (sample, channel) over the spatial axis: the moments (mean and
#    sum of squared deviations) forward; ``sum dy`` and ``sum dy * xhat``
#    backward. NCHW: a row is one (i, c), reduced in SMEM (two passes for the
#    variance, exact). Channels-last: a row is one (i, hw); the CTAs of sample
#    i each own a range of its rows and keep per-column float32 accumulators
#    in SMEM (Welford's update forward, exact to rounding), stored once as the
#    CTA's partial row.
# 2. In XLA, on (N, C)-sized arrays, in a fixed order (``_ordered_sum``, Chan's
#    merge ``common.combine_moments``): CTA partials -> per (i, c) -> per group
#    (statistics; ``c1``, ``c2``) and -> per parameter group (dgamma, dbeta).
#    No atomics: bitwise deterministic.
# 3. The apply kernel: ``out = (x - M) * Q + R [+ dy * P]`` with per-(i, c)
#    coefficients (a scalar per NCHW row; per channels-last sample a vector,
#    staged in SMEM once per CTA): y, or dx = rstd * (dy * gamma - c1 - xhat * c2).
#
# x (and dy) are read twice, where the Triton kernels read a segment that
# fits their tile once. An NCHW segment of cg * HW elements often fits SMEM
# (320 channels in 32 groups at 32x32: 40 KiB in float32): a fused kernel
# holding a whole segment would read x once there (the next step).


class _GroupRows:
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
    self.rows = common.Segments("rows", seg.n * seg.a, 1, seg.b, groups=1,
                                param_groups=1 if self.per_row else seg.n)
    self.spatial = seg.b if self.per_row else seg.a

  def _cut(self, pieces: int, length: int):
    seg = self.gn
    self.pieces = pieces
    self.rows = common.Segments("rows", seg.n * seg.a * pieces, 1, length, groups=1,
                                param_groups=1)
    self.tail = seg.b - (pieces - 1) * length

  def plans(self, itemsize: int, *, backward: bool, mask=(True, True, True), has_r: bool = True):
    """``(sums plan, apply plan | None)``: the SMEM layouts of the two kernels' rows.

    None when a row does not fit (a CTA holds a whole row). Channels-last
    counts the coefficient rows staged in SMEM (the activation's gamma, beta
    and rstd backward at most).
    """
    h = self.rows.b
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
    a = a.reshape(-1, self.gn.b)
    pad = self.pieces * self.rows.b - self.gn.b
    if pad:
      a = jnp.pad(a, [(0, 0), (0, pad)])
    return a.reshape(self.rows.n, self.rows.b)

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
    return [float(self.rows.b)] * (self.pieces - 1) + [float(self.tail)]

  def expand(self, a):
    """``(N, G)`` -> ``(N, C)``: a per-group value for each of the group's channels."""
    return jnp.repeat(a, self.gn.cg, axis=1)

  def per_sample(self, p):
    """``(W, C)`` parameters (None: ones) -> ``(N, C)`` float32, sample i's parameter row."""
    seg = self.gn
    if p is None:
      return None
    return jnp.repeat(p.astype(F32), seg.per_group, axis=0)


#: Up to this many terms a fixed-order reduction in XLA (``_fixed_order``) is a chain; more,
#: a pairwise tree.
_CHAIN_TERMS = 16


def _fixed_order(parts, combine):
  """``parts`` (a tuple of arrays, the terms along axis 0) reduced by ``combine`` in a fixed order.

  Up to ``_CHAIN_TERMS`` terms: in index order, one after another. More: a
  pairwise tree, terms (0, 1), (2, 3), ... combined level by level, an odd
  last one carried up unchanged. Either way XLA is given a fixed expression
  of elementwise ops, which it does not reassociate, so the result is
  bitwise reproducible (unlike a ``reduce``, whose order is the compiler's).
  The tree's HLO grows with log2 of the terms, not with their number: as a
  chain, the row backward's 500-odd CTA partials were 3K HLO ops (1022 adds,
  1024 slices) around a kernel of 1.9K ops, and that backward compiled in
  11-14 s on an H200 (jax 0.11.2), where the forward (a kernel of 1.5K ops,
  no partials) compiled in 0.3 s (``benchmarks/gpu_mosaic_probe.py``); with
  the tree, 0.52 s on an H100 (2026-11-27). A
  ``fori_loop`` instead is an XLA while loop: a kernel launch per term.
  """
  n = parts[0].shape[0]
  if n <= _CHAIN_TERMS:
    state = tuple(p[0] for p in parts)
    for j in range(1, n):
      state = combine(state, tuple(p[j] for p in parts))
    return state
  while n > 1:
    even = n - n % 2
    merged = combine(tuple(p[0:even:2] for p in parts), tuple(p[1:even:2] for p in parts))
    if n % 2:
      merged = tuple(jnp.concatenate([m, p[even:]]) for m, p in zip(merged, parts))
    parts, n = merged, (n + 1) // 2
  return tuple(p[0] for p in parts)


def _ordered_sum(a, axis: int):
  """``a`` summed over ``axis`` in a fixed order (``_fixed_order``): bitwise reproducible."""
  total, = _fixed_order((jnp.moveaxis(a, axis, 0),), lambda x, y: (x[0] + y[0],))
  return total


def _coef_reader(launch, rows: _GroupRows, refs, buf, barrier, w):
  """``at_row(i)`` -> ``read(k)``: the coefficient refs' values for row i, chunk k (None where absent).

  NCHW: the scalars of row i, loaded once per row. Channels-last: chunk k of
  sample w's vectors (``_params``: staged in SMEM or read from GMEM).
  """
  if rows.per_row:
    def at_row(i):
      values = [None if r is None else r[i, 0] for r in refs]
      return lambda k: values
    return at_row
  read = _params(launch, refs, buf, barrier, w)
  return lambda i: read


def _gn_sums_kernel(*refs, launch: _Launch, rows: _GroupRows, backward: bool,
                    pieces: int = 1, tail: int = 0, param_rows: int | None = None,
                    activation: str | None = None, act_params: tuple[bool, bool] = (False, False),
                    has_residual: bool = False):
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

  ``has_residual`` (forward): the moments are of the float32 sum of x's rows
  and the residual's, streamed beside them (the residual form's long rows).
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
  length = launch.seg.b
  if columns:
    zeros = jnp.zeros((launch.plan.width,), F32)

    def clear(k, carry):
      accs[0, k] = zeros
      accs[1, k] = zeros
      return carry

    launch.loop(clear, 0)

  def row(i, slot):
    load = _row_loader(xs, rs, slot)
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

  _stream(launch, (x_ref, r_ref, dy_ref), (xs, rs, dys), bar, start, end, row)
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


def _gn_sums(rows: _GroupRows, plan, x, dy, m, s, *, interpret, activation=None, ag=None,
             ab=None):
  """The sums kernel: two ``(N, C)`` float32 arrays, and the CTAs' row counts (channels-last).

  Channels-last returns the CTA partials ``(N, P, C)`` and their row counts ``(P,)``.
  ``activation``, ``ag``, ``ab``: GroupNorm's fused activation and its per-(i, c) gamma, beta.
  """
  backward = dy is not None
  launch = _Launch(rows.rows, plan, interpret)
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
  scratch.append(_barrier(1 + backward, plan.stages))
  if staged:
    scratch.append(_barrier(n_coef))
  if rows.per_row:
    out = jax.ShapeDtypeStruct((rows.rows.n, 1), F32)
  else:
    out = jax.ShapeDtypeStruct((rows.gn.n, launch.ctas, plan.chunks, plan.width), F32)
  coef = rows.coef if rows.per_row else launch.view
  kernel = functools.partial(_gn_sums_kernel, launch=launch, rows=rows, backward=backward,
                             activation=activation, act_params=(ag is not None, ab is not None),
                             pieces=rows.pieces, tail=getattr(rows, "tail", 0))
  a, b = launch.call(
      kernel, [out, out], scratch, view(x), None if dy is None else view(dy),
      *(coef(a) for a in (m, s, ag, ab)), interpret=interpret,
      name="jax_normgrad_norm_bwd_sums" if backward else "jax_normgrad_norm_fwd_stats")
  counts = [min(launch.per_cta, rows.spatial - p * launch.per_cta) for p in range(launch.ctas)]
  return rows.per_channel(launch, a), rows.per_channel(launch, b), counts


def _gn_apply_kernel(*refs, launch: _Launch, rows: _GroupRows, has_dy: bool, has_r: bool,
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

  def row(i, slot):
    coefs = at_row(i)
    _wait_output_slot(launch)

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
      outs[slot, k] = v.astype(outs.dtype)
      return carry

    launch.loop(write, 0)
    _store_row(launch, (outs,), slot, (out_ref,), i)

  srcs = (x_ref, dy_ref) if has_dy else (x_ref,)
  _stream(launch, srcs, (xs, dys) if has_dy else (xs,), bar, start, end, row)
  _compat.plgpu().wait_smem_to_gmem(0)


def _gn_apply(rows: _GroupRows, plan, x, dy, m, q, r, p, *, interpret, activation=None,
              act=(None, None, None)):
  """The apply kernel over x's rows (and dy's): a result like x.

  ``act``: the per-(i, c) rstd, gamma, beta of the backward's activation.
  """
  has_dy = dy is not None
  launch = _Launch(rows.rows, plan, interpret)
  act_params = tuple(a is not None for a in act)
  n_coef = 2 + (r is not None) + has_dy + sum(act_params)
  staged = not rows.per_row and launch.staged(n_coef)
  view = lambda a: launch.view(rows.rows_of(a))
  scratch = [launch.smem(plan.stages, x.dtype)]
  if has_dy:
    scratch.append(launch.smem(plan.stages, dy.dtype))
  scratch.append(launch.smem(plan.stages, x.dtype))
  if staged:
    scratch.append(launch.smem(n_coef, F32))
  scratch.append(_barrier(1 + has_dy, plan.stages))
  if staged:
    scratch.append(_barrier(n_coef))
  coef = rows.coef if rows.per_row else launch.view
  out, = launch.call(
      functools.partial(_gn_apply_kernel, launch=launch, rows=rows, has_dy=has_dy,
                        has_r=r is not None, activation=activation, act_params=act_params),
      [jax.ShapeDtypeStruct((rows.rows.n, plan.chunks, plan.width), x.dtype)], scratch,
      view(x), None if dy is None else view(dy), *(coef(a) for a in (m, q, r, p) + tuple(act)),
      interpret=interpret, name="jax_normgrad_norm_bwd" if has_dy else "jax_normgrad_norm_fwd")
  out = out.reshape(-1, rows.pieces * plan.padded)[:, :rows.gn.b]
  return out.reshape(x.shape)


def _moments(rows: _GroupRows, a, b, counts):
  """Per (i, c) ``(mean, M2)`` over the spatial axis from the sums kernel's forward outputs.

  Channels-last: the CTA partials merged in a fixed order (Chan's formula,
  ``_fixed_order``); NCHW rows in pieces: the pieces, in order.
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
  _, mean, m2 = _fixed_order((counts, jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0)),
                             common.combine_moments)
  return mean, m2


def _group_forward(x, weight, bias, *, seg: common.Segments, eps: float, interpret):
  """GroupNorm ``(y, mean, rstd)``: sums, statistics in XLA, then y."""
  rows = _GroupRows(seg)
  has_r = bias is not None
  sums_plan, apply_plan = rows.plans(x.dtype.itemsize, backward=False, has_r=has_r)
  a, b, counts = _gn_sums(rows, sums_plan, x, None, None, None, interpret=interpret)
  mean_c, m2_c = _moments(rows, a, b, counts)
  # Groups: cg parts of equal count (HW) each, merged exactly.
  shape = (seg.n, seg.groups, seg.cg)
  mc = mean_c.reshape(shape)
  mean = _ordered_sum(mc, 2) / seg.cg
  m2 = _ordered_sum(m2_c.reshape(shape) + rows.spatial * jnp.square(mc - mean[..., None]), 2)
  rstd = lax.rsqrt(m2 / seg.count + jnp.float32(eps))
  q = rows.expand(rstd)
  weight = rows.per_sample(weight)
  if weight is not None:
    q = q * weight
  y = _gn_apply(rows, apply_plan, x, None, rows.expand(mean), q, rows.per_sample(bias), None,
                interpret=interpret, activation=seg.activation)
  return y, mean, rstd


def _group_backward(dy, x, mean, rstd, gamma, beta, *, seg: common.Segments, mask, interpret):
  """GroupNorm ``(dx | None, dgamma | None, dbeta | None)``: sums, reductions in XLA, then dx.

  With a fused activation both kernels take dy as ``dy * act'(z)``, z
  recomputed from x and the per-(i, c) rstd, gamma, beta; dgamma and dbeta
  are then of z's cotangent, as the primitive defines them.
  """
  rows = _GroupRows(seg)
  sums_plan, apply_plan = rows.plans(x.dtype.itemsize, backward=True, mask=mask)
  m, s = rows.expand(mean), rows.expand(rstd)
  activation = seg.activation
  ag = ab = None
  if activation is not None:
    ag, ab = rows.per_sample(gamma), rows.per_sample(beta)
  s_dy, s_dyx, _ = _gn_sums(rows, sums_plan, x, dy, m, s, interpret=interpret,
                            activation=activation, ag=ag, ab=ab)
  if not rows.per_row:  # CTA partials, in a fixed order
    s_dy, s_dyx = _ordered_sum(s_dy, 1), _ordered_sum(s_dyx, 1)
  elif rows.pieces > 1:  # pieces, in order
    s_dy, s_dyx = _ordered_sum(s_dy, 2), _ordered_sum(s_dyx, 2)
  per_group = lambda a: _ordered_sum(a.reshape(seg.param_groups, seg.per_group, -1), 1)
  dgamma = per_group(s_dyx) if mask[1] else None
  dbeta = per_group(s_dy) if mask[2] else None
  dx = None
  if mask[0]:
    g = rows.per_sample(gamma)
    s_g, s_gx = (s_dy, s_dyx) if g is None else (s_dy * g, s_dyx * g)
    shape = (seg.n, seg.groups, seg.cg)
    c1 = rows.expand(_ordered_sum(s_g.reshape(shape), 2) / seg.count)
    c2 = rows.expand(_ordered_sum(s_gx.reshape(shape), 2) / seg.count)
    # dx = rstd * (dy * gamma - c1 - xhat * c2), xhat = (x - mean) * rstd.
    p = s if g is None else s * g
    act = (s, ag, ab) if activation is not None else (None, None, None)
    dx = _gn_apply(rows, apply_plan, x, dy, m, -(s * s * c2), -(s * c1), p, interpret=interpret,
                   activation=activation, act=act)
  return dx, dgamma, dbeta


# ----------------------------------------------------------------------------
# Long LayerNorm / RMSNorm rows: pieces, statistics through XLA.
#
# A row longer than SMEM holds (``mosaic_gpu_plan`` None) is cut into
# ``pieces`` pieces of ``plan.padded`` elements (the last one zero-padded),
# each a row to the kernels, the parameters of piece j being columns
# ``[j * L, (j + 1) * L)``; x (and dy) are read twice:
#
# * forward: the moments of each piece (the GroupNorm sums kernel, the last
#   piece's count masked), merged over the pieces in order (Chan) in XLA,
#   then the row kernel with these statistics given writes y;
# * backward: ``sum g`` and ``sum g * xhat`` of each piece, summed over the
#   pieces in order in XLA (c1, c2), then the row kernel with c1, c2 given
#   writes dx and its float32 partials per (parameter row, piece, CTA).


class _PieceRows:
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


def _piece_sums(seg, pieces, plan, x4, dy4, mean, rstd, gamma4, *, interpret, r4=None):
  """The sums kernel over the pieces: two ``(rows, pieces)`` float32 arrays.

  ``r4`` (forward): the residual's pieces; the moments are of ``x + residual``.
  """
  rows = _PieceRows(seg, pieces, plan.padded)
  backward = dy4 is not None
  launch = _Launch(rows.rows, plan, interpret)
  flat = lambda a: None if a is None else a.reshape(rows.rows.n, plan.chunks, plan.width)
  scratch = [launch.smem(plan.stages, x4.dtype)]
  if r4 is not None:
    scratch.append(launch.smem(plan.stages, r4.dtype))
  if backward:
    scratch.append(launch.smem(plan.stages, dy4.dtype))
  scratch.append(_barrier(1 + backward + (r4 is not None), plan.stages))
  out = jax.ShapeDtypeStruct((rows.rows.n, 1), F32)
  gamma = None if gamma4 is None else gamma4.reshape(-1, plan.chunks, plan.width)
  kernel = functools.partial(_gn_sums_kernel, launch=launch, rows=rows, backward=backward,
                             pieces=pieces, tail=seg.b - (pieces - 1) * plan.padded,
                             param_rows=None if gamma is None else seg.per_group,
                             has_residual=r4 is not None)
  a, b = launch.call(kernel, [out, out], scratch, flat(x4), flat(r4), flat(dy4), rows.coef(mean),
                     rows.coef(rstd), gamma, interpret=interpret,
                     name="jax_normgrad_norm_bwd_sums" if backward else "jax_normgrad_norm_fwd_stats")
  return a.reshape(seg.n, pieces), b.reshape(seg.n, pieces)


def _long_forward(x, residual, weight, bias, *, seg: common.Segments, eps: float, interpret,
                  h_dtype=None):
  """``(y, mean | None, rstd)`` of rows too long for one CTA's SMEM.

  The residual form (``residual``, ``h_dtype``): the pieces' moments are of
  ``x + residual``, and the kernel writing y writes h too; ``(y, mean | None, rstd, h)``.
  """
  n_params = (weight is not None) + (bias is not None)
  has_residual = residual is not None
  r_bytes = residual.dtype.itemsize if has_residual else 0
  pieces, plan = config.mosaic_gpu_pieces(seg.b, x.dtype.itemsize, backward=False,
                                          params=n_params,
                                          extra_bytes=_residual_bytes(residual, h_dtype))
  length = plan.padded
  x4 = _pieces(x.reshape(seg.n, seg.b), pieces, plan)
  r4 = _pieces(residual.reshape(seg.n, seg.b), pieces, plan) if has_residual else None
  sums_plan = config.mosaic_gpu_plan(length, x.dtype.itemsize, backward=False, params=0,
                                     outputs=0, extra_bytes=r_bytes)
  means, m2s = _piece_sums(seg, pieces, sums_plan, x4, None, None, None, None,
                           interpret=interpret, r4=r4)
  counts = [float(length)] * (pieces - 1) + [float(seg.b - (pieces - 1) * length)]
  if seg.centered:
    state = (counts[0], means[:, 0], m2s[:, 0])
    for j in range(1, pieces):  # Chan's merge, in piece order
      state = common.combine_moments(state, (counts[j], means[:, j], m2s[:, j]))
    mean, m2 = state[1], state[2]
  else:  # the sum of squares: M2 + n * mean^2 per piece
    mean, m2 = None, _ordered_sum(m2s + jnp.asarray(counts, F32) * means * means, 1)
  rstd = lax.rsqrt(m2 / seg.b + jnp.float32(eps))
  stats = [a.reshape(seg.n, 1) for a in (mean, rstd) if a is not None]
  launch = _Launch(seg, plan, interpret, pieces=pieces)
  params = [None if a is None else _pieces(a, pieces, plan).reshape(-1, plan.chunks, plan.width)
            for a in (weight, bias)]
  scratch = _fwd_scratch(launch, plan, x.dtype, n_params,
                         *((residual.dtype, h_dtype) if has_residual else ()))
  kernel = functools.partial(_fwd_kernel, launch=launch, eps=eps, has_weight=weight is not None,
                             has_bias=bias is not None, given=True, has_residual=has_residual)
  out_shape = [jax.ShapeDtypeStruct(x4.shape, x.dtype)]
  if has_residual:
    out_shape.append(jax.ShapeDtypeStruct(x4.shape, h_dtype))
  outs = launch.call(kernel, out_shape, scratch, x4, r4, *params, *stats, interpret=interpret,
                     name="jax_normgrad_norm_fwd")
  y, *h = [a.reshape(seg.n, pieces * length)[:, :seg.b].reshape(x.shape) for a in outs]
  return (y, (stats[0] if seg.centered else None), stats[-1], *h)


def _long_backward(dy, x, mean, rstd, gamma, dh=None, *, seg: common.Segments, mask, interpret):
  """``(dx | None, dgamma | None, dbeta | None)`` of rows too long for one CTA's SMEM.

  ``dh`` (the residual form): added to dx by the kernel writing it, in float32.
  """
  has_gamma = gamma is not None
  n_acc = mask[1] + mask[2]
  pieces, plan = config.mosaic_gpu_pieces(seg.b, x.dtype.itemsize, backward=True,
                                          params=int(has_gamma), outputs=int(mask[0]),
                                          partials=n_acc,
                                          extra_bytes=0 if dh is None else dh.dtype.itemsize)
  length = plan.padded
  x4 = _pieces(x.reshape(seg.n, seg.b), pieces, plan)
  dy4 = _pieces(dy.reshape(seg.n, seg.b), pieces, plan)
  dh4 = None if dh is None else _pieces(dh.reshape(seg.n, seg.b), pieces, plan)
  gamma4 = None if gamma is None else _pieces(gamma, pieces, plan)
  cs = []
  if mask[0]:
    sums_plan = config.mosaic_gpu_plan(length, x.dtype.itemsize, backward=True, params=0,
                                       outputs=0, partials=0)
    m = mean if seg.centered else jnp.zeros_like(rstd)
    s1, s2 = _piece_sums(seg, pieces, sums_plan, x4, dy4, m, rstd, gamma4, interpret=interpret)
    if seg.centered:
      cs.append((_ordered_sum(s1, 1) / seg.b).reshape(seg.n, 1))
    cs.append((_ordered_sum(s2, 1) / seg.b).reshape(seg.n, 1))
  launch = _Launch(seg, plan, interpret, pieces=pieces)
  scratch = _bwd_scratch(launch, plan, x.dtype, dy.dtype, mask, has_gamma, n_acc,
                         None if dh is None else dh.dtype)
  groups = seg.param_groups * pieces
  partial = jax.ShapeDtypeStruct((groups, launch.ctas, plan.chunks, plan.width), F32)
  out_shape = ([jax.ShapeDtypeStruct(x4.shape, x.dtype)] if mask[0] else []) + [partial] * n_acc
  outs = list(launch.call(
      functools.partial(_bwd_kernel, launch=launch, mask=mask, has_gamma=has_gamma, given=True,
                        has_dh=dh is not None),
      out_shape, scratch, dy4, x4, mean, rstd,
      None if gamma4 is None else gamma4.reshape(-1, plan.chunks, plan.width), *cs, dh4,
      interpret=interpret, name="jax_normgrad_norm_bwd"))
  dx = None
  if mask[0]:
    dx = outs.pop(0).reshape(seg.n, pieces * length)[:, :seg.b].reshape(x.shape)
  sums = []
  for want in mask[1:]:
    if not want:
      sums.append(None)
      continue
    part = outs.pop(0).reshape(seg.param_groups, pieces, launch.ctas, length)
    part = jnp.moveaxis(part, 1, 2).reshape(seg.param_groups, launch.ctas, pieces * length)
    sums.append(_ordered_sum(part[..., :seg.b], 1))
  return (dx, *sums)
