"""The jax internals the package reads, probed on the installed jax (``_compat.PRIMITIVES``,
``_compat.LAX_PRIMITIVES``).

For each role of the tables a tiny function that uses it is traced; its jaxpr
must hold a primitive of one of the role's names with every parameter the
table says is read. A higher-order primitive the table lacks is left alone by
the rewrite and named in its report; a first-order one the rewrite's modules
name must be in the table.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_normgrad as jn
import rewrite_corpus as rc
from jax_normgrad import _compat

F32 = jnp.float32


def _scan(x):
  return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]


def _custom_vjp():
  @jax.custom_vjp
  def f(x):
    return x * 2

  f.defvjp(lambda x: (f(x), None), lambda _, g: (2 * g,))
  return f


def _shard_map(x):
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("i",))
  return jax.shard_map(lambda x, w: x * _compat.pvary(w, ("i",)), mesh=mesh,
                       in_specs=(P("i"), P()), out_specs=P("i"))(x, x[0])


#: role -> a function whose jaxpr (on a (4, 8) float32) holds that role's primitive.
PROBES = {
    "jit": jax.jit(lambda x: x * 2),
    # A checkpointed scan's gradient: its known half is a closed_call.
    "closed_call": jax.grad(jax.checkpoint(lambda x: jnp.sum(_scan(x)))),
    "checkpoint": jax.checkpoint(jnp.sin),
    "scan": _scan,
    "while": lambda x: jax.lax.while_loop(lambda c: c[0, 0] < 3.0, lambda c: c * 2, x),
    "cond": lambda x: jax.lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x),
    "custom_jvp_call": jax.nn.relu,
    "custom_vjp_call": _custom_vjp(),
    "shard_map": _shard_map,
    "pvary": _shard_map,
}


def _equations(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for inner in _compat.jaxprs_in_params(e.params):
      yield from _equations(inner)


#: role -> a function whose jaxpr (on a (4, 8) float32) holds that first-order primitive.
LAX_PROBES = {
    "add": lambda x: x + 1, "sub": lambda x: x - 1, "mul": lambda x: x * x,
    "div": lambda x: x / 3, "neg": lambda x: -x, "max": lambda x: jnp.maximum(x, 0.0),
    "min": lambda x: jnp.minimum(x, 0.0), "pow": lambda x: jax.lax.pow(x, x),
    "integer_pow": lambda x: x ** 3, "square": jnp.square, "sqrt": jax.lax.sqrt,
    "rsqrt": jax.lax.rsqrt, "abs": jnp.abs, "exp": jnp.exp, "tanh": jnp.tanh,
    "logistic": jax.nn.sigmoid, "erf": jax.lax.erf, "ge": lambda x: x >= 0,
    "gt": lambda x: x > 0, "le": lambda x: x <= 0, "lt": lambda x: x < 0,
    "select_n": lambda x: jnp.where(x > 0, x, 0.0),
    "reduce_sum": lambda x: jnp.sum(x, axis=-1),
    "dot_general": lambda x: x @ x.T,
    "broadcast_in_dim": lambda x: jnp.broadcast_to(x[:, :1], (4, 8)),
    "reshape": lambda x: x.reshape(32), "squeeze": lambda x: jnp.squeeze(x[None]),
    "transpose": lambda x: x.T,
    "convert_element_type": lambda x: x.astype(jnp.bfloat16),
    "copy": jnp.copy, "reduce_precision": lambda x: jax.lax.reduce_precision(x, 5, 10),
    "optimization_barrier": jax.lax.optimization_barrier,
}
#: The modules that read jaxprs by primitive name: the rewrite's, and explain's walk.
READERS = sorted(pathlib.Path(_compat.__file__).parent.glob("_rewrite/*.py")) + [
    pathlib.Path(_compat.__file__).parent / "_explain.py"]


def test_every_role_is_probed():
  assert set(PROBES) == set(_compat.PRIMITIVES)
  assert set(LAX_PROBES) == set(_compat.LAX_PRIMITIVES)


def _known_names():
  return {n for table in (_compat.PRIMITIVES, _compat.LAX_PRIMITIVES)
          for entry in table.values() for n in entry.names}


def test_the_rewrite_names_no_primitive_outside_the_tables():
  """Every string of the jaxpr readers that is the name of a ``jax.lax`` primitive of this jax
  is in one of the tables, so the probes below reach everything they read by name."""
  lax_names = {getattr(jax.lax, a).name for a in dir(jax.lax)
               if a.endswith("_p") and isinstance(getattr(getattr(jax.lax, a), "name", None), str)}
  known = _known_names()
  outside = {}
  for path in READERS:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value in lax_names - known:
        outside.setdefault(node.value, []).append(f"{path.name}:{node.lineno}")
  assert not outside, f"primitive names read outside _compat's tables: {outside}"


@pytest.mark.parametrize("role", sorted(_compat.LAX_PRIMITIVES))
def test_first_order_primitive_names_and_params_on_this_jax(role):
  entry = _compat.LAX_PRIMITIVES[role]
  jaxpr = jax.make_jaxpr(LAX_PROBES[role])(jnp.ones((4, 8), F32)).jaxpr
  found = [e for e in _equations(jaxpr) if e.primitive.name in entry.names]
  assert found, (f"{role}: none of {entry.names} in the jaxpr of its probe on jax "
                 f"{jax.__version__}: {sorted({e.primitive.name for e in _equations(jaxpr)})}")
  for e in found:
    for p in entry.params:
      assert any(n in e.params for n in p.split("|")), (role, p, sorted(e.params))


_JAX = tuple(int(v) for v in jax.__version__.split(".")[:2])
#: Roles whose probe binds none of their names from this jax on: jax 0.12 traces a
#: checkpointed scan's gradient without a closed_call.
_NOT_BOUND_FROM = {"closed_call": (0, 12)}


@pytest.mark.parametrize("role", sorted(_compat.PRIMITIVES))
def test_primitive_names_and_params_on_this_jax(role):
  entry = _compat.PRIMITIVES[role]
  jaxpr = jax.make_jaxpr(PROBES[role])(jnp.ones((4, 8), F32)).jaxpr
  found = [e for e in _equations(jaxpr) if e.primitive.name in entry.names]
  if not found and role in _NOT_BOUND_FROM and _JAX >= _NOT_BOUND_FROM[role]:
    pytest.skip(f"jax {jax.__version__} binds no {role} where its probe looks (the rewrite's "
                "handling of it is unused there; the names stay for the older jax)")
  assert found, (f"{role}: none of {entry.names} in the jaxpr of its probe on jax "
                 f"{jax.__version__}: {sorted({e.primitive.name for e in _equations(jaxpr)})}")
  for e in found:
    assert _compat.bodies(e.primitive.name) == entry.bodies
    for p in entry.bodies:
      bodies = e.params[p] if isinstance(e.params[p], tuple) else (e.params[p],)
      assert bodies and all(isinstance(b, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))
                            for b in bodies), (role, p, e.params[p])
    for p in entry.params:
      assert any(n in e.params for n in p.split("|")), (role, p, sorted(e.params))
  if role == "pvary":
    assert all(_compat.is_varying_cast(e) for e in found)


def test_shard_map_of_reads_this_jaxs_params():
  jaxpr = jax.make_jaxpr(_shard_map)(jnp.ones((4, 8), F32)).jaxpr
  (e,) = [e for e in jaxpr.eqns if e.primitive.name in _compat.primitive_names("shard_map")]
  assert _compat.shard_map_of(e.params) is not None


def test_an_unknown_higher_order_primitive_is_reported_as_left_alone():
  """``custom_vmap`` (jax.custom_batching) binds ``custom_vmap_call``, a higher-order primitive not
  in the table: the norm inside it runs as written and the report says so; the values (and the
  forward derivative: jax differentiates custom_vmap in forward mode only) are the code's."""
  from jax.custom_batching import custom_vmap  # pylint: disable=g-import-not-at-top
  x, w, b, ct = rc.inputs(False, F32)

  @custom_vmap
  def norm(x):
    return rc.ln_two_pass(x, w, b)

  norm.def_vmap(lambda size, batched, x: (jax.vmap(norm)(x), True))
  f = lambda x: jnp.tanh(norm(x))
  name = jax.make_jaxpr(f)(x).jaxpr.eqns[0].primitive.name
  assert not _compat.bodies(name)
  report = jn.explain_rewrite(f, x)
  assert not report.matches
  (miss,) = report.near_misses
  assert miss.reason.startswith(f"a {name}, a higher-order primitive the rewrite does not know")
  assert "1 norm(s) found in it left alone" in miss.reason and miss.line() in str(report)
  new = jn.rewrite(f)
  np.testing.assert_array_equal(jax.jit(new)(x), jax.jit(f)(x))
  np.testing.assert_array_equal(jax.jit(lambda x: jax.jvp(new, (x,), (ct,)))(x),
                                jax.jit(lambda x: jax.jvp(f, (x,), (ct,)))(x))
