"""The algebra the matcher computes in: row statistics as expressions of the moments, values as polynomials in x.

A candidate norm has a root ``x`` and a set of reduced (canonical) axes. Every
value computed from ``x`` by the ops the matcher understands is a polynomial
in ``x`` (degree <= 2) whose coefficients are sums of ``row expression x
column monomial`` terms:

* a row expression (:class:`Row`) is a function of the row's moments ``S1 =
  mean(x)`` and ``S2 = mean(x^2)`` and of constants (the mean, the variance
  one-pass or two-pass, ``rsqrt(var + eps)``, ...), kept as a small tree and
  evaluated in float64 NumPy;
* a column monomial is a product of powers of values that do not depend on x
  (the scale, the offset, ``1 + w``: the *factors*, numbered per candidate).

``mean((x - mean(x))^2)`` is then ``S2 - S1^2`` whatever way the code wrote
it, and a LayerNorm is any value ``x * P + Q`` with ``P = rstd * W`` and ``Q
= B - S1 * rstd * W``: :func:`identify` checks that, numerically in float64 at
sample moments (variance 0 included, where eps decides), and recovers eps and
the affine's coefficients.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# ----------------------------------------------------------------------------
# Row expressions.


class Row(NamedTuple):
  """A node of a row expression: ``op`` and its arguments (Rows or floats)."""
  op: str
  args: tuple

  def __repr__(self):
    if self.op == "const":
      return f"{self.args[0]:g}"
    if self.op in ("s1", "s2"):
      return self.op.upper()
    return f"{self.op}({', '.join(map(repr, self.args))})"


S1 = Row("s1", ())
S2 = Row("s2", ())


def const(c: float) -> Row:
  return Row("const", (float(c),))


ZERO, ONE = const(0.0), const(1.0)


def is_const(r: Row) -> bool:
  return r.op == "const"


def value_of(r: Row) -> float:
  return r.args[0]


_FOLD = {
    "add": lambda a, b: a + b, "mul": lambda a, b: a * b, "max": max, "min": min,
}


def binary(op: str, a: Row, b: Row) -> Row:
  """``op(a, b)`` for op in add, mul, max, min, with constants folded."""
  if is_const(a) and is_const(b):
    return const(_FOLD[op](value_of(a), value_of(b)))
  if op == "add":
    if is_const(a) and value_of(a) == 0.0:
      return b
    if is_const(b) and value_of(b) == 0.0:
      return a
  if op == "mul":
    for p, q in ((a, b), (b, a)):
      if is_const(p) and value_of(p) == 1.0:
        return q
      if is_const(p) and value_of(p) == 0.0:
        return ZERO
  return Row(op, (a, b))


def add(a, b):
  return binary("add", a, b)


def mul(a, b):
  return binary("mul", a, b)


def neg(a):
  return mul(const(-1.0), a)


def sub(a, b):
  return add(a, neg(b))


def power(a: Row, p: float) -> Row:
  """``a ** p``, constants folded."""
  if p == 1.0:
    return a
  if is_const(a):
    with np.errstate(all="ignore"):
      return const(np.float64(value_of(a)) ** p)
  return Row("pow", (a, float(p)))


def recip(a):
  return power(a, -1.0)


def evaluate(r: Row, s1: np.ndarray, s2: np.ndarray, memo=None) -> np.ndarray:
  """The expression at the moments ``s1``, ``s2`` (float64 arrays of one shape)."""
  memo = {} if memo is None else memo
  key = id(r)
  if key in memo:
    return memo[key][1]
  with np.errstate(all="ignore"):
    if r.op == "const":
      out = np.full(s1.shape, r.args[0])
    elif r.op == "s1":
      out = s1
    elif r.op == "s2":
      out = s2
    elif r.op == "pow":
      out = evaluate(r.args[0], s1, s2, memo) ** r.args[1]
    else:
      a, b = (evaluate(x, s1, s2, memo) for x in r.args)
      out = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[r.op](a, b)
  memo[key] = (r, out)  # r kept alive so that id() stays unique
  return out


# ----------------------------------------------------------------------------
# Polynomials in x: {degree: {monomial: Row}}; a monomial is a sorted tuple of
# (factor index, power).


def _mono_mul(m1: tuple, m2: tuple) -> tuple:
  powers = dict(m1)
  for f, p in m2:
    powers[f] = powers.get(f, 0) + p
  return tuple(sorted((f, p) for f, p in powers.items() if p != 0))


def poly_const(r: Row, mono: tuple = ()) -> dict:
  return {0: {mono: r}}


X = {1: {(): ONE}}


def poly_add(a: dict, b: dict) -> dict:
  out = {d: dict(t) for d, t in a.items()}
  for d, terms in b.items():
    slot = out.setdefault(d, {})
    for m, r in terms.items():
      slot[m] = add(slot[m], r) if m in slot else r
  return out


def poly_scale(a: dict, r: Row, mono: tuple = ()) -> dict:
  return {d: {_mono_mul(m, mono): mul(c, r) for m, c in t.items()} for d, t in a.items()}


def poly_mul(a: dict, b: dict, max_degree: int = 2) -> dict | None:
  out: dict = {}
  for da, ta in a.items():
    for db, tb in b.items():
      if da + db > max_degree:
        return None
      for ma, ra in ta.items():
        for mb, rb in tb.items():
          out = poly_add(out, {da + db: {_mono_mul(ma, mb): mul(ra, rb)}})
  return out


def pure_row(a: dict) -> Row | None:
  """The row expression of a polynomial that is one (degree 0, no factor), else None."""
  if set(a) - {0} or set(a.get(0, {})) - {()}:
    return None
  return a.get(0, {}).get((), ZERO)


def single_term(a: dict) -> tuple[Row, tuple] | None:
  """``(row, mono)`` of a degree-0 polynomial of one term, else None."""
  if set(a) != {0} or len(a[0]) != 1:
    return None
  (m, r), = a[0].items()
  return r, m


# ----------------------------------------------------------------------------
# Identification.

# Sample moments: the variance from 0 (where only eps is left) to large, the
# mean from 0 to large against it, so that forms which differ only near a zero
# variance (eps outside the square root, max(norm, eps)) are told apart.
_VARS = np.array([0.0, 1e-9, 1e-6, 1e-3, 0.1, 0.5, 1.0, 2.0, 3.0, 10.0, 1e3, 1e6])
_MEANS = np.array([0.0, 0.3, -1.7, 4.0, 50.0])
_V, _M = (a.ravel() for a in np.meshgrid(_VARS, _MEANS))
_POINTS = (_M, _V + _M * _M)  # (S1, S2)
_RTOL = 1e-6


def _close(a, b, rtol=_RTOL, atol=0.0):
  return bool(np.all(np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=False)))


def _constant(v: np.ndarray, noise: np.ndarray | float = 0.0) -> float | None:
  """The value of a float64 vector that is constant (to rounding, and to ``noise`` per point), else None."""
  if not np.all(np.isfinite(v)):
    return None
  c = float(np.median(v))
  return c if _close(v, c, atol=1e-12 * max(1.0, abs(c)) + noise) else None


# The rounding of a float64 expression of the moments, relative to the largest term it
# cancels (S2 = mean^2 + var, S1 * rstd): a few ulps, with a margin.
_CANCEL = 1e-13


class Norm(NamedTuple):
  """What :func:`identify` found: ``y = norm(x) * W + B`` with ``W``, ``B`` column combinations.

  ``weight`` and ``bias``: ``{monomial: coefficient}`` (empty: absent);
  ``kind``: "layer" or "rms".
  """
  kind: str
  eps: float
  weight: dict
  bias: dict


def _fit_rstd(r: np.ndarray, var: np.ndarray, s2: np.ndarray):
  """``(scale, eps)`` with ``r = scale * (var + eps)^-1/2`` at every point, else a reason.

  The slope of ``1 / r^2`` against the variance is read where the variance
  dominates, its value at variance 0 (mean 0, where nothing cancels) is eps
  times it: an eps of 1e-12 is found as exactly as one of 1e-5. Elsewhere the
  check allows the rounding of an expression that cancels ``S2``.
  """
  with np.errstate(all="ignore"):
    q = 1.0 / (r * r)
  i, j = 8, 9  # variance 3 and 10 at mean 0
  zero = 0  # variance 0 at mean 0
  a = (q[j] - q[i]) / (var[j] - var[i])
  b = q[zero] - a * var[zero]
  if not (np.isfinite(a) and np.isfinite(b)) or a <= 0:
    return None, "the scale factor is not a power -1/2 of the variance"
  if b < -1e-12 * a:
    return None, f"eps would be negative ({b / a:g})"
  b = max(b, 0.0)
  fit = a * var + b
  noise = a * _CANCEL * np.abs(s2)
  if not _close(q, fit, atol=1e-12 * max(b, 1e-30)) and not np.all(
      np.abs(q - fit) <= _RTOL * np.abs(fit) + noise):
    worst = int(np.argmax(np.abs(q - fit) / np.maximum(np.abs(fit), 1e-300)))
    return None, (f"the scale factor is not 1/sqrt(var + eps) (at variance {var[worst]:g} it is "
                  f"1/sqrt({q[worst] / a:.6g}), not 1/sqrt({fit[worst] / a:.6g}))")
  sign = np.sign(r[i])
  return (float(sign / math.sqrt(a)), float(b / a)), None


def identify(poly: dict) -> tuple[Norm | None, str | None]:
  """A LayerNorm or RMSNorm of x in ``poly`` (see the module docstring), or ``(None, reason)``."""
  if set(poly) - {0, 1} or not poly.get(1):
    return None, "not linear in x after the statistics"
  s1, s2 = _POINTS
  var = s2 - s1 * s1
  memo: dict = {}
  p = {m: evaluate(r, s1, s2, memo) for m, r in poly[1].items()}
  q = {m: evaluate(r, s1, s2, memo) for m, r in poly.get(0, {}).items()}
  m0 = next((m for m, v in p.items() if np.any(v != 0)), None)
  if m0 is None:
    return None, "x drops out"
  r = p[m0]
  # Where eps is 0 the scale is infinite at variance 0: the ratios and offsets
  # are read where it is finite (the fit itself reads every point).
  fin = np.isfinite(r) & (r != 0)
  for v in list(p.values()) + list(q.values()):
    fin &= np.isfinite(v)
  if fin.sum() < len(r) // 2:
    return None, "the scale is not finite at most sample statistics"
  ratios = {}
  for m, v in p.items():
    with np.errstate(all="ignore"):
      c = _constant((v / r)[fin])
    if c is None:
      return None, "the scale differs between the scale's terms"
    ratios[m] = c
  reasons = []
  for kind, moment in (("layer", var), ("rms", s2)):
    fit, why = _fit_rstd(r, moment, s2)
    if fit is None:
      reasons.append(f"{'LayerNorm' if kind == 'layer' else 'RMSNorm'}: {why}")
      continue
    scale, eps = fit
    if kind == "rms" and not math.isclose(abs(scale), 1.0, rel_tol=1e-6):
      reasons.append(f"RMSNorm: the squares are summed, not averaged (x / sqrt({1 / scale ** 2:g} "
                     "mean(x^2) + ...)): an L2 normalization")
      continue
    bias = {}
    ok = True
    for m in set(p) | set(q):
      qm = q.get(m, np.zeros_like(r))
      with np.errstate(all="ignore"):
        moved = s1 * p[m] if (kind == "layer" and m in p) else np.zeros_like(r)
        c = _constant((qm + moved)[fin], _CANCEL * np.abs(moved[fin]))
      if c is None:
        ok = False
        break
      if c != 0.0:
        bias[m] = c
    if not ok:
      reasons.append(f"{'LayerNorm' if kind == 'layer' else 'RMSNorm'}: the offset depends on "
                     "the row's statistics")
      continue
    weight = {m: scale * c for m, c in ratios.items() if c != 0.0}
    return Norm(kind, eps, weight, bias), None
  return None, "; ".join(reasons)


def _row_has_moments(r: Row, memo: dict) -> bool:
  key = id(r)
  if key not in memo:
    memo[key] = r.op in ("s1", "s2") or any(
        isinstance(a, Row) and _row_has_moments(a, memo) for a in r.args)
  return memo[key]


def has_moments(poly: dict) -> bool:
  """Whether any coefficient of the polynomial reads the row's statistics."""
  memo: dict = {}
  return any(_row_has_moments(r, memo) for t in poly.values() for r in t.values())
