"""Helpers shared by the public ops: output_mask unpacking and float32 conversion of small operands."""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def as_f32(a, shape):
  """A small operand (statistics, parameters) as float32 in the canonical shape."""
  return None if a is None else a.reshape(shape).astype(F32)


def as_f32_weight(weight, shape, scale_offset=0.0):
  """The weight the kernels apply, ``weight + scale_offset``, as float32 in the canonical shape.

  The offset (Gemma-style zero-centered weights) is added in float32 after
  the cast, so a 16-bit weight loses nothing to it.
  """
  w = as_f32(weight, shape)
  return w if w is None or scale_offset == 0.0 else w + jnp.float32(scale_offset)


def unmask(outs, mask, finish):
  """Re-inserts None for masked outputs; ``finish[i]`` post-processes output i."""
  outs = list(outs)
  return tuple(finish[i](outs.pop(0)) if m else None for i, m in enumerate(mask))


def present(*arrays):
  """The operands that are not None (optional operands are left out of bind)."""
  return [a for a in arrays if a is not None]
