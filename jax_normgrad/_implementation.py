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

A forward primitive also carries ``forward`` (the layers' option, "kernel",
"xla" or "auto"): "xla" lowers it with the reference whatever the
implementation, so that XLA fuses it with its neighbours while the backward
still runs the kernel (``forward_implementation``, ``LAYER_FORWARD_DEFAULT``).

Where the default kernel does not exist yet, the pure-JAX reference ("xla")
runs instead and a one-time warning says so: no fallback is silent. An
implementation forced by the user that cannot run on the platform raises.
"""

from __future__ import annotations

import functools
import os
import threading
import types
from typing import Callable

import jax
import jax.extend.backend
import numpy as np
from jax.interpreters import mlir

from jax_normgrad import _compat
from jax_normgrad._fallback import FallbackWarning, warn_once  # noqa: F401  (FallbackWarning re-exported)
# The Pallas GPU backend choice; GPU_BACKEND_ENV re-exported (benchmarks).
from jax_normgrad.pallas.dispatch import GPU_BACKEND_ENV, GPU_BACKENDS, gpu_backend  # noqa: F401
from jax_normgrad.pallas.dispatch import quiet_lowering

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


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
    warn_once(
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


#: What a layer's forward runs with ``forward=None`` (and ``implementation=None``), per platform:
#: "kernel" (the forward kernel, as ``forward="kernel"``) or "xla" (the jnp forward, which XLA
#: fuses with the ops around it, as ``forward="xla"``). The backward is the kernel either way.
#: Chosen by the in-model benchmarks: on the CPU the kernel forward is 3-20x XLA's; on an
#: H100 (2026-11-27, BENCHMARKS.md "GPU: norms inside models") XLA's forward, which joins the
#: fusions around it, made no training step faster (UNet stack 0.98x, transformer 1.03x the
#: kernel forward's time), so the kernel stays the default there too.
LAYER_FORWARD_DEFAULT = types.MappingProxyType(
    {"cpu": "kernel", "cuda": "kernel", "rocm": "kernel", "tpu": "kernel"})

#: The values of a forward primitive's ``forward`` parameter (the layers' ``forward`` option;
#: "auto" is their None).
FORWARDS = ("kernel", "xla", "auto")

#: The environment variable that replaces ``LAYER_FORWARD_DEFAULT`` on every platform ("kernel"
#: or "xla"; read at each lowering, as ``JAX_NORMGRAD_GPU_BACKEND``): what ``forward=None``
#: layers, the drop-ins and ``patch()`` run, without a change to the model's code.
FORWARD_ENV = "JAX_NORMGRAD_FORWARD"


def layer_forward_default(platform: str) -> str:
  """What a layer's ``forward=None`` runs on ``platform``: "kernel" or "xla"."""
  chosen = os.environ.get(FORWARD_ENV, "")
  if chosen:
    if chosen not in ("kernel", "xla"):
      raise ValueError(f"{FORWARD_ENV}: expected 'kernel' or 'xla' (or unset), got {chosen!r}")
    return chosen
  return LAYER_FORWARD_DEFAULT.get(platform, "kernel")


def forward_implementation(forward: str, implementation: str | None, platform: str) -> str | None:
  """The implementation a forward primitive lowers with, given its ``forward`` parameter.

  "kernel": ``implementation`` itself (the public ops' forwards and ``forward="kernel"``).
  "xla": the pure-JAX forward, whatever ``implementation`` says (the backward still runs
  ``implementation``). "auto" (a layer's ``forward=None``): with ``implementation=None``,
  :func:`layer_forward_default`; an implementation named by the user is run as named.
  """
  if forward not in FORWARDS:
    raise ValueError(f"forward: expected one of {FORWARDS}, got {forward!r}")
  if forward == "xla" or (forward == "auto" and implementation is None
                          and layer_forward_default(platform) == "xla"):
    return "xla"
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


def default_implementations(platform: str | None = None) -> dict[str, str]:
  """Which implementation ``implementation=None`` runs, per primitive, on ``platform``.

  Args:
    platform: "cpu", "cuda", "rocm" or "tpu"; None (the default) for JAX's default backend.

  Returns:
    primitive name (``jax_normgrad_layer_norm_bwd`` and so on; ``python -m jax_normgrad``
    lists the functions each one serves) -> "ffi" (the C++ kernels), "pallas" (the
    platform's Pallas kernels) or "xla" (the pure-JAX reference, where no kernel exists:
    a ``FallbackWarning`` says so when it lowers).
  """
  if platform is None:
    platform = default_platform()
  if platform not in PLATFORMS:
    raise ValueError(f"platform: expected one of {PLATFORMS} (or None), got {platform!r}")
  return {name: default_for(name, platform) for name in primitive_names()}


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

    def rule(ctx, *args, implementation, forward="kernel", **params):
      implementation = forward_implementation(forward, implementation, platform)
      impl = resolve(implementation, platform, prim.name, available)
      if platform == "tpu" and implementation is None and _auto_partitioned(ctx):
        warn_once(
            f"jax_normgrad: {prim.name} is in a multi-device jit on TPU over mesh axes that XLA "
            f"partitions (Auto axes), where it would have to partition the Pallas (Mosaic) "
            f"kernel, which it cannot (and JAX's custom_partitioning rules do not run on TPU); "
            f"the pure-JAX reference ('xla') runs instead. Two ways run the kernels on each "
            f"device's shard: make the mesh axes Explicit (jax.make_mesh(..., axis_types="
            f"(jax.sharding.AxisType.Explicit, ...)) and jax.set_mesh), or write the step with "
            f"jax.shard_map.")
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
