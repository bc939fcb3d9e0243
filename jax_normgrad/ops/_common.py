"""Helpers shared by the public ops: the small operands' canonical forms."""

from __future__ import annotations

import jax.numpy as jnp

from jax_normgrad import _sharding

F32 = jnp.float32


def as_f32(a, shape):
  """A small operand (statistics, parameters) as float32 in the canonical shape."""
  return None if a is None else a.reshape(shape).astype(F32)


def kernel_params(weight, bias, shape, scale_offset=0.0):
  """``(weight + scale_offset, bias)`` as the LayerNorm kernels take them, in the canonical shape.

  In their own dtype, x's or float32: the kernels read either, so a 16-bit
  weight is not first copied to float32 (for few long rows that copy is as
  big as x). With a ``scale_offset`` (Gemma-style zero-centered weights) the
  offset is added in float32 after the cast, so a 16-bit weight loses
  nothing to it, and bias goes to float32 with it (the kernels take the two
  in one dtype). None stays None.
  """
  weight, bias = (None if a is None else _sharding.reshape(a, shape) for a in (weight, bias))
  if weight is not None and scale_offset != 0.0:
    weight = weight.astype(F32) + jnp.float32(scale_offset)
    bias = as_f32(bias, shape)
  return weight, bias

