"""A small model with every norm, for the sharded training-step tests.

``tests/test_sharding.py`` runs its step on 8 CPU devices against the unsharded
step; ``tests/accel_check.py`` compiles it for a TPU topology with libtpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_normgrad as jn

#: The GroupNorms' group counts (the images' channels must divide by both).
GROUPS = (8, 4)


def params(width: int, channels: int, seed: int = 20) -> dict:
  """The model's parameters: token width ``width``, image channels ``channels``."""
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  vec = lambda n, offset=0.0: offset + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)
  return {"ln_w": vec(width, 1.0), "ln_b": vec(width),
          "proj": jax.random.normal(next(keys), (width, width), jnp.float32) / width ** 0.5,
          "add_ln_w": vec(width, 1.0), "add_ln_b": vec(width), "add_rms_w": vec(width, 1.0),
          "rms_w": vec(width, 1.0), "gn_w": vec(channels, 1.0), "gn_b": vec(channels),
          "gn2_w": vec(channels, 1.0), "gn2_b": vec(channels)}


def loss(p, x, img):
  """A pre-norm block on tokens ``x`` (B, S, width): LayerNorm, the residual forms
  (``add_layer_norm``, ``add_rms_norm``) and RMSNorm; two GroupNorms on images ``img``
  (B, H, W, channels): NHWC with SiLU, then NCHW."""
  y = jnp.tanh(jn.layer_norm(x, p["ln_w"], p["ln_b"]) @ p["proj"])
  y, h = jn.add_layer_norm(y, x, p["add_ln_w"], p["add_ln_b"])
  z, h = jn.add_rms_norm(jnp.sin(y), h, p["add_rms_w"])
  z = jn.rms_norm(z + h, p["rms_w"])
  g = jn.group_norm(img, GROUPS[0], p["gn_w"], p["gn_b"], channel_axis=-1, activation="silu")
  g = jn.group_norm(jnp.moveaxis(g, -1, 1), GROUPS[1], p["gn2_w"], p["gn2_b"])
  return jnp.mean(z ** 2 * jnp.cos(jnp.arange(x.shape[-1]))) + jnp.mean(g ** 3)


#: The number of norm calls in ``loss``: each runs a forward and a backward kernel.
NORMS = 6
