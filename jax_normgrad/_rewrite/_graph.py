"""One jaxpr as the matcher sees it: nested ``jit`` calls inlined, producers and consumers, known constants.

The matcher reads a jaxpr's equations with every inner ``jit`` (``pjit``,
``closed_call``) expanded in place, so that statistics written inside a
nested ``jit`` (``jnp.var``'s, keras', haiku's) and an eps passed into it as
an argument are seen as the outer code computes them. Inner variables are
aliased to the outer atoms they are bound to. Scalars and other small values
that depend only on literals and constants are evaluated here (under
``jax.ensure_compile_time_eval``), so that ``ddof`` passed as an argument,
``jnp.where`` on a constant condition and ``N - ddof`` are plain numbers to
the matcher.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jax_normgrad import _compat

#: Call primitives inlined for the analysis (their bodies are plain code). A ``custom_jvp``
#: function is not: its own rule differentiates it, so its equations are rewritten only in its
#: primal body (where that rule still applies), never matched with the code around it.
INLINED = _compat.primitive_names("jit", "closed_call")
#: The largest value, in elements, evaluated at trace time.
MAX_CONST_ELEMENTS = 4096


def is_literal(atom) -> bool:
  return isinstance(atom, jcore.Literal)


def _renamed(jaxpr):
  """A copy of ``jaxpr`` with new variables (its equations' params, nested jaxprs included, shared)."""
  ren: dict = {}

  def var(v):
    if is_literal(v) or _compat.is_drop_var(v):
      return v
    if v not in ren:
      ren[v] = jcore.Var(v.aval)
    return ren[v]

  eqns = [e.replace(invars=[var(a) for a in e.invars], outvars=[var(o) for o in e.outvars])
          for e in jaxpr.eqns]
  return jaxpr.replace(constvars=[var(v) for v in jaxpr.constvars],
                       invars=[var(v) for v in jaxpr.invars],
                       outvars=[var(a) for a in jaxpr.outvars], eqns=eqns)


class Graph:
  """The flattened equations of one jaxpr and what the matcher asks of them.

  ``eqns``: the equations in order, inner jits' equations in place of the
  call; ``scope_vars``: the variables of the jaxpr itself (the only ones a
  rewrite can replace or read at run time); ``path``: for each flattened
  equation, the names of the jits it sits in.
  """

  def __init__(self, jaxpr, consts=()):
    self.alias: dict = {}
    self.const: dict = {}
    self.large_const: dict = {}
    self.eqns: list = []
    self.path: list = []
    self.exposed: dict = {}  # an inner jit's result -> the variable of this jaxpr bound to it
    self.scope_vars: set = set(jaxpr.invars) | set(jaxpr.constvars)
    for v, c in zip(jaxpr.constvars, consts):
      self._set_const(v, c)
    self.outvars = [self.resolve(a) for a in jaxpr.outvars]
    self._flatten(jaxpr, (), top=True)
    self.outvars = [self.resolve(a) for a in jaxpr.outvars]
    self.producer: dict = {}
    self.consumers: dict = {}
    for i, e in enumerate(self.eqns):
      for o in e.outvars:
        self.producer[o] = i
      for a in e.invars:
        a = self.resolve(a)
        if not is_literal(a):
          self.consumers.setdefault(a, []).append(i)
    self.out_set = {a for a in self.outvars if not is_literal(a)}
    self._fold_constants()

  # -- flattening --------------------------------------------------------------

  def _flatten(self, jaxpr, path, top=False):
    """Appends the equations of ``jaxpr``, each inner ``jit`` inlined with variables of its own.

    One jaxpr object is often the body of several calls (jax caches a jitted
    function's jaxpr: every ``nn.silu`` of a model is the same one), so each
    inlining renames the body's variables: the calls' values stay distinct.
    """
    for e in jaxpr.eqns:
      name = e.primitive.name
      body = _compat.bodies(name)
      if name in INLINED and body[0] in e.params:
        inner = e.params[body[0]]
        closed = inner if isinstance(inner, jcore.ClosedJaxpr) else None
        inner_jaxpr = _renamed(closed.jaxpr if closed is not None else inner)
        for v, c in zip(inner_jaxpr.constvars, closed.consts if closed is not None else ()):
          self._set_const(v, c)
        for v, a in zip(inner_jaxpr.invars, e.invars):
          self.alias[v] = self.resolve(a)
        self._flatten(inner_jaxpr, path + (_compat.param(e.params, "name", name),))
        for o, a in zip(e.outvars, inner_jaxpr.outvars):
          if not _compat.is_drop_var(o):
            self.alias[o] = self.resolve(a)
            if top:
              self.scope_vars.add(o)
              if not is_literal(self.alias[o]):  # a jitted helper may return a Python constant
                self.exposed.setdefault(self.alias[o], o)
        continue
      if _compat.is_varying_cast(e):
        # A type cast that leaves the value as it is (shard_map's pvary of a constant or a
        # replicated parameter): the same value to the matcher.
        self.alias[e.outvars[0]] = source = self.resolve(e.invars[0])
        if top:
          self.scope_vars.add(e.outvars[0])
          if not is_literal(source):
            self.exposed.setdefault(source, e.outvars[0])
        continue
      self.eqns.append(e)
      self.path.append(path)
      if top:
        self.scope_vars.update(o for o in e.outvars if not _compat.is_drop_var(o))

  def scope_var(self, atom):
    """The variable of this jaxpr that holds a (resolved) value, or None (an inner jit's own)."""
    if is_literal(atom):
      return None
    if atom in self.scope_vars:
      return atom
    return self.exposed.get(atom)

  def resolve(self, atom):
    """The atom an (inner) variable stands for."""
    while not is_literal(atom) and atom in self.alias:
      atom = self.alias[atom]
    return atom

  # -- constants ---------------------------------------------------------------

  def _set_const(self, v, c):
    if isinstance(c, jax.core.Tracer):
      return
    try:
      arr = np.asarray(c)
    except Exception:  # pylint: disable=broad-except
      return
    if arr.size <= MAX_CONST_ELEMENTS:
      self.const[v] = arr
    else:
      self.large_const[v] = arr

  def value(self, atom):
    """The concrete value of an atom (a literal, a constant, a folded value), else None."""
    atom = self.resolve(atom)
    if is_literal(atom):
      return np.asarray(atom.val)
    return self.const.get(atom)

  def _fold_constants(self):
    for e in self.eqns:
      if e.effects or any(_compat.is_drop_var(o) for o in e.outvars):
        continue
      if any(math.prod(getattr(o.aval, "shape", (1 << 30,))) > MAX_CONST_ELEMENTS
             for o in e.outvars):
        continue
      vals = [self.value(a) for a in e.invars]
      if any(v is None for v in vals) or any(
          isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr, tuple)) for p in e.params.values()
          if not isinstance(p, tuple) or any(isinstance(q, (jcore.Jaxpr, jcore.ClosedJaxpr))
                                             for q in p)):
        continue
      try:
        with jax.ensure_compile_time_eval():
          out = _compat.bind_equation(e, vals)
      except Exception:  # pylint: disable=broad-except
        continue
      outs = out if e.primitive.multiple_results else [out]
      for o, val in zip(e.outvars, outs):
        self._set_const(o, val)

  def scalar(self, atom):
    """A concrete value that is one number repeated (a scalar, a broadcast literal), else None."""
    v = self.value(atom)
    if v is None or v.size == 0 or v.dtype == bool or not jnp.issubdtype(v.dtype, jnp.number):
      return None
    flat = v.ravel().astype(np.float64)  # bfloat16 and float16 literals included
    return float(flat[0]) if np.all(flat == flat[0]) else None

  # -- structure ---------------------------------------------------------------

  def producer_eqn(self, atom):
    atom = self.resolve(atom)
    if is_literal(atom) or atom not in self.producer:
      return None
    return self.eqns[self.producer[atom]]

  def constant_dims(self, atom) -> frozenset:
    """The dims along which an x-independent value is provably constant (size 1, or broadcast)."""
    atom = self.resolve(atom)
    shape = getattr(atom.aval, "shape", ())
    dims = {i for i, s in enumerate(shape) if s == 1}
    e = self.producer_eqn(atom)
    if e is None:
      v = self.value(atom)
      if v is not None and v.ndim == len(shape):
        for i in range(v.ndim):
          if v.shape[i] > 1 and np.all(v == v.take([0], axis=i)):
            dims.add(i)
      return frozenset(dims)
    name = e.primitive.name
    if name == "broadcast_in_dim":
      bd = e.params["broadcast_dimensions"]
      inner = self.constant_dims(e.invars[0])
      src = e.invars[0].aval.shape
      for i in range(len(shape)):
        if i not in bd:
          dims.add(i)
        else:
          j = bd.index(i)
          if src[j] == 1 or j in inner:
            dims.add(i)
    elif name in ("convert_element_type", "neg", "copy", "copy_p", "reduce_precision") or (
        name in ("add", "sub", "mul", "div", "max", "min") and all(
            tuple(getattr(self.resolve(a).aval, "shape", ())) in ((), shape) for a in e.invars)):
      sets = [self.constant_dims(a) if getattr(self.resolve(a).aval, "shape", ()) else
              frozenset(range(len(shape))) for a in e.invars]
      dims |= set.intersection(*map(set, sets)) if sets else set()
    return frozenset(dims)

