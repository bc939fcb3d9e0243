"""What a rewrite did: its matches and near misses, as a printable report."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _affine_text(terms: dict, names) -> str:
  if not terms:
    return "-"
  parts = []
  for mono, c in sorted(terms.items(), key=lambda t: len(t[0])):
    factors = "*".join(names(f) + (f"^{p:g}" if p != 1 else "") for f, p in mono)
    if not factors:
      parts.append(f"{c:.4g}")
    elif abs(c - 1.0) < 1e-12:
      parts.append(factors)
    else:
      parts.append(f"{c:.4g}*{factors}")
  return " + ".join(parts)


@dataclasses.dataclass
class MatchInfo:
  """One rewritten norm: the op that now computes it, and what it was found from."""
  op: str
  shape: tuple
  dtype: str
  eps: float
  weight: str  # the scale as found ("w", "1 + w", "-": none)
  bias: str
  activation: str | None
  out_dtype: str
  where: str  # the nested jaxpr it sits in ("" at the top)
  source: str  # file:line (function) of the equation that produced the norm's result
  note: str | None = None  # what runs as written after the op, and why (an activation not fused)

  def line(self) -> str:
    extra = f", activation={self.activation}" if self.activation else ""
    extra += f" ({self.note})" if self.note else ""
    return (f"{self.op:15s} {'x'.join(map(str, self.shape)):>16s} {self.dtype:8s} -> {self.out_dtype:8s} "
            f"eps={self.eps:.3g} weight={self.weight} bias={self.bias}{extra}"
            f"{'  [' + self.where + ']' if self.where else ''}  {self.source}")


@dataclasses.dataclass
class MissInfo:
  """A value computed from row statistics that was left alone, and the reason."""
  shape: tuple
  dtype: str
  reason: str
  where: str
  source: str

  def line(self) -> str:
    return (f"left alone {'x'.join(map(str, self.shape)):>16s} {self.dtype:8s} {self.reason}"
            f"{'  [' + self.where + ']' if self.where else ''}  {self.source}")


@dataclasses.dataclass
class RewriteReport:
  """The matches (``matches``) and near misses (``near_misses``) of one trace of a rewritten function.

  ``str(report)`` is a table, one line each. A nested jaxpr (a ``scan`` body)
  is analysed once however often it runs.
  """
  matches: list = dataclasses.field(default_factory=list)
  near_misses: list = dataclasses.field(default_factory=list)

  def counts(self) -> dict:
    """How many norms each op now computes: ``{"layer_norm": 2, ...}``."""
    out: dict = {}
    for m in self.matches:
      out[m.op] = out.get(m.op, 0) + 1
    return out

  def __str__(self):
    lines = [f"{len(self.matches)} norm(s) rewritten, {len(self.near_misses)} left alone"]
    lines += ["  " + m.line() for m in self.matches]
    lines += ["  " + m.line() for m in self.near_misses]
    return "\n".join(lines)

  def add_match(self, m, where: str, names):
    info = MatchInfo(m.op, tuple(m.shape), jnp.dtype(m.dtype).name, m.eps,
                     _affine_text(m.weight, names), _affine_text(m.bias, names), m.activation,
                     jnp.dtype(m.y_dtype).name, where, m.source, m.note)
    self.matches.append(info)

  def add_miss(self, miss, where: str):
    info = MissInfo(tuple(miss.shape), jnp.dtype(miss.dtype).name, miss.reason, where, miss.source)
    self.near_misses.append(info)
