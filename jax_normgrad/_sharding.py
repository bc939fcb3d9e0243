"""Partitioning of the kernels under jit on many devices: one rule for every primitive, two paths.

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

The public ops call :func:`bind` instead of ``prim.bind``. On one device and
inside ``shard_map`` (all mesh axes manual) JAX inlines the kernel as
before. With Auto mesh axes the rule is a ``custom_partitioning`` rule,
applied by XLA's partitioner when it meets the call (on CPU and GPU: libtpu
calls no such rule, see ``_partitioned``). With Explicit mesh axes
(``jax.set_mesh``, ``AxisType.Explicit``) the operands' shardings are in
their types, and :func:`bind` applies the rule itself, running the kernel
per shard in ``shard_map`` (``_shard_mapped``): the same on every backend.
:func:`match_varying` and :func:`cotangent_like` give the ops and layers
``shard_map``'s varying-axes typing (and explicit sharding's cotangent types).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import warnings
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_normgrad import _compat, _platforms

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


def _is_row(factor: str) -> bool:
  return factor == ROW or (factor.startswith(ROW) and factor[len(ROW):].isdigit())


def _row_axes(mesh, arg_shapes, in_factors, op) -> dict[str, tuple[str, ...]]:
  """Row dim name -> the mesh axes sharding it: those of the first operand sharded on that dim.

  Warns once when a non-row axis arrives sharded (it will be gathered), or a
  row dim does not divide evenly over its mesh axes (it is gathered too:
  padded rows would add to the parameter gradients).
  """
  axes: dict[str, tuple[str, ...]] = {}
  sizes: dict[str, int] = {}
  for shape, factors in zip(arg_shapes, in_factors):
    if not isinstance(shape.sharding, NamedSharding):
      continue
    spec = _spec_of(shape.sharding, len(shape.shape))
    for f, entry, size in zip(factors, spec, shape.shape):
      if _is_row(f):
        sizes[f] = size
        if f not in axes and entry is not None:
          axes[f] = _axes_of(entry)
      elif entry is not None:
        _warn_once(
            f"jax_normgrad: {op} got an operand sharded along a normalized or parameter axis "
            f"({entry!r}); it is re-sharded to replicated (an all-gather per call) because the "
            f"kernel needs whole rows. Shard only the leading (batch / token) dims instead.")
  for f, a in list(axes.items()):
    shards = math.prod(mesh.shape[n] for n in a)
    if sizes[f] % shards:
      _warn_once(
          f"jax_normgrad: {op} has a row dim of {sizes[f]}, not divisible over the {shards} "
          f"devices of mesh axes {a}; it is replicated (gathered) for this call.")
      del axes[f]
  return axes


#: primitive -> roles(**params) -> (operand axis names, result axis names).
_ROLES: dict = {}


def register_roles(prim, roles: Callable) -> None:
  """Registers the axis names of ``prim``'s operands and results (see :func:`bind`).

  ``roles(**params)`` returns two lists with one tuple of names per operand
  (named by the ``operands`` parameter) / result of the canonical
  primitive, ``ROW`` first for the row-wise ones (e.g. ``("r", "h")`` for
  LayerNorm's x, ``("w", "h")`` for its weight).
  """
  _ROLES[prim] = roles


def _varying(a) -> frozenset:
  """The manual mesh axes ``a`` varies over inside ``shard_map`` (empty elsewhere)."""
  return _compat.varying_axes(jax.typeof(a))


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
          _compat.pvary(a, tuple(sorted(union - _varying(a)))) for a in args]


def reshape(a, shape):
  """``a.reshape(shape)`` for the ops' views of x (rows, GroupNorm's ``(N, C, HW)``).

  With explicit sharding JAX refuses a reshape that merges a sharded dim into
  the dim before it (a minor position): such a dim, a normalized or spatial
  one that the kernels need whole anyway, is gathered first, announced by
  the :class:`ShardingWarning`.
  """
  if a.size == 0 or _compat.explicit_mesh([a]) is None:
    return a.reshape(shape)
  sharding = jax.typeof(a).sharding
  spec = list(_spec_of(sharding, a.ndim))
  starts = set(itertools.accumulate(shape, operator.mul, initial=1))  # where an output dim starts
  inner = [d for d in range(a.ndim) if spec[d] is not None and math.prod(a.shape[:d]) not in starts]
  for d in inner:
    _warn_once(
        f"jax_normgrad: an operand is sharded along an axis that the op merges into the "
        f"normalized (or spatial) axes ({spec[d]!r}); it is re-sharded to replicated first (an "
        f"all-gather per call). Shard only the leading (batch / token) dims instead.")
    spec[d] = None
  if inner:
    a = jax.sharding.reshard(a, sharding.update(spec=PartitionSpec(*spec)))
  return a.reshape(shape)


def cotangent_like(cotangent, primal):
  """A custom_vjp cotangent given its primal's type: its varying axes, its explicit sharding.

  In a custom_vjp backward under ``shard_map``, a replicated weight's gradient
  computed from sharded rows varies over the row axes: its ``psum`` over
  them (the transpose of a pcast) is the gradient of the replicated weight,
  as for a jnp layer. With explicit sharding, JAX requires a cotangent of
  its primal's sharding: one the kernels' call left otherwise (a gathered
  axis, a bias sharded unlike the weight) is resharded.
  """
  if cotangent is None:
    return None
  extra = _varying(cotangent) - _varying(primal)
  if extra:
    cotangent = jax.lax.psum(cotangent, tuple(sorted(extra)))
  if _compat.explicit_mesh([primal]) is not None:
    want = jax.typeof(primal).sharding
    if not _same_spec(want, jax.typeof(cotangent).sharding.spec, cotangent.ndim):
      cotangent = jax.sharding.reshard(cotangent, want)
  return cotangent


def bind(prim, *args, lead: int = 1, **params):
  """``prim.bind(*args, **params)`` with the row-partitioning rule attached.

  The row-wise operands are given with ``lead`` leading dims (e.g. ``(B, S,
  H)`` x and ``(B, S)`` statistics for LayerNorm) and are merged into the
  primitive's one row axis *on each device*: merging a dim sharded over one
  mesh axis with a dim sharded over another is no local reshape, so doing it
  before the call would gather x. Row-wise results come back with the same
  ``lead`` leading dims; parameter operands and results are as the
  primitive has them. Empty ``(0,)`` placeholder operands stay as they are.

  The primitive is called through a ``custom_partitioning`` function whose
  rule is described in this module's docstring. ``custom_partitioning`` has
  no vmap or JVP rule of its own, so the call is wrapped in a ``custom_jvp``
  and a ``custom_vmap`` that hand those transformations to the bare
  primitive (its folding batcher and reference JVP): the primal path, which
  is what training runs, is partitioned, and ``vmap``, ``jax.jvp``,
  ``grad(grad)`` and ``jax.hessian`` work as before (their kernels run
  unpartitioned). Folded vmap batches (``param_groups > 1``) map rows to
  parameter rows by position, so they stay unpartitioned too.
  """
  args = match_varying(args)
  key = (prim, tuple(sorted(params.items())), lead, tuple((a.shape, a.dtype) for a in args))
  fn, factors = _plan(*key)
  if factors is None:
    return fn(*args)
  mesh = _compat.explicit_mesh(args)
  if mesh is not None:
    return _shard_mapped(prim.name, fn, args, mesh, *factors)
  return _partitioned_plan(*key)(*args)


@functools.lru_cache(maxsize=4096)
def _plan(prim, params: tuple, lead: int, shapes: tuple):
  """``bind``'s call of ``prim`` on operands of these shapes and dtypes: the local function, and
  the factors of its partitioning rule (None where the call is not partitioned).

  Cached, as is :func:`_partitioned_plan`: a model's norms of one shape share the functions, so
  jax traces their wrappers once, not once a norm.
  """
  params = dict(params)
  in_roles, out_roles = _ROLES[prim](**params)
  row_in = [r[:1] == (ROW,) and shape != (0,) for r, (shape, _) in zip(in_roles, shapes)]
  row_out = [r[:1] == (ROW,) for r in out_roles]

  def fn(*local):
    lead_shape = next(a.shape[:lead] for a, r in zip(local, row_in) if r)
    merged = [a.reshape((math.prod(lead_shape),) + a.shape[lead:]) if r else a
              for a, r in zip(local, row_in)]
    outs = prim.bind(*merged, **params)
    return [o.reshape(lead_shape + o.shape[1:]) if r else o for o, r in zip(outs, row_out)]

  if params.get("param_groups", 1) != 1 or not any(row_in) or lead < 1:
    return fn, None
  rows = (ROW,) + tuple(f"{ROW}{i}" for i in range(1, lead))
  # Shapes only: fn merges the lead dims, a reshape that explicit sharding may refuse on
  # global types (jax < 0.9); fn itself only ever runs on local shards.
  outs = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes])
  name = lambda i, shape, r, is_row: (f"e{i}",) if shape == (0,) and not is_row else (
      rows + tuple(r[1:]) if is_row else tuple(r))
  in_factors = [name(i, shape, r, w)
                for i, ((shape, _), r, w) in enumerate(zip(shapes, in_roles, row_in))]
  out_factors = [name(len(shapes) + i, o.shape, r, w)
                 for i, (o, r, w) in enumerate(zip(outs, out_roles, row_out))]
  return fn, (in_factors, out_factors)


@functools.lru_cache(maxsize=4096)
def _partitioned_plan(prim, params: tuple, lead: int, shapes: tuple) -> Callable:
  fn, (in_factors, out_factors) = _plan(prim, params, lead, shapes)
  return _partitioned(prim.name, fn, in_factors, out_factors)


def _shard_mapped(op: str, fn: Callable, args, mesh, in_factors, out_factors) -> list:
  """``fn`` run per shard in ``shard_map`` over the Explicit axes of ``mesh`` (explicit sharding).

  With explicit mesh axes (``jax.set_mesh``, ``AxisType.Explicit``) every
  operand's sharding is part of its type, known while tracing: the rule of
  :func:`_partitioned` is applied here, with no partitioner callback, so it
  holds on every backend (libtpu calls no ``custom_partitioning`` rule).
  The rows keep the sharding of the first operand sharded on them; an
  operand sharded otherwise (a normalized or parameter axis, or rows that do
  not divide over their axes) is gathered first, announced by a
  :class:`ShardingWarning`; the parameter results are the devices' partial
  sums added over the row axes only (an all-reduce). The Explicit axes are manual
  inside (``_compat.manual_axes``; an axis sharding no row sees replicated
  operands), so the kernel is lowered for each device's local shapes; Auto
  axes stay XLA's. ``vmap`` and JVP are ``shard_map``'s own (a mapped dim
  sharded over an axis stays sharded). A result comes back with the
  sharding of the first operand of the same axes (y and h like x, dx like
  dy, dweight like weight) where a gather changed it.
  """
  types = [jax.typeof(a) for a in args]
  axes = _row_axes(mesh, types, in_factors, op)
  row_axes = tuple(n for a in axes.values() for n in a)
  spec = lambda factors: PartitionSpec(*(axes.get(f) for f in factors))
  in_specs = [spec(f) for f in in_factors]
  args = [a if _same_spec(t.sharding, s, a.ndim)
          else jax.sharding.reshard(a, NamedSharding(mesh, s))
          for a, t, s in zip(args, types, in_specs)]
  reduced = [ROW not in f for f in out_factors]

  stacked = [r and bool(row_axes) for r in reduced]

  def local(*shards):
    # A parameter result is a sum over all rows: each device's partial sum, stacked
    # along the row axes and added after the shard_map (one all-reduce over exactly
    # those axes; a psum inside would be the same, but jax 0.8's vmap of it fails).
    outs = fn(*match_varying(shards))
    return [o[None] if s else o for o, s in zip(outs, stacked)]

  out_specs = [spec(f) for f in out_factors]
  outs = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                       out_specs=[PartitionSpec(row_axes, *sp) if s else sp
                                  for sp, s in zip(out_specs, stacked)],
                       axis_names=_compat.manual_axes(mesh, in_specs))(*args)
  outs = [o.sum(0) if s else o for o, s in zip(outs, stacked)]
  like = {}
  for f, t in zip(in_factors, types):
    like.setdefault(f, t.sharding)
  return [o if f not in like or _same_spec(like[f], s, o.ndim) else jax.sharding.reshard(o, like[f])
          for o, f, s in zip(outs, out_factors, out_specs)]


def _same_spec(sharding, spec, ndim) -> bool:
  """Whether ``sharding`` (a NamedSharding) shards as ``spec`` (a PartitionSpec) does."""
  norm = lambda sp: tuple(_axes_of(e) for e in tuple(sp) + (None,) * (ndim - len(tuple(sp))))
  return norm(getattr(sharding, "spec", None) or ()) == norm(spec)


def _partitioned(op: str, fn: Callable, in_factors: Sequence[Sequence[str]],
                 out_factors: Sequence[Sequence[str]]) -> Callable:
  """``fn`` with the row-partitioning rule attached; vmap and JVP go to ``fn`` itself.

  Args:
    op: the primitive's name, for messages.
    fn: a function of the primitive's array operands returning its list of results.
    in_factors, out_factors: one tuple of factor names per operand / result,
      one name per axis: the ``lead`` row dims (``ROW`` first), then names of
      axes that must stay whole; operands and results sharing a name share
      the axis (e.g. x's H and the weight's H). A result without ``ROW`` is
      a sum over rows (a parameter gradient) and is ``psum``-ed.
  """
  in_factors = [tuple(f) for f in in_factors]
  out_factors = [tuple(f) for f in out_factors]
  rule = (", ".join(" ".join(f) for f in in_factors) + " -> "
          + ", ".join(" ".join(f) for f in out_factors))

  def shardings(mesh, factors, axes):
    return tuple(NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in fs))) for fs in factors)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes = _row_axes(mesh, arg_shapes, in_factors, op)
    all_axes = tuple(n for a in axes.values() for n in a)
    reduced = [ROW not in f for f in out_factors]

    def lower_fn(*args):
      outs = list(fn(*args))
      if all_axes:
        # A parameter gradient is a sum over all rows: add the devices' partial sums
        # over exactly the mesh axes that shard the rows.
        outs = [jax.lax.psum(o, all_axes) if r else o for o, r in zip(outs, reduced)]
      return tuple(outs)

    return mesh, lower_fn, shardings(mesh, out_factors, axes), shardings(mesh, in_factors, axes)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, out_factors, _row_axes(mesh, arg_shapes, in_factors, op))

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
    return tuple(outs), (True,) * len(outs)

  def on_tpu(*args):
    # custom_partitioning's rules are Python callbacks of XLA's partitioner, which
    # libtpu's compiler does not call (jax-ml/jax#38196: "Custom emitter for
    # CustomSPMDPartitioning not found"), and XLA cannot partition a Mosaic kernel
    # either: on TPU the call is left to the lowering (_dispatch: the
    # reference, announced, in a multi-device jit; the kernel inside shard_map,
    # and with Explicit mesh axes, _shard_mapped).
    return tuple(fn(*args))

  @jax.custom_jvp
  def with_rules(*args):
    return batched(*args)

  @with_rules.defjvp
  def _jvp_rule(primals, tangents):
    outs, tangents_out = jax.jvp(fn, primals, tangents)
    return tuple(outs), tuple(tangents_out)

  return lambda *args: list(_platforms.partitioning_switch(*args, partitioned=with_rules,
                                                          plain=on_tpu))
