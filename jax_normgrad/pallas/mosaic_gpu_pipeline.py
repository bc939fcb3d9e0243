"""What every Mosaic GPU kernel of the package stands on: TMA, shared memory, barriers.

* ``Launch``: the static geometry of one launch (the persistent grid, a
  CTA's rows, the ``(chunks, width)`` row view, its SMEM buffers) and the
  ``plgpu.kernel`` call over it;
* ``stream``: rows streamed GMEM -> SMEM by TMA, several rows ahead where
  the stages fit (``config.mosaic_gpu_plan``); ``store_row`` /
  ``wait_output_slot``: output rows SMEM -> GMEM by TMA; ``params``: the
  parameter rows (staged in SMEM once per CTA, or read from GMEM);
  ``barrier``, ``row_loader``;
* the kernels' float32 partials (per CTA, per piece) are reduced in XLA in
  a fixed order by ``common.ordered_sum`` / ``common.fixed_order``, bitwise
  reproducible.

Stands on ``common`` and ``config`` (``config.mosaic_gpu_plan``: the
numbers); ``mosaic_gpu_rows``, ``mosaic_gpu_group_norm`` and
``mosaic_gpu_pieces`` stand on it, ``mosaic_gpu`` on them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_normgrad import _compat
from jax_normgrad.pallas import common, config

F32 = jnp.float32


class Launch:
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
    return a.reshape(a.shape[0], self.plan.padded)[:, :self.seg.minor]

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

  def sum_chunks(self, term, count=None):
    """``sum_k term(k)`` over the chunks of a row (or the first ``count``), elementwise.

    ``term``: a tuple of arrays. The first term is the initial carry: a loop
    carry keeps its register layout, and a zeros array would have a
    different one (splat).
    """
    add = lambda k, acc: tuple(a + t for a, t in zip(acc, term(k)))
    return lax.fori_loop(1, self.plan.chunks if count is None else count, add, term(0))

  def in_row(self, k, length=None):
    """Mask of the chunk-k elements inside the (unpadded) row; None without padding.

    ``length``: the row's valid length where it varies (a traced scalar).
    """
    if length is None and self.plan.padded == self.seg.minor:
      return None
    length = self.seg.minor if length is None else length
    width = self.plan.width
    if self.interpret:  # GPU interpret mode has no rule for layout casts
      iota = lax.broadcasted_iota(jnp.int32, (width,), 0)
    else:  # the layout of a chunk loaded from SMEM: 128 threads, width / 128 each
      plgpu = _compat.plgpu()
      iota = plgpu.broadcasted_iota(jnp.int32, (width,), 0,
                                    layout=plgpu.Layout.WG_STRIDED((width,), width // 128))
    return iota < length - k * width


def barrier(arrivals, count=1):
  plgpu = _compat.plgpu()
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=count)


def params(launch, srcs, buf, barrier, w):
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


def stream(launch, srcs, bufs, barrier, start, end, body, piece=None):
  """``body(i, slot, out)`` for rows ``[start, end)``, ``srcs[.][i]`` in ``bufs[.][slot]``.

  ``out``: the output slot row i writes (``out_stages`` of them, in turn).
  ``piece``: the sources are ``(rows, pieces, chunks, width)``; ``[i, piece]`` is streamed.
  A None source (an absent optional operand, such as the residual) is left
  out; ``barrier`` has a barrier per stage, each expecting one arrival per
  present source.

  With S stages the first S - 1 rows are fetched before the loop, and row i
  fetches row i + S - 1 into the slot row i - 1 used before it waits for its
  own, so S - 1 rows stay in flight while one is computed (with one stage,
  row i + 1 is fetched after row i). The slot being refilled was last read by
  the previous row, whose SMEM stores (Pallas places a warpgroup barrier
  after each) follow all its reads. With ``plan.in_place`` row i writes its
  output over its input (``out`` is ``slot``), and the refill first waits
  for row i - 1's TMA store to have read that slot.
  """
  plgpu = _compat.plgpu()
  stages, out_stages = launch.plan.stages, launch.plan.out_stages
  in_place = launch.plan.in_place
  srcs, bufs = zip(*[(s, b) for s, b in zip(srcs, bufs) if s is not None])

  def fetch(i, slot):
    for src, buf in zip(srcs, bufs):
      plgpu.copy_gmem_to_smem(_at(src, i, piece), buf.at[slot], barrier.at[slot])

  for j in range(max(stages - 1, 1)):  # the prologue: static, at most max_stages - 1 rows
    @pl.when(start + j < end)
    def _():
      fetch(start + j, j)

  def row(i, carry):
    slot = lax.rem(i - start, stages)
    if stages > 1:
      @pl.when(i + stages - 1 < end)
      def _():
        if in_place:  # row i - 1's output is in the slot: stored out first
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        fetch(i + stages - 1, lax.rem(slot + stages - 1, stages))
    plgpu.barrier_wait(barrier.at[slot])
    body(i, slot, slot if in_place else lax.rem(i - start, out_stages))
    if stages == 1:
      @pl.when(i + 1 < end)
      def _():
        fetch(i + 1, 0)
    return carry

  lax.fori_loop(start, end, row, 0)


def _at(ref, i, piece):
  """``ref.at[i]``, or ``ref.at[i, piece]`` for a piece of a long row."""
  return ref.at[i] if piece is None else ref.at[i, piece]


def store_row(launch, bufs, slot, dsts, i, piece=None):
  """TMA-stores the output rows in ``bufs[.][slot]`` to ``dsts[.][i]`` (waited for before reuse).

  ``slot``: the output slot ``stream`` gave row i.

  None outputs are left out. The copies of one row form one bulk-copy group
  (the last commits it), so ``wait_output_slot`` counts rows, however many
  outputs each has (y, and h in the residual form).
  """
  del launch
  plgpu = _compat.plgpu()
  pairs = [(b, d) for b, d in zip(bufs, dsts) if b is not None]
  plgpu.commit_smem()
  for j, (buf, dst) in enumerate(pairs):
    plgpu.copy_smem_to_gmem(buf.at[slot], _at(dst, i, piece), commit_group=j == len(pairs) - 1)


def wait_output_slot(launch):
  """Before writing an output slot: the store issued from it ``out_stages`` rows ago has read it."""
  _compat.plgpu().wait_smem_to_gmem(launch.plan.out_stages - 1, wait_read_only=True)


def row_loader(xs, rs, slot, h_dtype=None):
  """``load(k)``: chunk k of the row in ``xs[slot]`` as float32; with the residual's (``rs``),
  the residual form's h as it is stored: their float32 sum rounded to ``h_dtype``
  (``common.stored_sum``)."""
  if rs is None:
    return lambda k: xs[slot, k].astype(F32)
  assert h_dtype is not None, "the residual form's h dtype"
  return lambda k: common.stored_sum(xs[slot, k].astype(F32), rs[slot, k].astype(F32), h_dtype)
