"""What the Triton kernels launch for a problem, for ``explain`` (``kernels.describe``).

Decided by the functions ``gpu.forward`` and ``gpu.backward`` decide with, from the problem's
shapes and dtypes alone; ``tests/test_explain_kernels.py`` checks the answer against lowered
modules.
"""

from __future__ import annotations

from jax_normgrad.pallas import common, config, gpu

# The kernels' own planning helpers (this module's sibling's, private to the two of them).
# pylint: disable=protected-access


def describe(problem, *, interpret: bool) -> common.KernelPlan:
  """The kernels ``gpu.forward`` / ``gpu.backward`` launch for ``problem`` (a
  ``kernels.Problem``), and their plan.

  Decided as those functions decide: the sample-wide channels-last kernels where
  ``_nhwc_plan`` gives a plan (not for the residual form, nor a backward with ``dx_dy``),
  else the row kernels, fused (a segment in one tile) or chunked (the backward then with its
  statistics kernel first where dx is asked for); the parameter gradients' partial sums in
  a kernel of their own unless ``gpu_partials_in_xla``.
  """
  seg, backward = problem.seg, problem.backward
  itemsize = max(problem.itemsize, problem.dy_itemsize)
  mask = problem.mask if backward else (True, False, False)
  fused_form = problem.extra_bytes > 0 or problem.dx_dy
  sums = ("sum_partials",) if any(mask[1:]) and not config.triton().gpu_partials_in_xla else ()
  nhwc = None if fused_form else gpu._nhwc_plan(seg, itemsize, backward=backward)
  if nhwc is not None:
    launch = gpu._NhwcLaunch(seg, nhwc, interpret)
    split = launch.parts > 1
    if backward:
      names = (("bwd_nhwc_sums",) if split and mask[0] else ()) + ("bwd_nhwc",) + sums
    else:
      names = (("fwd_nhwc_moments",) if split else ()) + ("fwd_nhwc",)
    odd = f", groups of {nhwc.cg} channels summed by a 0/1 matrix" if nhwc.odd_groups else ""
    detail = (f"tiles of {nhwc.rows} pixels x {nhwc.cols} channels{odd}, {nhwc.num_warps} "
              f"warps, {launch.grid[0]} programs, "
              + (f"each sample in {launch.parts} parts" if split else "whole samples"))
    return common.KernelPlan("sample-wide channels-last", _named(names), detail)
  plan = config.gpu_plan(seg.shape, itemsize, backward=backward,
                         residual=problem.extra_bytes > 0 and not backward)
  launch = gpu._Launch(seg, plan, interpret)
  if backward:
    names = (("bwd_stats",) if mask[0] and not plan.fused else ()) + ("bwd",) + sums
  else:
    names = ("fwd",)
  variant = ("fused " if plan.fused else "chunked ") + common.KINDS[seg.kind]
  tiles = plan.chunks[0] * plan.chunks[1]
  detail = (f"tile {plan.tile[0]}x{plan.tile[1]}, {tiles} tile{'s' * (tiles > 1)} a segment, "
            f"{plan.num_warps} warps, {launch.grid[0]} programs")
  return common.KernelPlan(variant, _named(names), detail)


def _named(names):
  return tuple(f"jax_normgrad_{'' if n == 'sum_partials' else 'norm_'}{n}" for n in names)
