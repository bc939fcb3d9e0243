"""The outputs of each primitive, by name: one structure that every piece of an op reads.

A primitive returns the outputs its parameters ask for, in the order of its
structure's fields (``NormBwdOut``: dx, dx_dy, dweight, dbias, xhat).
``*_names(**params)`` says which, from the parameters alone (all that the
partitioning rule and the ops have); ``*_types(operands, **params)`` gives
every output's shape and dtype (``jax.ShapeDtypeStruct``), returned or not;
:func:`pack` and :func:`unpack` go between a structure and the list a
primitive returns, and :func:`slots` gives the result types of a C++ kernel
that writes all its outputs in its own order, the absent ones empty. The
abstract evaluations, the lowerings (C++, Pallas, the reference), the
partitioning rule and the ops read them alike. ``output_mask`` is
normalized here, once (:func:`output_mask`): RMSNorm's two-long mask has no
``dbias``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jax_normgrad._operands import GroupNormBwd, GroupNormFwd, NormBwd, NormFwd

F32 = jnp.float32


class NormFwdOut(NamedTuple):
  """LayerNorm / RMSNorm forward: ``y`` (x's shape, in ``y_dtype``); ``mean`` (absent for RMSNorm)
  and ``rstd`` ``(M,)`` float32; ``xhat`` (x's shape and dtype, with ``write_xhat``); the residual
  form's ``h`` (x's shape, in ``h_dtype``)."""

  y: Any
  mean: Any = None
  rstd: Any = None
  xhat: Any = None
  h: Any = None


class NormBwdOut(NamedTuple):
  """LayerNorm / RMSNorm backward: ``dx`` (x's shape and dtype); ``dx_dy``, dx rounded to dy's
  dtype (with ``write_dx_dy``); ``dweight``, ``dbias`` ``(W, H)`` float32; ``xhat`` (x's shape and
  dtype, with ``write_xhat``)."""

  dx: Any = None
  dx_dy: Any = None
  dweight: Any = None
  dbias: Any = None
  xhat: Any = None


class GroupNormFwdOut(NamedTuple):
  """GroupNorm forward: ``y`` (x's shape, in ``y_dtype``); ``mean``, ``rstd`` ``(N, G)`` float32."""

  y: Any
  mean: Any = None
  rstd: Any = None


class GroupNormBwdOut(NamedTuple):
  """GroupNorm backward: ``dx`` (x's shape and dtype); ``dweight``, ``dbias`` ``(W, C)`` float32."""

  dx: Any = None
  dweight: Any = None
  dbias: Any = None


def output_mask(mask: Sequence[bool]) -> tuple[bool, bool, bool]:
  """``(dx, dweight, dbias)``: which a backward computes (RMSNorm's two-long mask: no dbias)."""
  mask = tuple(bool(m) for m in mask)
  return mask + (False,) * (3 - len(mask))


def _masked(mask) -> tuple[str, ...]:
  return tuple(n for n, m in zip(("dx", "dweight", "dbias"), output_mask(mask)) if m)


def norm_fwd_names(*, operands, centered, write_xhat, **unused) -> tuple[str, ...]:
  """The outputs ``layer_norm_fwd_p`` returns with these parameters, in order."""
  del unused
  return (("y",) + ("mean",) * bool(centered) + ("rstd",) + ("xhat",) * bool(write_xhat)
          + ("h",) * ("residual" in operands))


def norm_bwd_names(*, output_mask, write_xhat, write_dx_dy=False, **unused) -> tuple[str, ...]:
  """The outputs ``layer_norm_bwd_p`` returns with these parameters, in order."""
  del unused
  names = _masked(output_mask)
  if write_dx_dy:
    names = names[:1] + ("dx_dy",) + names[1:]
  return names + ("xhat",) * bool(write_xhat)


def group_norm_fwd_names(**unused) -> tuple[str, ...]:
  """The outputs ``group_norm_fwd_p`` returns: all three."""
  del unused
  return GroupNormFwdOut._fields


def group_norm_bwd_names(*, output_mask, **unused) -> tuple[str, ...]:
  """The outputs ``group_norm_bwd_p`` returns with these parameters, in order."""
  del unused
  return _masked(output_mask)


def norm_fwd_types(ops: NormFwd, *, y_dtype, h_dtype=None, **unused) -> NormFwdOut:
  """Every output's type (``jax.ShapeDtypeStruct``), returned or not."""
  del unused
  x = ops.x
  stats = jax.ShapeDtypeStruct((x.shape[0],), F32)
  return NormFwdOut(y=jax.ShapeDtypeStruct(x.shape, y_dtype or x.dtype), mean=stats, rstd=stats,
                    xhat=jax.ShapeDtypeStruct(x.shape, x.dtype),
                    h=jax.ShapeDtypeStruct(x.shape, h_dtype or x.dtype))


def norm_bwd_types(ops: NormBwd, *, param_groups, **unused) -> NormBwdOut:
  """Every output's type (``jax.ShapeDtypeStruct``), returned or not."""
  del unused
  x = ops.x
  param = jax.ShapeDtypeStruct((param_groups, x.shape[1]), F32)
  return NormBwdOut(dx=jax.ShapeDtypeStruct(x.shape, x.dtype),
                    dx_dy=jax.ShapeDtypeStruct(x.shape, ops.dy.dtype), dweight=param,
                    dbias=param, xhat=jax.ShapeDtypeStruct(x.shape, x.dtype))


def group_norm_fwd_types(ops: GroupNormFwd, *, group, y_dtype, **unused) -> GroupNormFwdOut:
  """Every output's type (``jax.ShapeDtypeStruct``)."""
  del unused
  x = ops.x
  stats = jax.ShapeDtypeStruct((x.shape[0], group), F32)
  return GroupNormFwdOut(jax.ShapeDtypeStruct(x.shape, y_dtype or x.dtype), stats, stats)


def group_norm_bwd_types(ops: GroupNormBwd, *, channels_last, param_groups,
                         **unused) -> GroupNormBwdOut:
  """Every output's type (``jax.ShapeDtypeStruct``), returned or not."""
  del unused
  x = ops.x
  param = jax.ShapeDtypeStruct((param_groups, x.shape[2] if channels_last else x.shape[1]), F32)
  return GroupNormBwdOut(jax.ShapeDtypeStruct(x.shape, x.dtype), param, param)


def pack(outs: NamedTuple, names: Sequence[str]) -> list:
  """The outputs ``names`` of ``outs``, in that order: what a primitive returns."""
  return [getattr(outs, name) for name in names]


def unpack(cls, results, names: Sequence[str]):
  """The structure ``cls`` of a primitive's ``results``, named by ``names`` (None where absent)."""
  results = list(results)
  if len(results) != len(names):
    raise ValueError(f"{cls.__name__}: {len(results)} results, named {tuple(names)}")
  return cls(**dict(zip(names, results)))


def slots(types: NamedTuple, names: Sequence[str], order: Sequence[str]) -> list:
  """The types of a kernel that writes every output of ``order`` (its own order): those not among
  ``names`` are empty ``(0,)`` arrays of their dtype."""
  return [t if name in names else jax.ShapeDtypeStruct((0,), t.dtype)
          for name, t in ((n, getattr(types, n)) for n in order)]
