"""What every primitive shares: definition boilerplate, the batch-folding vmap rule and the JVP rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching
from jax.sharding import PartitionSpec

from jax_normgrad import _compat, _lowering, _settings, _sharding
from jax_normgrad.pallas import config


def make_primitive(name: str, abstract_eval, lowerings: _lowering.Lowerings, *,
                   roles=None) -> Primitive:
  """A multiple-result primitive with eager impl, lowerings, the folding batcher and a JVP rule.

  ``lowerings.xla`` is the primitive's pure-JAX reference: a function of the
  operands and of the parameters other than ``implementation``. It lowers
  ``implementation="xla"`` and defines the derivatives (see
  ``_reference_jvp_rule``); ``jax_normgrad._dispatch`` chooses among the
  lowerings. ``roles`` names the operands' and results' axes for the
  partitioning rule (see ``jax_normgrad._sharding.register_roles``). A
  forward primitive may carry a ``forward`` parameter ("kernel", "xla" or
  "auto", see ``_dispatch.choose``): it picks the lowering and nothing
  else, so the abstract evaluation and the reference never see it.
  """
  prim = _Primitive(name)
  prim.multiple_results = True
  prim.def_abstract_eval(_with_varying_axes(abstract_eval))
  _lowering.def_impl_via_jit(prim)
  _lowering.register_lowerings(prim, lowerings)
  xla = lowerings.xla
  if roles is not None:
    _sharding.register_roles(prim, roles)
  batching.primitive_batchers[prim] = _fold_batch_rule(prim)
  ad.primitive_jvps[prim] = _reference_jvp_rule(prim, xla)
  return prim


class _Primitive(Primitive):
  """A primitive whose binds inside ``pallas.config.override`` carry its changes.

  They travel as the static parameter ``tuning`` (absent outside an override),
  which the lowering applies (``_lowering.register_lowerings``): the tiles an op
  is lowered with are part of the traced program, seen by jit's cache.
  """

  def bind(self, *args, **params):
    if "tuning" not in params and (changes := config.traced_overrides()):
      params["tuning"] = changes
    return super().bind(*args, **params)


def _with_varying_axes(abstract_eval):
  """Inside ``shard_map`` (``check_vma``) the results vary over the axes the operands vary over.

  ``_sharding.bind`` first casts every operand to the union of their varying
  axes (as JAX does for its own primitives), so the first operand carries
  the type the results take.
  """

  def rule(*avals, forward="kernel", tuning=(), **params):
    del forward, tuning  # how the primitive is lowered: no bearing on its results
    _settings.current()  # fixed at the first trace; raises if changed since
    outs = abstract_eval(*avals, **params)
    ref = avals[0] if avals else None
    if ref is None or not _compat.varying_axes(ref):
      return outs
    return [ref.update(shape=o.shape, dtype=o.dtype, weak_type=False,
                       sharding=ref.sharding.update(spec=PartitionSpec(*[None] * o.ndim)))
            for o in outs]

  return rule


def _reference_jvp_rule(prim, reference_fn):
  """JVP: primal outputs from the kernel, tangents from ``jax.jvp`` of the jnp reference.

  The reference computes exactly what the kernels compute, so its JVP is the
  primitive's. The tangent computation is ordinary jnp code, linear in the
  tangents: it transposes (reverse mode over it: ``grad(grad)``), batches
  (``hessian``, ``vmap``) and differentiates again (any order), with no
  hand-written transpose rule. The kernels keep the primal path, which is
  what first-order training runs; higher orders pay for jnp tangent code
  (under ``jit`` XLA drops the reference's unused primal outputs). Operands
  with a symbolic-zero tangent are closed over, so their derivative terms
  are never built.
  """

  def rule(primals, tangents, *, implementation, **params):
    primal_out = prim.bind(*primals, implementation=implementation, **params)
    params.pop("forward", None)  # a forward primitive's lowering choice, not the reference's
    params.pop("tuning", None)
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]

    def of_live(*live_args):
      args = list(primals)
      for i, a in zip(live, live_args):
        args[i] = a
      return reference_fn(*args, **params)

    _, tangent_out = jax.jvp(of_live, [primals[i] for i in live], [tangents[i] for i in live])
    return primal_out, list(tangent_out)

  return rule


def _fold_batch_rule(prim):
  """vmap by folding the batch into the leading (row / sample) axis.

  Every operand of these primitives has a leading axis that the kernels loop
  over independently: rows of x and dy, entries of the statistics, and the
  ``param_groups`` rows of weight/bias. Under vmap with batch size B each
  operand's batch axis moves to the front (unbatched operands are broadcast)
  and is merged into that leading axis, ``param_groups`` is multiplied by B,
  and the kernel runs once on the whole batch. The parameter gradients come
  out per batch element, as vmap's semantics require. No Python loop.
  """

  def rule(args, dims, *, param_groups, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args, dims):
      a = jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)
      folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    outs = prim.bind(*folded, param_groups=param_groups * size, **params)
    outs = [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)

  return rule


def shaped(shape, dtype) -> jax.core.ShapedArray:
  return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))

