"""What differs between the jax versions this package supports, in one place.

Library code asks here instead of branching on ``jax.__version__`` itself.

* Varying axes inside ``shard_map`` (``check_vma``): jax 0.10 names an
  array type's manual-axes information ``manual_axis_type`` (``aval.mat``, a
  ``ManualAxisType`` whose ``varying`` is the set of mesh axes);
  earlier versions name it ``vma`` (``aval.vma``, the frozenset itself).
* Marking a value varying over manual axes: ``jax.lax.pcast(x, axes,
  to="varying")`` from jax 0.8.2; ``jax.lax.pvary(x, axes)`` before it (the
  same operation, deprecated since).
"""

from __future__ import annotations

import inspect

import jax

#: The keyword of ``jax.ShapeDtypeStruct`` that carries the varying axes.
_STRUCT_KEYWORD = ("manual_axis_type"
                   if "manual_axis_type" in inspect.signature(jax.ShapeDtypeStruct).parameters
                   else "vma")


def _manual_type(aval):
  """The manual-axes part of an abstract value (None outside ``shard_map``)."""
  return getattr(aval, "mat" if _STRUCT_KEYWORD == "manual_axis_type" else "vma", None)


def varying_axes(aval) -> frozenset:
  """The manual mesh axes an abstract value varies over (empty outside ``shard_map``)."""
  t = _manual_type(aval)
  if t is None:
    return frozenset()
  return t.varying if _STRUCT_KEYWORD == "manual_axis_type" else frozenset(t)


def struct_like(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct(shape, dtype)`` varying over the same mesh axes as ``like``.

  Inside ``shard_map`` with ``check_vma=True`` a ``pallas_call``'s ``out_shape``
  must say how its results vary; they vary like the operands they are
  computed from. Outside ``shard_map`` this is the plain struct.
  """
  t = _manual_type(jax.typeof(like))
  if t is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, **{_STRUCT_KEYWORD: t})


def without_varying(aval):
  """``aval`` varying over no mesh axis (itself when it has no manual-axes part).

  For lowering code that must not see ``shard_map``'s types (see
  ``_implementation.register_lowerings``): the types were checked when the
  program was traced, and the lowered HLO carries none.
  """
  t = _manual_type(aval)
  if t is None:
    return aval
  if _STRUCT_KEYWORD == "manual_axis_type":
    return aval.update(manual_axis_type=type(t)())
  return aval.update(vma=frozenset())


def pvary(x, axes: tuple):
  """``x`` marked varying over the manual mesh ``axes`` (its transpose is a ``psum``)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)
