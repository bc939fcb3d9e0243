"""The entry to the Pallas kernels: a problem handed to the backend chosen for it.

The layer above the kernel modules: ``gpu`` (Triton), ``mosaic_gpu`` and
``tpu`` hold the kernels, over the segment view and per-tile math of
``common``; ``forward`` and ``backward`` hand them a problem, with the
backend that ``jax_normgrad._dispatch`` chose (its name: "triton",
"mosaic_gpu" or "mosaic_tpu"), importing them on first lowering, and
``describe`` tells their plan. What a kernel will be handed
(:class:`Problem`, ``forward_problem``, ``backward_problem``) is
``problem``'s, named here for the lowerings above (``layer_norm``,
``group_norm``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_normgrad import _platforms
from jax_normgrad.pallas.common import KernelPlan, Segments
from jax_normgrad.pallas.problem import (Problem, backward_problem,  # noqa: F401
                                         forward_problem, y_plan)

F32 = jnp.float32

#: The Pallas backends a lowering may be handed.
BACKENDS = ("triton", "mosaic_gpu", "mosaic_tpu")


def describe(problem: Problem, backend: str, *, interpret: bool) -> KernelPlan | None:
  """The :class:`KernelPlan` of ``problem`` on ``backend`` (None for an empty problem, which
  runs no kernel)."""
  if problem.empty:
    return None
  _, tpu = _backends()
  if backend == "mosaic_tpu":
    return tpu.describe(problem, interpret=interpret)
  if backend == "mosaic_gpu":
    from jax_normgrad.pallas import mosaic_gpu_describe  # pylint: disable=g-import-not-at-top
    return mosaic_gpu_describe.describe(problem, interpret=interpret)
  from jax_normgrad.pallas import gpu_describe  # pylint: disable=g-import-not-at-top
  return gpu_describe.describe(problem, interpret=interpret)


def _gpu_kernels(backend: str):
  """The GPU kernel module of ``backend``: Mosaic GPU's, else Triton's (whose module is ``gpu``)."""
  gpu, _ = _backends()
  if backend != "mosaic_gpu":
    return gpu
  from jax_normgrad.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
  return mosaic_gpu


def dispatch(gpu_fn, tpu_fn, arrays, *, interpret: bool, backend: str, **static):
  """Runs ``gpu_fn`` on CUDA/ROCm, ``tpu_fn`` on TPU; on CPU, interpreted, the one of ``backend``.

  The GPU/TPU choice is ``_platforms.kernels_switch``, the package's one
  table of which kernels each platform runs, staged: the branch of the
  platform being lowered is the only one compiled. On CPU
  ``backend`` "mosaic_tpu" interprets the TPU kernels, "triton" and
  "mosaic_gpu" the GPU kernels (``gpu_fn``; Mosaic GPU's in Pallas' GPU
  interpret mode). Both return the final outputs, so the branches have the
  same types.
  """
  if interpret:
    fn = tpu_fn if backend == "mosaic_tpu" else gpu_fn
    return fn(*arrays, interpret=True, **static)
  gpu = functools.partial(gpu_fn, interpret=False, **static)
  return _platforms.kernels_switch(*arrays, gpu=gpu,
                                  tpu=functools.partial(tpu_fn, interpret=False, **static))


def _backends():
  """The kernel modules, imported on first lowering: importing Pallas costs about
  0.3 s, which ``import jax_normgrad`` should not pay on CPU."""
  from jax_normgrad.pallas import gpu, tpu  # pylint: disable=g-import-not-at-top
  return gpu, tpu


def forward(seg: Segments, x, weight, bias, *, eps: float, interpret: bool, y_dtype=None,
            backend: str = "triton", residual=None, h_dtype=None):
  """``(y, mean | None, rstd)``: ``y`` like x ``(n, major, minor)``, statistics ``(n, groups)`` float32.

  y is in ``y_dtype`` (None: x's). A float32 y from a 16-bit x widens x first
  (exactly; an XLA convert), so y is rounded once. A 16-bit y from a float32
  x is written by the Triton and TPU kernels themselves (``y_dtype`` passed
  on); the Mosaic GPU kernels write float32 and XLA rounds it after them.

  ``residual`` (x's shape, x's dtype or float32): the kernels normalize
  ``h = x + residual`` as it is stored: summed in float32 tile by tile and
  rounded to ``h_dtype`` (None: x's), statistics and y from that h
  (``common.stored_sum``), which they also write: the result is
  ``(y, mean | None, rstd, h)``.
  """
  kernel_x_dtype, narrow_y = y_plan(x.dtype, y_dtype)
  if x.dtype != kernel_x_dtype:
    x = x.astype(kernel_x_dtype)
  narrow = {} if narrow_y is None else dict(y_dtype=narrow_y)  # the kernels round y themselves
  _, tpu = _backends()
  kernels = _gpu_kernels(backend)
  stats = jnp.zeros((seg.n, seg.groups), F32)
  if residual is not None:
    h_dtype = jnp.dtype(h_dtype or x.dtype)
    if x.size == 0:
      return jnp.zeros_like(x), (stats if seg.centered else None), stats, jnp.zeros(x.shape, h_dtype)
    assert kernels.FUSES_RESIDUAL, kernels.__name__
    return dispatch(kernels.forward, tpu.forward, (x, residual, weight, bias),
                    interpret=interpret, backend=backend, seg=seg, eps=eps, h_dtype=h_dtype)
  if x.size == 0:
    return (jnp.zeros(x.shape, narrow.get("y_dtype", x.dtype)), (stats if seg.centered else None),
            stats)
  return dispatch(kernels.forward, tpu.forward, (x, weight, bias), interpret=interpret,
                  backend=backend, seg=seg, eps=eps, **narrow)


def backward(seg: Segments, dy, x, mean, rstd, weight, mask, *, interpret: bool,
             backend: str = "triton", bias=None, dh=None, dx_dy: bool = False):
  """``(dx | None, dweight | None, dbias | None)`` for ``mask`` (three bools), [dx in dy's dtype].

  ``bias`` is read only with ``seg.activation`` (the kernels then take it
  after the weight).

  ``dx`` like x; ``dweight``, ``dbias`` of shape ``(param_groups, channels)``
  float32. Empty inputs give an empty ``dx`` and zero parameter gradients.
  ``dy`` may be float32 with a 16-bit x (the backward of a float32 y), or
  16-bit with a float32 x (the residual form's float32 h). GPU kernel
  modules with ``MIXED_DTYPES`` (Triton's) and the TPU kernels read each in
  its own dtype, write dx in x's and, with ``dx_dy`` (needs ``mask[0]``), dx
  once more rounded to dy's dtype. The Mosaic GPU kernels take one dtype:
  with them x and dy are widened (exactly) in XLA, and dx rounded to x's
  (and dy's) dtype after them (the TPU branch then gets the same). ``dh``
  (x's shape; needs ``mask[0]``): added to dx in float32 in the kernels'
  output pass, before dx's rounding.
  """
  _, tpu = _backends()
  kernels = _gpu_kernels(backend)
  assert mask[0] or not dx_dy, "dx_dy needs dx"
  if not any(mask):
    return (None, None, None)
  if x.size == 0:
    zeros = jnp.zeros((seg.param_groups, seg.channels), F32)
    return (jnp.zeros_like(x) if mask[0] else None,) + tuple(
        zeros if m else None for m in mask[1:]) + ((jnp.zeros_like(dy),) if dx_dy else ())
  x_dtype, dy_dtype = x.dtype, dy.dtype
  if dh is not None:  # the residual form (rows; no activation, so no bias)
    assert kernels.FUSES_RESIDUAL, kernels.__name__
    operands = (dy, x, mean, rstd, weight, None, dh)
  else:
    params = (weight, bias) if seg.activation is not None else (weight,)
    operands = (dy, x, mean, rstd) + params
  # Whether the GPU kernels read dy and x in their own dtypes; the TPU
  # branch of ``dispatch`` takes the same operands and ``dx_dy`` (its kernels
  # read mixed dtypes too).
  mixed = getattr(kernels, "MIXED_DTYPES", False)
  if dy_dtype != x_dtype and not mixed:
    operands = (dy.astype(F32), x.astype(F32)) + operands[2:]
  outs = dispatch(kernels.backward, tpu.backward, operands, interpret=interpret,
                  backend=backend, seg=seg, mask=tuple(mask),
                  **(dict(dx_dy=dx_dy) if mixed else {}))
  dx, dweight, dbias = outs[:3]
  rest = ()
  if dx_dy:
    rest = (outs[3],) if mixed else (dx.astype(dy_dtype),)
  return ((None if dx is None else dx.astype(x_dtype)), dweight, dbias) + rest
