"""From candidates to matches: which op, its eps, parameters, layout, fused activation or residual add.

:func:`find` runs every candidate of a :class:`._graph.Graph` and returns
the matches (:class:`Match`: what the rewrite replaces, and with what) and
the near misses (:class:`NearMiss`: a value with row statistics that was not
rewritten, and why).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

from jax_normgrad import _activations, _compat
from jax_normgrad._rewrite import _algebra as al
from jax_normgrad._rewrite._graph import Graph, is_literal
from jax_normgrad._rewrite._match import (DECISIVE, Candidate, _sig, candidates, cast_direction,
                                          interpret)

SUPPORTED_X = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass
class Match:
  """One norm the rewrite replaces: ``outputs`` (variable -> "y" or "h") computed by ``op``."""
  op: str  # layer_norm, rms_norm, group_norm, add_layer_norm, add_rms_norm
  x: Any
  residual: tuple | None
  outputs: dict
  eps: float
  weight: dict  # monomial -> coefficient; empty: no weight
  bias: dict
  factors: list
  labels: Any  # the candidate's label resolver
  param_axes: tuple
  param_sizes: dict
  param_shape: tuple
  norm_ndim: int = 0  # LayerNorm / RMSNorm
  lead_ndim: int = 0  # GroupNorm: x's leading dims merged into N
  groups: int = 0
  channel_axis: int = 1
  activation: str | None = None
  y_dtype: Any = None
  source: str = ""
  shape: tuple = ()
  dtype: Any = None
  note: str | None = None  # what was kept as written, and why (an activation not fused)


@dataclasses.dataclass
class NearMiss:
  """A value computed from row statistics that was left alone, and why."""
  shape: tuple
  dtype: Any
  reason: str
  source: str = ""


def source_of(g: Graph, var) -> str:
  i = g.producer.get(var)
  if i is None:
    return ""
  return source_info_util.summarize(g.eqns[i].source_info)


def _layout(cand: Candidate):
  """``("layer", norm_ndim)`` or ``("group", lead_ndim, channel_axis, g, cg)``, or a reason."""
  sig = _sig(cand, cand.root_dims)
  red = [l for l in sorted(cand.reduced) if cand.sizes[l] > 1]
  keep = {l for l in range(len(cand.sizes)) if l not in cand.reduced and cand.sizes[l] > 1}
  split = next((i for i, d in enumerate(sig) if set(d) & set(red)), None)
  if split is None:
    return None, "no reduced axis left in x"
  lead_ok = all(set(d) <= keep for d in sig[:split])
  rest = [l for d in sig[split:] for l in d]
  if lead_ok and rest == red:
    return ("layer", len(sig) - split), None
  # GroupNorm: leading dims (N), then spatial dims and one channel dim holding a group axis
  # (kept) followed by the group's channels (reduced), or a kept axis alone (one channel per group).
  chan = [i for i, d in enumerate(sig[split:], split) if set(d) & keep]
  if lead_ok and split >= 1 and len(chan) == 1:
    d = sig[chan[0]]
    g = d[0]
    cg = d[1] if len(d) == 2 else None
    if g in keep and (len(d) == 1 or (len(d) == 2 and cg in red)) and all(
        set(x) <= set(red) for i, x in enumerate(sig[split:], split) if i != chan[0]):
      return ("group", split, chan[0] - split + 1, g, cg), None
  axes = [i for i, d in enumerate(sig) if set(d) & set(red)]
  # Leading axes (named-axis code): the op could run on a moved view, measured not to pay.
  moved = ("; the op on a moved view of x does not pay, so it stays as written "
           "(docs/rewrite.md, \"What it leaves alone\")" if axes == list(range(len(axes))) else "")
  return None, (f"the statistics are over axes {tuple(axes)} of x's shape {tuple(cand.root.aval.shape)}: "
                "neither its trailing axes (LayerNorm, RMSNorm) nor a group's channels and "
                f"spatial axes (GroupNorm){moved}")


def _factor_labels(cand: Candidate, f) -> set:
  shape = np.shape(f.atom.val) if is_literal(f.atom) else tuple(f.atom.aval.shape)
  out = set()
  for i, ents in enumerate(f.dims):
    if shape[i] > 1 and i not in f.const_dims:
      out |= {cand.label(l) for l, s, _ in ents if s > 1}
  return out


def _ancestors(g: Graph, var, stop) -> set:
  """Equation indices ``var`` depends on, back to ``stop``."""
  seen, todo = set(), [var]
  while todo:
    v = todo.pop()
    i = g.producer.get(v)
    if v is stop or i is None or i in seen:
      continue
    seen.add(i)
    todo.extend(a for a in map(g.resolve, g.eqns[i].invars) if not is_literal(a))
  return seen


#: A custom_jvp function (``jax.nn.relu``) among an activation's steps.
_CUSTOM_JVP = _compat.primitive_names("custom_jvp_call")
_ACT_PRIMS = ("logistic", "mul", "add", "sub", "div", "neg", "max", "min", "tanh", "exp",
              "integer_pow", "pow", "convert_element_type", "erf", "sqrt", "rsqrt", "abs",
              "square", "select_n", "ge", "gt", "le", "lt", *_CUSTOM_JVP)
#: The points an activation is compared at: ties (0, where ``max`` and ``where`` differ in
#: their derivative) included.
_ACT_TEST = np.linspace(-8.0, 8.0, 161, dtype=np.float32)
#: The largest y, in elements, whose activation is a ``custom_jvp`` function that is checked
#: (evaluated at y's shape, the shape of its jaxprs); a larger one is not fused.
MAX_ACT_ELEMENTS = 1 << 20


def _activation(g: Graph, y):
  """``(activation, output variable, note)`` where y feeds only an elementwise SiLU / GELU / ReLU.

  The code's function of y must equal the op's activation in value and in
  derivative (as jax differentiates the code: ``max(y, 0)`` has derivative
  0.5 at 0, a ``custom_jvp`` function its own rule's) at every test point,
  ties included: the op's backward uses its own derivative. Where only the
  values agree, nothing is fused and ``note`` says why (the activation then
  runs as written, after the op); else ``note`` is None.
  """
  avail = {y}
  chosen = []
  best, note = None, None
  frontier = set(g.consumers.get(y, ()))
  for _ in range(12):
    ready = sorted(i for i in frontier if _act_eqn(g, g.eqns[i], avail))
    if not ready:
      break
    i = ready[0]
    frontier.discard(i)
    chosen.append(i)
    out = g.eqns[i].outvars[0]
    avail.add(out)
    frontier |= set(g.consumers.get(out, ()))
    members = set(chosen)
    escape = [v for v in avail if v in g.out_set or any(c not in members for c in g.consumers.get(v, ()))]
    if escape != [out] or g.scope_var(out) is None:
      continue
    eqns = [g.eqns[j] for j in chosen]
    test = _ACT_TEST
    if any(e.primitive.name in _CUSTOM_JVP for e in eqns):
      # Its jaxprs are of y's shape: the points repeated over it.
      if math.prod(y.aval.shape) > MAX_ACT_ELEMENTS:
        continue
      test = np.resize(_ACT_TEST, y.aval.shape).astype(y.aval.dtype)
    key = _form_key(g, eqns, y, out) if test is _ACT_TEST else None
    got = _FORMS.get(key) if key is not None else None
    if got is None:
      got = _eval_elementwise(g, eqns, y, out, test)
      if key is not None and len(_FORMS) < _MAX_FORMS:
        _FORMS[key] = got if got is not None else _FAILED
    if got is None or got is _FAILED:
      continue
    for act in _activations.ACTIVATIONS:
      want, slope = _op_activation(act) if test is _ACT_TEST else _op_activation_at(test, act)
      if not np.allclose(got[0], want, rtol=1e-4, atol=1e-5):
        continue
      bad = ~np.isclose(got[1], slope, rtol=1e-4, atol=1e-5)
      if bad.any():
        k = np.unravel_index(np.argmax(bad), bad.shape)
        note = (f"{act} not fused: the code's derivative at {float(test[k]):g} is "
                f"{got[1][k]:g}, the op's {slope[k]:g}")
        continue
      best, note = (act, out), None
  return best, (note if best is None else None)


#: The code's activations already evaluated at ``_ACT_TEST``: form (:func:`_form_key`) ->
#: ``(value, derivative)``, or ``_FAILED``. A model repeats one form after each of its norms.
_FORMS: dict = {}
_FAILED = object()
_MAX_FORMS = 1024


def _form_key(g: Graph, eqns, y, out):
  """What the value of ``_eval_elementwise(g, eqns, y, out, _ACT_TEST)`` depends on, hashable.

  Each equation's primitive and parameters (none holds a jaxpr: a custom_jvp
  function is evaluated at y's shape and never cached) and its operands: y,
  an earlier equation's result, or a number with its dtype. None where a
  parameter is not hashable.
  """
  index = {y: -1}
  for k, e in enumerate(eqns):
    index[e.outvars[0]] = k
  key = [str(jnp.dtype(y.aval.dtype))]
  for e in eqns:
    ins = []
    for a in e.invars:
      r = g.resolve(a)
      if not is_literal(r) and r in index:
        ins.append(("v", index[r]))
      else:
        ins.append(("c", g.scalar(a), str(getattr(a.aval, "dtype", ""))))
    try:
      params = tuple(sorted(e.params.items()))
      hash(params)
    except TypeError:
      return None
    key.append((e.primitive.name, params, tuple(ins)))
  key.append(index[out])
  return tuple(key)


@functools.lru_cache(maxsize=None)
def _op_activation(act):
  """The op's activation and its derivative at ``_ACT_TEST`` (float64 NumPy)."""
  return _op_activation_at(_ACT_TEST, act)


def _op_activation_at(test, act):
  with jax.ensure_compile_time_eval():
    z = jnp.asarray(test, jnp.float32)
    return (np.asarray(_activations.apply(z, act), np.float64),
            np.asarray(_activations.grad(z, act), np.float64))


def _act_eqn(g: Graph, e, avail) -> bool:
  """Whether ``e`` is an elementwise step of an activation of the values in ``avail``."""
  if e.primitive.name not in _ACT_PRIMS or len(e.outvars) != 1 or not all(
      (not is_literal(a) and g.resolve(a) in avail) or g.scalar(a) is not None for a in e.invars):
    return False
  # A custom_jvp function (jax.nn.relu) of one value of its result's shape; evaluated below
  # with its own rule.
  return e.primitive.name not in _CUSTOM_JVP or (
      len(e.invars) == 1 and e.invars[0].aval.shape == e.outvars[0].aval.shape)


def _eval_elementwise(g: Graph, eqns, y, out, test):
  """``(value, derivative)`` of ``out`` as a function of ``y`` at the points ``test`` (float64 NumPy), else None.

  The derivative is jax's of the equations (``jax.jvp``), a ``custom_jvp``
  function's its own rule.
  """

  def fun(t):
    env = {y: t}
    for e in eqns:
      ins = []
      for a in e.invars:
        r = g.resolve(a)
        ins.append(env[r] if not is_literal(r) and r in env else
                   jnp.asarray(g.scalar(a), dtype=getattr(a.aval, "dtype", jnp.float32)))
      res = _compat.bind_equation(e, ins)
      env[e.outvars[0]] = res[0] if e.primitive.multiple_results else res
    return env[out]

  try:
    with jax.ensure_compile_time_eval():
      t = jnp.asarray(test)
      val, der = jax.jvp(fun, (t,), (jnp.ones_like(t),))
      return np.asarray(val, np.float64), np.asarray(der, np.float64)
  except Exception:  # pylint: disable=broad-except
    return None


def _dtype_op(kind, y_dtype, x_dtype):
  """The op's ``out_dtype`` for y's dtype, and whether y must be cast after it."""
  y_dtype, x_dtype = jnp.dtype(y_dtype), jnp.dtype(x_dtype)
  if y_dtype == x_dtype:
    return None
  if y_dtype == jnp.float32:
    return y_dtype
  if kind != "group" and x_dtype == jnp.float32 and y_dtype in SUPPORTED_X:
    return y_dtype
  return "cast"


def _residual(g: Graph, x, y):
  """``(a, b)`` where x = a + b is also used besides the norm (the fused residual form), else None."""
  e = g.producer_eqn(x)
  if e is None or e.primitive.name != "add":
    return None
  ab = [g.resolve(a) for a in e.invars]
  if any(is_literal(a) or a.aval.shape != x.aval.shape or a.aval.dtype != x.aval.dtype or
         g.scope_var(a) is None for a in ab):
    return None
  anc = _ancestors(g, y, x)
  if x not in g.out_set and all(c in anc for c in g.consumers.get(x, ())):
    return None
  return tuple(g.scope_var(a) for a in ab)


def find(g: Graph):
  """All matches and near misses of the graph's candidates."""
  matches: list[Match] = []
  misses: list[NearMiss] = []
  claimed: set = set()  # the outputs of the matches so far
  for views in candidates(g):
    miss = None
    for cand in views:
      interpret(cand, g.producer.get(cand.root, -1) + 1)
      found, reason, tried = _candidate_matches(g, cand)
      if found:
        break
      if miss is None and tried is not None and reason:
        miss = NearMiss(tuple(tried.aval.shape), tried.aval.dtype, reason, source_of(g, tried))
    for m in found:
      if claimed.isdisjoint(m.outputs):
        matches.append(m)
        claimed.update(m.outputs)
    if not found:
      # A traced eps, or statistics through a custom rule, is the first reason to give: the
      # values tried after it (x - mean, say) only fail for want of it.
      traced = next(((cand, v, why) for cand in views for v, why in cand.failures.items()
                     if why.startswith(DECISIVE)), None)
      if traced is not None:
        cand, v, why = traced
        miss = NearMiss(tuple(cand.root.aval.shape), cand.root.aval.dtype, why, source_of(g, v))
    if not found and miss is not None:
      misses.append(miss)
  return matches, misses


def _candidate_matches(g: Graph, cand: Candidate):
  root_sig = _sig(cand, cand.root_dims)
  built = {}
  reason, tried = None, None
  layout, layout_why = _layout(cand)
  for v, a in cand.abs.items():
    if v is cand.root or not a.poly.get(1) or set(a.poly) - {0, 1} or tuple(v.aval.shape) != tuple(cand.root.aval.shape):
      continue
    if _sig(cand, a.dims) != root_sig or not al.has_moments(a.poly):
      continue
    tried = v
    norm, why = al.identify(a.poly)
    if norm is None:
      reason = why
      continue
    if layout is None:
      reason = layout_why
      continue
    m, why = _build(g, cand, v, norm, layout)
    if m is None:
      reason, tried = why, v
      continue
    built[v] = m
  # A value is covered when its one reader stays in the region and ends in a match (xhat
  # before its scale, a norm before an einsum's transposes, a down-cast): only the last is
  # replaced. A value read twice is the match itself, each reader fed from the one op.
  leads: dict = {}
  for v in reversed(list(cand.abs)):
    leads[v] = v in built or _covered(g, cand, v, leads)
  # A value computed from a replaced one (a norm's result, then scaled again on its way to
  # another norm's statistics) is left to the equations after that op.
  after: dict = {}
  found = []
  for v in cand.abs:
    i = g.producer.get(v)
    ins = () if i is None else [a for a in map(g.resolve, g.eqns[i].invars)
                                if not is_literal(a) and a in cand.abs]
    after[v] = any(after[a] for a in ins)
    if v in built and not after[v] and not _covered(g, cand, v, leads):
      found.append(built[v])
      after[v] = True
  return found, reason, tried


def _covered(g: Graph, cand: Candidate, v, leads: dict) -> bool:
  """Whether v's one reader carries the norm on to a later match (which then computes v's value).

  An up-cast of a rounded value carries it on only where the chain goes on past
  the up-cast: where the up-cast is read twice, the rounded tensor is the op's
  result (the next norm's input, say), not the float32 value before it.
  """
  readers = set(g.consumers.get(v, ()))
  if len(readers) != 1 or v in g.out_set:
    return False
  e = g.eqns[readers.pop()]
  if cast_direction(e) > 0:
    return all(o in cand.abs and _covered(g, cand, o, leads) for o in e.outvars)
  return all(o in cand.abs and leads.get(o, False) for o in e.outvars)


def _build(g: Graph, cand: Candidate, y, norm: al.Norm, layout):
  x = cand.root
  xs = g.scope_var(x)
  ys = g.scope_var(y)
  if xs is None or ys is None:
    return None, "x or the result is a value inside a nested jit (matched there instead)"
  if jnp.dtype(x.aval.dtype) not in SUPPORTED_X:
    return None, f"x is {jnp.dtype(x.aval.dtype).name}: the kernels take float32, bfloat16, float16"
  if layout[0] == "layer":
    param_axes = tuple(l for l in sorted(cand.reduced) if cand.sizes[l] > 1)
    norm_ndim = layout[1]
    param_shape = tuple(x.aval.shape[len(x.aval.shape) - norm_ndim:])
  else:
    _, lead, chan, gl, cgl = layout
    param_axes = (gl,) + ((cgl,) if cgl is not None else ())
    param_shape = (math.prod(cand.sizes[l] for l in param_axes),)
  used = {f for m in list(norm.weight) + list(norm.bias) for f, _ in m}
  for f in used:
    extra = _factor_labels(cand, cand.factors[f]) - set(param_axes)
    if extra:
      return None, ("the scale or offset varies along axes the statistics are kept for "
                    "(a modulation per row, not a parameter)")
    if g.scope_var(cand.factors[f].atom) is None and g.value(cand.factors[f].atom) is None and (
        cand.factors[f].atom not in g.large_const):
      return None, "the scale or offset is computed inside a nested jit"
  common = dict(x=xs, residual=None, outputs={ys: "y"}, eps=float(norm.eps), weight=norm.weight,
                bias=norm.bias, factors=cand.factors, labels=cand.label, param_axes=param_axes,
                param_sizes={l: cand.sizes[l] for l in param_axes}, param_shape=param_shape,
                y_dtype=y.aval.dtype, source=source_of(g, y), shape=tuple(x.aval.shape),
                dtype=x.aval.dtype)
  if layout[0] == "layer":
    op = "layer_norm" if norm.kind == "layer" else "rms_norm"
    m = Match(op=op, norm_ndim=layout[1], **common)
    if jnp.dtype(y.aval.dtype) == jnp.dtype(x.aval.dtype):
      res = _residual(g, x, y)
      if res is not None:
        m.op = "add_" + op
        m.residual = res
        m.outputs = {ys: "y", xs: "h"}
    return m, None
  if norm.kind != "layer":
    return None, "an RMSNorm over a group's channels (no such op)"
  m = Match(op="group_norm", lead_ndim=layout[1], channel_axis=layout[2],
            groups=cand.sizes[layout[3]], **common)
  act, m.note = _activation(g, y)
  if act is not None and g.scope_var(act[1]) is not None:
    m.activation = act[0]
    m.outputs = {g.scope_var(act[1]): "y"}
    m.y_dtype = act[1].aval.dtype
  return m, None
