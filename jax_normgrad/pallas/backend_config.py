"""The kernels' heuristics: one typed, frozen configuration per Pallas backend.

:class:`TritonConfig` (the Triton kernels: ``gpu.py``), :class:`MosaicGpuConfig`
(``mosaic_gpu*.py``) and :class:`MosaicTpuConfig` (``tpu.py``) hold the values
the plans of ``config`` read; :class:`Tuning` is the three together, the
configuration an op is lowered with. Where the values come from is told in
``config``'s docstring and beside each field.

A value is hashable and compared by its fields. A caller changes the
configuration of what it traces by passing such a value (or single fields
by name) to ``config.override`` (``overrides``), which carries it to each op
as the op's static ``tuning`` parameter: see ``docs/api.md``, "Kernel
configuration".
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """The Triton kernels' heuristics (``config.gpu_plan``, ``gpu_nhwc_plan``, ``gpu_programs``)."""

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
  #: Faster on an H200 at the SD-class UNet's rows (BENCHMARKS.md), but off: its
  #: forward with a fused activation spills registers on sm_90 at 8x32x32x320
  #: bfloat16 (.ci/accel-check), which must be planned away first.
  gpu_nhwc_odd_groups: bool = False
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
  #: The backward's parameter partials summed in XLA (``common.ordered_sum``: a pairwise tree,
  #: the kernel's fixed order) instead of by the ``sum_partials`` kernel, where XLA may fuse the
  #: sum with what consumes the gradient (an optimizer's update). Off; gpu_sweep's
  #: configuration ``partials_xla`` times it (benchmarks/recorded/*_H200_sweep.json).
  gpu_partials_in_xla: bool = False


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig:
  """The Mosaic GPU kernels' heuristics (``config.mosaic_gpu_plan`` and its callers)."""

  #: shared memory of a block that Pallas keeps for its cross-warp
  #: reductions and barriers; the kernels plan with the rest.
  mosaic_gpu_smem_reserve: int = 27 * 1024
  #: most persistent CTAs (one warpgroup each) per SM; more hide
  #: more latency while shared memory lasts.
  mosaic_gpu_max_ctas_per_sm: int = 4
  #: the HBM bytes an SM's CTAs keep in flight by TMA (the rows
  #: fetched ahead of the one being computed): Little's law at an H100's
  #: 3.35 TB/s, 132 SMs and 1-2 us of loaded latency asks 25-50 KiB per SM.
  mosaic_gpu_inflight_bytes: int = 64 * 1024
  #: most shared-memory stages per streamed operand (rows fetched ahead + 1).
  #: Two, the double buffer: deeper plans were no faster on an H200, and slower where they
  #: leave fewer CTAs per SM (BENCHMARKS.md, "Mosaic GPU against Triton").
  mosaic_gpu_max_stages: int = 2


@dataclasses.dataclass(frozen=True)
class MosaicTpuConfig:
  """The TPU kernels' heuristics (``config.tpu_*_tiles``)."""

  #: Elements of one TPU data block after padding to the vreg tiling.
  tpu_block_elems: int = 128 * 1024


#: The configuration classes, each by the name of the part of :class:`Tuning` that holds it.
BACKENDS = {"triton": TritonConfig, "mosaic_gpu": MosaicGpuConfig, "mosaic_tpu": MosaicTpuConfig}


def field_names(cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The three backends' configurations an op is lowered with.

  A field of any of them reads as an attribute of this value too
  (``Tuning().gpu_max_tile_bwd``): their names are unique across the three.
  """

  triton: TritonConfig = TritonConfig()
  mosaic_gpu: MosaicGpuConfig = MosaicGpuConfig()
  mosaic_tpu: MosaicTpuConfig = MosaicTpuConfig()

  def __getattr__(self, name):
    for part, cls in BACKENDS.items():
      if name in _FIELDS[cls]:
        return getattr(object.__getattribute__(self, part), name)
    raise AttributeError(f"{type(self).__name__} has no field {name!r}")


_FIELDS = {cls: frozenset(field_names(cls)) for cls in BACKENDS.values()}
assert sum(map(len, _FIELDS.values())) == len(frozenset().union(*_FIELDS.values()))
