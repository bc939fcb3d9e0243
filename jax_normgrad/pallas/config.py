"""Tile and grid heuristics of the Pallas kernels, per backend, in one place.

A kernel's plan (``GpuPlan``, ``GpuNhwcPlan``, ``MosaicGpuPlan``, the TPU
tiles) is a small frozen value computed when an op is lowered, from the
static shapes and dtype, the heuristics of :class:`Tuning`, and the figures
of the device being compiled for (:class:`Device`: SMs and shared memory of
the GPU, TensorCores of the TPU). The heuristics come from hardware limits
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

Tests and benchmarks change these values with :func:`override`, which holds
for what is traced inside it: the changes travel with each op traced there
as its static ``tuning`` parameter, so the lowering (and jit's cache) sees
them, and a function traced before keeps the values it was traced with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Iterator

import jax


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The heuristics of the kernels' plans; see the module docstring for where they come from."""

  #: Largest fused GPU tile (elements) of the backward and of the forward (registers).
  gpu_max_tile_bwd: int = 8192
  gpu_max_tile_fwd: int = 16384
  #: Warps of persistent programs per SM: half of the 64 an SM can hold, so
  #: that loads of one program overlap the arithmetic of another while the
  #: float32 working set still fits the registers. Every program this plans
  #: is resident at once: programs of 16 or fewer warps hold at most 8
  #: elements per thread and compile to at most 64 registers (2 x 16 warps x
  #: 64 = the SM's 64K registers); 32-warp programs run one per SM.
  gpu_warps_per_sm: int = 32
  #: The same for the forward, tuned apart (the backward writes one partial
  #: row per program, the forward none); 64 was faster at rows of 1024 and
  #: slower at long rows and channels-last GroupNorm, so both stay at 32.
  gpu_warps_per_sm_fwd: int = 32
  #: The backward's partials reduction, ``(W, P, C)`` -> ``(W, C)``: one program per
  #: ``gpu_partials_cols`` columns (32: one 128-byte line per tile row), each adding a
  #: ``(rows, cols)`` tile of ``gpu_partials_tile`` elements per step over the P partial
  #: rows, with ``gpu_partials_warps`` warps: many programs, many bytes in flight each.
  gpu_partials_cols: int = 32
  gpu_partials_tile: int = 4096
  gpu_partials_warps: int = 8
  #: Triton's num_stages for that loop: 1 (at 3, Triton did not pipeline its loads).
  gpu_partials_stages: int = 1
  #: Bytes of each input one thread holds per tile: 16 is one 128-bit load (4
  #: float32 or 8 16-bit elements); more gives fewer warps per program and more
  #: programs per SM (``gpu_warps_per_sm*``). The forward's 32 was faster than 16
  #: at every row length; the backward's 32 lost at rows of 1024 (twice the
  #: programs, twice the partial rows), so 16 there and ``gpu_max_warps_bwd``.
  gpu_fwd_bytes_per_thread: int = 32
  gpu_bwd_bytes_per_thread: int = 16
  #: The residual form's forward counts elements, not bytes (x, the residual and
  #: h live per element): 8 per thread. 16 bfloat16 elements took too many
  #: registers for the programs planned per SM; 4 float32 elements ran the
  #: float32 tile of 4096 as one 32-warp program, and was slower.
  gpu_fwd_residual_elems_per_thread: int = 8
  #: Most warps of a backward program whose tile fits 8 elements per thread at that
  #: count; a larger tile takes the warps 8 per thread need (to ``gpu_max_warps``).
  #: Of the tiles planned, this moves the float32 4096-element tile from one
  #: 32-warp program per SM to two of 16, which was faster.
  gpu_max_warps_bwd: int = 16
  #: Most warps of one GPU program: 32 (1024 threads, Triton's and CUDA's
  #: limit). At 32 warps the largest tiles (8192 backward, 16384 forward) hold
  #: 8-16 elements per thread and compile to 31-64 registers with no spills
  #: (docs/gpu-resources.md); at 16 they took 68-113 registers and spilled on sm_80.
  gpu_max_warps: int = 32
  #: Most warps of the chunked backward's statistics kernel, which keeps two
  #: tile-shaped float32 sums across its chunks: at 32 warps ptxas spilled them.
  gpu_max_warps_stats: int = 16
  #: Tiles up to this many elements are software-pipelined (num_stages=2).
  gpu_small_tile: int = 2048
  #: Channels-last GroupNorm whose groups span fewer bytes than this (a UNet's
  #: 32 groups of 2-8 channels: 8-32 bytes of every pixel's row) runs the
  #: sample-wide kernels (``gpu_nhwc_plan``): a tile is rows of all the
  #: channels, contiguous, and the groups are summed inside it; the per-group
  #: tiles would read a few bytes of each 32-byte sector. The backward takes
  #: them below 64 bytes a group, the forward below 32 (at 32 bytes the
  #: forward's per-group tiles were faster, the backward's slower).
  gpu_nhwc_group_bytes: int = 64
  gpu_nhwc_group_bytes_fwd: int = 32
  #: The sample-wide kernels also for groups of a channel count that is not a
  #: power of two (an SD-class UNet's 32 groups of 10 or 20 channels): the
  #: tile's columns summed per group by a 0/1 matrix instead of a reshape.
  #: False: the per-group tiles, as for groups of wide sectors (BENCHMARKS.md,
  #: the SD-class UNet's GroupNorm rows).
  gpu_nhwc_odd_groups: bool = True
  #: Largest tile (elements) of the sample-wide channels-last kernels: the
  #: forward keeps about three float32 values per element, the backward five
  #: (x, dy, dx and the two tile-shaped parameter sums).
  gpu_nhwc_max_tile_fwd: int = 8192
  gpu_nhwc_max_tile_bwd: int = 4096
  #: Where a channels-last GroupNorm has fewer samples than the programs the GPU
  #: holds (a UNet's batch of 32 on 132 SMs), the sample-wide kernels split each
  #: sample's pixels into parts, a program each: a first kernel writes each part's
  #: group moments (forward) or sums (backward), a second combines a sample's
  #: parts in a fixed order and writes y or dx. False: one persistent kernel each
  #: way, a sample per program at a time.
  gpu_nhwc_split: bool = True
  #: Elements of one TPU data block after padding to the vreg tiling.
  tpu_block_elems: int = 128 * 1024
  #: Mosaic GPU: shared memory of a block that Pallas keeps for its cross-warp
  #: reductions and barriers; the kernels plan with the rest.
  mosaic_gpu_smem_reserve: int = 27 * 1024
  #: Mosaic GPU: most persistent CTAs (one warpgroup each) per SM; more hide
  #: more latency while shared memory lasts.
  mosaic_gpu_max_ctas_per_sm: int = 4
  #: Mosaic GPU: the HBM bytes an SM's CTAs keep in flight by TMA (the rows
  #: fetched ahead of the one being computed): Little's law at an H100's
  #: 3.35 TB/s, 132 SMs and 1-2 us of loaded latency asks 25-50 KiB per SM.
  mosaic_gpu_inflight_bytes: int = 64 * 1024
  #: Mosaic GPU: most shared-memory stages per streamed operand (rows fetched ahead + 1).
  #: Two, the double buffer: deeper plans were no faster on an H200, and slower where they
  #: leave fewer CTAs per SM (BENCHMARKS.md, "Mosaic GPU against Triton").
  mosaic_gpu_max_stages: int = 2


#: Shared memory of a GPU block and of an SM (bytes) by compute capability (major, minor);
#: CUDA's limits (an opt-in block may use all but 1 KiB of its SM's).
_SMEM_BY_CAPABILITY = {(7, 0): 96, (7, 5): 64, (8, 0): 164, (8, 6): 100, (8, 7): 164,
                       (8, 9): 100, (9, 0): 228, (10, 0): 228, (12, 0): 100}
#: SMs by the device kinds whose count is known, for an abstract device (export with no GPU).
_SMS_BY_KIND = (("H100 PCIe", 114), ("H100", 132), ("H200", 132), ("H20", 78), ("A100", 108),
                ("B200", 148), ("L40", 142), ("L4", 58), ("A10", 72))


@dataclasses.dataclass(frozen=True)
class Device:
  """The figures of the device a lowering compiles for (:func:`device`); an H100's by default.

  ``sms``: streaming multiprocessors of the GPU; ``smem_per_sm``: shared
  memory of an SM (bytes); ``mosaic_gpu_smem_bytes``: what one Mosaic GPU CTA
  plans with (the block's limit less ``Tuning.mosaic_gpu_smem_reserve``);
  ``tpu_cores``: TensorCores sharing a TPU chip's grid ("parallel" axis; 2
  on megacore chips; on single-core chips the two halves run in turn).
  """

  sms: int = 132
  smem_per_sm: int = 228 * 1024
  mosaic_gpu_smem_bytes: int = 200 * 1024
  tpu_cores: int = 2


@dataclasses.dataclass(frozen=True)
class Trials:
  """Kernel variants built but not yet measured on a GPU: off by default.

  For ``benchmarks/gpu_sweep.py`` and ``benchmarks/bench_models.py``'s
  ``base@key=value`` variants, through :func:`override`; not part of the
  package's supported configuration.
  """

  #: Sum the Triton backward's parameter partials in XLA (``common.ordered_sum``: a
  #: pairwise tree, the kernel's fixed order), where XLA may fuse the sum with what
  #: consumes the gradient (an optimizer's update): one launch fewer per norm.
  gpu_partials_in_xla: bool = False
  #: The residual form's Triton backward loads dh with x and dy, before the row's
  #: sums, instead of after them (where its load waits a memory round trip of its own).
  gpu_bwd_early_dh: bool = False


#: Persistent programs of the interpreter (CPU tests): few, to keep it fast,
#: more than one so that the partial sums and their reduction are exercised.
INTERPRET_PROGRAMS = 3

_PARTS = {"tuning": Tuning, "device": Device, "trials": Trials}
#: The names :func:`override` takes.
KEYS = frozenset({f.name for cls in _PARTS.values() for f in dataclasses.fields(cls)}
                 | {"interpret_programs"})


@dataclasses.dataclass(frozen=True)
class _Context:
  tuning: Tuning = Tuning()
  device: Device = Device()
  trials: Trials = Trials()
  interpret_programs: int = INTERPRET_PROGRAMS


#: The changes of the :func:`override` blocks in force: a jax user context, so part of jit's
#: cache keys (a function called inside a block is traced and lowered with its changes).
_OVERRIDES = jax.make_user_context(default_value=())
#: The contexts of the ops being lowered on this thread (:func:`lowering`).
_LOCAL = threading.local()


def _context() -> _Context:
  stack = getattr(_LOCAL, "stack", None)
  return stack[-1] if stack else _overridden(traced_overrides())


@functools.lru_cache(maxsize=64)
def _overridden(changes) -> _Context:
  return _with(_Context(), changes)


def current() -> Tuning:
  """The heuristics in force: the defaults, or those of the op being lowered."""
  return _context().tuning


def device() -> Device:
  """The figures of the device the op being lowered compiles for (an H100's outside a lowering)."""
  return _context().device


def trials() -> Trials:
  return _context().trials


def interpret_programs() -> int:
  return _context().interpret_programs


def _with(context: _Context, changes) -> _Context:
  parts = {name: getattr(context, name) for name in _PARTS}
  extra = {}
  for key, value in changes:
    owner = next((n for n, cls in _PARTS.items()
                  if key in {f.name for f in dataclasses.fields(cls)}), None)
    if owner is not None:
      parts[owner] = dataclasses.replace(parts[owner], **{key: value})
    elif key == "interpret_programs":
      extra[key] = value
    else:
      raise TypeError(f"config.override: no setting named {key!r}")
  return _Context(**parts, interpret_programs=extra.get("interpret_programs",
                                                        context.interpret_programs))


def traced_overrides() -> tuple[tuple[str, Any], ...]:
  """The changes of the :func:`override` blocks in force, as a hashable value."""
  return _OVERRIDES.value


@contextlib.contextmanager
def override(**changes) -> Iterator[Tuning]:
  """Changes the tuning, device figures, trials or ``interpret_programs`` for what is traced inside.

  For tests and benchmarks. The changes are part of jit's cache key (a
  function called inside the block is traced again), and the ops traced
  inside carry them as their static ``tuning`` parameter
  (``primitives._common``), which their lowering applies; :func:`current`
  and the plans read them inside the block too.
  """
  merged = tuple(sorted({**dict(traced_overrides()), **changes}.items()))
  context = _overridden(merged)  # checks the names
  with _OVERRIDES(merged):
    yield context.tuning


@contextlib.contextmanager
def lowering(changes, platform: str):
  """The plans of an op lowered for ``platform`` with its ``tuning`` parameter's ``changes``."""
  context = _with(_Context(device=_device_for(platform)), tuple(changes))
  _LOCAL.stack = getattr(_LOCAL, "stack", ()) + (context,)
  try:
    yield
  finally:
    _LOCAL.stack = _LOCAL.stack[:-1]


def _device_for(platform: str) -> Device:
  """The figures of the device jax compiles for on ``platform`` (an H100's where unknown)."""
  if platform in ("cuda", "rocm"):
    return _gpu_device(*_gpu_target())
  if platform == "tpu":
    cores = _attached_tpu_cores()
    return Device(tpu_cores=cores) if cores else Device()
  return Device()


def _gpu_target() -> tuple[str, str | None, int | None]:
  """(kind, compute capability, SM count) of the GPU a lowering targets, None where unknown."""
  from jax_normgrad.pallas import gpu_target  # pylint: disable=g-import-not-at-top
  dev = gpu_target.target()
  return dev.kind, dev.compute_capability, None if dev.abstract else _attached_sms()


@functools.lru_cache(maxsize=None)
def _gpu_device(kind: str, capability: str | None, sms: int | None) -> Device:
  default = Device()
  if sms is None:
    sms = next((n for name, n in _SMS_BY_KIND if name in kind), default.sms)
  smem = None
  if capability is not None:
    major, minor = (int(v) for v in capability.split("."))
    smem = _SMEM_BY_CAPABILITY.get((major, minor)) or _SMEM_BY_CAPABILITY.get((major, 0))
  if smem is None:
    return dataclasses.replace(default, sms=sms)
  per_sm = smem * 1024
  budget = per_sm - 1024 - Tuning().mosaic_gpu_smem_reserve
  return Device(sms=sms, smem_per_sm=per_sm, mosaic_gpu_smem_bytes=budget,
                tpu_cores=default.tpu_cores)


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


@functools.lru_cache(maxsize=None)
def _attached_tpu_cores() -> int | None:
  """TensorCores per chip of an attached TPU, None without one."""
  try:
    devices = jax.devices("tpu")
  except RuntimeError:
    return None
  cores = getattr(devices[0], "num_cores", None)
  return int(cores) if cores else None


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
  t = current()
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
  if not current().gpu_nhwc_split or plan.fused or samples >= target:
    return 1
  parts = min(plan.chunks, cdiv(target, max(samples, 1)))
  return cdiv(plan.chunks, cdiv(plan.chunks, parts))  # no empty part


def gpu_programs(plan: GpuPlan, *, interpret: bool) -> int:
  """Target number of persistent programs: ``gpu_warps_per_sm`` (forward:
  ``gpu_warps_per_sm_fwd``) warps' worth per SM."""
  t = current()
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
  return min(max(device().smem_per_sm // smem, 1), current().mosaic_gpu_max_ctas_per_sm)


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
  return split(blocks, device().tpu_cores)
