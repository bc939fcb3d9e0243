"""Finding the norms in one (flattened) jaxpr: candidates, the abstract interpretation, the matches.

A candidate is a root ``x`` and the axes a ``reduce_sum`` reduces in a view
of it (its *canonical* axes: the reduced operand's axes, so that GroupNorm's
reshape to groups is a view of x). From the root the equations are
interpreted in the algebra of :mod:`._algebra`: every value computed from x
is a polynomial in x with row-statistic and column-factor coefficients, laid
out over the canonical axes (:class:`Abs`). Each value that
:func:`._algebra.identify` recognises and whose layout is x's is a match;
the first reason a promising value was refused is kept for the report.

Layouts: each array dim holds a list of entries ``(label, size, materialized)``;
a label is a canonical axis (an int >= 0) or an anonymous axis (< 0: a dim a
broadcast created, constant by construction), which takes the label of the
axis it is later aligned with.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jax_normgrad import _compat
from jax_normgrad._rewrite import _algebra as al
from jax_normgrad._rewrite._graph import Graph, is_literal

ELEMENTWISE_UNARY_ID = ("convert_element_type", "copy", "copy_p", "reduce_precision",
                        "optimization_barrier")


class Abs(NamedTuple):
  """An x-dependent value: its polynomial, its layout (a tuple of dims, each a tuple of entries)."""
  poly: dict
  dims: tuple
  dtype: Any


class Factor(NamedTuple):
  """An x-independent operand of the norm's affine: the atom and, per its dim, the entries it spans."""
  atom: Any
  dims: tuple  # per dim of the atom: the entries of the x-dependent operand it was aligned with
  const_dims: frozenset  # dims along which the atom is constant though materialized


class Candidate:
  """One root and its canonical axes; the state of its interpretation."""

  def __init__(self, graph: Graph, root, sizes: tuple, reduced: frozenset, root_dims: tuple):
    self.g = graph
    self.root = root
    self.sizes = sizes
    self.reduced = reduced
    self.root_dims = root_dims
    self.abs: dict = {root: Abs(al.X, root_dims, root.aval.dtype)}
    self.factors: list[Factor] = []
    self.bind: dict = {}  # anonymous label -> canonical label
    self._anon = 0
    self.moments_seen = False
    self.failures: dict = {}  # var -> reason an x-dependent use was not understood
    self.tainted: set = {root}  # every value computed from x, understood or not

  # -- labels ------------------------------------------------------------------

  def new_anon(self):
    self._anon -= 1
    return self._anon

  def label(self, lab):
    while lab < 0 and lab in self.bind:
      lab = self.bind[lab]
    return lab

  def unify(self, a, b):
    a, b = self.label(a), self.label(b)
    if a == b:
      return True
    if a < 0:
      self.bind[a] = b
      return True
    if b < 0:
      self.bind[b] = a
      return True
    return False

  # -- factors -----------------------------------------------------------------

  def factor(self, atom, dims) -> int:
    atom = self.g.resolve(atom)
    f = Factor(atom, dims, self.g.constant_dims(atom) if not is_literal(atom) else frozenset())
    for i, old in enumerate(self.factors):
      if old.atom is f.atom and old.dims == f.dims:
        return i
    self.factors.append(f)
    return len(self.factors) - 1


def _entries_size(entries, materialized_only=True):
  return math.prod(s for _, s, m in entries if m or not materialized_only)


def regroup(entries: list, shape: tuple, cand: Candidate | None = None):
  """Flat entries regrouped into dims of ``shape`` (a reshape); None if an entry would be split.

  Anonymous entries may be split (they are broadcasts); canonical ones may not.
  """
  entries = list(entries)
  out = []
  for target in shape:
    dim, prod = [], 1
    while entries and (prod < target or (not entries[0][2] or entries[0][1] == 1)):
      lab, size, mat = entries[0]
      eff = size if mat else 1
      if prod * eff <= target:
        dim.append(entries.pop(0))
        prod *= eff
        if prod == target and entries and entries[0][2] and entries[0][1] > 1:
          break
        continue
      if lab < 0 and cand is not None and target % prod == 0 and size % (target // prod) == 0:
        part = target // prod
        entries[0] = (lab, size // part, mat)
        dim.append((cand.new_anon(), part, mat))
        prod *= part
        break
      return None
    if prod != target:
      return None
    out.append(tuple(dim))
  if entries:
    if any(m and s > 1 for _, s, m in entries):
      return None
    out[-1:] = [out[-1] + tuple(entries)] if out else []
  return tuple(out)


def _dim_size(dim):
  return math.prod(s for _, s, m in dim if m)


def _flat(dims):
  return [e for d in dims for e in d]


def _sig(cand, dims):
  """The labels of a layout's materialized entries of size > 1, per dim (anonymous resolved)."""
  return tuple(tuple(cand.label(l) for l, s, m in d if m and s > 1) for d in dims)


def _align(cand: Candidate, a: tuple, b: tuple):
  """Two layouts of one rank aligned elementwise (broadcasting size-1 dims); None if they differ."""
  if len(a) != len(b):
    return None
  out = []
  for da, db in zip(a, b):
    sa, sb = _dim_size(da), _dim_size(db)
    if sa == 1 and sb == 1:
      out.append(da if len(da) >= len(db) else db)
      continue
    if sa == 1 or sb == 1:
      big, small = (da, db) if sb == 1 else (db, da)
      # The size-1 side's canonical entries must not contradict the other's.
      labs = [cand.label(l) for l, s, m in big if m and s > 1]
      if any(cand.label(l) >= 0 and cand.label(l) not in labs for l, s, _ in small if s > 1):
        return None
      out.append(big)
      continue
    ea = [e for e in da if e[2] and e[1] > 1]
    eb = [e for e in db if e[2] and e[1] > 1]
    if len(ea) != len(eb) or any(x[1] != y[1] for x, y in zip(ea, eb)):
      return None
    for x, y in zip(ea, eb):
      if not cand.unify(x[0], y[0]):
        return None
    out.append(da)
  return tuple(out)


def _ext_dims(cand: Candidate, atom, dims_of_abs: tuple):
  """The entries an x-independent operand spans, aligned with an x-dependent one's layout."""
  shape = tuple(getattr(atom.aval, "shape", ())) if not is_literal(atom) else np.shape(atom.val)
  if not shape:
    return ()
  if len(shape) != len(dims_of_abs):
    return None
  out = []
  for s, d in zip(shape, dims_of_abs):
    if s == 1:
      out.append(())
      continue
    full = [(l, sz, True) for l, sz, _ in d if sz > 1]
    if not full and _dim_size(d) == 1:
      # A size-1 dim of a row statistic (a keepdims axis): the operand spans an axis of it
      # whose label the alignment with x will tell.
      full = [(cand.new_anon(), s, True)]
    if math.prod(sz for _, sz, _ in full) != s:
      return None
    out.append(tuple(full))
  return tuple(out)


def _broadcast_ext_layout(dims_abs, ext_dims):
  """The result layout of an x-dependent value combined with an x-independent one."""
  out = []
  for d, e in zip(dims_abs, ext_dims):
    if e and _dim_size(d) == 1:
      out.append(tuple((l, s, True) for l, s, _ in d) if _entries_size(d, False) == math.prod(
          s for _, s, _ in e) else e)
    else:
      out.append(d)
  return tuple(out)


class Fail(Exception):
  """An x-dependent equation the algebra does not cover (a boundary of the candidate)."""


def _operand(cand: Candidate, atom, dims_like, dtype):
  """An operand as an Abs: its own, a constant, or a factor aligned with ``dims_like``."""
  atom = cand.g.resolve(atom)
  if not is_literal(atom) and atom in cand.abs:
    return cand.abs[atom], None
  if not is_literal(atom) and atom in cand.tainted:
    raise Fail("an operand computed from x by an op the algebra does not cover")
  ext = _ext_dims(cand, atom, dims_like)
  if ext is None:
    raise Fail("an operand that does not broadcast against the row layout")
  c = cand.g.scalar(atom)
  if c is not None:
    return Abs(al.poly_const(al.const(c)), None, dtype), ext
  if not ext:  # a traced scalar
    f = cand.factor(atom, ())
    return Abs(al.poly_const(al.ONE, ((f, 1),)), None, dtype), ()
  f = cand.factor(atom, ext)
  return Abs(al.poly_const(al.ONE, ((f, 1),)), None, dtype), ext


def _exact_mean(cand: Candidate, stat: Abs, c: Abs, dtype) -> Abs:
  """The constant ``c`` of ``stat * c``: exactly 1/n where ``stat`` is a row statistic and ``c``
  is 1/n rounded to ``dtype``, n the candidate's reduced size (``sum(x) * (1 / n)``, a mean).

  In float64 the rounded 1/n is not 1/n: a one-pass variance would then not cancel to
  the variance (by a relative 1e-8 of the mean squared), where the code's arithmetic
  rounds as much in its mean.
  """
  r, row = al.pure_row(c.poly), al.pure_row(stat.poly)
  if r is None or row is None or not al.is_const(r):
    return c
  n = math.prod(cand.sizes[l] for l in cand.reduced if cand.sizes[l] > 1)
  v = al.value_of(r)
  if v != 1.0 / n and abs(v - 1.0 / n) <= float(jnp.finfo(dtype).eps) / n:
    return c._replace(poly=al.poly_const(al.const(1.0 / n)))
  return c


def _binary(cand: Candidate, e, a, b):
  """Transfer of an elementwise binary op; returns the output's (poly, dims)."""
  name = e.primitive.name
  dtype = e.outvars[0].aval.dtype
  ga, gb = cand.g.resolve(a), cand.g.resolve(b)
  in_a = not is_literal(ga) and ga in cand.abs
  in_b = not is_literal(gb) and gb in cand.abs
  ref = cand.abs[ga] if in_a else cand.abs[gb]
  pa, ea = _operand(cand, a, ref.dims, dtype)
  pb, eb = _operand(cand, b, ref.dims, dtype)
  if in_a and in_b:
    dims = _align(cand, pa.dims, pb.dims)
    if dims is None:
      raise Fail("operands laid out over different axes")
  else:
    ext = eb if in_a else ea
    dims = _broadcast_ext_layout(ref.dims, ext) if ext else ref.dims
  if name == "mul" and in_b != in_a:
    if in_a:
      pb = _exact_mean(cand, pa, pb, dtype)
    else:
      pa = _exact_mean(cand, pb, pa, dtype)
  P, Q = pa.poly, pb.poly
  if name == "add":
    return al.poly_add(P, Q), dims
  if name == "sub":
    return al.poly_add(P, al.poly_scale(Q, al.const(-1.0))), dims
  if name == "mul":
    out = al.poly_mul(P, Q)
    if out is None:
      raise Fail("a polynomial of degree > 2 in x")
    return out, dims
  if name == "div":
    t = al.single_term(Q)
    if t is None:
      raise Fail("a division by a value that depends on x elementwise")
    r, mono = t
    return al.poly_scale(P, al.recip(r), tuple((f, -p) for f, p in mono)), dims
  if name in ("max", "min", "pow"):
    ra, rb = al.pure_row(P), al.pure_row(Q)
    if name == "pow" and ra is None:
      _check_traced_statistics(cand, P)
    if ra is None or rb is None:
      raise Fail(f"{name} of a value that is not a row statistic")
    if name == "pow":
      if not al.is_const(rb):
        raise Fail("a power with a traced exponent")
      return al.poly_const(al.power(ra, al.value_of(rb))), dims
    return al.poly_const(al.binary(name, ra, rb)), dims
  raise Fail(f"{name}")


#: The start of the reason given where a traced value enters the statistics under the square root.
TRACED_STATISTICS = "eps is a traced value"


def _check_traced_statistics(cand: Candidate, P):
  """Raises :class:`Fail` saying so where ``P`` is the row's statistics plus (or times) a traced scalar.

  ``var + eps`` with eps a jit argument (a tracer, not a number) is not a row
  statistic to the algebra: the norm's eps must be known when it is traced.
  """
  if set(P) != {0} or () not in P[0] or not al.has_moments({0: {(): P[0][()]}}):
    return
  traced = [cand.factors[f] for mono in P[0] if mono for f, _ in mono]
  if traced and all(not f.dims for f in traced):
    avals = ", ".join(sorted({str(getattr(f.atom, "aval", "?")) for f in traced}))
    raise Fail(f"{TRACED_STATISTICS} ({avals}, added to the statistics under the square root), "
               "not a number known when the function is traced: pass eps as a Python float "
               "(closed over, or a static argument of the enclosing jit: static_argnames)")


def _unary(cand: Candidate, e, a):
  name = e.primitive.name
  src = cand.abs[cand.g.resolve(a)]
  P = src.poly
  if name in ELEMENTWISE_UNARY_ID:
    if name == "convert_element_type" and not jnp.issubdtype(e.params["new_dtype"], jnp.floating):
      raise Fail("a cast to a non-float type")
    return P, src.dims
  if name == "neg":
    return al.poly_scale(P, al.const(-1.0)), src.dims
  if name in ("square", "integer_pow"):
    y = 2 if name == "square" else e.params["y"]
    if y >= 0:
      out = al.poly_const(al.ONE)
      for _ in range(y):
        out = al.poly_mul(out, P)
        if out is None:
          raise Fail("a polynomial of degree > 2 in x")
      return out, src.dims
    r = al.pure_row(P)
    if r is None:
      _check_traced_statistics(cand, P)
      raise Fail("a negative power of a value that depends on x elementwise")
    return al.poly_const(al.power(r, y)), src.dims
  r = al.pure_row(P)
  if name in ("sqrt", "rsqrt") and r is None:
    _check_traced_statistics(cand, P)
  if name in ("sqrt", "rsqrt", "abs") and r is not None:
    if name == "abs":
      raise Fail("abs")
    return al.poly_const(al.power(r, 0.5 if name == "sqrt" else -0.5)), src.dims
  raise Fail(f"{name} of a value that depends on x")


def _reduce_sum(cand: Candidate, e, a):
  src = cand.abs[cand.g.resolve(a)]
  axes = tuple(e.params["axes"])
  red_labels = {cand.label(l) for i in axes for l, s, m in src.dims[i] if m and s > 1}
  anon = [l for l in red_labels if l < 0]
  if anon:
    # A reduced anonymous axis is a broadcast: bind it by size if a reduced
    # canonical axis is left; else it only multiplies.
    raise Fail("a sum over a broadcast axis")
  want = {l for l in cand.reduced if cand.sizes[l] > 1}
  if red_labels != want:
    raise Fail("a sum over other axes than the candidate's")
  kept = tuple(d for i, d in enumerate(src.dims) if i not in axes)
  n = math.prod(cand.sizes[l] for l in want)
  out = {}
  for deg, terms in src.poly.items():
    for mono, r in terms.items():
      if mono:
        raise Fail("a column factor inside the statistics")
      moment = {0: al.ONE, 1: al.S1, 2: al.S2}[deg]
      out = al.poly_add(out, al.poly_const(al.mul(al.mul(r, moment), al.const(n))))
  cand.moments_seen = True
  return out, kept


def _shape_op(cand: Candidate, e, a):
  name = e.primitive.name
  src = cand.abs[cand.g.resolve(a)]
  shape = tuple(e.outvars[0].aval.shape)
  if name == "broadcast_in_dim":
    bd = e.params["broadcast_dimensions"]
    out = []
    for j, s in enumerate(shape):
      if j in bd:
        d = src.dims[bd.index(j)]
        if _dim_size(d) == 1 and s > 1:
          if _entries_size(d, False) == s and any(sz > 1 for _, sz, _ in d):
            d = tuple((l, sz, True) for l, sz, _ in d)
          else:
            d = tuple((l, sz, False) for l, sz, _ in d) + ((cand.new_anon(), s, True),)
        out.append(d)
      else:
        out.append(((cand.new_anon(), s, True),) if s > 1 else ())
    return src.poly, tuple(out)
  if name == "reshape":
    if e.params.get("dimensions") not in (None, ()):
      raise Fail("a reshape with a transpose")
    dims = regroup(_flat(src.dims), shape, cand)
    if dims is None:
      raise Fail("a reshape that splits a reduced axis")
    return src.poly, dims
  if name == "squeeze":
    drop = set(e.params["dimensions"])
    kept = [d for i, d in enumerate(src.dims) if i not in drop]
    extra = [x for i, d in enumerate(src.dims) if i in drop for x in d]
    if kept:
      kept[-1] = kept[-1] + tuple(extra)
    return src.poly, tuple(kept)
  if name == "transpose":
    return src.poly, tuple(src.dims[p] for p in e.params["permutation"])
  raise Fail(name)


def _dot_general(cand: Candidate, e):
  """A dot_general with no contraction against an x-independent operand: a scale (an einsum)."""
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  lhs, rhs = (cand.g.resolve(a) for a in e.invars)
  in_l = not is_literal(lhs) and lhs in cand.abs
  in_r = not is_literal(rhs) and rhs in cand.abs
  if lc or rc or in_l == in_r:
    raise Fail("a dot_general that contracts, or of two values that depend on x")
  src, ext, sb, eb = (cand.abs[lhs], rhs, lb, rb) if in_l else (cand.abs[rhs], lhs, rb, lb)
  ext_shape = ext.aval.shape
  if len(eb) != len(ext_shape):
    raise Fail("a dot_general whose other operand has free dims")
  # Output: batch dims (in order), then the x-dependent operand's free dims (the other
  # operand has none, whichever side it is on).
  free = [i for i in range(len(src.dims)) if i not in sb]
  ext_dims = [()] * len(ext_shape)
  for i, j in zip(sb, eb):
    if ext_shape[j] > 1:
      ext_dims[j] = tuple((l, s, True) for l, s, _ in src.dims[i] if s > 1)
  out_dims = [src.dims[i] for i in sb] + [src.dims[i] for i in free]
  f = cand.factor(ext, tuple(ext_dims))
  return al.poly_scale(src.poly, al.ONE, ((f, 1),)), tuple(out_dims)


def _select_n(cand: Candidate, e):
  pred = cand.g.value(e.invars[0])
  if pred is None or pred.size == 0 or not np.all(pred.ravel() == pred.ravel()[0]):
    raise Fail("a select on a traced condition")
  pred = pred.ravel()[0]
  chosen = cand.g.resolve(e.invars[1 + int(pred)])
  if is_literal(chosen) or chosen not in cand.abs:
    raise Fail("a select of a value that does not depend on x")
  src = cand.abs[chosen]
  return src.poly, src.dims


BINARY = ("add", "sub", "mul", "div", "max", "min", "pow")
#: Functions with derivative rules of their own (not inlined: ``_graph.INLINED``).
CUSTOM_CALLS = _compat.primitive_names("custom_jvp_call", "custom_vjp_call")
#: The start of the reason given where the statistics pass through one.
CUSTOM_RULE = "the statistics pass through a function with a custom derivative"
#: Reasons that explain a candidate's other failures, reported first.
DECISIVE = (TRACED_STATISTICS, CUSTOM_RULE)
SHAPE = ("broadcast_in_dim", "reshape", "squeeze", "transpose")


def interpret(cand: Candidate, start: int):
  """Runs the candidate's abstract interpretation over the equations from index ``start``.

  Only the equations that read a value computed from x are visited, in their
  order, and only while one of them reads an interpreted value (``cand.abs``):
  past the last such equation nothing can change the interpretation, so its
  cost is that of the norm's region, not of the rest of the graph.
  """
  g = cand.g
  pending: dict = {}  # equation index -> whether it reads an interpreted value
  heap: list = []
  live_pending = 0

  def push_readers(v, live):
    nonlocal live_pending
    for j in g.consumers.get(v, ()):
      if j < start:
        continue
      if j not in pending:
        pending[j] = live
        heapq.heappush(heap, j)
        live_pending += live
      elif live and not pending[j]:
        pending[j] = True
        live_pending += 1

  for v in cand.tainted:
    push_readers(v, v in cand.abs)
  while heap and live_pending:
    i = heapq.heappop(heap)
    live_pending -= pending.pop(i)
    e = g.eqns[i]
    ins = [g.resolve(a) for a in e.invars]
    if any(not is_literal(a) and a in cand.tainted for a in ins):
      for o in e.outvars:
        if o not in cand.tainted:
          cand.tainted.add(o)
          push_readers(o, False)
    live = [a for a in ins if not is_literal(a) and a in cand.abs]
    if not live or len(e.outvars) != 1:
      if live:
        for a in live:
          cand.failures.setdefault(a, f"{e.primitive.name} (several results)")
      continue
    name = e.primitive.name
    out = e.outvars[0]
    try:
      if name in CUSTOM_CALLS and any(al.pure_row(cand.abs[a].poly) is not None and
                                      al.has_moments(cand.abs[a].poly) for a in live):
        raise Fail(f"{CUSTOM_RULE} ({name}): its own derivative rule, which the op's would "
                   "replace, differentiates the statistics; left as written")
      if name in BINARY and len(ins) == 2:
        poly, dims = _binary(cand, e, ins[0], ins[1])
      elif name == "reduce_sum":
        poly, dims = _reduce_sum(cand, e, ins[0])
      elif name in SHAPE:
        poly, dims = _shape_op(cand, e, ins[0])
      elif name == "dot_general":
        poly, dims = _dot_general(cand, e)
      elif name == "select_n":
        poly, dims = _select_n(cand, e)
      elif len(ins) == 1:
        poly, dims = _unary(cand, e, ins[0])
      else:
        raise Fail(name)
      if len(dims) != len(out.aval.shape) or any(
          _dim_size(d) != s for d, s in zip(dims, out.aval.shape)):
        raise Fail(f"{name}: layout mismatch")
    except Fail as why:
      for a in live:
        cand.failures.setdefault(a, str(why))
      continue
    cand.abs[out] = Abs(poly, dims, out.aval.dtype)
    push_readers(out, True)


# ----------------------------------------------------------------------------
# Candidates.

_ROOT_THROUGH = ("convert_element_type", "reshape", "square", "copy", "copy_p")


def cast_direction(e) -> int:
  """1 for a ``convert_element_type`` that widens (exact), -1 for one that rounds, else 0."""
  if e.primitive.name != "convert_element_type":
    return 0
  src, dst = jnp.dtype(e.invars[0].aval.dtype), jnp.dtype(e.outvars[0].aval.dtype)
  if src == dst:
    return 0
  return 1 if jnp.promote_types(src, dst) == dst else -1


def _walk_to_root(g: Graph, u):
  """From a reduced operand back to the tensor it is computed from elementwise (or a view of)."""
  v = u
  chain = [v]
  for _ in range(64):
    e = g.producer_eqn(v)
    if e is None:
      break
    name = e.primitive.name
    ins = [g.resolve(a) for a in e.invars]
    shape = tuple(v.aval.shape)
    nxt = None
    if name in _ROOT_THROUGH or (name == "integer_pow" and e.params["y"] == 2):
      if is_literal(ins[0]) or not jnp.issubdtype(ins[0].aval.dtype, jnp.floating):
        break
      if cast_direction(e) < 0:
        break  # a down-cast: the rounded tensor is x, not the value before it
      nxt = ins[0]
    elif name == "mul" and ins[0] is ins[1]:
      nxt = ins[0]
    elif name == "sub":
      full = [a for a in ins if not is_literal(a) and tuple(a.aval.shape) == shape]
      plain = [a for a in full if (g.producer_eqn(a) is None or
                                   g.producer_eqn(a).primitive.name != "broadcast_in_dim")]
      nxt = (plain or full or [None])[0]
    if nxt is None or is_literal(nxt):
      break
    v = nxt
    chain.append(v)
  return chain


def candidates(g: Graph) -> list[list[Candidate]]:
  """Per distinct (root, view, reduced axes) of the graph's ``reduce_sum``s, the candidates to try.

  The first is rooted at the earliest tensor the reduced view regroups into (a
  GroupNorm's x before its reshape to groups); each next one at a later view of
  another shape (the per-head (B, S, H, D) of a QK-norm, where no group op fits).
  """
  seen = set()
  out = []
  for i, e in enumerate(g.eqns):
    if e.primitive.name != "reduce_sum":
      continue
    u = g.resolve(e.invars[0])
    if is_literal(u) or not jnp.issubdtype(u.aval.dtype, jnp.floating):
      continue
    sizes = tuple(u.aval.shape)
    reduced = frozenset(e.params["axes"])
    canon = tuple((k, s, True) for k, s in enumerate(sizes))
    roots = []  # (root, dims), the earliest tensor of each shape along the chain
    for v in _walk_to_root(g, u):
      dims = regroup(list(canon), tuple(v.aval.shape))
      if dims is None:
        break
      if roots and tuple(v.aval.shape) == tuple(roots[-1][0].aval.shape):
        roots[-1] = (v, dims)
      else:
        roots.append((v, dims))
    if not roots:
      continue
    key = (roots[-1][0], sizes, reduced)
    if key in seen:
      continue
    seen.add(key)
    out.append([Candidate(g, root, sizes, reduced, dims) for root, dims in reversed(roots)])
  return out
