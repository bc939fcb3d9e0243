"""Asking which implementation runs what, and why, without compiling anything.

:func:`explain` traces a function and puts every op of the package in it to
the dispatcher (``_dispatch.choose``) as its lowering would, for a platform;
:func:`default_implementations` answers per primitive. Both are queries:
they compile nothing and change nothing in jax (``_dispatch.Request``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jaxlib

from jax_normgrad import _compat, _lowering, _platforms
from jax_normgrad._dispatch import IMPLEMENTATIONS, Choice, Request, choose
from jax_normgrad.pallas import config, kernels


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
  return {name: choose(name, None, platform) for name in sorted(_lowering.registered())}


@dataclasses.dataclass(frozen=True)
class Explained:
  """One op of a traced function (:func:`explain`)."""

  #: The primitive; ``operands``: its operands as ``dtype[shape]``; ``where``: the user's line.
  op: str
  operands: tuple[str, ...]
  where: str
  choice: Choice
  #: The chosen implementation's kernels and plan (``Implementation.describe``: a
  #: ``kernels.KernelPlan`` for the Pallas kernels, the build for the C++ ones; None for the
  #: reference, and where no kernel runs).
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

  An op is taken as partitioned over devices by XLA (on a TPU the kernels then
  fall back, as :func:`choose` says) where an argument's sharding or a nested
  ``jit``'s spans several devices, unless it is inside a ``shard_map``.

  Raises:
    ValueError: an op whose ``implementation`` cannot run on ``platform``,
      as its lowering would.
  """
  platform = _platforms.platform_or_default(platform)
  closed = jax.make_jaxpr(functools.partial(fun, **kwargs))(*args)
  found = Explanation()
  registry = _lowering.registered()
  for eqn, where, partitioned in _equations(closed.jaxpr, "?", _multi_device(args, kwargs)):
    lowerings = registry.get(eqn.primitive.name)
    if lowerings is None:
      continue
    params = dict(eqn.params)
    implementation = params.pop("implementation")
    forward = params.pop("forward", "kernel")
    avals = [v.aval for v in eqn.invars]
    problem = _lowering.problem_of(lowerings, avals, params)
    with config.lowering(params.pop("tuning", ()), platform):
      choice = choose(eqn.primitive.name, implementation, platform, forward=forward,
                      problem=problem, auto_partitioned=lambda: partitioned)
      plan = IMPLEMENTATIONS[choice.implementation].describe(
          Request(eqn.primitive.name, platform, problem))
    operands = tuple(f"{a.dtype}{list(a.shape)}" for a in avals)
    found.append(Explained(eqn.primitive.name, operands, where, choice, plan))
  return found


def _multi_device(*trees) -> bool:
  """Whether a leaf of ``trees`` (an array or ``jax.ShapeDtypeStruct``) is sharded over several
  devices."""
  return any(_spans_devices(getattr(leaf, "sharding", None)) for leaf in jax.tree.leaves(trees))


def _spans_devices(sharding) -> bool:
  return len(getattr(sharding, "device_set", ())) > 1


def _equations(jaxpr, where: str, partitioned: bool):
  """``(equation, the user's line, partitioned)`` of ``jaxpr`` and of the jaxprs in its
  equations' parameters; ``partitioned``: whether XLA partitions the equation over devices (a
  ``jit`` with shardings over several devices; not inside ``shard_map``).

  The equations of a ``cond``'s branches are given once where branches repeat
  them (the package's ops are staged per platform: ``_sharding.bind``). The
  line is the innermost frame outside jax and this package, else the
  enclosing equation's.
  """
  for eqn in jaxpr.eqns:
    here = _user_line(eqn.source_info) or where
    yield eqn, here, partitioned
    inside = partitioned
    if eqn.primitive.name in _JIT:
      inside = partitioned or any(_spans_devices(s) for s in (
          *_compat.param(eqn.params, "in_shardings", ()),
          *_compat.param(eqn.params, "out_shardings", ())))
    elif eqn.primitive.name in _SHARD_MAP:
      inside = False
    seen = set()
    for inner in _compat.jaxprs_in_params(eqn.params):
      for found in _equations(inner, here, inside):
        key = (found[0].primitive, str(found[0].params), found[1],
               tuple(str(v.aval) for v in found[0].invars))
        if eqn.primitive.name not in _COND or key not in seen:
          seen.add(key)
          yield found


_COND = _compat.primitive_names("cond")
_JIT = _compat.primitive_names("jit")
_SHARD_MAP = _compat.primitive_names("shard_map")
_NOT_USER = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, jaxlib))


def _user_line(source_info) -> str | None:
  """``file:line (function)`` of the innermost frame outside jax, jaxlib and this package."""
  frames = getattr(getattr(source_info, "traceback", None), "frames", None) or ()
  for frame in frames:
    if not frame.file_name.startswith(_NOT_USER + (_PACKAGE,)):
      return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
  return None


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
