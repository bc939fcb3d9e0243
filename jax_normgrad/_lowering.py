"""The lowering rule of every primitive, and its eager implementation.

Each primitive registers its :class:`Lowerings` here (``primitives._common``):
one rule per platform (``_platforms.register_per_platform``) asks the
dispatcher (``_dispatch.choose``) which implementation runs the op, with the
kernels' problem and whether XLA partitions the op, announces a fallback,
and lowers the chosen one under the op's ``tuning`` (``pallas.config``).
The Mosaic GPU kernels interpreted on CPU run through ``_interpret``.
``registered`` answers which primitives there are (``explain``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax.interpreters import mlir

from jax_normgrad import _compat, _dispatch, _interpret, _platforms
from jax_normgrad._fallback import warn_once
from jax_normgrad.pallas import config, kernels, triton_warning


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


def registered() -> dict[str, Lowerings]:
  """Primitive name -> its :class:`Lowerings`, for every primitive registered."""
  return dict(_REGISTRY)


def register_lowerings(prim, lowerings: Lowerings) -> None:
  """One lowering rule per platform that lowers ``prim`` with the implementation
  ``_dispatch.choose`` picks."""
  _REGISTRY[prim.name] = lowerings

  def make_rule(platform):

    def rule(ctx, *args, implementation, forward="kernel", tuning=(), **params):
      with config.lowering(tuning, platform):
        return lower(ctx, *args, implementation=implementation, forward=forward, tuning=tuning,
                     **params)

    def lower(ctx, *args, implementation, forward, tuning, **params):
      choice = _dispatch.choose(prim.name, implementation, platform, forward=forward,
                      problem=problem_of(lowerings, ctx.avals_in, params),
                      auto_partitioned=lambda: _auto_partitioned(ctx), lowering=True)
      if choice.warning:
        warn_once(choice.warning)
      fn = {"xla": lowerings.xla, "ffi": lowerings.ffi}.get(choice.implementation)
      if fn is None:
        interpret = platform == "cpu"
        fn = functools.partial(lowerings.pallas, interpret=interpret,
                               backend=choice.implementation)
        if interpret and choice.implementation == "mosaic_gpu":
          fn = _interpret.in_own_computation(functools.partial(fn, **params), tuning)
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
      prim, lambda platform: triton_warning.quiet_lowering(make_rule(platform), platform))


def problem_of(lowerings: Lowerings, avals, params) -> Callable[[], kernels.Problem | None]:
  if lowerings.problem is None:
    return lambda: None
  return lambda: lowerings.problem(*avals, **params)


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
