"""The transformation: trace, find the norms, evaluate the jaxpr with the matched ones on this package's ops.

:func:`rewrite` traces the function to a jaxpr (``jax.make_jaxpr``), finds
the norms of each jaxpr (:mod:`._identify`), and evaluates it as
``jax.core.eval_jaxpr`` would, equation by equation, except that a matched
norm's result is computed by the op (``jax_normgrad.layer_norm`` ...) from
its input and parameters. Only what the outputs need is evaluated, so the
equations of a replaced norm are dropped unless something else reads an
intermediate (the mean, the rstd), which is then computed as before.

Nested jaxprs keep their structure: a ``jit``'s, ``scan``'s, ``while``'s,
``cond``'s, and ``custom_jvp`` / ``custom_vjp`` function's body is rewritten
to a new jaxpr of the same type (``jax.make_jaxpr`` of the evaluation) and
the primitive bound again with it; a ``checkpoint`` body is evaluated under
``jax.checkpoint`` with the same policy, a ``shard_map`` body under
``jax.shard_map`` with the same mesh, specs and manual axes. A body with no match is passed on
unchanged (the very same jaxpr object).
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util

from jax_normgrad import _compat
from jax_normgrad._rewrite import _identify
from jax_normgrad._rewrite._graph import Graph, is_literal
from jax_normgrad._rewrite._report import RewriteReport
from jax_normgrad.ops.add_norm import add_layer_norm, add_rms_norm
from jax_normgrad.ops.group_norm import group_norm
from jax_normgrad.ops.layer_norm import layer_norm
from jax_normgrad.ops.rms_norm import rms_norm

#: Primitives whose bodies (ClosedJaxprs) are rewritten to jaxprs of the same signature and
#: bound again (the names and parameters: ``_compat.PRIMITIVES``).
_REBOUND = _compat.primitive_names("jit", "closed_call", "scan", "while", "cond",
                                   "custom_jvp_call", "custom_vjp_call")
_REMAT = _compat.primitive_names("checkpoint")
_SHARD_MAP = _compat.primitive_names("shard_map")


class _Rewriter:
  """One rewrite of one trace: the report, and the nested jaxprs already rewritten."""

  def __init__(self):
    self.report = RewriteReport()
    self.closed_memo: dict = {}
    self.applied = 0

  # -- analysis ----------------------------------------------------------------

  def plan(self, jaxpr, consts, where):
    """The graph, the matches and the evaluation order (:func:`_schedule`) of one jaxpr."""
    g = Graph(jaxpr, consts)
    matches, misses = _identify.find(g)
    order, cyclic = _schedule(jaxpr, matches, g)
    while cyclic:
      # A safety net: a match whose op would read a value computed from its own result
      # (a matcher error) is dropped, announced, and its norm runs as written.
      warnings.warn(f"jax_normgrad.rewrite: {len(cyclic)} match(es) in {where or 'the function'} "
                    f"would read their own results ({', '.join(m.source or m.op for m in cyclic)}); "
                    "they run as written", RuntimeWarning, stacklevel=4)
      matches = [m for m in matches if not any(m is c for c in cyclic)]
      order, cyclic = _schedule(jaxpr, matches, g)
    for m in matches:
      self.report.add_match(m, where, _factor_namer(m))
    for miss in misses:
      self.report.add_miss(miss, where)
    return g, matches, order

  # -- evaluation --------------------------------------------------------------

  def run(self, jaxpr, consts, args, where=""):
    """The jaxpr's outputs on ``args``, its matched norms computed by the ops."""
    g, matches, order = self.plan(jaxpr, consts, where)
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    replaced = {v for m in matches for v in m.outputs}

    def read(atom):
      return atom.val if is_literal(atom) else env[atom]

    for step in order:
      if isinstance(step, int):
        e = jaxpr.eqns[step]
        outs = self.bind(e, [read(a) for a in e.invars], where)
        env.update((o, val) for o, val in zip(e.outvars, outs)
                   if not _compat.is_drop_var(o) and o not in replaced)
      else:
        env.update(_apply(matches[step[1]], read, g))
        self.applied += 1
    return [read(a) for a in jaxpr.outvars]

  def bind(self, e, invals, where):
    name = e.primitive.name
    params = dict(e.params)
    sub = f"{where} > {name}" if where else name
    if name in _REMAT:
      (body,) = _compat.bodies(name)
      inner = params[body]
      fun = lambda *a: self.run(inner, (), a, sub)
      prevent_cse, policy = _compat.PRIMITIVES["checkpoint"].params
      outs = jax.checkpoint(fun, prevent_cse=params.get(prevent_cse, True),
                            policy=params.get(policy))(*invals)
      return outs
    if name in _SHARD_MAP:
      (body,) = _compat.bodies(name)
      inner = params[body]
      make = None if inner.constvars else _compat.shard_map_of(params)
      if make is not None:
        return list(make(lambda *a: tuple(self.run(inner, (), a, sub)))(*invals))
      self.left_alone(e, where, "a shard_map whose body has constants of its own, or whose "
                      "parameters this jax names otherwise")
    elif name not in _REBOUND and next(_compat.jaxprs_in_params(e.params), None) is not None:
      self.left_alone(e, where, f"a {name}, a higher-order primitive the rewrite does not know")
    for key in _compat.bodies(name) if name in _REBOUND else ():
      val = params[key]
      if isinstance(val, tuple):
        params[key] = tuple(self.rewrite_closed(c, f"{sub}[{i}]") for i, c in enumerate(val))
      elif isinstance(val, jcore.ClosedJaxpr):
        call = _compat.param(params, "name")  # a jit's function's name
        params[key] = self.rewrite_closed(val, f"{sub}({call})" if call else sub)
    if params != e.params:
      e = e.replace(params=params)
    with source_info_util.user_context(e.source_info.traceback,
                                       name_stack=e.source_info.name_stack):
      out = _compat.bind_equation(e, invals)
    return out if e.primitive.multiple_results else [out]

  def left_alone(self, e, where, what):
    """Reports ``e``, whose bodies run as written, as left alone, with the norms found in them."""
    found = 0
    for inner in _compat.jaxprs_in_params(e.params):
      try:
        found += len(_identify.find(Graph(inner))[0])
      except Exception:  # pylint: disable=broad-except
        pass  # a body the matcher cannot read (a kernel's) holds no norm it could rewrite
    out = next((o for o in e.outvars if hasattr(o.aval, "shape")), None)
    self.report.add_miss(_identify.NearMiss(
        tuple(getattr(getattr(out, "aval", None), "shape", ())),
        getattr(getattr(out, "aval", None), "dtype", jnp.float32),
        f"{what}: its body runs as written ({found} norm(s) found in it left alone)",
        source_info_util.summarize(e.source_info)), where)

  def rewrite_closed(self, closed, where):
    """The closed jaxpr with its norms rewritten; the same object when there were none."""
    key = id(closed)
    if key in self.closed_memo:
      return self.closed_memo[key][1]
    before = self.applied
    new = jax.make_jaxpr(lambda *a: self.run(closed.jaxpr, closed.consts, a, where))(
        *closed.in_avals)
    if self.applied == before:
      new = closed
    elif [(a.shape, a.dtype, a.weak_type) for a in new.out_avals] != [
        (a.shape, a.dtype, a.weak_type) for a in closed.out_avals]:
      warnings.warn(f"jax_normgrad.rewrite: the rewritten {where} changed its result types "
                    f"({new.out_avals} instead of {closed.out_avals}); it runs unchanged",
                    RuntimeWarning, stacklevel=3)
      new = closed
    self.closed_memo[key] = (closed, new)
    return new


def _schedule(jaxpr, matches, g):
  """``(order, cyclic)``: the steps that compute the outputs, each after what it reads.

  A step is an equation's index or ``("match", k)``, matches[k] computed by
  its op from x and the parameters (:func:`_inputs`), standing in for the
  equations that produced its outputs. Only what the outputs and the
  effectful equations need is scheduled, so a replaced norm's equations
  are dropped unless something else reads an intermediate (the mean, the
  rstd). The equations keep their order where they can. ``cyclic``: the
  matches on a cycle (empty for a sound plan), when the order is None.
  """
  producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
  replaced = {v: ("match", k) for k, m in enumerate(matches) for v in m.outputs}

  def node_of(atom):
    if is_literal(atom):
      return None
    return replaced.get(atom, producer.get(atom))

  def deps(node):
    atoms = jaxpr.eqns[node].invars if isinstance(node, int) else _inputs(matches[node[1]], g)
    return [n for n in map(node_of, atoms) if n is not None]

  roots = [i for i, e in enumerate(jaxpr.eqns) if e.effects]
  roots += [n for n in map(node_of, jaxpr.outvars) if n is not None]
  needed, cycle = _postorder(roots, deps)
  if cycle is not None:
    return None, [matches[n[1]] for n in cycle if not isinstance(n, int)]
  # Again from the needed equations in their order: each runs where it was, a match before
  # its first reader.
  first = sorted(n for n in needed if isinstance(n, int))
  order, _ = _postorder(first + [n for n in roots if not isinstance(n, int)], deps)
  return order, []


def _postorder(roots, deps):
  """``(nodes, None)``: the nodes the roots reach, each after its deps; ``(None, cycle)`` on a cycle."""
  order, state = [], {}  # state: 1 while on the stack, 2 when placed
  for root in roots:
    if root in state:
      continue
    stack = [(root, iter(deps(root)))]
    state[root] = 1
    while stack:
      node, it = stack[-1]
      nxt = next(it, None)
      if nxt is None:
        stack.pop()
        state[node] = 2
        order.append(node)
      elif nxt not in state:
        state[nxt] = 1
        stack.append((nxt, iter(deps(nxt))))
      elif state[nxt] == 1:
        nodes = [n for n, _ in stack]
        return None, nodes[nodes.index(nxt):]
  return order, None


def _inputs(m, g):
  """The variables of the jaxpr a match reads at run time."""
  out = list(m.residual) if m.residual else [m.x]
  used = {f for mono in list(m.weight) + list(m.bias) for f, _ in mono}
  for f in used:
    sv = g.scope_var(m.factors[f].atom)
    if sv is not None:
      out.append(sv)
  return out


def _factor_namer(m):
  def name(f):
    atom = m.factors[f].atom
    if is_literal(atom):
      return repr(atom.val)
    return atom.aval.str_short()
  return name


# ----------------------------------------------------------------------------
# A match, computed by the op.


def _factor_value(m, f, read, g):
  fac = m.factors[f]
  atom = fac.atom
  sv = g.scope_var(atom)
  if sv is not None:
    v = read(sv)
  else:
    v = g.value(atom)
    v = g.large_const[atom] if v is None else v
  v = jnp.asarray(v, jnp.float32)
  if not fac.dims:
    return jnp.broadcast_to(v.reshape(()), m.param_shape)
  for d in sorted(fac.const_dims):
    if v.shape[d] > 1:
      v = jax.lax.slice_in_dim(v, 0, 1, axis=d)
  shape, labels = [], []
  for d, ents in enumerate(fac.dims):
    if v.shape[d] == 1:
      continue
    for lab, size, _ in ents:
      if size > 1:
        shape.append(size)
        labels.append(m.labels(lab))
  v = v.reshape(shape)
  order = sorted(range(len(labels)), key=lambda i: m.param_axes.index(labels[i]))
  v = jnp.transpose(v, order)
  labels = [labels[i] for i in order]
  v = v.reshape([m.param_sizes[a] if a in labels else 1 for a in m.param_axes])
  v = jnp.broadcast_to(v, [m.param_sizes[a] for a in m.param_axes])
  return v.reshape(m.param_shape)


def _combination(m, terms, read, g, is_weight):
  if not terms or (is_weight and set(terms) == {()} and terms[()] == 1.0):
    return None
  total = None
  for mono, c in terms.items():
    t = None if c == 1.0 and mono else jnp.full(m.param_shape, c, jnp.float32)  # 1 * f is f
    for f, p in mono:
      fv = _factor_value(m, f, read, g)
      fv = fv if p == 1 else fv ** p
      t = fv if t is None else t * fv
    total = t if total is None else total + t
  return total


def _apply(m, read, g) -> dict:
  """``{variable: value}`` of the match's outputs, computed by the op."""
  x = read(m.residual[0]) if m.residual else read(m.x)
  w = _combination(m, m.weight, read, g, True)
  b = _combination(m, m.bias, read, g, False)
  kind = "group" if m.op == "group_norm" else "layer"
  od = _identify._dtype_op(kind, m.y_dtype, x.dtype)
  out_dtype = None if od == "cast" else od
  outs = {}
  if m.op in ("layer_norm", "rms_norm"):
    kw = dict(normalized_shape=x.shape[x.ndim - m.norm_ndim:], eps=m.eps, out_dtype=out_dtype)
    if m.op == "layer_norm":
      y = layer_norm(x, w, b, **kw)
    else:
      y = rms_norm(x, w, **kw)
      if b is not None:
        y = (y.astype(jnp.float32) + b).astype(y.dtype)
  elif m.op in ("add_layer_norm", "add_rms_norm"):
    a, r = (read(v) for v in m.residual)
    kw = dict(normalized_shape=x.shape[x.ndim - m.norm_ndim:], eps=m.eps)
    if m.op == "add_layer_norm":
      y, h = add_layer_norm(a, r, w, b, **kw)
    else:
      y, h = add_rms_norm(a, r, w, **kw)
      if b is not None:
        y = (y.astype(jnp.float32) + b).astype(y.dtype)
    outs["h"] = h
  else:
    lead = int(np.prod(x.shape[:m.lead_ndim]))
    x2 = x.reshape((lead,) + x.shape[m.lead_ndim:])
    y = group_norm(x2, m.groups, w, b, eps=m.eps, channel_axis=m.channel_axis,
                      out_dtype=out_dtype, activation=m.activation)
    y = y.reshape(x.shape)
  outs["y"] = y if y.dtype == m.y_dtype else y.astype(m.y_dtype)
  return {v: outs[role] for v, role in m.outputs.items()}


# ----------------------------------------------------------------------------
# The public functions.


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "aval")


def _split(args, kwargs, dynamic):
  """``(values, rebuild)``: the leaves ``dynamic`` picks, and ``(args, kwargs)`` from new values for them."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dyn = [i for i, leaf in enumerate(leaves) if dynamic(leaf)]

  def rebuild(values):
    full = list(leaves)
    for i, val in zip(dyn, values):
      full[i] = val
    return jax.tree.unflatten(treedef, full)

  return [leaves[i] for i in dyn], rebuild


def _describe(fun) -> str:
  """The user's function as an error names it: its name and where it is defined."""
  name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or repr(fun)
  code = getattr(inspect.unwrap(fun), "__code__", None) if callable(fun) else None
  return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _trace(fun, args, kwargs):
  """``(closed jaxpr, its dynamic arguments, outputs from the jaxpr's results)``.

  Array leaves of the arguments are traced, other leaves are static; so are
  the outputs' (a string, a function in an equinox Module come back as the
  function returned them).
  """
  values, rebuild = _split(args, kwargs, _is_array)
  out: dict = {}

  @functools.wraps(fun)  # jax's messages then name the user's function, not this one
  def flat_fun(*values):
    a, k = rebuild(values)
    leaves, treedef = jax.tree.flatten(fun(*a, **k))
    dyn = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    out.update(treedef=treedef, dyn=dyn,
               leaves=[None if i in dyn else leaf for i, leaf in enumerate(leaves)])
    return [leaves[i] for i in dyn]

  if kwargs or len(values) != len(args) or not all(map(_is_array, args)):
    # The traced values are not fun's positional arguments one for one: jax names them
    # args[i] rather than by a signature they do not bind to as named.
    flat_fun.__signature__ = inspect.Signature(
        [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])
  try:
    closed = jax.make_jaxpr(flat_fun)(*values)
  except Exception as e:  # pylint: disable=broad-except
    errors = sys.modules.get("flax.errors")
    if errors is None or not isinstance(e, getattr(errors, "TraceContextError", ())):
      raise
    raise TypeError(
        f"jax_normgrad.rewrite: {_describe(fun)} changes a flax.nnx object that is not among "
        "its arguments (a Module it closes over), whose state the rewrite cannot thread "
        "through: pass the Module as an argument") from e

  def outputs(results):
    leaves = list(out["leaves"])
    for i, val in zip(out["dyn"], results):
      leaves[i] = val
    return jax.tree.unflatten(out["treedef"], leaves)

  return closed, values, outputs


def _nnx_of(args, kwargs):
  """``flax.nnx`` where the arguments hold its graph nodes (Modules, Variables, Rngs), else None.

  Only where the caller has imported ``flax.nnx``: the rewrite never imports it.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return None
  is_node = nnx.graph.is_graph_node
  return nnx if any(map(is_node, jax.tree.leaves((args, kwargs), is_leaf=is_node))) else None


def _on_graph_nodes(nnx, call, fun, args, kwargs):
  """``call(fun, args, kwargs)`` with NNX graph nodes threaded through as ``nnx.jit`` does.

  The graph nodes among the arguments are split into their state, the traced
  function merges them again, calls ``fun`` and returns the state it left
  them in, and the caller's objects are updated with it: Variables, RNG
  counts, batch statistics and an optimizer's updates change as in the
  plain code (a Module is otherwise a pytree, rebuilt inside the trace, and
  its changes would be lost).
  """
  is_node = nnx.graph.is_graph_node
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
  where = [i for i, leaf in enumerate(leaves) if is_node(leaf)]
  nodes = [leaves[i] for i in where]
  graphdef, state = nnx.split(nodes)

  def pure(state, rest):
    inner = nnx.merge(graphdef, state)
    full = list(rest)
    for i, node in zip(where, inner):
      full[i] = node
    a, k = jax.tree.unflatten(treedef, full)
    result = fun(*a, **k)
    if any(map(is_node, jax.tree.leaves(result, is_leaf=is_node))):
      raise TypeError(f"jax_normgrad.rewrite: {_describe(fun)} returned a flax.nnx graph node "
                      "(a Module, Variable or Rngs); the rewrite threads graph nodes through its "
                      "arguments only: return arrays (and change the arguments' Modules in place)")
    return result, nnx.state(inner)

  rest = [None if i in where else leaf for i, leaf in enumerate(leaves)]
  result, new_state = call(functools.wraps(fun)(pure), (state, rest), {})
  nnx.update(nodes, new_state)
  return result


def rewrite(fun, *, report=False):
  """``fun`` with every LayerNorm, RMSNorm and GroupNorm it computes run by this package's ops.

  The returned function has ``fun``'s signature. Each call traces ``fun`` to a
  jaxpr (``jax.make_jaxpr``; array arguments are traced, every other leaf is
  static), finds the norms by what they compute (docs/rewrite.md lists the
  forms), and evaluates the jaxpr with each norm's result computed by
  :func:`jax_normgrad.layer_norm`, :func:`~jax_normgrad.rms_norm`,
  :func:`~jax_normgrad.group_norm` (a SiLU, GELU or ReLU after it fused) or
  :func:`~jax_normgrad.add_layer_norm` / :func:`~jax_normgrad.add_rms_norm`
  (a residual add before it whose sum is also used), with the same eps,
  scale, offset and output dtype. Everything else is evaluated unchanged:
  custom derivative rules stay the function's, a fused activation has the
  code's derivative, and ``flax.nnx`` Modules among the arguments are
  threaded through as ``nnx.jit`` does, so their state changes as in the
  plain code. Non-array outputs are returned as ``fun`` returned them.

  Wrap the result in ``jax.jit`` (the trace and the matching then run once
  per compile) and differentiate the result, not the other way round:
  ``jax.jit(jax.grad(rewrite(loss)))``. A function that already holds a
  gradient has the norms' forward in its jaxpr, which is rewritten, but its
  backward is XLA's transposed code, which is left alone.

  Args:
    fun: a function of arrays and pytrees of arrays (and of ``flax.nnx``
      graph nodes); not an already jitted one (``jax.jit``, ``nnx.jit``,
      ``eqx.filter_jit``): put ``rewrite`` inside the jit.
    report: False; True prints the :class:`RewriteReport` of each trace; a
      callable is called with it.

  Returns:
    The rewritten function.

  Raises:
    TypeError: ``fun`` is not callable or is jitted; ``report`` is not a
      bool or a callable.
  """
  if not callable(fun):
    raise TypeError(f"fun: expected a callable, got {type(fun).__name__}")
  if not (isinstance(report, bool) or callable(report)):
    raise TypeError(f"report: expected a bool or a callable, got {type(report).__name__}")
  if callable(getattr(fun, "lower", None)) and hasattr(fun, "__wrapped__"):  # a jit's wrapper
    raise TypeError(
        f"jax_normgrad.rewrite: {_describe(fun)} is already jitted (it has .lower: jax.jit, "
        "nnx.jit, eqx.filter_jit); rewriting it would trace it again at every call, outside "
        "the jit's cache, and leave its backward to XLA. Put rewrite inside the jit: "
        "jax.jit(jn.rewrite(f)) (nnx.jit(jn.rewrite(f)), eqx.filter_jit(jn.rewrite(f))) of the "
        "function before it was jitted")

  def call(fun, args, kwargs):
    closed, values, outputs = _trace(fun, args, kwargs)
    rw = _Rewriter()
    outs = rw.run(closed.jaxpr, closed.consts, values)
    if report is True:
      print(rw.report)
    elif callable(report):
      report(rw.report)
    return outputs(outs)

  @functools.wraps(fun)
  def rewritten(*args, **kwargs):
    nnx = _nnx_of(args, kwargs)
    if nnx is not None:
      return _on_graph_nodes(nnx, call, fun, args, kwargs)
    return call(fun, args, kwargs)

  return rewritten


def explain_rewrite(fun, *args, **kwargs) -> RewriteReport:
  """The :class:`RewriteReport` of ``rewrite(fun)(*args, **kwargs)``, traced abstractly (nothing runs).

  ``args`` may be arrays or ``jax.ShapeDtypeStruct``s; other leaves are static, as in
  :func:`rewrite`.
  """
  reports = []
  new = rewrite(fun, report=reports.append)
  values, rebuild = _split(args, kwargs,
                           lambda leaf: _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct))

  def call(*values):
    a, k = rebuild(values)
    return new(*a, **k)

  jax.eval_shape(call, *values)
  return reports[-1]
