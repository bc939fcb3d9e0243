"""The activations GroupNorm can fuse, and their derivatives, in float32 jnp.

One definition for every backend's math: the pure-JAX reference and the Pallas
kernels call these on float32 values (the CPU kernels in ``csrc/`` implement
the same formulas; the tests hold them to a float64 NumPy reference).

``z`` is the normalized, scaled and shifted value ``xhat * gamma + beta``; the
layer's output is ``act(z)``. The backward recomputes ``z`` from x and the
statistics, so the pre-activation tensor is never written or read:

* ``"silu"`` (swish): ``z * sigmoid(z)``; derivative
  ``sigmoid(z) * (1 + z * (1 - sigmoid(z)))``.
* ``"gelu"``: the tanh approximation, which is ``jax.nn.gelu``'s and
  ``flax.linen.gelu``'s default (``approximate=True``):
  ``0.5 * z * (1 + tanh(u)) = z * sigmoid(2u)``,
  ``u = sqrt(2/pi) * (z + 0.044715 z^3)``, computed in the second form (as
  the CPU kernels do; the same function, without tanh's cancellation near
  0); derivative ``s + z * s * (1 - s) * 2 sqrt(2/pi) * (1 + 3 * 0.044715 z^2)``
  with ``s = sigmoid(2u)``.
* ``"relu"``: ``max(z, 0)``; derivative 1 where ``z > 0``, else 0 (as
  ``jax.nn.relu``'s gradient at 0).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

ACTIVATIONS = ("silu", "gelu", "relu")

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def _sigmoid(z):
  return 1.0 / (1.0 + jnp.exp(-z))


def apply(z, activation):
  """``act(z)``; ``activation`` None is the identity."""
  if activation is None:
    return z
  if activation == "silu":
    return z * _sigmoid(z)
  if activation == "gelu":
    return z * _sigmoid(2.0 * GELU_C * (z + GELU_A * z * z * z))
  if activation == "relu":
    return jnp.maximum(z, 0.0)
  raise ValueError(f"activation: expected None or one of {ACTIVATIONS}, got {activation!r}")


def grad(z, activation):
  """``d act(z) / dz``; ``activation`` None has derivative 1 (returns None)."""
  if activation is None:
    return None
  if activation == "silu":
    s = _sigmoid(z)
    return s * (1.0 + z * (1.0 - s))
  if activation == "gelu":
    z2 = z * z
    s = _sigmoid(2.0 * GELU_C * (z + GELU_A * z2 * z))
    return s + z * s * (1.0 - s) * 2.0 * GELU_C * (1.0 + 3.0 * GELU_A * z2)
  if activation == "relu":
    return jnp.where(z > 0.0, 1.0, 0.0).astype(z.dtype)
  raise ValueError(f"activation: expected None or one of {ACTIVATIONS}, got {activation!r}")
