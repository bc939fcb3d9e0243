"""jax_normgrad.flax and jax_normgrad.nnx against flax.linen and flax.nnx: parameters, outputs, gradients, fallbacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

import jax_normgrad.flax as jf  # noqa: E402
import jax_normgrad.nnx as jx  # noqa: E402
from cases import assert_launches  # noqa: E402
from dropin import (assert_matches_original, assert_same_structure, assert_trees_close,  # noqa: E402
                    cotangent, expect_fallback, kernel_calls, linear_loss, normal, random_like, run_jitted,
                    tol_dtype)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _x(shape, dtype=F32, seed=0, offset=0.0):
  return normal(shape, dtype, seed, offset)


# (class name, constructor kwargs, x shape, x dtype, kernel expected)
LINEN_CASES = [
    ("LayerNorm", {}, (4, 6, 40), F32, True),
    ("LayerNorm", {"use_scale": False}, (5, 33), F32, True),
    ("LayerNorm", {"use_bias": False, "epsilon": 1e-3}, (5, 33), F32, True),
    ("LayerNorm", {"use_bias": False, "use_scale": False}, (5, 33), F32, True),
    ("LayerNorm", {"use_fast_variance": False}, (5, 33), F32, True),
    ("LayerNorm", {"dtype": BF16}, (4, 6, 40), F32, True),                  # f32 x, bf16 result
    ("LayerNorm", {}, (4, 6, 40), BF16, True),                              # bf16 x, f32 result
    ("LayerNorm", {"param_dtype": BF16}, (4, 6, 40), BF16, True),           # all bf16
    ("LayerNorm", {"param_dtype": F16, "dtype": F16}, (3, 24), F32, True),
    ("LayerNorm", {"reduction_axes": (1, 2), "feature_axes": -1}, (4, 6, 40), F32, True),
    ("LayerNorm", {"reduction_axes": (-2, -1), "feature_axes": (-2, -1)}, (4, 6, 40), F32, True),
    ("LayerNorm", {"reduction_axes": 1}, (4, 6, 40), F32, False),          # not trailing
    ("LayerNorm", {"feature_axes": (-2, -1)}, (4, 6, 40), F32, False),     # features outside
    ("LayerNorm", {"force_float32_reductions": False}, (4, 40), BF16, False),
    ("RMSNorm", {}, (4, 6, 40), F32, True),
    ("RMSNorm", {"use_scale": False}, (4, 40), F32, True),
    ("RMSNorm", {}, (4, 40), BF16, True),
    ("RMSNorm", {"reduction_axes": (-2, -1), "feature_axes": -1}, (4, 6, 40), F32, True),
    ("RMSNorm", {"reduction_axes": 0}, (4, 40), F32, False),
    ("GroupNorm", {"num_groups": 4}, (3, 5, 7, 16), F32, True),              # NHWC
    ("GroupNorm", {"num_groups": None, "group_size": 2}, (3, 5, 16), F32, True),
    ("GroupNorm", {"num_groups": 4, "use_scale": False, "use_bias": False}, (3, 32), F32, True),
    ("GroupNorm", {"num_groups": 4, "dtype": BF16, "param_dtype": BF16}, (3, 5, 7, 16), BF16, True),
    ("GroupNorm", {"num_groups": 4}, (3, 5, 7, 16), BF16, True),              # f32 result
    ("GroupNorm", {"num_groups": 2, "reduction_axes": (2, 3, 4)}, (2, 3, 4, 5, 8), F32, True),
    ("GroupNorm", {"num_groups": 2, "reduction_axes": (1, 3)}, (2, 3, 4, 8), F32, False),
]


def _linen_pair(name, kwargs):
  return getattr(jf, name)(**kwargs), getattr(nn, name)(**kwargs)


@pytest.mark.parametrize("name,kwargs,shape,dtype,kernel", LINEN_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3].__name__}" for c in LINEN_CASES])
def test_linen_matches_flax(name, kwargs, shape, dtype, kernel):
  ours, theirs = _linen_pair(name, kwargs)
  x = _x(shape, dtype)
  # Same parameter names, shapes and dtypes (abstract init: no compile).
  with expect_fallback(not kernel):
    v_ours = jax.eval_shape(ours.init, jax.random.key(1), x)
  v_theirs = jax.eval_shape(theirs.init, jax.random.key(1), x)
  assert_same_structure(v_ours, v_theirs)
  params = random_like(v_theirs)
  ct = cotangent(shape)
  run = lambda m: run_jitted(jax.value_and_grad(
      lambda p, x: linear_loss(m.apply(p, x), ct), argnums=(0, 1), has_aux=False), params, x)
  y = lambda m: run_jitted(m.apply, params, x)[0]
  low = tol_dtype(dtype, kwargs.get("dtype"), kwargs.get("param_dtype"))
  assert_trees_close(y(ours), y(theirs), "y", low)
  (ours_out, calls), (theirs_out, _) = run(ours), run(theirs)
  assert_trees_close(ours_out, theirs_out, "loss and grads", low)
  assert (calls > 0) == kernel


def test_linen_mask_falls_back_to_flax():
  x = _x((3, 20))
  mask = jnp.arange(20) < 15
  ours, theirs = jf.LayerNorm(), nn.LayerNorm()
  params = random_like(theirs.init(jax.random.key(0), x))
  with expect_fallback(True):
    y = ours.apply(params, x, mask=mask)
  np.testing.assert_array_equal(y, theirs.apply(params, x, mask=mask))


def test_linen_float64_falls_back_numpy_float64_does_not():
  ours, theirs = jf.LayerNorm(), nn.LayerNorm()
  x = np.random.default_rng(0).normal(size=(3, 16))  # NumPy float64: float32 in JAX without x64
  params = random_like(jax.eval_shape(theirs.init, jax.random.key(0), x))
  with expect_fallback(False):
    y = ours.apply(params, x)
  assert y.dtype == jnp.float32
  assert_trees_close(y, theirs.apply(params, x))
  with jax.enable_x64(True):
    x64 = jnp.asarray(x, jnp.float64)
    with expect_fallback(True):
      y = ours.apply(params, x64)
    np.testing.assert_array_equal(y, theirs.apply(params, x64))


def test_linen_under_vmap_and_nnx_positional_mask():
  ours, theirs = jf.GroupNorm(num_groups=2), nn.GroupNorm(num_groups=2)
  x = _x((5, 3, 4, 8))
  params = random_like(jax.eval_shape(theirs.init, jax.random.key(0), x[0]))
  f = lambda m: jax.jit(jax.vmap(lambda x: m.apply(params, x)))
  assert_trees_close(f(ours)(x), f(theirs)(x))
  mask = jnp.arange(8) < 6
  m_ours, m_theirs = jx.RMSNorm(8, rngs=nnx.Rngs(0)), nnx.RMSNorm(8, rngs=nnx.Rngs(0))
  with expect_fallback(True):
    y = m_ours(x, mask)
  np.testing.assert_array_equal(y, m_theirs(x, mask))


def test_linen_fast_variance_is_the_variance():
  """flax's E[x^2]-E[x]^2 and the kernels' two-pass variance agree when |mean| ~ std, not far beyond."""
  ours, theirs = jf.LayerNorm(use_scale=False, use_bias=False), nn.LayerNorm(use_scale=False,
                                                                              use_bias=False)
  x = _x((8, 256), offset=1.0)
  assert_trees_close(ours.apply({}, x), theirs.apply({}, x))
  # Far off-centre, flax's fast variance loses digits; the kernels match the float64 result.
  x = _x((8, 256), offset=3000.0)
  x64 = np.asarray(x, np.float64)
  exact = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6)
  err = lambda y: float(np.max(np.abs(np.asarray(y, np.float64) - exact)))
  assert err(ours.apply({}, x)) < 1e-3 < err(theirs.apply({}, x))


def test_linen_group_norm_errors_are_flax_errors():
  x = _x((2, 4, 12))
  for kwargs in ({"num_groups": 4, "group_size": 3}, {"num_groups": 5},
                 {"num_groups": 2, "reduction_axes": (1,)}):
    with pytest.raises(ValueError) as ours:
      jf.GroupNorm(**kwargs).init(jax.random.key(0), x)
    with pytest.raises(ValueError) as theirs:
      nn.GroupNorm(**kwargs).init(jax.random.key(0), x)
    assert str(ours.value) == str(theirs.value)


def _model(lib):
  """A small linen model written against ``lib``'s norm layers (auto-named submodules)."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = lib.LayerNorm()(x)
      h = nn.Dense(32)(h)
      h = lib.RMSNorm()(h)
      h = lib.GroupNorm(num_groups=8)(h.reshape(x.shape[0], 4, 32))
      return lib.LayerNorm(use_bias=False)(h)

  return Model()


def test_linen_model_swap_keeps_checkpoints():
  """An import swap: the same parameter tree, and the original's parameters give equal results."""
  x = _x((6, 4, 24))
  ours, theirs = _model(jf), _model(nn)
  init = lambda m: jax.jit(m.init)(jax.random.key(0), x)
  v_theirs = init(theirs)
  assert_trees_close(init(ours), v_theirs)  # same names, shapes, dtypes and initial values
  params = random_like(v_theirs)
  ct = cotangent((6, 4, 32))
  run = lambda m: run_jitted(jax.value_and_grad(lambda p: linear_loss(m.apply(p, x), ct)), params)
  # Float32 dots: a GPU's default (TF32) would turn the norms' last-bit differences into
  # differences of 1e-3 in the Dense gradients.
  with jax.default_matmul_precision("float32"):
    (ours_out, calls), (theirs_out, _) = run(ours), run(theirs)
  assert_trees_close(ours_out, theirs_out)
  assert calls >= 8  # forward and backward of each of the four layers


def test_linen_attributes_are_flax_attributes():
  """Every flax attribute with its default, in flax's order; ``implementation`` and ``forward``
  added last (GroupNorm: then ``activation``)."""
  import dataclasses
  for name in ("LayerNorm", "RMSNorm", "GroupNorm"):
    flax_fields = [(f.name, f.default) for f in dataclasses.fields(getattr(nn, name))
                   if f.name not in ("parent", "name")]
    our_fields = [(f.name, f.default) for f in dataclasses.fields(getattr(jf, name))
                  if f.name not in ("parent", "name")]
    extra = [("implementation", None), ("forward", None)] + (
        [("activation", None)] if name == "GroupNorm" else [])
    assert our_fields == flax_fields + extra
    assert issubclass(getattr(jf, name), getattr(nn, name))


def test_linen_implementation_xla_has_no_custom_call():
  x = _x((4, 32))
  m = jf.LayerNorm(implementation="xla")
  params = m.init(jax.random.key(0), x)
  assert kernel_calls(jax.grad(lambda p: jnp.sum(m.apply(p, x) ** 2)), params) == 0


# ----------------------------------------------------------------------------
# flax.nnx

# (class name, positional args, kwargs, x shape, x dtype, kernel expected)
NNX_CASES = [
    ("LayerNorm", (40,), {}, (4, 6, 40), F32, True),
    ("LayerNorm", (40,), {"use_bias": False, "use_scale": False}, (4, 40), F32, True),
    ("LayerNorm", (40,), {"dtype": BF16}, (4, 40), F32, True),  # x promoted to bf16 first
    ("LayerNorm", (40,), {}, (4, 40), BF16, True),                # bf16 x read as is, f32 y
    ("LayerNorm", (40,), {"param_dtype": BF16}, (4, 40), BF16, True),
    ("LayerNorm", (6,), {"reduction_axes": 1, "feature_axes": 1}, (4, 6, 40), F32, False),
    ("RMSNorm", (40,), {}, (4, 6, 40), F32, True),
    ("RMSNorm", (40,), {"use_scale": False, "epsilon": 1e-3}, (4, 40), BF16, True),
    ("RMSNorm", (40,), {}, (4, 6, 40), BF16, True),
    ("GroupNorm", (16,), {"num_groups": 4}, (3, 5, 7, 16), F32, True),
    ("GroupNorm", (16,), {"num_groups": None, "group_size": 2}, (3, 4, 16), F32, True),
    ("GroupNorm", (16,), {"num_groups": 4, "use_bias": False, "dtype": BF16}, (3, 5, 16), F32,
     True),
    ("GroupNorm", (16,), {"num_groups": 4}, (3, 5, 7, 16), BF16, True),
    ("GroupNorm", (8,), {"num_groups": 2, "reduction_axes": (1, 3)}, (2, 3, 4, 8), F32, False),
]


@pytest.mark.parametrize("name,args,kwargs,shape,dtype,kernel", NNX_CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[4].__name__}" for c in NNX_CASES])
def test_nnx_matches_flax(name, args, kwargs, shape, dtype, kernel):
  ours = getattr(jx, name)(*args, **kwargs, rngs=nnx.Rngs(0))
  theirs = getattr(nnx, name)(*args, **kwargs, rngs=nnx.Rngs(0))
  assert_trees_close(nnx.state(ours), nnx.state(theirs), "state")
  # The original's (non-trivial) parameters, loaded into ours: a checkpoint swap.
  state = random_like(nnx.state(theirs))
  nnx.update(theirs, state)
  nnx.update(ours, state)
  x = _x(shape, dtype)
  low = tol_dtype(dtype, kwargs.get("dtype"), kwargs.get("param_dtype"))
  ct = cotangent(shape)
  def run(m):
    graphdef, st = nnx.split(m)
    y = lambda st, x: nnx.merge(graphdef, st)(x)
    loss = lambda st, x: linear_loss(y(st, x), ct)
    return run_jitted(lambda st, x: (y(st, x), jax.value_and_grad(loss, argnums=(0, 1))(st, x)),
                      st, x)
  assert_matches_original(run, ours, theirs, low, kernel)


def test_nnx_constructor_is_flax_constructor():
  import inspect
  for name in ("LayerNorm", "RMSNorm", "GroupNorm"):
    ours = inspect.signature(getattr(jx, name).__init__).parameters
    theirs = inspect.signature(getattr(nnx, name).__init__).parameters
    extra = ["implementation", "forward"] + (["activation"] if name == "GroupNorm" else [])
    assert list(ours)[:len(theirs)] == list(theirs) and list(ours)[len(theirs):] == extra
    assert all(ours[p].default is theirs[p].default for p in theirs)
  m = jx.LayerNorm(8, rngs=nnx.Rngs(0), implementation="xla")
  assert m.implementation == "xla" and isinstance(m, nnx.LayerNorm)
  with pytest.raises(ValueError, match="Either `num_groups` or `group_size`"):
    jx.GroupNorm(8, num_groups=2, group_size=4, rngs=nnx.Rngs(0))


ACTIVATIONS = {"silu": nn.swish, "gelu": nn.gelu, "relu": nn.relu}


@pytest.mark.parametrize("activation,dtype", [("silu", jnp.float32), ("gelu", jnp.bfloat16),
                                              ("relu", jnp.float32)])
def test_linen_group_norm_activation_is_flax_then_the_activation(activation, dtype):
  """GroupNorm(activation=a) == a(flax GroupNorm): y and every gradient, on the kernels."""
  ours = jf.GroupNorm(num_groups=4, activation=activation)
  theirs = nn.GroupNorm(num_groups=4)
  shape = (2, 5, 7, 16)
  x = _x(shape, dtype)
  params = random_like(jax.eval_shape(theirs.init, jax.random.key(1), x))
  ct = cotangent(shape)
  act = ACTIVATIONS[activation]
  run = lambda apply: run_jitted(jax.value_and_grad(
      lambda p, x: linear_loss(apply(p, x), ct), argnums=(0, 1)), params, x)
  with expect_fallback(False):
    ours_out, calls = run(ours.apply)
  theirs_out, _ = run(lambda p, x: act(theirs.apply(p, x)))
  assert_trees_close(ours_out, theirs_out, "loss and grads", dtype)
  assert_launches(calls, 3)  # channels last, on CPU: the statistics, y, the backward


def test_nnx_group_norm_activation_is_flax_then_the_activation():
  ours = jx.GroupNorm(16, num_groups=4, activation="silu", rngs=nnx.Rngs(0))
  theirs = nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0))
  state = random_like(nnx.state(theirs))
  nnx.update(theirs, state)
  nnx.update(ours, state)
  x = _x((2, 5, 7, 16), jnp.float32)
  with expect_fallback(False):
    y, calls = run_jitted(lambda x: ours(x), x)
  assert_trees_close(y, nnx.swish(theirs(x)), "y")
  assert_launches(calls, 2)  # on CPU: the statistics, then y
  assert ours.activation == "silu"


def test_docs_flax_example_runs():
  import pathlib
  import re
  readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "dropins.md").read_text()
  section = readme[readme.index("## Drop-in layers"):]
  block = re.findall(r"```python\n(.+?)\n```", section, re.S)[0]
  namespace = {}
  exec(compile(block, "README.md", "exec"), namespace)
  assert jax.tree.map(jnp.shape, namespace["grads"])["params"]["LayerNorm_0"] == {
      "scale": (64,), "bias": (64,)}
