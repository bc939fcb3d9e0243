"""Which kernels run a problem: the Pallas GPU backend, and the forward and backward that dispatch.

The layer above the kernel modules: ``gpu`` (Triton), ``mosaic_gpu`` and
``tpu`` hold the kernels, over the segment view and per-tile math of
``common``; this module chooses among them (``gpu_backend``, at each
lowering, from ``implementation``, ``JAX_NORMGRAD_GPU_BACKEND`` and the
targeted GPU: ``gpu_target``) and hands them a problem (``forward``,
``backward``), importing them on first lowering. Where no Pallas GPU kernel
can run, the lowerings run the pure-JAX reference (``with_reference``); and
the package's GPU lowerings run with jax's Pallas Triton deprecation warning
ignored (``quiet_lowering``). Above it stand the lowerings (``layer_norm``,
``group_norm``) and ``jax_normgrad._implementation``, which imports the
backend choice from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import threading
import warnings
from typing import Callable

import jax.numpy as jnp
from jax import lax

from jax_normgrad import _compat
from jax_normgrad._fallback import warn_once
from jax_normgrad.pallas import config, gpu_target
from jax_normgrad.pallas.common import Segments

F32 = jnp.float32

#: The Pallas GPU backends ``implementation`` may name.
GPU_BACKENDS = ("triton", "mosaic_gpu")

#: The environment variable choosing the GPU backend of "pallas" (and of None).
GPU_BACKEND_ENV = "JAX_NORMGRAD_GPU_BACKEND"


@dataclasses.dataclass(frozen=True)
class GpuBackend:
  """The Pallas GPU backend a lowering was asked for (``gpu_backend``).

  ``name`` is "triton", "mosaic_gpu" or "xla" (see ``no_triton``).
  ``forced``: the user named it (``implementation="mosaic_gpu"``), so a
  problem its kernels cannot run raises; otherwise
  (``JAX_NORMGRAD_GPU_BACKEND``) Triton runs it instead, with a
  ``FallbackWarning``.
  """

  name: str = "triton"
  forced: bool = False
  #: Why Pallas Triton cannot lower for the targeted GPU (``gpu_target.triton_problem``),
  #: None when it can. With "mosaic_gpu": what those kernels cannot run falls
  #: to the reference, not to Triton. ``name`` "xla": no Pallas GPU kernel
  #: runs on this GPU; the reference runs (``with_reference``).
  no_triton: str | None = None


TRITON = GpuBackend()


class NoGpuKernel(Exception):
  """No Pallas GPU kernel can run this problem on the targeted GPU (the message says why)."""


def gpu_backend(implementation: str, platform: str, op: str) -> GpuBackend:
  """The Pallas GPU backend of a resolved Pallas ``implementation`` ("pallas", "triton", "mosaic_gpu").

  A backend named by ``implementation`` is forced. "pallas" on CUDA takes
  ``JAX_NORMGRAD_GPU_BACKEND`` (default "triton") as a preference; on ROCm and
  with a jax lacking the Mosaic GPU API a preference for it is announced and
  Triton runs. On CPU and TPU the variable does not apply.

  On a GPU that Pallas Triton does not lower for (``gpu_target.triton_problem``:
  jax 0.11+ lists the GPU kinds it knows), "pallas" runs the Mosaic GPU
  kernels where they can stand in (sm_90+), else the pure-JAX reference
  (backend "xla"), announced; "triton" raises.
  """
  if implementation in GPU_BACKENDS:
    if implementation == "triton" and platform in ("cuda", "rocm"):
      if problem := gpu_target.triton_problem():
        raise ValueError(f"{op}: implementation='triton' cannot run here: {problem}")
    return GpuBackend(implementation, forced=True)
  if platform not in ("cuda", "rocm"):
    return TRITON
  preferred = os.environ.get(GPU_BACKEND_ENV, "") or "triton"
  if preferred not in GPU_BACKENDS:
    raise ValueError(f"{GPU_BACKEND_ENV}: expected one of {GPU_BACKENDS} (or unset), "
                     f"got {preferred!r}")
  no_triton = gpu_target.triton_problem()
  if preferred == "mosaic_gpu":
    reason = ("Mosaic GPU does not run on ROCm" if platform == "rocm"
              else _compat.mosaic_gpu_api_missing())
    if not reason:
      return GpuBackend("mosaic_gpu", forced=False, no_triton=no_triton)
    if not no_triton:
      warn_once(f"jax_normgrad: {op}: {GPU_BACKEND_ENV}=mosaic_gpu, but {reason}; the Triton "
                f"kernels run instead.")
  if not no_triton:
    return TRITON
  if not (reason := gpu_target.mosaic_gpu_problem(platform)):
    warn_once(f"jax_normgrad: {op}: {no_triton}; the Mosaic GPU kernels run instead (and the "
              f"pure-JAX reference what they cannot run).")
    return GpuBackend("mosaic_gpu", forced=False, no_triton=no_triton)
  warn_once(f"jax_normgrad: {op}: {no_triton}; {reason}. The pure-JAX reference ('xla') runs "
            f"instead; pass implementation='xla' to silence this.")
  return GpuBackend("xla", no_triton=no_triton)


def with_reference(pallas: Callable, xla: Callable, op: str) -> Callable:
  """The lowering function ``pallas``, falling back to ``xla`` where no Pallas GPU kernel can run.

  That is where ``gpu_backend`` chose the backend "xla", and where the Mosaic
  GPU kernels standing in for Triton cannot run the problem
  (``NoGpuKernel``, raised before any kernel is traced).
  """

  @functools.wraps(pallas)
  def lower(*args, interpret, gpu_backend=TRITON, **params):
    if gpu_backend.name == "xla":
      return xla(*args, **params)
    try:
      return pallas(*args, interpret=interpret, gpu_backend=gpu_backend, **params)
    except NoGpuKernel as e:
      warn_once(f"jax_normgrad: {op}: {e}; the pure-JAX reference ('xla') runs it instead.")
      return xla(*args, **params)

  return lower


#: The start of jax's DeprecationWarning at each lowering of a Pallas Triton kernel
#: (jax 0.11+, ``jax/_src/pallas/pallas_call.py``, deprecation "jax-pallas-triton"):
#: "The Pallas Triton backend is deprecated and will be removed in a future JAX version. ..."
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"

#: Our filter's pattern: that text, tagged (a regex comment) so that the entry is
#: ours alone, never equal to one a user added (jax's own tests add that text).
_FILTER_PATTERN = re.escape(TRITON_DEPRECATION) + "(?# jax_normgrad)"
_FILTER_LOCK = threading.Lock()
_filter_users = 0


@contextlib.contextmanager
def triton_deprecation_ignored():
  """Ignores jax's Pallas Triton DeprecationWarning (``TRITON_DEPRECATION``) inside the block.

  Around the package's own GPU lowerings (``quiet_lowering``): the package
  chose the backend, so its users have nothing to act on. Only that message
  and category; other warnings, and that one outside the block, are shown
  as before. One filter entry is shared by the blocks of all threads, put
  first in ``warnings.filters`` when the first block starts and removed when
  the last ends: ``warnings.catch_warnings`` saves and restores the whole
  list, so two lowerings overlapping in two threads could leave the filter
  behind, or drop one a user added meanwhile. (An ignored warning is not
  recorded in any ``__warningregistry__``, so removing the entry leaves no
  trace.)
  """
  global _filter_users  # pylint: disable=global-statement
  with _FILTER_LOCK:
    if _filter_users == 0:
      warnings.filterwarnings("ignore", message=_FILTER_PATTERN, category=DeprecationWarning)
    _filter_users += 1
  try:
    yield
  finally:
    with _FILTER_LOCK:
      _filter_users -= 1
      if _filter_users == 0:  # list.remove: one step, whatever other threads do to the list
        for entry in [f for f in warnings.filters if _is_ours(f)]:
          with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)


def _is_ours(entry) -> bool:
  message = entry[1]
  return message is not None and message.pattern == _FILTER_PATTERN


def quiet_lowering(rule: Callable, platform: str) -> Callable:
  """The lowering rule ``rule``, on CUDA and ROCm run with ``triton_deprecation_ignored``.

  The Pallas Triton lowering, where jax 0.11+ warns, runs inside the rule
  (``mlir.lower_fun`` traces and lowers the kernels there).
  """
  if platform not in ("cuda", "rocm"):
    return rule

  @functools.wraps(rule)
  def quiet(*args, **kwargs):
    with triton_deprecation_ignored():
      return rule(*args, **kwargs)

  return quiet


def _gpu_kernels(backend: GpuBackend, seg: Segments, itemsize: int, *, backward: bool, op: str,
                 extra_bytes: int = 0):
  """The GPU kernel module for ``seg``: Mosaic GPU when asked for and able, else Triton.

  ``extra_bytes``: the residual form's further rows, bytes per element (the
  residual and h forward, dh backward; ``mosaic_gpu.unsupported``).
  """
  gpu, _ = _backends()
  if backend.name != "mosaic_gpu":
    return gpu
  from jax_normgrad.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
  reason = mosaic_gpu.unsupported(seg, itemsize, backward=backward, extra_bytes=extra_bytes)
  if reason is None:
    return mosaic_gpu
  if backend.forced:
    raise ValueError(f"{op}: implementation='mosaic_gpu' cannot run this problem: {reason}")
  if backend.no_triton:
    raise NoGpuKernel(f"the Mosaic GPU kernels cannot run this problem ({reason}), and "
                      f"{backend.no_triton}")
  warn_once(
      f"jax_normgrad: {op}: the Mosaic GPU kernels (JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu) cannot "
      f"run this problem ({reason}); the Triton kernels run it instead.")
  return gpu


def dispatch(gpu_fn, tpu_fn, arrays, *, interpret: bool, mosaic_gpu: bool = False, **static):
  """Runs ``gpu_fn`` on CUDA/ROCm, ``tpu_fn`` on TPU, either interpreted on CPU.

  The lowering rule is shared by every platform and only says whether to
  interpret, so the GPU/TPU choice is staged with ``lax.platform_dependent``:
  the branch of the platform being lowered is the only one compiled. On CPU
  the tuning's ``interpret_backend`` picks which kernels the interpreter runs,
  unless ``gpu_fn`` is a Mosaic GPU kernel (``mosaic_gpu``), which runs in
  Pallas' GPU interpret mode. Both return the final outputs, so the branches
  have the same types.
  """
  if interpret:
    use_tpu = config.current().interpret_backend == "tpu" and not mosaic_gpu
    fn = tpu_fn if use_tpu else gpu_fn
    return fn(*arrays, interpret=True, **static)
  gpu = functools.partial(gpu_fn, interpret=False, **static)
  return lax.platform_dependent(*arrays, cuda=gpu, rocm=gpu,
                                tpu=functools.partial(tpu_fn, interpret=False, **static))


def _backends():
  """The kernel modules, imported on first lowering: importing Pallas costs about
  0.3 s, which ``import jax_normgrad`` should not pay on CPU."""
  from jax_normgrad.pallas import gpu, tpu  # pylint: disable=g-import-not-at-top
  return gpu, tpu


def _residual_kernels(gpu_backend: GpuBackend, seg: Segments, itemsize: int, *, backward: bool,
                      op: str, extra_bytes: int):
  """The GPU kernel module for the residual form (``_gpu_kernels``).

  Every GPU kernel module fuses the residual (``FUSES_RESIDUAL``): its
  ``forward`` takes ``residual`` and ``h_dtype``, its ``backward`` ``dh``; the
  TPU kernels do too. ``extra_bytes``: the residual's and h's bytes per
  element forward, dh's backward.
  """
  kernels = _gpu_kernels(gpu_backend, seg, itemsize, backward=backward, op=op,
                         extra_bytes=extra_bytes)
  assert getattr(kernels, "FUSES_RESIDUAL", False), kernels.__name__
  return kernels


def forward(seg: Segments, x, weight, bias, *, eps: float, interpret: bool, y_dtype=None,
            gpu_backend: GpuBackend = TRITON, op: str = "norm_fwd", residual=None, h_dtype=None):
  """``(y, mean | None, rstd)``: ``y`` like x ``(n, a, b)``, statistics ``(n, groups)`` float32.

  y is in ``y_dtype`` (None: x's). A float32 y from a 16-bit x widens x first
  (exactly; an XLA convert), so y is rounded once. A 16-bit y from a float32
  x is written by the Triton and TPU kernels themselves (``y_dtype`` passed
  on); the Mosaic GPU kernels write float32 and XLA rounds it after them.

  ``residual`` (x's shape, x's dtype or float32): the kernels normalize
  ``h = x + residual``, summed in float32 tile by tile (statistics and y from
  the unrounded sum), and also write h in ``h_dtype`` (None: x's): the
  result is ``(y, mean | None, rstd, h)``.
  """
  narrow = {}
  if y_dtype is not None and jnp.dtype(y_dtype) != x.dtype:
    if jnp.dtype(y_dtype).itemsize < x.dtype.itemsize:
      narrow = dict(y_dtype=jnp.dtype(y_dtype))  # the kernels round y themselves
    else:
      x = x.astype(y_dtype)
  gpu, tpu = _backends()
  stats = jnp.zeros((seg.n, seg.groups), F32)
  if residual is not None:
    h_dtype = jnp.dtype(h_dtype or x.dtype)
    if x.size == 0:
      return jnp.zeros_like(x), (stats if seg.centered else None), stats, jnp.zeros(x.shape, h_dtype)
    kernels = _residual_kernels(gpu_backend, seg, x.dtype.itemsize, backward=False, op=op,
                                extra_bytes=residual.dtype.itemsize + h_dtype.itemsize)
    return dispatch(kernels.forward, tpu.forward, (x, residual, weight, bias),
                    interpret=interpret, mosaic_gpu=kernels is not gpu, seg=seg, eps=eps,
                    h_dtype=h_dtype)
  if x.size == 0:
    return (jnp.zeros(x.shape, narrow.get("y_dtype", x.dtype)), (stats if seg.centered else None),
            stats)
  kernels = _gpu_kernels(gpu_backend, seg, x.dtype.itemsize, backward=False, op=op)
  return dispatch(kernels.forward, tpu.forward, (x, weight, bias), interpret=interpret,
                  mosaic_gpu=kernels is not gpu, seg=seg, eps=eps, **narrow)


def backward(seg: Segments, dy, x, mean, rstd, gamma, mask, *, interpret: bool,
             gpu_backend: GpuBackend = TRITON, op: str = "norm_bwd", beta=None, dh=None,
             dx_dy: bool = False):
  """``(dx | None, dgamma | None, dbeta | None)`` for ``mask`` (three bools), [dx in dy's dtype].

  ``beta`` is read only with ``seg.activation`` (the kernels then take it
  after gamma).

  ``dx`` like x; ``dgamma``, ``dbeta`` of shape ``(param_groups, channels)``
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
  gpu, tpu = _backends()
  assert mask[0] or not dx_dy, "dx_dy needs dx"
  if not any(mask):
    return (None, None, None)
  if x.size == 0:
    zeros = jnp.zeros((seg.param_groups, seg.channels), F32)
    return (jnp.zeros_like(x) if mask[0] else None,) + tuple(
        zeros if m else None for m in mask[1:]) + ((jnp.zeros_like(dy),) if dx_dy else ())
  x_dtype, dy_dtype = x.dtype, dy.dtype
  if dh is not None:  # the residual form (rows; no activation, so no beta)
    kernels = _residual_kernels(gpu_backend, seg, x.dtype.itemsize, backward=True, op=op,
                                extra_bytes=dh.dtype.itemsize)
    operands = (dy, x, mean, rstd, gamma, None, dh)
  else:
    kernels = _gpu_kernels(gpu_backend, seg, x.dtype.itemsize, backward=True, op=op)
    params = (gamma, beta) if seg.activation is not None else (gamma,)
    operands = (dy, x, mean, rstd) + params
  # Whether the GPU kernels read dy and x in their own dtypes; the TPU
  # branch of ``dispatch`` takes the same operands and ``dx_dy`` (its kernels
  # read mixed dtypes too).
  mixed = getattr(kernels, "MIXED_DTYPES", False)
  if dy_dtype != x_dtype and not mixed:
    operands = (dy.astype(F32), x.astype(F32)) + operands[2:]
  outs = dispatch(kernels.backward, tpu.backward, operands, interpret=interpret,
                  mosaic_gpu=kernels is not gpu, seg=seg, mask=tuple(mask),
                  **(dict(dx_dy=dx_dy) if mixed else {}))
  dx, dgamma, dbeta = outs[:3]
  rest = ()
  if dx_dy:
    rest = (outs[3],) if mixed else (dx.astype(dy_dtype),)
  return ((None if dx is None else dx.astype(x_dtype)), dgamma, dbeta) + rest
