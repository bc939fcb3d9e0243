"""Tile and grid heuristics of the Pallas kernels, per backend, in one place.

Everything here is decided at trace time from static shapes and the dtype.
The numbers are starting points derived from hardware limits (registers per
SM, VMEM per TensorCore, the (8, 128) TPU tiling), not measured optima: no
GPU or TPU was available when they were chosen. The GPU sweeps so far
(``benchmarks/gpu_sweep.py``, BENCHMARKS-history.md "GPU": an H100 on 2026-11-25,
an H200 on 2026-11-26) set the partials reduction's tiles, the forward's bytes
per thread and the backward's warp cap. Tune them here, nowhere else.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator

import jax


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The tunable constants; see the module docstring for where they come from."""

  #: Largest fused GPU tile (elements) of the backward and of the forward.
  gpu_max_tile_bwd: int = 8192
  gpu_max_tile_fwd: int = 16384
  #: SM count used when no GPU is attached at trace time (export): H100 SXM.
  gpu_default_sms: int = 132
  #: Warps of persistent programs per SM: half of the 64 an SM can hold, so
  #: that loads of one program overlap the arithmetic of another while the
  #: float32 working set still fits the registers. Every program this plans
  #: is resident at once: programs of 16 or fewer warps hold at most 8
  #: elements per thread and compile to at most 64 registers (2 x 16 warps x
  #: 64 = the SM's 64K registers); 32-warp programs run one per SM.
  gpu_warps_per_sm: int = 32
  #: The same for the forward, tuned apart: the backward writes one partial row
  #: per program, the forward none. On an H100 (benchmarks/gpu_sweep.py) 64 was
  #: 3-18% faster at rows of 1024 and 3-9% slower at 16384x4096 bfloat16 and
  #: channels-last GroupNorm; left at 32 until a rule by tile size is measured.
  gpu_warps_per_sm_fwd: int = 32
  #: The backward's partials reduction, ``(W, P, C)`` -> ``(W, C)``: one program per
  #: ``gpu_partials_cols`` columns, each adding a ``(rows, cols)`` tile of
  #: ``gpu_partials_tile`` elements per step over the P partial rows, with
  #: ``gpu_partials_warps`` warps. Before 2026-11-26 it was 128 columns and 16 rows
  #: (2048) at 4 warps: at C = 1024 that is 8 programs walking P = 1056 rows, 66
  #: dependent steps of 8 KiB: 30 us on an H200 next to a 79 us backward kernel.
  #: 32 columns (one 128-byte line per tile row) give 4x the programs, and 4096
  #: elements per step at 8 warps 4x the bytes in flight per program.
  gpu_partials_cols: int = 32
  gpu_partials_tile: int = 4096
  gpu_partials_warps: int = 8
  #: Triton's num_stages for that loop: at 3 the sm_90 cubin had no shared-memory
  #: buffers (Triton did not pipeline the loads), so 1.
  gpu_partials_stages: int = 1
  #: Sum those partials in XLA instead (``common.ordered_sum``: a pairwise tree
  #: of slices and adds, a fixed order as the kernel's), where the sum is an
  #: elementwise fusion that XLA may merge with what consumes the gradient (an
  #: optimizer's update): one launch fewer per norm inside a training step,
  #: where on an H100 a launch left about 6 us of idle GPU (BENCHMARKS.md "GPU:
  #: norms inside models"), against a fusion that reads P partial rows per
  #: column. Not timed on a GPU yet: ``benchmarks/bench_models.py --variants
  #: ours@gpu_partials_in_xla=True`` and gpu_sweep's ``partials_xla`` measure it.
  gpu_partials_in_xla: bool = False
  #: Bytes of each input one thread holds per tile: 16 is one 128-bit load (4
  #: float32 or 8 16-bit elements); more gives fewer warps per program and more
  #: programs per SM (``gpu_warps_per_sm*``). Forward 32 since 2026-11-26: on an
  #: H200 (benchmarks/gpu_sweep.py) 1.0-1.38x faster at rows of 1024 to 16384
  #: than 16, none slower; 64 was no better. The backward's 32 lost 13-16% at rows
  #: of 1024 (twice the programs: twice the partial rows) and gained 1.5x only
  #: where 16 gave a 32-warp program: ``gpu_max_warps_bwd``.
  gpu_fwd_bytes_per_thread: int = 32
  gpu_bwd_bytes_per_thread: int = 16
  #: The residual form's forward counts elements, not bytes (x, the residual and
  #: h live per element): 8 per thread. 16 bfloat16 elements (32 bytes) took 72
  #: registers at add_layer_norm's tile of 1024, too many for the 16 programs per
  #: SM planned (docs/gpu-resources.md); 4 float32 elements (16 bytes, until
  #: 2026-11-26) ran the float32 tile of 4096 as one 32-warp program: on an H200
  #: (gpu_sweep.py, res_fwd_e4 against 8) add_rms_norm 16384x4096 float32's
  #: forward took 0.464 ms against 0.339, 32768x1024 0.172 against 0.167.
  gpu_fwd_residual_elems_per_thread: int = 8
  #: Most warps of a backward program whose tile fits 8 elements per thread at that
  #: count; a larger tile takes the warps 8 per thread need (to ``gpu_max_warps``).
  #: Of the tiles planned, this moves the float32 4096-element tile from one
  #: 32-warp program per SM to two of 16: 1.49x faster on an H200 (RMSNorm
  #: 16384x4096 float32 backward, 0.351 -> 0.235 ms).
  gpu_max_warps_bwd: int = 16
  #: The residual form's backward loads h's cotangent dh with x and dy, before
  #: the row's sums, instead of after them (where its load waits a memory
  #: round trip of its own). Off, unmeasured: an H200 trace (2026-11-26) of
  #: add_layer_norm 16384x4096 bfloat16 gave its backward kernel 247 us where
  #: the plain backward took 129 for 3/4 of the bytes; with 8 bfloat16
  #: elements per thread the late dh load has 16 KiB a SM in flight, less
  #: than the bandwidth-latency product. Float32 rows ran at the plain rate.
  #: gpu_sweep.py's "bwd_early_dh" measures it.
  gpu_bwd_early_dh: bool = False
  #: Most warps of one GPU program: 32 (1024 threads, Triton's and CUDA's
  #: limit). Capped at 16 (until 2026-11-25), the largest tiles (8192
  #: backward, 16384 forward) held 16-32 elements per thread and compiled to
  #: 68-113 registers: one 16-warp program per SM, a quarter of its 64 warps,
  #: while the grid planned two (a second wave), and 2 kernels spilled on
  #: sm_80. At 32 warps they hold 8-16 elements and compile to 31-64
  #: registers with no spills (docs/gpu-resources.md): twice the warps resident.
  gpu_max_warps: int = 32
  #: Most warps of the chunked backward's statistics kernel, which keeps two
  #: tile-shaped float32 sums across its chunks: at 32 warps (64 registers at
  #: most) ptxas spilled 8-40 bytes of them; at 16 it uses 64-114 registers, no spills.
  gpu_max_warps_stats: int = 16
  #: Tiles up to this many elements are software-pipelined (num_stages=2).
  gpu_small_tile: int = 2048
  #: Channels-last GroupNorm whose groups span fewer bytes than this (a UNet's
  #: 32 groups of 2-8 channels: 8-32 bytes of every pixel's row) runs the
  #: sample-wide kernels (``gpu_nhwc_plan``): a tile is rows of all the
  #: channels, contiguous, and the groups are summed inside it. The per-group
  #: tiles read a few bytes of each 32-byte sector: on an H100 (2026-11-27,
  #: bench_models.py) the 32x32x32x64 float32 forward (32 groups) took 43 us
  #: where its bytes need 6; with these kernels the two forward kernels took 9
  #: us and the step's norm kernels 0.24 ms against 0.54 (BENCHMARKS.md "GPU:
  #: norms inside models"). The backward takes them below 64 bytes a group,
  #: the forward below 32: at 8 float32 channels a group (8x64x64x256,
  #: bench_gpu.py) the backward went from 1.22x to 1.63x XLA's, the forward
  #: from 0.97x to 0.78x (two runs of one day; ratios in each run).
  gpu_nhwc_group_bytes: int = 64
  gpu_nhwc_group_bytes_fwd: int = 32
  #: Largest tile (elements) of the sample-wide channels-last kernels: the
  #: forward keeps about three float32 values per element, the backward five
  #: (x, dy, dx and the two tile-shaped parameter sums).
  gpu_nhwc_max_tile_fwd: int = 8192
  gpu_nhwc_max_tile_bwd: int = 4096
  #: Where a channels-last GroupNorm has fewer samples than the programs an
  #: H100 holds (a UNet's batch of 32: 32 of 132 SMs busy), the sample-wide
  #: kernels split each sample's pixels into parts, a program each: a first
  #: kernel writes each part's group moments (forward) or sums (backward), a
  #: second combines a sample's parts in a fixed order and writes y or dx.
  #: False: one persistent kernel each way, a sample per program at a time.
  gpu_nhwc_split: bool = True
  #: Persistent programs of the interpreter (CPU tests): few, to keep it fast,
  #: more than one so that the partial sums and their reduction are exercised.
  interpret_programs: int = 3
  #: Elements of one TPU data block after padding to the vreg tiling.
  tpu_block_elems: int = 128 * 1024
  #: TensorCores sharing a TPU chip's grid ("parallel" axis): 2 on megacore
  #: chips (v4, v5p); on single-core chips the two halves just run in turn.
  tpu_cores: int = 2
  #: Mosaic GPU: SMEM one CTA may use (bytes). H100 allows 227 KiB per block;
  #: Pallas reserves some for its cross-warp reductions and barriers.
  mosaic_gpu_smem_bytes: int = 200 * 1024
  #: Mosaic GPU: SMEM of one SM shared by its resident CTAs (H100: 228 KiB).
  mosaic_gpu_smem_per_sm: int = 228 * 1024
  #: Mosaic GPU: most persistent CTAs (one warpgroup each) per SM; more hide
  #: more latency while SMEM lasts.
  mosaic_gpu_max_ctas_per_sm: int = 4
  #: Mosaic GPU: the HBM bytes an SM's CTAs keep in flight by TMA (the rows
  #: fetched ahead of the one being computed): Little's law at an H100's
  #: 3.35 TB/s, 132 SMs and 1-2 us of loaded latency asks 25-50 KiB per SM.
  #: Two stages (one row ahead) left 2-8 KiB for rows of 1-4K elements, and
  #: the forward moved 1.5 TB/s (``benchmarks/gpu_mosaic_probe.py``).
  mosaic_gpu_inflight_bytes: int = 64 * 1024
  #: Mosaic GPU: most SMEM stages per streamed operand (rows fetched ahead + 1).
  mosaic_gpu_max_stages: int = 8


_tuning = Tuning()


def current() -> Tuning:
  return _tuning


@contextlib.contextmanager
def override(**changes) -> Iterator[Tuning]:
  """Temporarily changes the tuning (tests). Call ``jax.clear_caches()`` around it:
  compiled functions keep the tiles they were lowered with."""
  global _tuning
  saved = _tuning
  _tuning = dataclasses.replace(saved, **changes)
  try:
    yield _tuning
  finally:
    _tuning = saved


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
  t = current()
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

  @property
  def fused(self) -> bool:
    return self.chunks == 1

  @property
  def groups(self) -> int:
    """Groups in a tile row, padding included."""
    return self.cols // self.cg


def gpu_nhwc_plan(hw: int, c: int, cg: int, itemsize: int, *,
                  backward: bool) -> GpuNhwcPlan | None:
  """The sample-wide plan of a channels-last GroupNorm, or None where the per-group tiles run.

  Those run where a group's channels span ``gpu_nhwc_group_bytes`` (forward:
  ``gpu_nhwc_group_bytes_fwd``) or more (whole sectors already), where ``cg``
  is not a power of two (the tile could not be viewed as groups), with one
  group (the segment is the sample), and where a row of all channels exceeds
  the tile.
  """
  t = current()
  limit = t.gpu_nhwc_max_tile_bwd if backward else t.gpu_nhwc_max_tile_fwd
  group_bytes = t.gpu_nhwc_group_bytes if backward else t.gpu_nhwc_group_bytes_fwd
  cols = _pow2(c)
  if cg == c or cg & (cg - 1) or cg * itemsize >= group_bytes or cols > limit:
    return None
  rows = min(_pow2(hw), limit // cols)
  per_thread = max((t.gpu_bwd_bytes_per_thread if backward else t.gpu_fwd_bytes_per_thread)
                   // itemsize, 1)
  num_warps = min(max(rows * cols // (32 * per_thread), 1), t.gpu_max_warps_bwd)
  return GpuNhwcPlan(rows=rows, cols=cols, cg=cg, chunks=cdiv(hw, rows), num_warps=num_warps,
                     backward=backward)


def gpu_nhwc_parts(plan: GpuNhwcPlan, samples: int, *, interpret: bool) -> int:
  """Parts each sample's pixels are split into (``gpu_nhwc_split``): 1, or enough that the
  samples' parts make the persistent grid's program count, at most one tile each."""
  target = gpu_programs(plan, interpret=interpret)
  if not current().gpu_nhwc_split or plan.fused or samples >= target:
    return 1
  parts = min(plan.chunks, cdiv(target, max(samples, 1)))
  return cdiv(plan.chunks, cdiv(plan.chunks, parts))  # no empty part


@functools.lru_cache(maxsize=None)
def _attached_sms() -> int | None:
  """The SM count of an attached GPU, None when tracing without one (export)."""
  for backend in ("cuda", "rocm"):
    try:
      devices = jax.devices(backend)
    except RuntimeError:
      continue
    count = getattr(devices[0], "core_count", None)
    if count:
      return int(count)
  return None


def gpu_programs(plan: GpuPlan, *, interpret: bool) -> int:
  """Target number of persistent programs: ``gpu_warps_per_sm`` (forward:
  ``gpu_warps_per_sm_fwd``) warps' worth per SM."""
  t = current()
  if interpret:
    return t.interpret_programs
  sms = _attached_sms() or t.gpu_default_sms
  warps = t.gpu_warps_per_sm if plan.backward else t.gpu_warps_per_sm_fwd
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
  t = current()
  return min(max(t.mosaic_gpu_smem_per_sm // smem, 1), t.mosaic_gpu_max_ctas_per_sm)


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
  t = current()
  for params_in_smem in (True, False):
    best = None
    for stages in range(1 + in_place, max(t.mosaic_gpu_max_stages, 2) + 1):
      out_stages = stages if in_place else min(stages, 2)
      smem = stages * in_row + out_stages * out_row + fixed(params_in_smem)
      if smem > t.mosaic_gpu_smem_bytes:
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
  t = current()
  if interpret:
    return t.interpret_programs
  return (_attached_sms() or t.gpu_default_sms) * mosaic_gpu_ctas_per_sm(plan.smem)


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
  budget, sub = current().tpu_block_elems, sublanes(itemsize)
  th = _fit(width, budget // sub, 128)
  tm = max(budget // _round_up(th, 128) // sub, 1) * sub
  return (rows if rows <= tm else tm), th


def tpu_channels_first_tiles(samples: int, cg: int, hw: int, itemsize: int) -> tuple[int, int, int]:
  """GroupNorm NCHW segment ``(cg, hw)``: ``(tn, tc, thw)``, tn dividing ``samples``."""
  budget, sub = current().tpu_block_elems, sublanes(itemsize)
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
  budget, sub = current().tpu_block_elems, sublanes(itemsize)
  row = _round_up(c, 128)
  per_sample = _round_up(hw, sub) * row
  if per_sample <= budget:
    return _largest_divisor(samples, budget // per_sample), hw
  return 1, _fit(hw, max(budget // row, sub), sub)


def tpu_split(blocks: int) -> tuple[int, int]:
  """``(programs, steps)``: sample blocks spread over the TensorCores, none idle."""
  return split(blocks, current().tpu_cores)
