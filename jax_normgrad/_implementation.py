"""Which implementation lowers a primitive on which platform, and the plumbing to register it.

Every primitive carries an ``implementation`` parameter (None, "xla", "ffi",
"pallas", "triton" or "mosaic_gpu"). The choice is made at lowering time, when
the platform is known:

===========  ======================  ==============================================
platform     implementation=None     also available
===========  ======================  ==============================================
cpu          "ffi" (C++ custom call)  "xla"; "pallas", "triton", "mosaic_gpu"
                                      interpreted (tests)
cuda         "pallas" (Triton)        "xla", "triton", "mosaic_gpu" (sm_90+)
rocm         "pallas" (Triton)        "xla", "triton"
tpu          "pallas" (Mosaic TPU)    "xla"
===========  ======================  ==============================================

"pallas" is the platform's default Pallas backend. On GPUs that is Triton
unless the environment variable ``JAX_NORMGRAD_GPU_BACKEND`` says
``mosaic_gpu`` (read at each lowering): then the Mosaic GPU kernels run on
CUDA where they can, and Triton runs, with a warning, what they cannot (ROCm,
GroupNorm, rows too long for them). "triton" and "mosaic_gpu" force a
backend: one that cannot run the problem raises. Triton stays the default
until the Mosaic GPU kernels, which passed their tests on an H100, are timed
there at least as fast.

Where the default kernel does not exist yet, the pure-JAX reference ("xla")
runs instead and a one-time warning says so: no fallback is silent. An
implementation forced by the user that cannot run on the platform raises.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import jax
import jax.extend.backend
import numpy as np
from jax.interpreters import mlir

from jax_normgrad import _compat
from jax_normgrad._fallback import FallbackWarning, warn_once  # noqa: F401  (re-exported)
# The Pallas GPU backend choice; GPU_BACKEND_ENV re-exported (benchmarks).
from jax_normgrad.pallas.dispatch import GPU_BACKEND_ENV, GPU_BACKENDS, gpu_backend  # noqa: F401
from jax_normgrad.pallas.dispatch import quiet_lowering

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

#: A ``FallbackWarning``, once per message (``_fallback``; also for the kernels' own fallbacks).
_warn_once = warn_once


def resolve(implementation: str | None, platform: str, op: str, available: dict[str, Callable | None]) -> str:
  """Returns the implementation to lower ``op`` with on ``platform``.

  Args:
    implementation: the user's choice (None for the platform's default).
    platform: the lowering platform ("cpu", "cuda", "rocm", "tpu").
    op: the primitive's name, for messages.
    available: implementation name -> lowering function, None where absent.
  """
  default = "ffi" if platform == "cpu" else "pallas"
  if implementation is None:
    if available.get(default) is not None:
      return default
    _warn_once(
        f"jax_normgrad: no {default!r} kernel for {op} on {platform}; using the pure-JAX "
        f"reference implementation ('xla') instead. Pass implementation='xla' to silence this.")
    return "xla"
  if implementation == "ffi" and platform != "cpu":
    raise ValueError(
        f"{op}: implementation='ffi' is the CPU custom call and cannot run on {platform}; "
        f"use implementation=None, 'pallas' or 'xla'")
  if implementation in GPU_BACKENDS:
    if platform == "tpu" or (platform == "rocm" and implementation == "mosaic_gpu"):
      raise ValueError(
          f"{op}: implementation={implementation!r} is a Pallas backend for "
          f"{'CUDA' if implementation == 'mosaic_gpu' else 'CUDA and ROCm'} GPUs and cannot run "
          f"on {platform}; use implementation=None, 'pallas' or 'xla'")
    if implementation == "mosaic_gpu" and (missing := _compat.mosaic_gpu_api_missing()):
      raise ValueError(f"{op}: implementation='mosaic_gpu' is unavailable: {missing}")
    if available.get("pallas") is None:
      raise ValueError(f"{op}: implementation={implementation!r} is not available on {platform}")
    return implementation
  if available.get(implementation) is None:
    raise ValueError(f"{op}: implementation={implementation!r} is not available on {platform}")
  return implementation


#: primitive name -> platform -> {implementation: lowering function or None}.
_REGISTRY: dict[str, dict[str, dict[str, Callable | None]]] = {}


def default_platform() -> str:
  """The lowering platform ("cpu", "cuda", "rocm", "tpu") of JAX's default backend.

  ``jax.default_backend()`` says "gpu" for CUDA and ROCm alike; lowerings are
  registered per platform, and the backend's platform version tells the two apart.
  """
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  version = jax.extend.backend.get_backend().platform_version.lower()
  return "rocm" if "rocm" in version else "cuda"


def default_for(prim_name: str, platform: str) -> str:
  """The implementation ``implementation=None`` lowers ``prim_name`` with on ``platform``."""
  available = _REGISTRY[prim_name][platform]
  default = "ffi" if platform == "cpu" else "pallas"
  return default if available.get(default) is not None else "xla"


def primitive_names() -> list[str]:
  return sorted(_REGISTRY)


def register_lowerings(prim, *, xla: Callable, ffi: Callable | None = None,
                       pallas: Callable | None = None) -> None:
  """Registers one lowering rule per platform that dispatches on ``implementation``.

  Each implementation is a function of the primitive's array operands and its
  parameters (minus ``implementation``) written with jnp / ``jax.ffi.ffi_call``
  / ``pallas_call``; it is lowered with ``mlir.lower_fun``. ``pallas`` also
  receives ``interpret=True`` on CPU and the Pallas GPU backend
  (``gpu_backend``, a ``pallas.dispatch.GpuBackend``).
  """
  def make_rule(platform):
    available = {"xla": xla, "ffi": ffi if platform == "cpu" else None, "pallas": pallas}
    _REGISTRY.setdefault(prim.name, {})[platform] = available

    def rule(ctx, *args, implementation, **params):
      impl = resolve(implementation, platform, prim.name, available)
      if platform == "tpu" and implementation is None and _auto_partitioned(ctx):
        _warn_once(
            f"jax_normgrad: {prim.name} is in a multi-device jit on TPU, where XLA would have to "
            f"partition the Pallas (Mosaic) kernel, which it cannot (and JAX's custom_partitioning "
            f"rules do not run on TPU); the pure-JAX reference ('xla') runs instead. Write the "
            f"step with jax.shard_map to run the kernels on each device's local shapes.")
        impl = "xla"
      fn = available.get(impl)
      if impl in GPU_BACKENDS or impl == "pallas":
        interpret = platform == "cpu"
        backend = gpu_backend(impl, platform, prim.name)
        fn = functools.partial(available["pallas"], interpret=interpret, gpu_backend=backend)
        if interpret and backend.name == "mosaic_gpu":
          fn = _in_own_computation(functools.partial(fn, **params))
          params = {}
        if interpret:
          # Pallas' interpreter (every jax up to 0.11) evaluates a kernel's body on
          # operands that vary inside shard_map next to constants that do not,
          # which check_vma refuses; lowered code needs no varying types.
          ctx = ctx.replace(avals_in=[_compat.without_varying(a) for a in ctx.avals_in])
      return mlir.lower_fun(functools.partial(fn, **params), multiple_results=prim.multiple_results)(ctx, *args)

    return rule

  for platform in PLATFORMS:
    mlir.register_lowering(prim, quiet_lowering(make_rule(platform), platform), platform=platform)


_INTERPRET_LOCK = threading.Lock()


def _in_own_computation(fn):
  """``fn`` run by a host callback as a jitted computation of its own, one at a time.

  For the Mosaic GPU kernels in GPU interpret mode (CPU). The interpreter
  simulates a kernel with ordered callbacks around one process-wide simulated
  GPU, set up and torn down per kernel: two kernels must not overlap, which
  JAX ensures through the ordered effect those callbacks carry. A primitive
  declares no effects (its abstract evaluation knows no platform), so inside
  the primitive's lowering nothing would order two kernels of one program;
  run on its own, the kernel's computation declares the effect, and the lock
  keeps kernels of concurrent computations apart.
  """
  jitted = jax.jit(fn)

  def host(*arrays):
    with _INTERPRET_LOCK:
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
