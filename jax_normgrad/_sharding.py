"""Partitioning of the kernels under jit on many devices: one custom_partitioning rule for every primitive.

Every operand and result of the primitives is either row-wise (x, dy, y, dx,
xhat, the statistics: leading axis = rows for LayerNorm / RMSNorm, samples
for GroupNorm) or a parameter array (weight, bias and their gradients, shape
``(param_groups, C)``). The rule, the same for all of them:

* the leading axis keeps the sharding of the first row-wise operand that is
  sharded on it (any mesh axes, one or several): each device runs the kernel
  on its local rows;
* parameter operands are replicated; parameter results (dweight, dbias) are
  the local partial sums followed by one ``psum`` over exactly the mesh axes
  that shard the rows;
* every other axis (LayerNorm's H, GroupNorm's C and HxW, the statistics'
  groups) is re-sharded to replicated: a kernel needs whole rows. The first
  time this happens a :class:`ShardingWarning` says so, since it costs an
  all-gather of x (and dy) per call.

The rule is attached at lowering time (``partitioned`` wraps the lowering of
the chosen implementation), after vmap, JVP and transposition have run on
the primitive, so it composes with all of them; on one device and inside
``shard_map`` (all axes manual) JAX inlines the kernel as before.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

#: The factor name of the row axis in the sharding rules.
ROW = "r"


class ShardingWarning(UserWarning):
  """Emitted once per (op, reason) when a sharding is changed at a kernel's boundary (a reshard)."""


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  warnings.warn(message, ShardingWarning, stacklevel=2)


def _axes_of(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_of(sharding, ndim):
  spec = tuple(getattr(sharding, "spec", None) or ())
  return spec + (None,) * (ndim - len(spec))


def _row_axes(mesh, arg_shapes, in_factors, rows, op):
  """The mesh axes that shard the rows: those of the first row-wise operand sharded on them.

  Also warns once when a non-row axis arrives sharded (it will be gathered).
  """
  axes = None
  for shape, factors in zip(arg_shapes, in_factors):
    if not isinstance(shape.sharding, NamedSharding):
      continue
    spec = _spec_of(shape.sharding, len(shape.shape))
    for f, entry in zip(factors, spec):
      if f == ROW:
        if axes is None and entry is not None:
          axes = _axes_of(entry)
      elif entry is not None:
        _warn_once(
            f"jax_normgrad: {op} got an operand sharded along a normalized or parameter axis "
            f"({entry!r}); it is re-sharded to replicated (an all-gather per call) because the "
            f"kernel needs whole rows. Shard only the leading (batch / token) dims instead.")
  axes = axes or ()
  shards = math.prod(mesh.shape[a] for a in axes)
  if axes and rows % shards:
    _warn_once(
        f"jax_normgrad: {op} has {rows} rows, not divisible over the {shards} devices of mesh "
        f"axes {axes}; the rows are replicated (gathered) for this call.")
    axes = ()
  return axes


#: primitive -> factors(avals_in, avals_out, **params) -> (in_factors, out_factors).
_FACTORS: dict = {}


def register_factors(prim, factors: Callable) -> None:
  """Registers how ``prim``'s operand and result axes are named (see :func:`bind`)."""
  _FACTORS[prim] = factors


def _varying(a) -> frozenset:
  """The manual mesh axes ``a`` varies over inside ``shard_map`` (empty elsewhere)."""
  mat = getattr(jax.typeof(a), "mat", None)
  return frozenset() if mat is None else mat.varying


def match_varying(args):
  """Casts every array to the union of their varying axes, as JAX does for its own primitives.

  Inside ``shard_map`` with ``check_vma`` a replicated weight used with a
  sharded x must be marked varying first; the transpose of that cast is
  the ``psum`` that makes the weight's gradient whole.
  """
  union = frozenset().union(*(_varying(a) for a in args))
  if not union:
    return list(args)
  return [a if _varying(a) == union else
          jax.lax.pcast(a, tuple(sorted(union - _varying(a))), to="varying") for a in args]


def sum_to_varying(cotangent, primal):
  """A custom_vjp cotangent reduced to its primal's varying axes (the transpose of a pcast).

  In a custom_vjp backward under ``shard_map``, a replicated weight's gradient
  computed from sharded rows varies over the row axes: its ``psum`` over
  them is the gradient of the replicated weight, as for a jnp layer.
  """
  if cotangent is None:
    return None
  extra = _varying(cotangent) - _varying(primal)
  return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def bind(prim, *args, **params):
  """``prim.bind(*args, **params)`` with the row-partitioning rule attached.

  The primitive is called through a ``custom_partitioning`` function whose
  rule is described in this module's docstring. ``custom_partitioning`` has
  no vmap or JVP rule of its own, so the call is wrapped in a
  ``custom_jvp`` and a ``custom_vmap`` that hand those transformations to
  the bare primitive (its folding batcher and reference JVP): the primal
  path, which is what training runs, is partitioned, and ``vmap``,
  ``jax.jvp``, ``grad(grad)`` and ``jax.hessian`` work as before (their
  kernels run unpartitioned). Folded vmap batches (``param_groups > 1``) map
  rows to parameter rows by position, so they stay unpartitioned too.
  """
  args = match_varying(args)
  plain = lambda *a: prim.bind(*a, **params)
  factors = _FACTORS.get(prim)
  if factors is None or params.get("param_groups", 1) != 1:
    return plain(*args)
  avals_in = [jax.core.ShapedArray(a.shape, a.dtype) for a in args]
  avals_out = jax.eval_shape(plain, *args)
  in_factors, out_factors = factors(avals_in, avals_out, **params)
  return _partitioned(prim.name, plain, in_factors, out_factors)(*args)


def _partitioned(op: str, fn: Callable, in_factors: Sequence[Sequence[str]],
                 out_factors: Sequence[Sequence[str]]) -> Callable:
  """``fn`` with the row-partitioning rule attached; vmap and JVP go to ``fn`` itself.

  Args:
    op: the primitive's name, for messages.
    fn: a function of the primitive's array operands returning its list of results.
    in_factors, out_factors: one tuple of factor names per operand / result,
      one name per axis: ``ROW`` for the row axis, any other name for an axis
      that must stay whole; operands and results sharing a name share the
      axis (e.g. x's H and the weight's H). A result without ``ROW`` is a
      sum over rows (a parameter gradient) and is ``psum``-ed.
  """
  in_factors = [tuple(f) for f in in_factors]
  out_factors = [tuple(f) for f in out_factors]
  rule = (", ".join(" ".join(f) for f in in_factors) + " -> "
          + ", ".join(" ".join(f) for f in out_factors))

  def shardings(mesh, factors, axes):
    return tuple(
        NamedSharding(mesh, PartitionSpec(*((axes or None) if f == ROW else None for f in fs)))
        for fs in factors)

  def rows_of(arg_shapes):
    return next((s.shape[0] for s, f in zip(arg_shapes, in_factors) if f[:1] == (ROW,)), 0)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes = _row_axes(mesh, arg_shapes, in_factors, rows_of(arg_shapes), op)
    reduced = [ROW not in f for f in out_factors]

    def lower_fn(*args):
      outs = list(fn(*args))
      if axes:
        # A parameter gradient is a sum over all rows: add the devices' partial sums.
        outs = [jax.lax.psum(o, axes) if r else o for o, r in zip(outs, reduced)]
      return tuple(outs)

    return mesh, lower_fn, shardings(mesh, out_factors, axes), shardings(mesh, in_factors, axes)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, out_factors,
                     _row_axes(mesh, arg_shapes, in_factors, rows_of(arg_shapes), op))

  @custom_partitioning
  def call(*args):
    return tuple(fn(*args))

  call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule)

  @jax.custom_batching.custom_vmap
  def batched(*args):
    return call(*args)

  @batched.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    del axis_size
    outs = jax.vmap(fn, in_axes=[0 if b else None for b in in_batched])(*args)
    return list(outs), [True] * len(outs)

  @jax.custom_jvp
  def with_rules(*args):
    return batched(*args)

  @with_rules.defjvp
  def _jvp_rule(primals, tangents):
    return jax.jvp(fn, primals, tangents)

  return lambda *args: list(with_rules(*args))
