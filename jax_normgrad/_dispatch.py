"""Which implementation runs each op, and why: the one place that decides.

Every primitive of the package carries ``implementation`` (the user's
choice) and, for the forwards, ``forward``; the choice is made here when the
primitive is lowered, where the platform is known, by :func:`choose`.

The implementations, each an :class:`Implementation` that says whether it can
run a problem and, if not, why (:meth:`Implementation.cannot_run`):

==============  ==========================================  =======================
name            what                                        runs on
==============  ==========================================  =======================
``"ffi"``       the C++ kernels, an XLA FFI custom call     cpu
``"triton"``    the Pallas Triton kernels                   cuda, rocm (cpu: interpreted)
``"mosaic_gpu"``  the Pallas Mosaic GPU kernels (sm_90+)     cuda (cpu: GPU interpret mode)
``"mosaic_tpu"``  the Pallas TPU (Mosaic) kernels             tpu (cpu: interpreted)
``"xla"``       the pure-JAX reference (``reference.py``)   everywhere
==============  ==========================================  =======================

The rule. ``implementation=None`` walks the platform's preference list
(:func:`preferences`): cpu ``ffi, xla``; cuda ``triton, mosaic_gpu, xla``
(``JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu``: ``mosaic_gpu, triton, xla``); rocm
``triton, xla`` (the same variable: ``mosaic_gpu, triton, xla``, the Mosaic GPU
kernels passed over there with a warning); tpu ``mosaic_tpu, xla``. The first
that can run the problem runs it; where that is not the first, one
``FallbackWarning`` (once per message) names each one passed over and why. ``"pallas"`` is the same list
without the CPU kernels (on the CPU: the Triton kernels, interpreted). Any
other name runs that implementation, or raises ``ValueError`` saying why it
cannot. A forward whose ``forward`` is "xla" (or "auto", a layer's default,
with ``implementation=None`` where the forward default is "xla":
``_settings``) runs the reference, as asked: no fallback, no warning.

This module is the policy alone: the lowering rule that asks it and lowers
the choice is ``_lowering``'s; ``_explain`` asks it for a traced function
(``explain``) and per primitive (``default_implementations``), without
compiling anything.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from jax_normgrad import _compat, _ffi, _platforms, _settings
from jax_normgrad.pallas import gpu_target, kernels

PLATFORMS = _platforms.PLATFORMS

#: The values of a forward primitive's ``forward`` parameter (the layers' ``forward`` option;
#: "auto" is their None).
FORWARDS = ("kernel", "xla", "auto")


@dataclasses.dataclass(frozen=True)
class Request:
  """What an implementation is asked to run: the op, where, and the kernels' problem.

  ``problem`` and ``auto_partitioned`` are called only by the implementations
  that need them (the kernel problem imports nothing heavy, but a Mosaic GPU
  check imports Pallas). ``named``: the user named this implementation (by
  ``implementation=`` or ``JAX_NORMGRAD_GPU_BACKEND``), so it runs wherever it
  is not known to fail. ``lowering``: asked by the op's lowering, which may
  prepare jax for the implementation it then lowers (register the GPU with
  Pallas Triton: ``gpu_target.triton_problem``); a query (``explain``,
  ``default_implementations``) changes nothing.
  """

  op: str
  platform: str
  problem: Callable[[], kernels.Problem | None]
  auto_partitioned: Callable[[], bool] = lambda: False
  lowering: bool = False
  named: bool = False


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to lower the primitives; ``cannot_run`` is None where it can run a request."""

  name: str
  #: How messages name it (plural: "the ... kernels").
  title: str
  #: The platforms it is compiled for; ``interpreted``: also the CPU, interpreted.
  platforms: tuple[str, ...]
  interpreted: bool = False

  def cannot_run(self, request: Request) -> str | None:
    if request.platform in self.platforms or (self.interpreted and request.platform == "cpu"):
      return self._cannot_run_here(request)
    cpu = ", interpreted on cpu" if self.interpreted else ""
    return f"{self.title} run on {' and '.join(self.platforms)}{cpu}"

  def _cannot_run_here(self, request: Request) -> str | None:
    del request
    return None

  def describe(self, request: Request) -> kernels.KernelPlan | str | None:
    """The kernels it runs for ``request`` and their plan, for :func:`explain` (None: not told)."""
    problem = request.problem() if self.name in kernels.BACKENDS else None
    if problem is None:
      return None
    return kernels.describe(problem, self.name, interpret=request.platform == "cpu")

  @property
  def verb(self) -> str:
    return "run" if self.title.endswith("kernels") else "runs"


class _Ffi(Implementation):

  def _cannot_run_here(self, request):
    del request
    if not _ffi.available():
      return f"jax_normgrad's C++ extension failed to import: {_ffi.import_error()}"
    return None

  def describe(self, request):
    del request
    return f"the {_ffi.isa()} build of the C++ kernels" if _ffi.available() else None


class _Triton(Implementation):

  def _cannot_run_here(self, request):
    if request.platform == "cpu":
      return None
    return gpu_target.triton_problem(register=request.lowering)


class _MosaicGpu(Implementation):

  def _cannot_run_here(self, request):
    if request.platform != "cpu":
      device = gpu_target.mosaic_gpu_problem(known_device=not request.named)
      if device:
        return device
    problem = request.problem()
    if problem is None or problem.empty:
      return _compat.mosaic_gpu_api_missing()
    from jax_normgrad.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
    return mosaic_gpu.unsupported(problem.seg, problem.itemsize, backward=problem.backward,
                                  extra_bytes=problem.extra_bytes)


class _MosaicTpu(Implementation):

  def _cannot_run_here(self, request):
    if request.platform not in _platforms.CUSTOM_PARTITIONING and request.auto_partitioned():
      return ("the op is in a multi-device jit over mesh axes that XLA partitions (Auto axes), "
              "where it would have to partition the Pallas TPU kernel, which it cannot (JAX's "
              "custom_partitioning rules do not run on TPU). Two ways run the kernels on each "
              "device's shard: make the mesh axes Explicit (jax.make_mesh(..., axis_types="
              "(jax.sharding.AxisType.Explicit, ...)) and jax.set_mesh), or write the step "
              "with jax.shard_map")
    return None


FFI = _Ffi("ffi", "the C++ kernels", ("cpu",))
TRITON = _Triton("triton", "the Triton kernels", _platforms.GPUS, interpreted=True)
MOSAIC_GPU = _MosaicGpu("mosaic_gpu", "the Mosaic GPU kernels", ("cuda",), interpreted=True)
MOSAIC_TPU = _MosaicTpu("mosaic_tpu", "the TPU kernels", ("tpu",), interpreted=True)
XLA = Implementation("xla", "the pure-JAX reference ('xla')", PLATFORMS)

#: Every implementation by name (those of ``kernels.BACKENDS`` run Pallas kernels).
IMPLEMENTATIONS = {i.name: i for i in (FFI, TRITON, MOSAIC_GPU, MOSAIC_TPU, XLA)}


def preferences(platform: str, implementation: str | None,
                settings: _settings.Settings) -> tuple[str, ...]:
  """The implementations ``implementation`` (None or "pallas") tries on ``platform``, in order."""
  if platform == "cpu":
    return ("ffi", "xla") if implementation is None else ("triton",)
  if platform == "tpu":
    return ("mosaic_tpu", "xla")
  if platform == "rocm":
    return ("mosaic_gpu", "triton", "xla") if settings.gpu_backend == "mosaic_gpu" else (
        "triton", "xla")
  if settings.gpu_backend == "mosaic_gpu":
    return ("mosaic_gpu", "triton", "xla")
  return ("triton", "mosaic_gpu", "xla")


@dataclasses.dataclass(frozen=True)
class Choice:
  """What runs an op (``implementation``), why, and what was passed over (``skipped``)."""

  op: str
  platform: str
  implementation: str
  why: str
  skipped: tuple[tuple[str, str], ...] = ()

  @property
  def warning(self) -> str | None:
    """The ``FallbackWarning`` of a fallback (None where the first choice runs)."""
    if not self.skipped:
      return None
    chosen = IMPLEMENTATIONS[self.implementation]
    passed = "; ".join(f"{IMPLEMENTATIONS[n].title} cannot run it: {r}" for n, r in self.skipped)
    hint = " Pass implementation='xla' to silence this." if chosen is XLA else ""
    instead = f"{chosen.title} {chosen.verb} it instead."
    return (f"jax_normgrad: {self.op} on {self.platform}: {passed}. "
            f"{instead[0].upper()}{instead[1:]}{hint}")


def choose(op: str, implementation: str | None, platform: str, *, forward: str = "kernel",
           problem: Callable[[], kernels.Problem | None] = lambda: None,
           auto_partitioned: Callable[[], bool] = lambda: False,
           lowering: bool = False) -> Choice:
  """The implementation that lowers ``op`` on ``platform``, by the rule of the module docstring.

  ``lowering``: asked by the op's lowering (:class:`Request`); else a query, which changes
  nothing in jax.

  Raises:
    ValueError: ``implementation`` names one that cannot run here (the message says why),
      or a bad ``forward``.
  """
  if forward not in FORWARDS:
    raise ValueError(f"forward: expected one of {FORWARDS}, got {forward!r}")
  settings = _settings.current()
  if forward == "xla":
    return Choice(op, platform, "xla", "forward='xla': the jnp forward, fused by XLA")
  if forward == "auto" and implementation is None and settings.layer_forward(platform) == "xla":
    source = (f"{_settings.FORWARD_ENV}=xla" if settings.forward else
              "the layers' forward default on this platform (LAYER_FORWARD_DEFAULT)")
    return Choice(op, platform, "xla", f"forward=None: {source}")
  request = functools.partial(Request, op, platform, problem, auto_partitioned, lowering)
  if implementation not in (None, "pallas"):
    impl = IMPLEMENTATIONS[implementation]
    reason = impl.cannot_run(request(named=True))
    if reason:
      raise ValueError(f"{op}: implementation={implementation!r} cannot run on {platform}: "
                       f"{reason}")
    return Choice(op, platform, implementation, f"implementation={implementation!r}")
  order = preferences(platform, implementation, settings)
  skipped = []
  for name in order:
    named = name == settings.gpu_backend and platform in ("cuda", "rocm")
    reason = IMPLEMENTATIONS[name].cannot_run(request(named=named))
    if reason is None:
      why = (f"implementation={implementation!r}" if implementation else "the default") + (
          f" on {platform} ({', '.join(order)})")
      if named:
        why += f"; {_settings.GPU_BACKEND_ENV}={settings.gpu_backend}"
      return Choice(op, platform, name, why, tuple(skipped))
    skipped.append((name, reason))
  raise ValueError(f"{op}: implementation={implementation!r} cannot run on {platform}: "
                   + "; ".join(f"{n}: {r}" for n, r in skipped))
