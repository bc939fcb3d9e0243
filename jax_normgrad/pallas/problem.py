"""What a kernel is handed (:class:`Problem`), from the operands' shapes and dtypes.

The lowerings (``layer_norm``, ``group_norm``) build it with
:func:`forward_problem` and :func:`backward_problem`; the dispatcher asks it
before choosing a backend (whether the Mosaic GPU kernels fit it), and
``explain`` describes the kernels' plan for it. Building one imports no
kernel module.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_normgrad.pallas.common import Segments


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a kernel is handed: the segments, and the bytes it reads per element.

  ``itemsize``: x's bytes per element as the kernels read it (after a
  forward's widening to a float32 y); ``extra_bytes``: the residual form's
  further rows, bytes per element (the residual and h forward, dh backward),
  ``residual_bytes`` the residual's share of them; ``empty``: no kernel runs
  (an empty x, or a backward with nothing asked for).
  """

  seg: Segments
  itemsize: int
  backward: bool
  extra_bytes: int = 0
  empty: bool = False
  #: x's dtype as the kernels are handed it (the name), and a backward's dy's.
  dtype: str = "float32"
  dy_dtype: str = "float32"
  #: A backward's: the outputs asked for (dx, dweight, dbias) and dx written a second time in
  #: dy's dtype.
  mask: tuple[bool, bool, bool] = (True, True, True)
  dx_dy: bool = False
  #: Which of (weight, bias) the kernels are handed: a backward's bias is GroupNorm's with an
  #: activation only.
  params: tuple[bool, bool] = (True, True)
  residual_bytes: int = 0

  @property
  def dy_itemsize(self) -> int:
    return jnp.dtype(self.dy_dtype).itemsize if self.backward else 0


def y_plan(x_dtype, y_dtype):
  """``(kernel x dtype, y dtype the kernels round to | None)`` of a forward.

  A float32 y from a 16-bit x widens x first (exactly; an XLA convert), so y
  is rounded once; a 16-bit y from a float32 x is rounded by the kernels.
  """
  x_dtype = jnp.dtype(x_dtype)
  if y_dtype is None or jnp.dtype(y_dtype) == x_dtype:
    return x_dtype, None
  if jnp.dtype(y_dtype).itemsize < x_dtype.itemsize:
    return x_dtype, jnp.dtype(y_dtype)
  return jnp.dtype(y_dtype), None


def forward_problem(seg: Segments, x_dtype, *, size: int, y_dtype=None, residual_dtype=None,
                    h_dtype=None, params=(True, True)) -> Problem:
  """The :class:`Problem` of ``forward`` with these operands (``size``: x's elements;
  ``params``: whether the weight and the bias are given)."""
  x_dtype, _ = y_plan(x_dtype, y_dtype)
  extra = residual = 0
  if residual_dtype is not None:
    residual = jnp.dtype(residual_dtype).itemsize
    extra = residual + jnp.dtype(h_dtype or x_dtype).itemsize
  return Problem(seg, x_dtype.itemsize, False, extra, empty=size == 0, dtype=x_dtype.name,
                 params=tuple(bool(p) for p in params), residual_bytes=residual)


def backward_problem(seg: Segments, x_dtype, mask, *, size: int, dh_dtype=None, dy_dtype=None,
                     dx_dy: bool = False, params=(True, False)) -> Problem:
  """The :class:`Problem` of ``backward`` with these operands (``size``: x's elements;
  ``params``: whether the weight is given, and GroupNorm's bias with an activation)."""
  extra = 0 if dh_dtype is None else jnp.dtype(dh_dtype).itemsize
  x_dtype = jnp.dtype(x_dtype)
  return Problem(seg, x_dtype.itemsize, True, extra,
                 empty=size == 0 or not any(mask), dtype=x_dtype.name,
                 dy_dtype=jnp.dtype(dy_dtype or x_dtype).name,
                 mask=tuple(bool(m) for m in mask), dx_dy=dx_dy,
                 params=tuple(bool(p) for p in params))
