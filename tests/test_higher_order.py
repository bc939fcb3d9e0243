"""Higher-order AD through the layers and ops (grad of grad, hessian, jvp of grad) against plain jnp layers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn


# ----------------------------------------------------------------------------
# Plain jnp layers, differentiated by JAX itself: the oracle.


def ln_jnp(x, w, b, norm_ndim=1, eps=1e-5, scale_offset=0.0, centered=True):
  axes = tuple(range(x.ndim - norm_ndim, x.ndim))
  xc = x - x.mean(axes, keepdims=True) if centered else x
  y = xc / jnp.sqrt((xc * xc).mean(axes, keepdims=True) + eps)
  if w is not None:
    y = y * (w + scale_offset)
  return y + b if b is not None else y


def gn_jnp(x, num_groups, w, b, channel_axis, eps=1e-5):
  xc = jnp.moveaxis(x, channel_axis, 1)
  n, c = xc.shape[:2]
  blocks = xc.reshape(n, num_groups, -1)
  mean = blocks.mean(-1, keepdims=True)
  var = ((blocks - mean) ** 2).mean(-1, keepdims=True)
  y = ((blocks - mean) / jnp.sqrt(var + eps)).reshape(xc.shape)
  bcast = (1, c) + (1,) * (xc.ndim - 2)
  y = y * w.reshape(bcast) + b.reshape(bcast)
  return jnp.moveaxis(y, 1, channel_axis)


def _layers(impl):
  """name -> (ours(x, w, b), plain jnp(x, w, b), x shape, parameter shape)."""
  return {
      "layer_norm": (lambda x, w, b: jn.layer_norm(x, w, b, implementation=impl),
                     ln_jnp, (2, 3, 8), (8,)),
      "layer_norm_normalized_offset": (
          lambda x, w, b: jn.layer_norm(x, w, b, normalized_shape=(2, 4), scale_offset=1.0,
                                        save="normalized", implementation=impl),
          lambda x, w, b: ln_jnp(x, w, b, norm_ndim=2, scale_offset=1.0), (3, 2, 4), (2, 4)),
      "rms_norm": (lambda x, w, b: jn.rms_norm(x, w, eps=1e-6, scale_offset=0.5,
                                               implementation=impl) + b,
                   lambda x, w, b: ln_jnp(x, w, b, eps=1e-6, scale_offset=0.5, centered=False),
                   (2, 3, 8), (8,)),
      "group_norm_nchw": (lambda x, w, b: jn.group_norm(x, 3, w, b, implementation=impl),
                          lambda x, w, b: gn_jnp(x, 3, w, b, 1), (2, 6, 2, 2), (6,)),
      "group_norm_nhwc": (lambda x, w, b: jn.group_norm(x, 2, w, b, channel_axis=-1,
                                                        implementation=impl),
                          lambda x, w, b: gn_jnp(x, 2, w, b, -1), (2, 3, 4), (4,)),
      "group_norm_silu": (lambda x, w, b: jn.group_norm(x, 2, w, b, channel_axis=-1,
                                                        activation="silu", implementation=impl),
                          lambda x, w, b: jax.nn.silu(gn_jnp(x, 2, w, b, -1)), (2, 3, 4), (4,)),
  }


def _args(rng, x_shape, p_shape):
  f = lambda shape, offset=0.0: jnp.asarray(rng.normal(offset, 1.0, size=shape), jnp.float32)
  return f(x_shape, 0.3), f(p_shape, 1.0), f(p_shape)


def _like(rng, arrays):
  return tuple(jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in arrays)


def _loss(layer, cot):
  """A scalar with a non-trivial second derivative through y (so both primitives' JVPs matter)."""
  return lambda x, w, b: jnp.sum(jnp.sin(layer(x, w, b)) * cot)


def _second_order(loss, args, v, tangents):
  """Reverse-over-reverse (a Hessian-vector product), jax.hessian and jvp of grad, in one jit."""
  grad = jax.grad(loss, (0, 1, 2))

  @jax.jit
  def run(args, v, tangents):
    inner = lambda *a: sum(jnp.vdot(g, t) for g, t in zip(grad(*a), v))
    return {"grad_of_grad": jax.grad(inner, (0, 1, 2))(*args),
            # d2/db2 is in the other two already; leaving b out keeps the compile small.
            "hessian": jax.hessian(loss, (0, 1))(*args),
            "jvp_of_grad": jax.jvp(grad, args, tangents)}

  return run(args, v, tangents)


def _close(actual, expected, name=""):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    e = np.asarray(e, np.float64)
    np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=1e-4,
                               atol=1e-4 * max(1.0, float(np.max(np.abs(e)))), err_msg=name)


LAYER_NAMES = list(_layers(None))


@functools.lru_cache(maxsize=None)
def _layer_problem(name):
  """Inputs, cotangent, directions and the plain-jnp second-order results (shared by the subclasses)."""
  rng = np.random.default_rng(LAYER_NAMES.index(name))
  _, plain, x_shape, p_shape = _layers(None)[name]
  args = _args(rng, x_shape, p_shape)
  cot = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  v, tangents = _like(rng, args), _like(rng, args)
  return cot, args, v, tangents, _second_order(_loss(plain, cot), args, v, tangents)


def _backward_op_cases(impl, rng):
  """name -> (our backward op, its jnp formula, arguments)."""
  x, w, _ = _args(rng, (3, 8), (8,))
  dy = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
  mean, var = x.mean(-1), x.var(-1)
  rstd = 1 / jnp.sqrt(var + 1e-5)
  xhat = (x - mean[:, None]) * rstd[:, None]

  def compact(dy, xhat, rstd, w):  # grad_input, grad_weight, grad_bias.
    g = dy * w
    dx = rstd[:, None] * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)

  ascend_xhat = lambda x, v, m: (x - m[:, None]) / jnp.sqrt(v + 1e-5)[:, None]
  return {
      "layer_norm_backward": (
          lambda dy, x, m, r, w: jn.layer_norm_backward(dy, x, 8, m, r, w, implementation=impl),
          lambda dy, x, m, r, w: compact(dy, (x - m[:, None]) * r[:, None], r, w),
          (dy, x, mean, rstd, w)),
      "layer_norm_grad": (
          lambda dy, x, v, m, w: jn.layer_norm_grad(dy, x, v, m, w, 1e-5, implementation=impl),
          lambda dy, x, v, m, w: (compact(dy, ascend_xhat(x, v, m), 1 / jnp.sqrt(v + 1e-5), w)[0],
                                  ascend_xhat(x, v, m)),
          (dy, x, var, mean, w)),
      "layer_norm_grad_beta": (
          lambda dy, xh: jn.layer_norm_grad_beta(dy, xh, implementation=impl),
          lambda dy, xh: ((dy * xh).sum(0), dy.sum(0)), (dy, xhat)),
      "from_normalized": (
          lambda dy, w, xh, s: jn.layer_norm_backward_from_normalized(dy, w, xh, s,
                                                                      implementation=impl),
          lambda dy, w, xh, s: compact(dy, xh, 1 / s, w), (dy, w, xhat, 1 / rstd)),
      "rms_norm_backward": (
          lambda dy, x, r, w: jn.rms_norm_backward(dy, x, 8, r, w, implementation=impl),
          lambda dy, x, r, w: (
              r[:, None] * (dy * w - x * r[:, None] * (dy * w * x * r[:, None]).mean(-1, keepdims=True)),
              (dy * x * r[:, None]).sum(0)),
          (dy, x, 1 / jnp.sqrt((x * x).mean(-1) + 1e-6), w)),
  }


def _first_order_all(fns, problems):
  """JVP and VJP (the JVP transposed) of every op, in one jit."""

  @jax.jit
  def run(problems):
    return {name: (jax.jvp(fns[name], a, t), jax.vjp(fns[name], *a)[1](c))
            for name, (a, t, c) in problems.items()}

  return run(problems)


@functools.lru_cache(maxsize=None)
def _backward_op_problems():
  rng = np.random.default_rng(100)
  cases = _backward_op_cases(None, rng)
  problems = {}
  for name, (_, plain, args) in cases.items():
    problems[name] = (args, _like(rng, args), _like(rng, plain(*args)))
  plain = {name: c[1] for name, c in cases.items()}
  return problems, _first_order_all(plain, problems)


class HigherOrderTests:
  """Higher-order AD suite; subclasses set ``implementation``."""

  implementation = None

  @pytest.mark.parametrize("name", LAYER_NAMES)
  def test_second_order(self, name):
    """grad of grad, jax.hessian and jvp of grad through the layer equal the plain jnp layer's."""
    cot, args, v, tangents, expected = _layer_problem(name)
    ours = _layers(self.implementation)[name][0]
    got = _second_order(_loss(ours, cot), args, v, tangents)
    for key in expected:
      _close(got[key], expected[key], f"{name} {key}")

  def test_third_order(self, rng):
    x, w, b = _args(rng, (2, 4), (4,))
    cot = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    ours = lambda x, w, b: jn.layer_norm(x, w, b, implementation=self.implementation)
    third = lambda layer: jax.jit(jax.jacfwd(jax.hessian(
        lambda x: _loss(layer, cot)(x, w, b))))(x)
    _close(third(ours), third(ln_jnp), "third order")

  def test_second_order_under_vmap(self, rng):
    """Hessian-vector products under vmap with a per-example weight (param_groups > 1)."""
    impl = self.implementation
    x, w, b = _args(rng, (3, 4, 8), (3, 8))
    cot, vx, vw = _like(rng, (x, x, w))
    layers = (lambda x, w, b: jn.layer_norm(x, w, b[0], implementation=impl) +
              jn.rms_norm(x, w, implementation=impl),
              lambda x, w, b: ln_jnp(x, w, b[0]) + ln_jnp(x, w, None, eps=1e-6, centered=False))

    def hvp(layer):
      def one(x, w, b, cot, vx, vw):
        loss = _loss(layer, cot)
        inner = lambda x, w: sum(jnp.vdot(g, t) for g, t in
                                 zip(jax.grad(loss, (0, 1))(x, w, b), (vx, vw)))
        return jax.grad(inner, (0, 1))(x, w)
      return jax.jit(jax.vmap(one, in_axes=(0, 0, None, 0, 0, 0)))(x, w, b, cot, vx, vw)

    _close(hvp(layers[0]), hvp(layers[1]), "vmap of hvp")

  def test_forward_mode_of_fwd_ops(self, rng):
    """jax.jvp of the forward-with-statistics ops (plain primitives, no custom_vjp)."""
    impl = self.implementation
    x, w, b = _args(rng, (4, 8), (8,))
    tx, tw, tb = _like(rng, (x, w, b))

    def plain_ln(x, w, b):
      mean = x.mean(-1, keepdims=True)
      rstd = 1 / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
      return ln_jnp(x, w, b), mean, rstd

    def both(ln, rms):
      return jax.jit(lambda: (jax.jvp(ln, (x, w, b), (tx, tw, tb)),
                              jax.jvp(rms, (x, w), (tx, tw))))()

    _close(both(lambda x, w, b: jn.layer_norm_fwd(x, 8, w, b, implementation=impl),
                lambda x, w: jn.rms_norm_fwd(x, 8, w, implementation=impl)),
           both(plain_ln, lambda x, w: (ln_jnp(x, w, None, eps=1e-6, centered=False),
                                        1 / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6))))

  def test_derivatives_of_backward_ops(self):
    """The backward ops in every kernel mode (x or xhat in, xhat out) differentiate like their formulas."""
    problems, expected = _backward_op_problems()
    ours = {name: c[0] for name, c in
            _backward_op_cases(self.implementation, np.random.default_rng(100)).items()}
    got = _first_order_all(ours, problems)
    for name in expected:
      _close(got[name], expected[name], name)


class TestHigherOrderDefault(HigherOrderTests):
  implementation = None


class TestHigherOrderXla(HigherOrderTests):
  implementation = "xla"
