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

:func:`explain` answers for a function and its arguments which
implementation runs each op and why, without compiling anything.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from typing import Callable

import jax
import jaxlib
import numpy as np
from jax.interpreters import mlir

from jax_normgrad import _compat, _ffi, _platforms, _settings
from jax_normgrad._fallback import warn_once
from jax_normgrad.pallas import config, gpu_target, kernels

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


# ----------------------------------------------------------------------------
# The lowering rule of every primitive.


@dataclasses.dataclass(frozen=True)
class Lowerings:
  """A primitive's lowering functions, each of its array operands and its parameters.

  ``xla``: the pure-JAX reference; ``ffi``: the C++ custom call (CPU);
  ``pallas``: the Pallas lowering, which also takes ``interpret`` and
  ``backend`` (a name of ``kernels.BACKENDS``); ``problem``: the kernels' problem
  (``kernels.Problem``) from the operands' shapes and dtypes and the parameters.
  """

  xla: Callable
  ffi: Callable | None = None
  pallas: Callable | None = None
  problem: Callable | None = None


#: primitive name -> its lowerings (``default_implementations``, ``explain``).
_REGISTRY: dict[str, Lowerings] = {}


def register_lowerings(prim, lowerings: Lowerings) -> None:
  """One lowering rule per platform that lowers ``prim`` with the implementation :func:`choose` picks."""
  _REGISTRY[prim.name] = lowerings

  def make_rule(platform):

    def rule(ctx, *args, implementation, forward="kernel", tuning=(), **params):
      with config.lowering(tuning, platform):
        return lower(ctx, *args, implementation=implementation, forward=forward, tuning=tuning,
                     **params)

    def lower(ctx, *args, implementation, forward, tuning, **params):
      choice = choose(prim.name, implementation, platform, forward=forward,
                      problem=_problem_of(lowerings, ctx.avals_in, params),
                      auto_partitioned=lambda: _auto_partitioned(ctx), lowering=True)
      if choice.warning:
        warn_once(choice.warning)
      fn = {"xla": lowerings.xla, "ffi": lowerings.ffi}.get(choice.implementation)
      if fn is None:
        interpret = platform == "cpu"
        fn = functools.partial(lowerings.pallas, interpret=interpret,
                               backend=choice.implementation)
        if interpret and choice.implementation == "mosaic_gpu":
          fn = _in_own_computation(functools.partial(fn, **params), tuning)
          params = {}
        if interpret:
          # Pallas' interpreter (every jax up to 0.11) evaluates a kernel's body on
          # operands that vary inside shard_map next to constants that do not,
          # which check_vma refuses; lowered code needs no varying types.
          ctx = ctx.replace(avals_in=[_compat.without_varying(a) for a in ctx.avals_in])
      return mlir.lower_fun(functools.partial(fn, **params),
                            multiple_results=prim.multiple_results)(ctx, *args)

    return rule

  _platforms.register_per_platform(
      prim, lambda platform: kernels.quiet_lowering(make_rule(platform), platform))


def _problem_of(lowerings: Lowerings, avals, params) -> Callable[[], kernels.Problem | None]:
  if lowerings.problem is None:
    return lambda: None
  return lambda: lowerings.problem(*avals, **params)


_INTERPRET_LOCK = threading.Lock()


def _in_own_computation(fn, tuning):
  """``fn`` run by a host callback as a jitted computation of its own, one at a time.

  For the Mosaic GPU kernels in GPU interpret mode (CPU). The interpreter
  simulates a kernel with ordered callbacks around one process-wide simulated
  GPU, set up and torn down per kernel: two kernels must not overlap, which
  JAX ensures through the ordered effect those callbacks carry. A primitive
  declares no effects (its abstract evaluation knows no platform), so inside
  the primitive's lowering nothing would order two kernels of one program;
  run on its own, the kernel's computation declares the effect, and the lock
  keeps kernels of concurrent computations apart. The kernel is traced when
  the callback first runs, so the primitive's ``tuning`` is applied there.
  """
  jitted = jax.jit(fn)

  def host(*arrays):
    with _INTERPRET_LOCK, config.lowering(tuning, "cpu"):
      return jax.tree.map(np.asarray, jitted(*arrays))

  def run(*args):
    shapes = jax.eval_shape(fn, *args)
    return jax.pure_callback(host, shapes, *args)

  return run


def _auto_partitioned(ctx) -> bool:
  """Whether XLA's SPMD partitioner (not ``shard_map``) splits the op being lowered over devices.

  A ``jit`` over many devices lowers in a sharding context of that many
  devices; inside ``shard_map`` the manual mesh axes are the module's, and
  only mesh axes left automatic (of size > 1) are partitioned by XLA.
  """
  axis_context = ctx.module_context.axis_context
  manual = getattr(axis_context, "manual_axes", None)
  if manual is None:
    return getattr(axis_context, "num_devices", 1) > 1
  mesh = axis_context.mesh
  return any(mesh.shape[a] > 1 for a in mesh.axis_names if a not in manual)


def def_impl_via_jit(prim) -> None:
  """Eager calls of ``prim`` run its lowering through a cached ``jax.jit``."""

  @functools.lru_cache(maxsize=256)
  def jitted(params_key):
    params = dict(params_key)
    return jax.jit(lambda *args: prim.bind(*args, **params))

  def impl(*args, **params):
    return jitted(tuple(sorted(params.items())))(*args)

  prim.def_impl(impl)


# ----------------------------------------------------------------------------
# Asking: which implementation runs what.


def default_platform() -> str:
  """The lowering platform of JAX's default backend (``_platforms.default_platform``)."""
  return _platforms.default_platform()


def default_implementations(platform: str | None = None) -> dict[str, str]:
  """Which implementation ``implementation=None`` runs, per primitive, on ``platform``.

  Args:
    platform: "cpu", "cuda", "rocm" or "tpu"; None (the default) for JAX's default backend.

  Returns:
    primitive name (``jax_normgrad_layer_norm_bwd`` and so on; ``python -m jax_normgrad``
    lists the functions each one serves) -> the first implementation of the platform's
    preference list that can run on its device ("ffi", "triton", "mosaic_gpu",
    "mosaic_tpu", or "xla" where none can: a ``FallbackWarning`` says so when it lowers).
    A problem a kernel cannot run (a shape too large for the Mosaic GPU kernels, say) may
    still fall further down the list: :func:`explain` answers for given shapes.
  """
  return {name: c.implementation for name, c in default_choices(platform).items()}


def default_choices(platform: str | None = None) -> dict[str, Choice]:
  """:func:`default_implementations` with the reasons: primitive name -> its :class:`Choice`."""
  platform = _platforms.platform_or_default(platform)
  return {name: choose(name, None, platform) for name in sorted(_REGISTRY)}


@dataclasses.dataclass(frozen=True)
class Explained:
  """One op of a traced function (:func:`explain`)."""

  #: The primitive; ``operands``: its operands as ``dtype[shape]``; ``where``: the user's line.
  op: str
  operands: tuple[str, ...]
  where: str
  choice: Choice
  #: The chosen implementation's kernels and plan (``Implementation.describe``: a
  #: ``kernels.KernelPlan`` for the Triton and TPU kernels, the build for the C++ ones; None
  #: where it does not tell them: the reference, the Mosaic GPU kernels).
  plan: kernels.KernelPlan | str | None = None

  def __str__(self) -> str:
    c = self.choice
    skipped = "".join(f"\n    passed over {n}: {r}" for n, r in c.skipped)
    plan = f"\n    kernels: {self.plan}" if self.plan else ""
    return (f"{self.op}({', '.join(self.operands)}) at {self.where}\n"
            f"    runs {c.implementation}: {c.why}{skipped}{plan}")


class Explanation(list):
  """The :class:`Explained` ops of a function, in trace order; ``str`` prints them."""

  def __str__(self) -> str:
    return "\n".join(str(e) for e in self) or "no jax_normgrad op"


def explain(fun: Callable, *args, platform: str | None = None, **kwargs) -> Explanation:
  """Which implementation runs each op of ``fun(*args, **kwargs)``, and why.

  ``fun`` is traced (``jax.make_jaxpr``: nothing is compiled or run) on
  ``args`` (arrays or ``jax.ShapeDtypeStruct``), and every op of this package
  in it, inside nested ``jit``, ``vmap``, ``grad``, ``scan``, ``cond`` and
  ``checkpoint`` included, is put to :func:`choose` as its lowering would
  put it for ``platform`` (None: JAX's default backend) and the device jax
  targets there (the default device, or the abstract mesh's).

  What a lowering alone can know is not assumed: an op in a multi-device
  ``jit`` on a TPU (where the kernels fall back) is reported as on one device.

  Raises:
    ValueError: an op whose ``implementation`` cannot run on ``platform``,
      as its lowering would.
  """
  platform = _platforms.platform_or_default(platform)
  closed = jax.make_jaxpr(functools.partial(fun, **kwargs))(*args)
  found = Explanation()
  for eqn, where in _equations(closed.jaxpr, "?"):
    lowerings = _REGISTRY.get(eqn.primitive.name)
    if lowerings is None:
      continue
    params = dict(eqn.params)
    implementation = params.pop("implementation")
    forward = params.pop("forward", "kernel")
    avals = [v.aval for v in eqn.invars]
    problem = _problem_of(lowerings, avals, params)
    with config.lowering(params.pop("tuning", ()), platform):
      choice = choose(eqn.primitive.name, implementation, platform, forward=forward,
                      problem=problem)
      plan = IMPLEMENTATIONS[choice.implementation].describe(
          Request(eqn.primitive.name, platform, problem))
    operands = tuple(f"{a.dtype}{list(a.shape)}" for a in avals)
    found.append(Explained(eqn.primitive.name, operands, where, choice, plan))
  return found


def _equations(jaxpr, where: str):
  """``(equation, the user's line)`` of ``jaxpr`` and of the jaxprs in its equations' parameters.

  The equations of a ``cond``'s branches are given once where branches repeat
  them (the package's ops are staged per platform: ``_sharding.bind``). The
  line is the innermost frame outside jax and this package, else the
  enclosing equation's.
  """
  for eqn in jaxpr.eqns:
    here = _user_line(eqn.source_info) or where
    yield eqn, here
    seen = set()
    for inner in _compat.jaxprs_in_params(eqn.params):
      for found in _equations(inner, here):
        key = (found[0].primitive, str(found[0].params), found[1],
               tuple(str(v.aval) for v in found[0].invars))
        if eqn.primitive.name not in _COND or key not in seen:
          seen.add(key)
          yield found


_COND = _compat.primitive_names("cond")
_NOT_USER = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, jaxlib))


def _user_line(source_info) -> str | None:
  """``file:line (function)`` of the innermost frame outside jax, jaxlib and this package."""
  frames = getattr(getattr(source_info, "traceback", None), "frames", None) or ()
  for frame in frames:
    if not frame.file_name.startswith(_NOT_USER + (_PACKAGE,)):
      return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
  return None


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
