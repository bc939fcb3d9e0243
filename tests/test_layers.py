"""The differentiable layers: jax.grad against jnp layers, jit, vmap, nested vmap, check_grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_normgrad as jn
from cases import random

IMPLEMENTATIONS = [None, "xla"]


def jnp_layer_norm(x, w=None, b=None, axes=(-1,), eps=1e-5):
  x32 = x.astype(jnp.float32)
  m = x32.mean(axes, keepdims=True)
  v = ((x32 - m) ** 2).mean(axes, keepdims=True)
  y = (x32 - m) / jnp.sqrt(v + eps)
  if w is not None:
    y = y * w
  if b is not None:
    y = y + b
  return y.astype(x.dtype)


def jnp_group_norm(x, groups, w=None, b=None, channel_axis=1, eps=1e-5):
  """Plain jnp GroupNorm; channel axis moved to 1."""
  xc = jnp.moveaxis(x, channel_axis, 1)
  n, c = xc.shape[:2]
  xb = xc.reshape(n, groups, -1).astype(jnp.float32)
  m = xb.mean(-1, keepdims=True)
  v = ((xb - m) ** 2).mean(-1, keepdims=True)
  y = ((xb - m) / jnp.sqrt(v + eps)).reshape(xc.shape)
  bshape = (1, c) + (1,) * (xc.ndim - 2)
  if w is not None:
    y = y * w.reshape(bshape)
  if b is not None:
    y = y + b.reshape(bshape)
  return jnp.moveaxis(y.astype(x.dtype), 1, channel_axis)


def _vjp_all(f, args, ct):
  _, pullback = jax.vjp(f, *args)
  return pullback(ct)


def _assert_tree_close(a, b, tol=2e-5):
  for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u, np.float64), np.asarray(w, np.float64), rtol=tol,
                               atol=tol * max(1.0, float(np.max(np.abs(np.asarray(w, np.float64))))))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,norm_shape", [((6, 1000), None), ((2, 3, 4, 42), (4, 42))])
@pytest.mark.parametrize("params", ["both", "weight", "none"])
def test_layer_norm_grad_matches_jnp(rng, implementation, shape, norm_shape, params):
  ns = norm_shape or shape[-1:]
  x = random(rng, shape, jnp.float32, 2.0, 0.3)
  w = random(rng, ns, jnp.float32, 1.0, 1.0) if params != "none" else None
  b = random(rng, ns, jnp.float32) if params == "both" else None
  ct = random(rng, shape, jnp.float32)
  axes = tuple(range(-len(ns), 0))
  ours = _vjp_all(lambda x, w, b: jn.layer_norm(x, w, b, normalized_shape=norm_shape,
                                                implementation=implementation), (x, w, b), ct)
  theirs = _vjp_all(lambda x, w, b: jnp_layer_norm(x, w, b, axes), (x, w, b), ct)
  _assert_tree_close(ours, theirs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,channel_axis,groups", [
    ((3, 12, 5, 7), 1, 4), ((3, 5, 7, 12), -1, 3), ((2, 6, 12, 5), 2, 4), ((4, 10), 1, 5),
    ((2, 8, 3, 2, 3), 1, 2)])
def test_group_norm_grad_matches_jnp(rng, implementation, shape, channel_axis, groups):
  c = shape[channel_axis]
  x = random(rng, shape, jnp.float32, 2.0, -0.4)
  w = random(rng, (c,), jnp.float32, 1.0, 1.0)
  b = random(rng, (c,), jnp.float32)
  ct = random(rng, shape, jnp.float32)
  ours = _vjp_all(lambda x, w, b: jn.group_norm(x, groups, w, b, channel_axis=channel_axis,
                                                implementation=implementation), (x, w, b), ct)
  theirs = _vjp_all(lambda x, w, b: jnp_group_norm(x, groups, w, b, channel_axis), (x, w, b), ct)
  _assert_tree_close(ours, theirs)


def test_layer_norm_mixed_precision_grad_dtypes(rng):
  x = random(rng, (8, 96), jnp.bfloat16)
  w = random(rng, (96,), jnp.float32, 1.0, 1.0)
  b = random(rng, (96,), jnp.float32)
  y = jn.layer_norm(x, w, b)
  assert y.dtype == jnp.bfloat16
  gx, gw, gb = jax.grad(lambda x, w, b: jnp.sum(jn.layer_norm(x, w, b).astype(jnp.float32) ** 2),
                        argnums=(0, 1, 2))(x, w, b)
  assert gx.dtype == jnp.bfloat16 and gw.dtype == gb.dtype == jnp.float32


@pytest.mark.parametrize("layer", ["layer_norm", "group_norm"])
def test_jit_and_check_grads(rng, layer):
  if layer == "layer_norm":
    x = random(rng, (5, 21), jnp.float32, 2.0)
    w, b = random(rng, (21,), jnp.float32, 1.0, 1.0), random(rng, (21,), jnp.float32)
    f = jax.jit(lambda x, w, b: jn.layer_norm(x, w, b))
  else:
    x = random(rng, (3, 6, 4, 5), jnp.float32, 2.0)
    w, b = random(rng, (6,), jnp.float32, 1.0, 1.0), random(rng, (6,), jnp.float32)
    f = jax.jit(lambda x, w, b: jn.group_norm(x, 3, w, b))
  # First order (reverse mode runs the backward kernel); float32 needs loose tolerances.
  check_grads(f, (x, w, b), order=1, modes=["rev"], atol=3e-2, rtol=3e-2, eps=1e-2)


def test_vmap_in_axes_layer_norm(rng):
  x = random(rng, (4, 7, 33), jnp.float32, 2.0)
  ws = random(rng, (4, 33), jnp.float32, 1.0, 1.0)
  w = ws[0]
  ct = random(rng, (4, 7, 33), jnp.float32)

  def per_example(f):
    return lambda x, w, ct: jax.vjp(f, x, w)[1](ct)

  ours = lambda x, w: jn.layer_norm(x, w)
  theirs = lambda x, w: jnp_layer_norm(x, w)
  # Batched x only; batched x and weight; batched weight only; batch at axis 1.
  for in_axes, args in [((0, None, 0), (x, w, ct)), ((0, 0, 0), (x, ws, ct)),
                        ((None, 0, 0), (x[0], ws, ct)),
                        ((1, None, 1), (jnp.swapaxes(x, 0, 1), w, jnp.swapaxes(ct, 0, 1)))]:
    a = jax.vmap(per_example(ours), in_axes)(*args)
    b = jax.vmap(per_example(theirs), in_axes)(*args)
    _assert_tree_close(a, b)


def test_nested_vmap_and_jit(rng):
  x = random(rng, (3, 2, 5, 40), jnp.float32, 2.0)
  w = random(rng, (3, 40), jnp.float32, 1.0, 1.0)
  grad = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))
  inner = lambda f: jax.vmap(grad(f), in_axes=(0, None))
  ours = jax.jit(jax.vmap(inner(lambda x, w: jn.layer_norm(x, w)), in_axes=(0, 0)))(x, w)
  theirs = jax.vmap(inner(jnp_layer_norm), in_axes=(0, 0))(x, w)
  _assert_tree_close(ours, theirs)


def test_vmap_group_norm_batched_params(rng):
  x = random(rng, (5, 2, 8, 9), jnp.float32, 2.0)
  w = random(rng, (5, 8), jnp.float32, 1.0, 1.0)
  b = random(rng, (5, 8), jnp.float32)
  for cl in (1, -1):
    xx = jnp.moveaxis(x, 2, cl if cl == -1 else 2)
    g = lambda f: jax.grad(lambda x, w, b: jnp.sum(jnp.cos(f(x, w, b))), argnums=(0, 1, 2))
    ours = jax.vmap(g(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=cl)))(xx, w, b)
    theirs = jax.vmap(g(lambda x, w, b: jnp_group_norm(x, 4, w, b, cl)))(xx, w, b)
    _assert_tree_close(ours, theirs)
  # With the fused activation: per-example weights and biases reach z = xhat * w + b.
  ours = jax.vmap(g(lambda x, w, b: jn.group_norm(x, 4, w, b, activation="gelu")))(x, w, b)
  theirs = jax.vmap(g(lambda x, w, b: jax.nn.gelu(jnp_group_norm(x, 4, w, b))))(x, w, b)
  _assert_tree_close(ours, theirs)


def test_vmap_of_backward_ops(rng):
  x = random(rng, (3, 6, 20), jnp.float32, 2.0)
  dy = random(rng, (3, 6, 20), jnp.float32)
  _, mean, rstd = jn.layer_norm_fwd(x, 20)
  w = random(rng, (20,), jnp.float32, 1.0, 1.0)
  batched = jax.vmap(lambda dy, x, m, r: jn.layer_norm_backward(dy, x, 20, m, r, w))(dy, x, mean, rstd)
  for i in range(3):
    single = jn.layer_norm_backward(dy[i], x[i], 20, mean[i], rstd[i], w)
    _assert_tree_close([b[i] for b in batched], single, 1e-6)


def test_layer_saves_only_x_and_float32_stats(rng):
  x = random(rng, (16, 64), jnp.bfloat16)
  w = random(rng, (64,), jnp.bfloat16, 1.0, 1.0)
  _, vjp_fn = jax.vjp(lambda x, w: jn.layer_norm(x, w), x, w)
  saved = [l for l in jax.tree.leaves(vjp_fn) if hasattr(l, "shape")]
  big = [l for l in saved if l.size >= x.size]
  assert all(l.dtype == jnp.bfloat16 for l in big), [(l.shape, l.dtype) for l in saved]
  assert sum(l.size for l in big) <= x.size


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "group_norm"])
def test_float32_result_under_vmap_and_second_order(rng, op):
  """out_dtype=float32 with a bfloat16 x: vmap with per-example weights and grad of grad.

  The default implementation against the pure-JAX reference ("xla"), which
  computes the same thing in float32: dx agrees to bfloat16 rounding, the
  float32 gradients to float32 accumulation.
  """
  x = random(rng, (3, 5, 24), jnp.bfloat16, 2.0, 0.5)
  w = random(rng, (3, 24), jnp.float32, 1.0, 1.0)
  layers = {
      "layer_norm": lambda x, w, impl: jn.layer_norm(x, w, None, out_dtype=jnp.float32,
                                                     implementation=impl),
      "rms_norm": lambda x, w, impl: jn.rms_norm(x, w, out_dtype=jnp.float32, implementation=impl),
      "group_norm": lambda x, w, impl: jn.group_norm(x, 4, w, None, channel_axis=-1,
                                                     out_dtype=jnp.float32, implementation=impl),
  }
  layer = layers[op]
  loss = lambda impl: lambda x, w: jnp.sum(layer(x, w, impl) ** 3)
  per_example = {impl: jax.jit(jax.vmap(jax.grad(loss(impl), argnums=(0, 1))))(x, w)
                 for impl in (None, "xla")}
  (dx, dw), (dx_ref, dw_ref) = per_example[None], per_example["xla"]
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  _assert_tree_close(dx.astype(jnp.float32), dx_ref.astype(jnp.float32), 2.0 ** -7)
  _assert_tree_close(dw, dw_ref)
  grad_w = lambda impl: jax.grad(loss(impl), argnums=1)
  second = {impl: jax.jit(jax.grad(lambda w: jnp.sum(grad_w(impl)(x[0], w) ** 2)))(w[0])
            for impl in (None, "xla")}
  _assert_tree_close(second[None], second["xla"])
