"""What the Mosaic GPU kernels launch for a problem, for ``explain`` (``kernels.describe``).

Decided by the functions ``mosaic_gpu.forward`` / ``backward`` and the modules under them
decide with (``mosaic_gpu.forward_plan``, ``mosaic_gpu_pieces.forward_plans``,
``mosaic_gpu_group_norm.whole_segments``, ``GroupRows.plans``, ...), from the problem's shapes
and dtypes alone; ``tests/test_explain_kernels.py`` checks the answer against lowered modules.
"""

from __future__ import annotations

from jax_normgrad.pallas import (common, config, mosaic_gpu, mosaic_gpu_group_norm,
                                 mosaic_gpu_pieces)
from jax_normgrad.pallas import mosaic_gpu_pipeline as pipeline


def describe(problem, *, interpret: bool) -> common.KernelPlan:
  """The kernels ``mosaic_gpu.forward`` / ``mosaic_gpu.backward`` launch for ``problem`` (a
  ``kernels.Problem``), and their plan: per kernel its row (SMEM rows x width), stages and CTAs.

  LayerNorm / RMSNorm rows held whole (one kernel each way), or cut in pieces (a moments or
  sums kernel first: the backward's where dx is asked for); GroupNorm's NCHW segments held whole
  (one kernel each way), else two passes over rows (sums, then apply: the backward's where dx
  is asked for).
  """
  seg, backward = problem.seg, problem.backward
  # The kernels read one dtype: a backward's x and dy of two dtypes are widened to float32.
  itemsize = 4 if backward and problem.dtype != problem.dy_dtype else problem.itemsize
  mask = problem.mask if backward else (True, False, False)
  has_weight, has_bias = problem.params
  if seg.kind != "rows":
    return _group_norm(seg, itemsize, backward, mask, has_bias, interpret)
  if backward:
    kw = dict(has_gamma=has_weight, mask=mask, extra_bytes=problem.extra_bytes)
    plan = mosaic_gpu.backward_plan(seg, itemsize, **kw)
  else:
    kw = dict(params=has_weight + has_bias, extra_bytes=problem.extra_bytes)
    plan = mosaic_gpu.forward_plan(seg, itemsize, **kw)
  way = "bwd" if backward else "fwd"
  if plan is not None:
    return common.KernelPlan("whole rows", (_name(way),),
                             _launch(way, plan, pipeline.Launch(seg, plan, interpret)))
  if backward:
    pieces, plan, sums_plan = mosaic_gpu_pieces.backward_plans(seg, itemsize, **kw)
  else:
    pieces, plan, sums_plan = mosaic_gpu_pieces.forward_plans(
        seg, itemsize, **kw, residual_bytes=problem.residual_bytes)
  launches = []
  if sums_plan is not None:
    rows = mosaic_gpu_pieces.PieceRows(seg, pieces, plan.padded).rows
    launches.append((f"{way}_{'sums' if backward else 'stats'}", sums_plan,
                     pipeline.Launch(rows, sums_plan, interpret)))
  launches.append((way, plan, pipeline.Launch(seg, plan, interpret, pieces=pieces)))
  return _plan(f"rows in {pieces} pieces", launches)


def _group_norm(seg, itemsize, backward, mask, has_bias, interpret) -> common.KernelPlan:
  way = "bwd" if backward else "fwd"
  kind = common.KINDS[seg.kind]
  whole = mosaic_gpu_group_norm.whole_segments(seg, itemsize, backward=backward, mask=mask)
  if whole is not None:
    _, plan = whole
    launch = mosaic_gpu_group_norm.segment_launch(seg, plan, interpret)
    return common.KernelPlan(f"{kind}, segments whole", (_name(way),), _launch(way, plan, launch))
  rows = mosaic_gpu_group_norm.GroupRows(seg)
  sums_plan, apply_plan = rows.plans(itemsize, backward=backward, mask=mask, has_r=has_bias)
  launches = [(f"{way}_{'sums' if backward else 'stats'}", sums_plan,
               pipeline.Launch(rows.rows, sums_plan, interpret))]
  if apply_plan is not None:
    launches.append((way, apply_plan, pipeline.Launch(rows.rows, apply_plan, interpret)))
  pieces = f" in {rows.pieces} pieces" if rows.pieces > 1 else ""
  return _plan(f"{kind}, two passes over rows{pieces}", launches)


def _plan(variant, launches) -> common.KernelPlan:
  return common.KernelPlan(variant, tuple(_name(n) for n, _, _ in launches),
                           "; ".join(_launch(*launch) for launch in launches))


def _launch(way: str, plan: config.MosaicGpuPlan, launch: pipeline.Launch) -> str:
  """One kernel's plan: its row in SMEM, the stages streamed, where outputs go, its CTAs."""
  stages = f"{plan.stages} stage{'s' * (plan.stages > 1)}"
  out = ", output over input" if plan.in_place else ""
  return (f"{way}: rows of {plan.chunks}x{plan.width}, {stages}{out}, "
          f"{launch.grid[0]} CTAs")


def _name(way: str) -> str:
  return f"jax_normgrad_norm_{way}"
