"""Norms as real code writes them, in plain jnp: the corpus of tests/test_rewrite.py.

Each form is ``f(x, w, b) -> y`` (``w``, ``b`` of the normalized or channel
shape; a form ignores what it does not use) and how many kernels the rewrite
must put in its place. Framework layers (flax, keras, haiku, transformers)
are in tests/test_rewrite_frameworks.py.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

EPS = 1e-5


class Form(NamedTuple):
  fn: Callable
  op: str  # the ops the report must name, "+"-separated
  norms: int = 1
  group: bool = False  # x is (N, H, W, C) with C = 8 groups of 2 (else (rows, H))


def _mean(x, axis=-1):
  return jnp.sum(x, axis=axis, keepdims=True) / x.shape[axis]


def ln_two_pass(x, w, b):
  m = _mean(x)
  v = _mean(jnp.square(x - m))
  return (x - m) / jnp.sqrt(v + EPS) * w + b


def ln_one_pass_max(x, w, b):
  m = jnp.mean(x, -1, keepdims=True)
  v = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - m * m)
  return (x - m) * jax.lax.rsqrt(v + EPS) * w + b


def ln_folded(x, w, b):
  """``x * inv + (b - mean * inv)``: x never centred, the scale folded into the rsqrt factor."""
  m = jnp.mean(x, -1, keepdims=True)
  inv = jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS) * w
  return x * inv + (b - m * inv)


def ln_eps_tiny(x, w, b):
  """BERT's eps of 1e-12 (one-pass, as flax's LayerNorm): found as exactly as a large one."""
  m = x.mean(-1, keepdims=True)
  v = jnp.maximum(0.0, (x * x).mean(-1, keepdims=True) - m * m)
  return (x - m) * jax.lax.rsqrt(v + 1e-12) * w + b


def ln_pow_half(x, w, b):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * (v + EPS) ** -0.5 * (1.0 + w) + b


def ln_ddof(x, w, b):
  """``jnp.var`` with ``ddof=1`` (its ddof reaches a nested jit as an argument): a scaled LayerNorm."""
  m = x.mean(-1, keepdims=True)
  return (x - m) / jnp.sqrt(jnp.var(x, -1, ddof=1, keepdims=True) + EPS) * w


_EPS_ARRAY = jnp.asarray(EPS, jnp.float32)


@jax.jit
def _normalize_with(x, eps):
  m = x.mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(x.var(-1, keepdims=True) + eps)


def ln_eps_nested(x, w, b):
  """eps a closed-over array passed into a nested jit as an argument."""
  return _normalize_with(x, _EPS_ARRAY) * w + b


def ln_two_axes(x, w, b):
  """Over the last two axes (w, b broadcast over the first of them)."""
  x = x.reshape(x.shape[0], 4, x.shape[1] // 4)
  m = x.mean((-2, -1), keepdims=True)
  v = x.var((-2, -1), keepdims=True)
  y = (x - m) * jax.lax.rsqrt(v + EPS) * w.reshape(4, -1) + b.reshape(4, -1)
  return y.reshape(y.shape[0], -1)


def ln_bf16_math(x, w, b):
  """All arithmetic in x's dtype (bfloat16 in the bfloat16 runs)."""
  m = jnp.mean(x, -1, keepdims=True)
  xc = x - m
  v = jnp.mean(xc * xc, -1, keepdims=True)
  return (xc * jax.lax.rsqrt(v + jnp.asarray(EPS, x.dtype)) * w.astype(x.dtype)).astype(x.dtype)


def rms_llama(x, w, b):
  """transformers' FlaxLlamaRMSNorm / FlaxMistralRMSNorm: float32 up-cast, ``x / sqrt(mean(x^2) + eps)``."""
  variance = jnp.power(jnp.asarray(x, jnp.float32), 2).mean(-1, keepdims=True)
  return w * jnp.asarray(x / jnp.sqrt(variance + 1e-6), x.dtype)


def rms_gemma(x, w, b):
  """transformers' FlaxGemmaRMSNorm: the scale ``1 + w``."""
  variance = jnp.power(jnp.asarray(x, jnp.float32), 2).mean(-1, keepdims=True)
  return (1 + w) * jnp.asarray(x / jnp.sqrt(variance + 1e-6), x.dtype)


def rms_maxtext(x, w, b):
  """MaxText's RMSNorm: float32 up-cast, ``mean(square)``, ``rsqrt``, back to x's dtype, einsum scale."""
  y = jnp.asarray(x, jnp.float32)
  mean2 = jnp.mean(jax.lax.square(y), axis=-1, keepdims=True)
  y = jnp.asarray(y * jax.lax.rsqrt(mean2 + 1e-6), x.dtype)
  return jnp.einsum("...k,k->...k", y, w.astype(x.dtype))


def rms_folded(x, w, b):
  """The scale folded into the rstd before x is scaled; a bias after (RMSNorm, then + b)."""
  scale = w / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
  return x * scale + b


def rms_per_head(x, w, b):
  """A QK-norm: RMSNorm over each head's dims of a (rows, heads, head_dim) view, one scale for all heads."""
  q = x.reshape(x.shape[0], 4, x.shape[1] // 4)
  q = q * jax.lax.rsqrt(jnp.mean(q * q, -1, keepdims=True) + EPS) * w[:q.shape[-1]]
  return q.reshape(x.shape)


def gn_nhwc_silu(x, w, b):
  """Channels last: a reshape to (N, H, W, G, C/G), the statistics over (H, W, C/G), then SiLU."""
  n, h, wd, c = x.shape
  xg = x.reshape(n, h, wd, 8, c // 8)
  m = xg.mean((1, 2, 4), keepdims=True)
  v = xg.var((1, 2, 4), keepdims=True)
  y = ((xg - m) * jax.lax.rsqrt(v + EPS)).reshape(x.shape) * w + b
  return jax.nn.silu(y)


def gn_sum_times_one_pass(x, w, b):
  """The mean as ``sum * (1 / n)`` (n = 30: 1/n rounded in float32), the variance one-pass."""
  n, h, wd, c = x.shape
  xg = x.reshape(n, h, wd, 8, c // 8)
  inv_n = 1.0 / (h * wd * (c // 8))
  m = jnp.sum(xg, (1, 2, 4), keepdims=True) * inv_n
  v = jnp.sum(xg * xg, (1, 2, 4), keepdims=True) * inv_n - m * m
  return ((xg - m) * jax.lax.rsqrt(v + EPS)).reshape(x.shape) * w + b


def gn_nchw(x, w, b):
  """Channels first (x transposed in and out): a reshape to (N, G, C/G*H*W), the statistics over the last axis.

  The reshape merges each group's channels and spatial axes into one, so the
  rewrite sees a LayerNorm over that view (the affine then stays XLA's)."""
  x = jnp.transpose(x, (0, 3, 1, 2))
  n, c, h, wd = x.shape
  xg = x.reshape(n, 8, (c // 8) * h * wd)
  m = xg.mean(-1, keepdims=True)
  v = jnp.mean(jnp.square(xg), -1, keepdims=True) - jnp.square(m)
  y = ((xg - m) / jnp.sqrt(v + EPS)).reshape(x.shape)
  return jnp.transpose(y * w[:, None, None] + b[:, None, None], (0, 2, 3, 1))


def ln_residual(x, w, b):
  """A pre-norm block's residual add whose sum flows on: the fused add_layer_norm."""
  h = x + jnp.flip(x, 0)
  return ln_two_pass(h, w, b) + 2.0 * h


def ln_stats_used(x, w, b):
  """The rstd is also used elsewhere: still rewritten, the rstd recomputed."""
  m = x.mean(-1, keepdims=True)
  r = jax.lax.rsqrt(x.var(-1, keepdims=True) + EPS)
  return (x - m) * r * w + b + r


def two_norms(x, w, b):
  """Two norms in a row with a residual add between them."""
  y = rms_llama(x, w, b)
  return ln_two_pass(y + x, w, b)


FORMS = {
    "ln_two_pass": Form(ln_two_pass, "layer_norm"),
    "ln_one_pass_max": Form(ln_one_pass_max, "layer_norm"),
    "ln_folded": Form(ln_folded, "layer_norm"),
    "ln_eps_tiny": Form(ln_eps_tiny, "layer_norm"),
    "ln_pow_half": Form(ln_pow_half, "layer_norm"),
    "ln_ddof": Form(ln_ddof, "layer_norm"),
    "ln_eps_nested": Form(ln_eps_nested, "layer_norm"),
    "ln_two_axes": Form(ln_two_axes, "layer_norm"),
    "ln_bf16_math": Form(ln_bf16_math, "layer_norm"),
    "rms_llama": Form(rms_llama, "rms_norm"),
    "rms_gemma": Form(rms_gemma, "rms_norm"),
    "rms_maxtext": Form(rms_maxtext, "rms_norm"),
    "rms_folded": Form(rms_folded, "rms_norm"),
    "rms_per_head": Form(rms_per_head, "rms_norm"),
    "gn_nhwc_silu": Form(gn_nhwc_silu, "group_norm", group=True),
    "gn_sum_times_one_pass": Form(gn_sum_times_one_pass, "group_norm", group=True),
    "gn_nchw": Form(gn_nchw, "layer_norm", group=True),
    "ln_residual": Form(ln_residual, "add_layer_norm"),
    "ln_stats_used": Form(ln_stats_used, "layer_norm"),
    "two_norms": Form(two_norms, "rms_norm+layer_norm", norms=2),
}


# ----------------------------------------------------------------------------
# What must be left alone.


def eps_outside_sqrt(x, w, b):
  m = x.mean(-1, keepdims=True)
  return (x - m) / (jnp.sqrt(x.var(-1, keepdims=True)) + EPS) * w + b


def batch_axis_stats(x, w, b):
  """Statistics over the leading (batch) axis: a BatchNorm, not a LayerNorm."""
  m = x.mean(0, keepdims=True)
  return (x - m) * jax.lax.rsqrt(x.var(0, keepdims=True) + EPS) * w + b


def l2_normalize(x, w, b):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def l2_normalize_eps(x, w, b):
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-12))


def softmax(x, w, b):
  return jax.nn.softmax(x, -1) * w


def mean_only(x, w, b):
  return (x - x.mean(-1, keepdims=True)) * w


NEGATIVES = {f.__name__: f for f in (eps_outside_sqrt, batch_axis_stats, l2_normalize,
                                     l2_normalize_eps, softmax, mean_only)}


@jax.custom_jvp
def damped_rsqrt(v):
  """rsqrt whose derivative is damped (half rsqrt's): not the op's derivative."""
  return jax.lax.rsqrt(v)


damped_rsqrt.defjvp(lambda p, t: (damped_rsqrt(p[0]), -0.25 * t[0] * damped_rsqrt(p[0]) ** 3))


# ----------------------------------------------------------------------------
# Activations after a GroupNorm (tests/test_rewrite_semantics.py, tests/test_rewrite_fuzz.py).

#: name -> (activation code, the op's activation it is fused as; None: left as written).
ACTIVATION_FORMS = {
    "maximum": (lambda y: jnp.maximum(y, 0.0), None),  # derivative 0.5 at 0
    "maximum_zero_first": (lambda y: jnp.maximum(0.0, y), None),
    "where_ge": (lambda y: jnp.where(y >= 0, y, 0.0), None),  # derivative 1 at 0
    "nn_relu": (jax.nn.relu, "relu"),  # a custom_jvp: derivative 0 at 0, as the op's
    "mul_gt": (lambda y: y * (y > 0), "relu"),
    "nn_silu": (jax.nn.silu, "silu"),
    "sigmoid_form": (lambda y: y * jax.nn.sigmoid(y), "silu"),
    "nn_gelu_tanh": (jax.nn.gelu, "gelu"),
    "nn_gelu_erf": (lambda y: jax.nn.gelu(y, approximate=False), None),
}


@functools.cache
def inputs(group: bool, dtype):
  """``(x, w, b, cotangent)``: x (6, 32) rows or (2, 3, 5, 16) NHWC with 8 groups."""
  k = jax.random.split(jax.random.key(53), 4)
  shape = (2, 3, 5, 16) if group else (6, 32)
  width = shape[-1]
  x = (jax.random.normal(k[0], shape, jnp.float32) * 1.5 + 0.7).astype(dtype)
  w = 1.0 + 0.2 * jax.random.normal(k[1], (width,), jnp.float32)
  b = 0.1 * jax.random.normal(k[2], (width,), jnp.float32)
  ct = jax.random.normal(k[3], shape, jnp.float32)
  return x, w, b, ct
