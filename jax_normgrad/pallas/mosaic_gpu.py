"""Pallas Mosaic GPU kernels (Hopper and newer, CUDA only): LayerNorm / RMSNorm rows, GroupNorm.

Mosaic GPU is the Pallas GPU backend JAX keeps (the Triton one is deprecated
from jax 0.11). It targets sm_90+ and runs one warpgroup (128 threads) per
CTA; data moves GMEM -> SMEM by TMA, SMEM -> registers by plain loads.

Design (``config.mosaic_gpu_plan`` has the numbers):

* Persistent grid: a few CTAs per SM (as many as their SMEM allows, at most
  ``mosaic_gpu_max_ctas_per_sm``); CTA ``p`` of parameter group ``w`` walks a
  contiguous range of that group's rows.
* Rows are streamed through SMEM by TMA, several rows ahead: rows ``i + 1``
  to ``i + S - 1`` are in flight while row ``i`` is computed, S stages chosen
  to keep about 64 KiB of reads in flight per SM over its CTAs (Little's law
  at HBM3's bandwidth and latency; ``config.mosaic_gpu_plan``), at most 8;
  one buffer where two do not fit. A row
  is viewed as ``(chunks, width)``, width 128 or 256 (a TMA box side is at
  most 256 elements): one TMA copy per row and operand. The whole row sits in
  SMEM, so x (and dy) is read from HBM once; statistics and dx come from SMEM.
* Outputs (y, dx) are written to SMEM and stored by TMA, double-buffered.
  The plain forward of a row so long that a row of x and one of y leave
  room for one stage writes y over x instead (``MosaicGpuPlan.in_place``:
  16384 elements, either dtype, get two stages so), and refills a buffer
  once its y has been stored.
* dweight / dbias: float32 partial sums per CTA, kept in SMEM across its rows
  and stored once; the partials are summed over CTAs in a fixed order
  (``common.fixed_order``: a pairwise tree in XLA, its HLO small for hundreds of
  CTAs): bitwise deterministic, no atomics.
* Rows whose length is not a multiple of the width are padded with zeros in
  XLA (the TMA box must match the SMEM buffer, and a copy must move a multiple
  of 128 bytes): an extra copy of x / dy for such shapes, none for the usual
  hidden sizes (multiples of 256). Padded columns are masked out of the
  variance; elsewhere their dy is 0 and contributes nothing.

Rows longer than SMEM holds (``mosaic_gpu_plan`` None beyond about 25K
elements forward and 10K backward in float32, 51K and 14K in 16-bit types)
are cut in pieces that fit (``config.mosaic_gpu_pieces``; ``mosaic_gpu_pieces``):
x and dy are then read twice, statistics (or c1, c2) first.

The residual form (``add_layer_norm`` / ``add_rms_norm``, ``FUSES_RESIDUAL``):
the forward streams the residual's row (x's dtype or float32) beside x's and
writes h (``h_dtype``) beside y, one TMA group per row; every pass reads h
as it is stored (the float32 sum rounded to ``h_dtype``), so the statistics
and y are those of the stored h. The backward streams dh beside x (here h)
and dy and adds it to dx in float32 before dx's rounding. The plans count these rows (``extra_bytes``),
so rows are single-buffered, or cut in pieces, sooner: whole rows up to
12.8K elements forward and 8.4K backward in float32 (25.6K and 12.8K in
16-bit types), two stages or more up to 5.1K and 4.6K (8.4K and 7.1K). The
pieces' forward moments are of the stored h; their output kernels write h /
add dh. A budget too small even for pieces of 256 (``unsupported``) leaves the
problem to Triton, announced.

GroupNorm, both layouts (``mosaic_gpu_group_norm``), is two passes over rows (per-channel sums,
then the output), x read twice; an NCHW segment that SMEM holds with two
stages and whose HW is a multiple of 128 is instead one row of the row
kernels, read once, one kernel each way. NCHW rows (HW) longer than SMEM
holds are cut in pieces too; channels-last rows (C) must fit SMEM whole (C
beyond about 25K channels falls back to Triton).

Not here yet:

* The register chunk is one SMEM row (2 elements per thread); wider chunks
  (several SMEM rows per load) would cut loop overhead.
* Warp specialization (a producer warp issuing TMA, consumer warpgroups
  computing; ``emit_pipeline_warp_specialized``) would keep more bytes in
  flight than one warpgroup per CTA.

Blackwell (sm_100) would change little for a memory-bound kernel: the same
TMA and barriers apply; its larger L2 and TMA multicast over a CTA cluster
could share the parameter rows between CTAs, and TMEM is of no use without
matrix multiplies. These kernels pass the op suites on an H100; they run slower than the
Triton ones, which stay the GPU default (docs/api.md#the-two-pallas-gpu-backends; their
timings: BENCHMARKS.md#gpu-mosaic-gpu-against-triton).

The modules, each importing only those below it:

* ``mosaic_gpu_describe`` (for ``explain``): what the kernels launch for a
  problem, decided by the plan functions the entry points decide with
  (``forward_plan``, ``backward_plan`` here, ``mosaic_gpu_pieces.forward_plans``, ...);
* ``mosaic_gpu`` (this one): what the kernels can run (``unsupported``) and
  ``forward`` / ``backward``, which route a problem to
* ``mosaic_gpu_pieces`` (longer rows; it uses the other two),
* ``mosaic_gpu_group_norm`` (its whole NCHW segments are rows of the row
  kernels) and
* ``mosaic_gpu_rows`` (rows that fit SMEM whole);
* ``mosaic_gpu_pipeline``: the launch geometry, the TMA / SMEM streaming and
  barriers they share (``common``: the fixed-order sums of their partials in
  XLA).
"""

from __future__ import annotations

from jax_normgrad import _compat
from jax_normgrad.pallas import (common, config, mosaic_gpu_group_norm, mosaic_gpu_pieces,
                                 mosaic_gpu_rows)

#: The forward takes ``residual`` / ``h_dtype`` and the backward ``dh`` (``kernels.forward``).
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
    if mosaic_gpu_group_norm.GroupRows(seg).plans(itemsize, backward=backward) is None:
      return (f"rows of {seg.minor} elements (the {'HW' if seg.chan_axis == 1 else 'C'} of GroupNorm) "
              f"do not fit the Mosaic GPU kernels' shared memory")
    return None
  kw = dict(backward=backward, extra_bytes=extra_bytes)
  if (config.mosaic_gpu_plan(seg.minor, itemsize, in_place=not backward, **kw) is None
      and config.mosaic_gpu_pieces(seg.minor, itemsize, **kw) is None):
    what = " with the residual form's rows" if extra_bytes else ""
    return (f"rows of {seg.minor} elements{what} are longer than the Mosaic GPU kernels' pieces "
            "allow")
  return None


def forward_plan(seg: common.Segments, itemsize: int, *, params: int,
                 extra_bytes: int = 0) -> config.MosaicGpuPlan | None:
  """The plan of the row forward holding rows whole (y over x where that gives more stages);
  None: the rows are cut in pieces (``mosaic_gpu_pieces.forward_plans``).

  ``params``: how many of the weight and bias are given; ``extra_bytes``: the residual form's
  rows (``mosaic_gpu_rows.residual_bytes``).
  """
  return config.mosaic_gpu_plan(seg.minor, itemsize, backward=False, params=params,
                                extra_bytes=extra_bytes, in_place=True)


def backward_plan(seg: common.Segments, itemsize: int, *, has_gamma: bool, mask,
                  extra_bytes: int = 0) -> config.MosaicGpuPlan | None:
  """The plan of the row backward holding rows whole; None: the rows are cut in pieces
  (``mosaic_gpu_pieces.backward_plans``). ``extra_bytes``: dh's bytes per element."""
  return config.mosaic_gpu_plan(seg.minor, itemsize, backward=True, params=int(has_gamma),
                                outputs=int(mask[0]), partials=mask[1] + mask[2],
                                extra_bytes=extra_bytes)


def forward(x, *operands, seg: common.Segments, eps: float, interpret, h_dtype=None,
            y_dtype=None):
  """``(y, mean | None, rstd)`` of LayerNorm / RMSNorm rows or GroupNorm; see ``kernels.forward``.

  ``y_dtype`` (a 16-bit y of a float32 x): these kernels write y in x's
  dtype; it is rounded to ``y_dtype`` in an XLA pass after them.

  The residual form (rows): ``(x, residual, weight, bias)`` and ``h_dtype``
  give ``(y, mean | None, rstd, h)``, h = x + residual in float32 rounded
  once to ``h_dtype``, the statistics and y from that h.
  """
  if y_dtype is not None:
    y, *rest = forward(x, *operands, seg=seg, eps=eps, interpret=interpret, h_dtype=h_dtype)
    return (y.astype(y_dtype), *rest)
  has_residual = h_dtype is not None
  residual, weight, bias = operands if has_residual else (None, *operands)
  if seg.kind != "rows":
    assert not has_residual, "the residual form is rows only"
    return mosaic_gpu_group_norm.forward(x, weight, bias, seg=seg, eps=eps, interpret=interpret)
  plan = forward_plan(seg, x.dtype.itemsize, params=(weight is not None) + (bias is not None),
                      extra_bytes=mosaic_gpu_rows.residual_bytes(residual, h_dtype))
  if plan is None:
    return mosaic_gpu_pieces.forward(x, residual, weight, bias, seg=seg, eps=eps,
                                     interpret=interpret, h_dtype=h_dtype)
  return mosaic_gpu_rows.forward(x, residual, weight, bias, plan, seg=seg, eps=eps,
                                 interpret=interpret, h_dtype=h_dtype)


def backward(dy, x, mean, rstd, gamma, beta=None, dh=None, *, seg: common.Segments, mask,
             interpret):
  """``(dx | None, dgamma | None, dbeta | None)`` of LayerNorm / RMSNorm rows or GroupNorm.

  See ``kernels.backward``; ``beta`` only with GroupNorm's fused activation;
  ``dh`` (the residual form, rows; needs ``mask[0]``) is added to dx in
  float32 before its rounding.
  """
  if seg.kind != "rows":
    assert dh is None, "the residual form is rows only"
    return mosaic_gpu_group_norm.backward(dy, x, mean, rstd, gamma, beta, seg=seg, mask=mask,
                                          interpret=interpret)
  if dh is not None and not mask[0]:
    raise ValueError("dh needs dx (mask[0])")
  plan = backward_plan(seg, x.dtype.itemsize, has_gamma=gamma is not None, mask=mask,
                       extra_bytes=0 if dh is None else dh.dtype.itemsize)
  if plan is None:
    return mosaic_gpu_pieces.backward(dy, x, mean, rstd, gamma, dh, seg=seg, mask=mask,
                                      interpret=interpret)
  return mosaic_gpu_rows.backward(dy, x, mean, rstd, gamma, dh, plan, seg=seg, mask=mask,
                                  interpret=interpret)
