"""jax_normgrad.equinox against equinox.nn: leaves, outputs, gradients, state, fallbacks; optional imports."""

from __future__ import annotations

import io
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_launches, kernel_launches
from dropin import (assert_matches_original, assert_trees_close, cotangent, expect_fallback,
                    linear_loss, normal, random_like, run_jitted, tol_dtype)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def test_importing_jax_normgrad_imports_no_framework():
  code = ("import sys, jax_normgrad\n"
          "bad = [m for m in ('flax', 'equinox') if m in sys.modules]\n"
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)


eqx = pytest.importorskip("equinox")
import jax_normgrad.equinox as je  # noqa: E402

# (class name, args, kwargs, batched x shape (vmapped over axis 0), x dtype, kernel expected)
CASES = [
    ("LayerNorm", (32,), {}, (6, 32), F32, True),
    ("LayerNorm", ((5, 32),), {"eps": 1e-3}, (4, 5, 32), F32, True),
    ("LayerNorm", (32,), {"use_weight": False}, (6, 32), BF16, True),
    ("LayerNorm", (32,), {"use_bias": False, "dtype": BF16}, (6, 32), F16, True),
    ("LayerNorm", (32,), {"use_weight": False, "use_bias": False}, (6, 32), F32, True),
    ("RMSNorm", (32,), {}, (6, 32), F32, True),
    ("RMSNorm", (32,), {}, (6, 32), BF16, True),  # with a bias: float32 path
    ("RMSNorm", ((5, 32),), {"use_bias": False}, (4, 5, 32), BF16, True),
    ("RMSNorm", (32,), {"use_weight": False, "use_bias": False}, (6, 32), F32, True),
    ("GroupNorm", (4, 16), {}, (3, 16, 5, 7), F32, True),  # (C, H, W) samples
    ("GroupNorm", (2, 16), {"eps": 1e-3}, (3, 16, 9), BF16, True),
    ("GroupNorm", (4,), {"channelwise_affine": False}, (3, 16, 6), F32, True),
    ("GroupNorm", (2, 8), {}, (5, 8), F32, True),  # no spatial axes
]


@pytest.mark.parametrize("name,args,kwargs,shape,dtype,kernel", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[4].__name__}" for c in CASES])
def test_equinox_matches_equinox(name, args, kwargs, shape, dtype, kernel):
  ours = getattr(je, name)(*args, **kwargs)
  theirs = getattr(eqx.nn, name)(*args, **kwargs)
  assert isinstance(ours, getattr(eqx.nn, name))
  assert_trees_close(ours, theirs, "leaves")  # the same paths (weight, bias), shapes, dtypes
  # The original's (non-trivial) parameters, loaded into ours through a serialised checkpoint.
  theirs = random_like(theirs)
  buf = io.BytesIO()
  eqx.tree_serialise_leaves(buf, theirs)
  buf.seek(0)
  ours = eqx.tree_deserialise_leaves(buf, ours)
  x = normal(shape, dtype)
  ct = cotangent(shape)
  low = tol_dtype(dtype, kwargs.get("dtype"))

  def run(m):
    y = lambda m, x: jax.vmap(m)(x)
    loss = lambda m, x: linear_loss(y(m, x), ct)
    return run_jitted(lambda m, x: (y(m, x), jax.value_and_grad(loss, argnums=(0, 1))(m, x)), m, x)

  assert_matches_original(run, ours, theirs, low, kernel)


def test_equinox_state_and_key_pass_through():
  m = je.LayerNorm(8)
  x = normal((8,))
  y, state = m(x, "state", key=jax.random.key(0))
  assert state == "state"
  assert_trees_close(y, eqx.nn.LayerNorm(8)(x))


def test_equinox_float64_falls_back():
  with jax.enable_x64(True):
    x = jnp.linspace(-1, 1, 16, dtype=jnp.float64)
    with expect_fallback(True):
      y = je.RMSNorm(16)(x)
    assert y.dtype == jnp.float64
    assert_trees_close(y, eqx.nn.RMSNorm(16)(x))


def test_equinox_errors_are_equinox_errors():
  for ours, theirs, x in ((je.LayerNorm(8), eqx.nn.LayerNorm(8), jnp.ones((2, 8))),
                          (je.GroupNorm(3, 6), eqx.nn.GroupNorm(3, 6), jnp.ones((8, 4)))):
    with pytest.raises(Exception) as a:
      ours(x)
    with pytest.raises(Exception) as b:
      theirs(x)
    assert (type(a.value), str(a.value)) == (type(b.value), str(b.value))
  with pytest.raises(ValueError, match="groups must divide"):
    je.GroupNorm(4, 6)


def test_equinox_constructor_is_equinox_constructor():
  import inspect
  for name in ("LayerNorm", "RMSNorm", "GroupNorm"):
    ours = inspect.signature(getattr(je, name).__init__).parameters
    theirs = inspect.signature(getattr(eqx.nn, name).__init__).parameters
    extra = ["implementation", "forward"] + (["activation"] if name == "GroupNorm" else [])
    assert list(ours)[:len(theirs)] == list(theirs) and list(ours)[len(theirs):] == extra
    assert all(ours[p].default is theirs[p].default for p in theirs)
  m = je.GroupNorm(2, 4, implementation="xla")
  assert m.implementation == "xla"
  text = jax.jit(jax.grad(lambda m, x: jnp.sum(m(x) ** 2))).lower(m, jnp.ones((4, 3))).as_text()
  assert kernel_launches(text) == 0


def test_equinox_group_norm_activation_is_equinox_then_the_activation():
  """GroupNorm(activation="gelu") == jax.nn.gelu(equinox GroupNorm): y and every gradient."""
  ours = random_like(je.GroupNorm(4, 16, activation="gelu"))
  theirs = eqx.nn.GroupNorm(4, 16)
  theirs = eqx.tree_at(lambda m: (m.weight, m.bias), theirs, (ours.weight, ours.bias))
  x = normal((3, 16, 5, 7))
  ct = cotangent(x.shape)
  run = lambda f: run_jitted(jax.value_and_grad(
      lambda m, x: linear_loss(jax.vmap(f(m))(x), ct), argnums=(0, 1)), ours, x)
  with expect_fallback(False):
    ours_out, calls = run(lambda m: m)
  theirs_out, _ = run(lambda m: lambda x: jax.nn.gelu(theirs.__class__.__call__(
      eqx.tree_at(lambda t: (t.weight, t.bias), theirs, (m.weight, m.bias)), x)))
  assert_trees_close(ours_out[0], theirs_out[0], "loss")
  assert_trees_close(ours_out[1][1], theirs_out[1][1], "grad x")
  assert_trees_close((ours_out[1][0].weight, ours_out[1][0].bias),
                     (theirs_out[1][0].weight, theirs_out[1][0].bias), "grad weight, bias")
  assert_launches(calls, 2)
  assert ours.activation == "gelu"


@pytest.mark.parametrize("name,plain", [("AddLayerNorm", "LayerNorm"), ("AddRMSNorm", "RMSNorm")])
def test_equinox_add_norm(name, plain):
  """AddLayerNorm / AddRMSNorm: the plain layer's leaves and checkpoints, (y, h) of the fused
  kernels (one forward custom call) equal to the plain layer on x + residual, and its gradients."""
  cls = getattr(je, name)
  ours, theirs = cls(32), random_like(getattr(eqx.nn, plain)(32))
  assert isinstance(ours, getattr(eqx.nn, plain))
  buf = io.BytesIO()
  eqx.tree_serialise_leaves(buf, theirs)
  buf.seek(0)
  ours = eqx.tree_deserialise_leaves(buf, ours)
  x, r = normal((6, 32), F32), normal((6, 32), F32)

  def loss(layer, x, r):
    y, h = jax.vmap(layer)(x, r)
    return jnp.sum(jnp.sin(y)) + jnp.sum(h * h)

  def plain_loss(layer, x, r):
    return jnp.sum(jnp.sin(jax.vmap(layer)(x + r))) + jnp.sum((x + r) ** 2)

  with expect_fallback(False):
    (y, h), state = ours(x[0], r[0], state="s")
    assert state == "s" and y.shape == h.shape == (32,)
    y, h = jax.vmap(ours)(x, r)
    got = eqx.filter_jit(eqx.filter_grad(loss))(ours, x, r)
    text = eqx.filter_jit(eqx.filter_grad(loss)).lower(ours, x, r).as_text()
  assert_launches(kernel_launches(text, "jax_normgrad_layer_norm_fwd"), 1)
  assert_trees_close(y, jax.vmap(theirs)(x + r), "y")
  np.testing.assert_array_equal(h, x + r)
  assert_trees_close(got, eqx.filter_grad(plain_loss)(theirs, x, r), "gradients")
  # bfloat16 with residual_dtype=float32; AddRMSNorm's bias (equinox's default) with a
  # 16-bit x falls back, announced.
  layer = cls(32, residual_dtype=F32)
  with expect_fallback(name == "AddRMSNorm"):
    y, h = jax.vmap(layer)(x.astype(BF16), r.astype(BF16))
  assert y.dtype == BF16 and h.dtype == F32
