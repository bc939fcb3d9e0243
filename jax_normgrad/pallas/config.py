"""Tile and grid heuristics of the Pallas kernels, per backend, in one place.

A kernel's plan (``GpuPlan``, ``GpuNhwcPlan``, ``MosaicGpuPlan``, the TPU
tiles) is a small frozen value computed when an op is lowered, from the
static shapes and dtype, the heuristics of the backend's configuration
(``backend_config``), and the figures of the device being compiled for
(``device.Device``: SMs and shared memory of the GPU, TensorCores of the
TPU). The heuristics come from hardware limits
(registers per SM, VMEM per TensorCore, the (8, 128) TPU tiling) and from
the GPU sweeps (``benchmarks/gpu_sweep.py``); the measurements behind each
value are in BENCHMARKS-history.md ("The tile heuristics' measurements").

GPU (Triton). A normalization segment (a LayerNorm row, a GroupNorm
``(sample, group)`` block) is processed as 2-D power-of-two tiles held in
registers. The backward keeps about seven float32 values per tile element
live (x, dy, xhat, g, dx and two accumulators), and an SM has 64K 32-bit
registers, so a fused backward tile is at most 8192 elements; the forward
keeps about three and may use 16384. A longer segment is looped over in
chunks of that size (a second pass for the statistics it needs first).
The warp counts and programs per SM below are set from what Triton compiles
these tiles to (registers, spills, resident blocks per SM, 128-bit loads):
``docs/gpu-resources.md``, regenerated with no GPU by ``python
tests/accel_check.py --gpu-report docs/gpu-resources.md``; CI fails on any
spill or on a persistent grid that would not be resident at once.

TPU (Mosaic). A block of at most ``tpu_block_elems`` elements after padding
to the (8, 128) vreg tiling (16 sublanes for 16-bit types): x, dy and dx
double-buffered plus float32 temporaries stay under about 6 MiB, inside the
16 MiB default scoped VMEM of v4/v5e with room to spare.

The values are held apart, one module a job: ``backend_config``, one
frozen configuration per backend (``TritonConfig``, ``MosaicGpuConfig``,
``MosaicTpuConfig``; ``Tuning`` the three together); ``device``, the
device's figures (``Device``) and how they are read; ``overrides``, how a
caller changes either for what it traces (:func:`override`, which also takes
a configuration value whole), carried to each op as its static ``tuning``
parameter, so the lowering (and jit's cache) sees them, and a function
traced before keeps the values it was traced with. This module holds the
plans, and names those modules' entries its callers use.
"""

from __future__ import annotations

import dataclasses

from jax_normgrad.pallas.backend_config import (MosaicGpuConfig, MosaicTpuConfig,  # noqa: F401
                                                TritonConfig, Tuning)
from jax_normgrad.pallas.device import Device  # noqa: F401
from jax_normgrad.pallas.overrides import (INTERPRET_PROGRAMS, KEYS, current, device,  # noqa: F401
                                           interpret_programs, lowering, mosaic_gpu,
                                           mosaic_tpu, override, traced_overrides, triton)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, m: int) -> int:
  return cdiv(n, m) * m


# ----------------------------------------------------------------------------
# GPU (Triton)


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  """How a segment of shape ``(sa, sb)`` is tiled on a GPU.

  Attributes:
    tile: power-of-two ``(ta, tb)`` tile; masked where it overhangs the segment.
    chunks: tiles per segment along each axis; ``(1, 1)`` is the fused case
      (the whole segment in registers, x and dy read once).
    num_warps, num_stages: Triton launch parameters.
    stats_warps: ``num_warps`` of the chunked backward's statistics kernel.
    backward: the plan of a backward kernel (its programs per SM differ).
  """

  tile: tuple[int, int]
  chunks: tuple[int, int]
  num_warps: int
  num_stages: int
  stats_warps: int
  backward: bool = True

  @property
  def fused(self) -> bool:
    return self.chunks == (1, 1)


def gpu_plan(segment: tuple[int, int], itemsize: int, *, backward: bool,
             residual: bool = False) -> GpuPlan:
  """Tiles a segment: the whole of it if it fits, else halving the longer tile side.

  ``num_warps`` gives each thread ``gpu_fwd_bytes_per_thread`` (forward) or
  ``gpu_bwd_bytes_per_thread`` bytes of every input per tile (the residual
  form's forward: ``gpu_fwd_residual_elems_per_thread`` elements), 1 to
  ``gpu_max_warps`` warps; a backward program has at most ``gpu_max_warps_bwd``
  unless its tile needs more for 8 elements per thread.
  """
  t = triton()
  limit = t.gpu_max_tile_bwd if backward else t.gpu_max_tile_fwd
  ta, tb = _pow2(segment[0]), _pow2(segment[1])
  while ta * tb > limit:
    if ta >= tb:
      ta //= 2
    else:
      tb //= 2
  elems = ta * tb
  per_thread = (t.gpu_fwd_residual_elems_per_thread if residual and not backward else
                max((t.gpu_bwd_bytes_per_thread if backward else t.gpu_fwd_bytes_per_thread)
                    // itemsize, 1))
  num_warps = min(max(elems // (32 * per_thread), 1), t.gpu_max_warps)
  if backward:
    num_warps = min(max(min(num_warps, t.gpu_max_warps_bwd), elems // (32 * 8)), t.gpu_max_warps)
  return GpuPlan(tile=(ta, tb), chunks=(cdiv(segment[0], ta), cdiv(segment[1], tb)),
                 num_warps=num_warps, num_stages=2 if elems <= t.gpu_small_tile else 1,
                 stats_warps=min(num_warps, t.gpu_max_warps_stats), backward=backward)


@dataclasses.dataclass(frozen=True)
class GpuNhwcPlan:
  """How a channels-last GroupNorm sample ``(HW, C)`` is tiled by the sample-wide kernels.

  Attributes:
    rows, cols: the power-of-two tile, ``rows`` pixels of all ``cols >= C`` channels.
    cg: channels per group, a power of two; the tile is viewed as
      ``(rows, cols // cg, cg)`` to sum the groups.
    chunks: tiles per sample; 1 is the fused case (x and dy read once).
    num_warps: Triton's.
    backward: the plan of a backward kernel.
  """

  rows: int
  cols: int
  cg: int
  chunks: int
  num_warps: int
  backward: bool
  #: Groups of a statistics vector where ``cg`` is not a power of two (the
  #: sample's groups, padded to a power of two); 0 where the tile is viewed as
  #: ``(rows, cols // cg, cg)``.
  odd_groups: int = 0

  @property
  def fused(self) -> bool:
    return self.chunks == 1

  @property
  def groups(self) -> int:
    """Groups in a tile row, padding included."""
    return self.odd_groups or self.cols // self.cg


def gpu_nhwc_plan(hw: int, c: int, cg: int, itemsize: int, *,
                  backward: bool) -> GpuNhwcPlan | None:
  """The sample-wide plan of a channels-last GroupNorm, or None where the per-group tiles run.

  Those run where a group's channels span ``gpu_nhwc_group_bytes`` (forward:
  ``gpu_nhwc_group_bytes_fwd``) or more (whole sectors already), where ``cg``
  is not a power of two (the tile could not be viewed as groups) unless
  ``gpu_nhwc_odd_groups`` and the ``(cols, groups)`` 0/1 matrix that sums the
  groups holds at most ``_ODD_GROUPS_ELEMS`` elements, with one group (the
  segment is the sample), and where a row of all channels exceeds the tile.
  """
  t = triton()
  limit = t.gpu_nhwc_max_tile_bwd if backward else t.gpu_nhwc_max_tile_fwd
  group_bytes = t.gpu_nhwc_group_bytes if backward else t.gpu_nhwc_group_bytes_fwd
  cols = _pow2(c)
  odd_groups = _pow2(c // cg) if cg & (cg - 1) else 0
  if (cg == c or cg * itemsize >= group_bytes or cols > limit or odd_groups and (
      not t.gpu_nhwc_odd_groups or cols * odd_groups > _ODD_GROUPS_ELEMS)):
    return None
  rows = min(_pow2(hw), limit // cols)
  per_thread = max((t.gpu_bwd_bytes_per_thread if backward else t.gpu_fwd_bytes_per_thread)
                   // itemsize, 1)
  num_warps = min(max(rows * cols // (32 * per_thread), 1), t.gpu_max_warps_bwd)
  return GpuNhwcPlan(rows=rows, cols=cols, cg=cg, chunks=cdiv(hw, rows), num_warps=num_warps,
                     backward=backward, odd_groups=odd_groups)


#: Largest ``(cols, groups)`` 0/1 matrix of the sample-wide kernels' odd groups (float32
#: elements in registers while a tile's sums are spread over the groups): 1024 channels in 32
#: groups.
_ODD_GROUPS_ELEMS = 32 * 1024


def gpu_nhwc_parts(plan: GpuNhwcPlan, samples: int, *, interpret: bool) -> int:
  """Parts each sample's pixels are split into (``gpu_nhwc_split``): 1, or enough that the
  samples' parts make the persistent grid's program count, at most one tile each."""
  target = gpu_programs(plan, interpret=interpret)
  if not triton().gpu_nhwc_split or plan.fused or samples >= target:
    return 1
  parts = min(plan.chunks, cdiv(target, max(samples, 1)))
  return cdiv(plan.chunks, cdiv(plan.chunks, parts))  # no empty part


def gpu_programs(plan: GpuPlan, *, interpret: bool) -> int:
  """Target number of persistent programs: ``gpu_warps_per_sm`` (forward:
  ``gpu_warps_per_sm_fwd``) warps' worth per SM."""
  t = triton()
  if interpret:
    return interpret_programs()
  sms = device().sms
  warps = t.gpu_warps_per_sm if plan.backward else t.gpu_warps_per_sm_fwd
  if getattr(plan, "odd_groups", 0):
    # The odd groups' 0/1 matrices take registers (at 16 warps on sm_80 and sm_90, cuobjdump:
    # the backward's kernels 94-128 a thread, the forward's moments kernel 68, where 64 let two
    # programs share an SM): one such program per SM holds at once, not two.
    warps //= 2
  return sms * max(warps // plan.num_warps, 1)


def split(samples: int, target: int) -> tuple[int, int]:
  """``(programs, samples per program)``: at most ``target`` programs, none empty."""
  per = cdiv(samples, max(min(target, samples), 1))
  return cdiv(samples, per), per


# ----------------------------------------------------------------------------
# GPU (Mosaic GPU)


@dataclasses.dataclass(frozen=True)
class MosaicGpuPlan:
  """How a LayerNorm row of ``h`` elements is laid out for the Mosaic GPU kernels.

  Attributes:
    width: elements of one SMEM row and of one register chunk: 256 (the
      largest TMA box side), 128 for short rows; a multiple of 128 bytes, as
      a TMA copy must be.
    chunks: SMEM rows per data row; ``width * chunks`` is the row zero-padded.
    stages: SMEM buffers per streamed input: ``stages - 1`` rows are fetched
      by TMA while one is computed (1: fetched after it).
    out_stages: SMEM buffers per output row (2: a row's TMA store drains
      while the next row is written; 1 where two do not fit).
    params_in_smem: the parameter rows are staged in SMEM once per CTA (else
      read from GMEM, through L2, chunk by chunk).
    smem: SMEM bytes of one CTA.
    in_place: the output row is written over its input row's buffer (no
      output buffers; ``out_stages == stages``), and a buffer is refilled
      only once its output's TMA store has read it: long rows that would
      otherwise get one stage.
  """

  width: int
  chunks: int
  stages: int
  params_in_smem: bool
  smem: int
  out_stages: int = 2
  in_place: bool = False

  @property
  def padded(self) -> int:
    return self.width * self.chunks


def mosaic_gpu_ctas_per_sm(smem: int) -> int:
  """Resident CTAs of ``smem`` bytes each on one SM (at least 1, at most the cap)."""
  return min(max(device().smem_per_sm // smem, 1), mosaic_gpu().mosaic_gpu_max_ctas_per_sm)


def mosaic_gpu_plan(h: int, itemsize: int, *, backward: bool, params: int = 2, outputs: int = 1,
                    partials: int = 2, inputs: int | None = None, extra_bytes: int = 0,
                    in_place: bool = False, width: int | None = None) -> MosaicGpuPlan | None:
  """The SMEM layout of a row, None when a whole row does not fit one CTA's SMEM.

  A CTA holds, per input stage, the streamed inputs (``inputs``; default x,
  and dy backward; ``extra_bytes``: the bytes per element of the further
  rows in their own dtypes, the residual form's residual and h forward, dh
  backward, counted as inputs), per output stage the output row (y; dx when
  asked for), and once the float32 parameter rows and (backward, or any
  kernel passing ``inputs``) the float32 partial-sum rows.

  The stages: the fewest (at least 2) whose rows in flight, over the CTAs
  that fit an SM (``mosaic_gpu_ctas_per_sm``), reach
  ``mosaic_gpu_inflight_bytes``; else as many as fit (at most
  ``mosaic_gpu_max_stages``), one where two do not. The parameters are
  staged in SMEM where a row fits beside them, else read from GMEM.

  ``in_place``: the kernel can write its one output over its one input's
  buffer (the plain forward); a row that gets one stage otherwise is laid
  out so (``MosaicGpuPlan.in_place``) where that gives it two or more, its
  parameters read from GMEM if that is what frees the SMEM. ``width``: the
  chunk width where the caller needs one (128 or 256).
  """
  width = width or (256 if h > 128 else 128)
  chunks = cdiv(max(h, 1), width)
  if chunks > 256:  # a TMA box side
    return None
  row = width * chunks
  if inputs is None:
    inputs, partials = (2, partials) if backward else (1, 0)
  in_row = row * (itemsize * inputs + extra_bytes)
  fixed = lambda in_smem: row * 4 * (params * in_smem + partials)
  plan = _mosaic_gpu_stages(width, chunks, in_row, row * itemsize * outputs, fixed)
  if in_place and outputs == 1 and inputs == 1 and not extra_bytes and (
      plan is None or plan.stages < 2):
    over = _mosaic_gpu_stages(width, chunks, in_row, 0, fixed, in_place=True)
    if over is not None:
      return over
  return plan


def _mosaic_gpu_stages(width, chunks, in_row, out_row, fixed,
                       in_place=False) -> MosaicGpuPlan | None:
  """``mosaic_gpu_plan``'s choice of stages and parameter placement for rows of these sizes.

  ``in_place``: output rows over the input buffers, and two stages at least.
  """
  t = mosaic_gpu()
  for params_in_smem in (True, False):
    best = None
    for stages in range(1 + in_place, max(t.mosaic_gpu_max_stages, 2) + 1):
      out_stages = stages if in_place else min(stages, 2)
      smem = stages * in_row + out_stages * out_row + fixed(params_in_smem)
      if smem > device().mosaic_gpu_smem_bytes:
        break
      inflight = mosaic_gpu_ctas_per_sm(smem) * (stages - 1) * in_row
      best = MosaicGpuPlan(width=width, chunks=chunks, stages=stages,
                           params_in_smem=params_in_smem, smem=smem, out_stages=out_stages,
                           in_place=in_place)
      if stages >= 2 and inflight >= t.mosaic_gpu_inflight_bytes:
        break
    if best is not None:
      return best
  return None


def mosaic_gpu_pieces(h: int, itemsize: int, *, backward: bool,
                      **kwargs) -> tuple[int, MosaicGpuPlan] | None:
  """Rows too long for ``mosaic_gpu_plan``: ``(pieces, plan)``, a row cut in pieces.

  Each piece is ``plan.padded`` elements (a multiple of 256; the last piece
  zero-padded); the fewest pieces whose plan streams two stages or more with the
  parameters in SMEM, else the fewest that fit at all. ``kwargs`` as for
  ``mosaic_gpu_plan`` (the most demanding of the kernels that share the pieces).
  """
  fallback = None
  for pieces in range(2, cdiv(h, 256) + 1):
    length = _round_up(cdiv(h, pieces), 256)
    pieces = cdiv(h, length)  # no empty last piece
    plan = mosaic_gpu_plan(length, itemsize, backward=backward, **kwargs)
    if plan is None:
      continue
    if plan.stages >= 2 and plan.params_in_smem:
      return pieces, plan
    fallback = fallback or (pieces, plan)
  return fallback


def mosaic_gpu_ctas(plan: MosaicGpuPlan, *, interpret: bool) -> int:
  """Target number of persistent CTAs: as many per SM as their SMEM allows, up to the cap."""
  if interpret:
    return interpret_programs()
  return device().sms * mosaic_gpu_ctas_per_sm(plan.smem)


# ----------------------------------------------------------------------------
# TPU (Mosaic)


def sublanes(itemsize: int) -> int:
  """Rows of one vreg tile: 8 for 32-bit, 16 for 16-bit (packed) types."""
  return 8 * max(4 // itemsize, 1)


def _even_chunk(extent: int, largest: int, align: int) -> int:
  """A chunk of at most ``largest`` (a multiple of ``align``) splitting ``extent`` evenly."""
  chunks = cdiv(extent, largest)
  return _round_up(cdiv(extent, chunks), align)


def _fit(extent: int, budget_units: int, align: int) -> int:
  """The whole ``extent`` if it fits ``budget_units``, else an even aligned chunk."""
  if extent <= budget_units:
    return extent
  return _even_chunk(extent, max(budget_units // align, 1) * align, align)


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, max(at_most, 1)) + 1) if n % d == 0)


def tpu_rows_tiles(rows: int, width: int, itemsize: int) -> tuple[int, int]:
  """LayerNorm ``(rows, width)``: a ``(tm, th)`` block, th the whole row if it fits."""
  budget, sub = mosaic_tpu().tpu_block_elems, sublanes(itemsize)
  th = _fit(width, budget // sub, 128)
  tm = max(budget // _round_up(th, 128) // sub, 1) * sub
  return (rows if rows <= tm else tm), th


def tpu_channels_first_tiles(samples: int, cg: int, hw: int, itemsize: int) -> tuple[int, int, int]:
  """GroupNorm NCHW segment ``(cg, hw)``: ``(tn, tc, thw)``, tn dividing ``samples``."""
  budget, sub = mosaic_tpu().tpu_block_elems, sublanes(itemsize)
  seg = _round_up(cg, sub) * _round_up(hw, 128)
  if seg <= budget:
    return _largest_divisor(samples, budget // seg), cg, hw
  if _round_up(cg, sub) * 128 <= budget:
    return 1, cg, _fit(hw, budget // _round_up(cg, sub), 128)
  thw = _fit(hw, budget // sub, 128)
  return 1, _fit(cg, budget // _round_up(thw, 128), sub), thw


def tpu_channels_last_tiles(samples: int, hw: int, c: int, itemsize: int) -> tuple[int, int]:
  """GroupNorm channels-last sample ``(hw, c)``: ``(tn, thw)``, all channels per block.

  The channels of a sample stay in one block (the groups are lane segments),
  so C is limited by VMEM (about 16K float32 channels per 8 rows).
  """
  budget, sub = mosaic_tpu().tpu_block_elems, sublanes(itemsize)
  row = _round_up(c, 128)
  per_sample = _round_up(hw, sub) * row
  if per_sample <= budget:
    return _largest_divisor(samples, budget // per_sample), hw
  return 1, _fit(hw, max(budget // row, sub), sub)


def tpu_split(blocks: int) -> tuple[int, int]:
  """``(programs, steps)``: sample blocks spread over the TensorCores, none idle."""
  return split(blocks, device().tpu_cores)
