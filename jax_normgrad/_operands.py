"""The operands of each primitive, by name: one structure that every piece of an op reads.

A primitive binds the operands that are present, in the order of its
structure's fields, and names them in its static parameter ``operands``
(``("x", "weight")``: no residual, no bias). :func:`pack` makes the two from
a structure; :func:`unpack` gives the structure back, None where absent, to
the abstract evaluation, the lowerings (C++, Pallas, the reference) and the
partitioning rule alike. The names are the same in both directions and for
every op: ``weight`` and ``bias`` are GroupNorm's gamma and beta too.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class NormFwd(NamedTuple):
  """LayerNorm / RMSNorm forward: x ``(M, H)``; the residual form's ``residual`` (x's shape);
  ``weight``, ``bias`` ``(W, H)``."""

  x: Any
  residual: Any = None
  weight: Any = None
  bias: Any = None


class NormBwd(NamedTuple):
  """LayerNorm / RMSNorm backward: dy and x ``(M, H)``; ``mean`` (absent for RMSNorm and the
  ``normalized`` backward) and ``rstd`` ``(M,)``; ``weight`` ``(W, H)``; the residual form's
  ``dh`` (x's shape)."""

  dy: Any
  x: Any
  mean: Any = None
  rstd: Any = None
  weight: Any = None
  dh: Any = None


class GroupNormFwd(NamedTuple):
  """GroupNorm forward: x ``(N, C, HW)`` or ``(N, HW, C)``; ``weight``, ``bias`` ``(W, C)``."""

  x: Any
  weight: Any = None
  bias: Any = None


class GroupNormBwd(NamedTuple):
  """GroupNorm backward: dy and x as the forward's x; ``mean``, ``rstd`` ``(N, G)``;
  ``weight`` ``(W, C)``; ``bias`` (read only with a fused activation)."""

  dy: Any
  x: Any
  mean: Any
  rstd: Any
  weight: Any = None
  bias: Any = None


def pack(ops: NamedTuple) -> tuple[list, tuple[str, ...]]:
  """``(the present operands in order, their names)``: what a primitive binds."""
  names = tuple(name for name, a in zip(ops._fields, ops) if a is not None)
  return [getattr(ops, name) for name in names], names


def unpack(cls, args, operands: tuple[str, ...]):
  """The structure ``cls`` of a primitive's bound ``args``, named by its ``operands`` parameter."""
  if len(args) != len(operands):
    raise ValueError(f"{cls.__name__}: {len(args)} operands bound, named {operands}")
  return cls(**dict(zip(operands, args)))
