"""``patch()`` of jax_normgrad.flax / .nnx / .equinox: the libraries' classes replaced process-wide.

Models written against ``flax.linen.LayerNorm`` (and the others) then run the
kernels unchanged; every fallback path of a drop-in still runs the original
class's code (it is found through the class the drop-in subclasses, never
through the replaced module attribute, which would recurse).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")

import equinox as eqx  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_normgrad.equinox as je  # noqa: E402
import jax_normgrad.flax as jf  # noqa: E402
import jax_normgrad.nnx as jx  # noqa: E402
from dropin import expect_fallback, kernel_calls, normal, random_like  # noqa: E402

NAMES = ("LayerNorm", "RMSNorm", "GroupNorm")
LIBS = [  # (patching module, package, the original classes, modules that must be patched)
    (jf, "flax.linen", (jf._LayerNorm, jf._RMSNorm, jf._GroupNorm),
     ["flax.linen", "flax.linen.normalization"]),
    (jx, "flax.nnx", (jx._LayerNorm, jx._RMSNorm, jx._GroupNorm),
     ["flax.nnx", "flax.nnx.nn.normalization"]),
    (je, "equinox", (je._LayerNorm, je._RMSNorm, je._GroupNorm), ["equinox.nn"]),
]
IDS = ["linen", "nnx", "equinox"]


def _holders(package, cls):
  """``module.attr`` names under ``package`` that hold ``cls``."""
  return sorted(f"{name}.{attr}" for name, mod in list(sys.modules.items())
                if mod is not None and (name == package or name.startswith(package + "."))
                for attr, v in list(vars(mod).items()) if v is cls)


@pytest.mark.parametrize("lib,package,originals,public", LIBS, ids=IDS)
def test_patch_replaces_every_name_and_undoes(lib, package, originals, public):
  before = {name: _holders(package, orig) for name, orig in zip(NAMES, originals)}
  undo = lib.patch()
  try:
    for name, orig in zip(NAMES, originals):
      drop_in = getattr(lib, name)
      assert _holders(package, orig) == [], name  # no name left on the original
      assert _holders(package, drop_in) == before[name]
      for module in public:
        assert getattr(sys.modules[module], name) is drop_in
    assert sorted(undo.replaced) == sorted(sum(before.values(), []))
    again = lib.patch()  # idempotent: nothing more to replace
    assert again.replaced == []
    again()
    assert getattr(sys.modules[public[0]], "LayerNorm") is lib.LayerNorm
  finally:
    undo()
  for name, orig in zip(NAMES, originals):
    assert _holders(package, orig) == before[name]
    assert _holders(package, getattr(lib, name)) == []


def test_linen_attention_qk_norm_is_patched_too():
  with jf.patch():
    assert sys.modules["flax.linen.attention"].LayerNorm is jf.LayerNorm
  assert sys.modules["flax.linen.attention"].LayerNorm is jf._LayerNorm


def test_patch_is_a_context_manager_and_undo_keeps_later_changes():
  with jf.patch() as p:
    assert nn.LayerNorm is jf.LayerNorm and p.replaced
    nn.RMSNorm = "a user's own replacement"
  assert nn.LayerNorm is jf._LayerNorm
  assert nn.RMSNorm == "a user's own replacement"  # not clobbered by the undo
  nn.RMSNorm = jf._RMSNorm
  import flax.linen.normalization as norm_mod
  assert norm_mod.RMSNorm is jf._RMSNorm


# ----------------------------------------------------------------------------
# Code that names only the libraries' classes gets the kernels.


class _LinenBlock(nn.Module):
  """A module as a model library writes it: flax's names, nothing of jax_normgrad."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.Dense(x.shape[-1])(h)
    h = nn.RMSNorm()(h + x)
    return nn.GroupNorm(num_groups=4)(h[:, None, :, :])


def test_linen_model_runs_the_kernels_with_flax_parameters():
  x = normal((2, 6, 16))
  params = random_like(_LinenBlock().init(jax.random.key(0), x))
  loss = lambda p, x: jnp.sum(_LinenBlock().apply(p, x) ** 2)
  # Float32 dots: a GPU's default (TF32) would turn the norms' last-bit differences into
  # differences of 1e-3 in the gradients.
  with jax.default_matmul_precision("float32"):
    theirs = jax.grad(loss)(params, x)
  assert kernel_calls(jax.grad(loss), params, x) == 0
  with jf.patch(), jax.default_matmul_precision("float32"):
    assert kernel_calls(jax.grad(loss), params, x) >= 6  # 3 forwards + 3 backwards
    ours = jax.grad(loss)(params, x)
    assert jax.tree.structure(_LinenBlock().init(jax.random.key(0), x)) == \
        jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_nnx_model_runs_the_kernels():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln = nnx.LayerNorm(16, rngs=rngs)
      self.gn = nnx.GroupNorm(16, num_groups=4, rngs=rngs)

    def __call__(self, x):
      return self.gn(self.ln(x))

  x = normal((2, 5, 16))
  with jx.patch():
    block = Block(nnx.Rngs(0))
    assert isinstance(block.ln, jx.LayerNorm) and isinstance(block.gn, jx.GroupNorm)
    graphdef, state = nnx.split(block)
    loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x) ** 2)
    calls = kernel_calls(jax.grad(loss), state, x)
  assert calls >= 4
  assert type(Block(nnx.Rngs(0)).ln) is jx._LayerNorm


def test_equinox_model_runs_the_kernels():
  x = normal((12,))
  with je.patch():
    ln = eqx.nn.LayerNorm(12)
    assert isinstance(ln, je.LayerNorm)
    assert kernel_calls(jax.grad(lambda x: jnp.sum(ln(x) ** 2)), x) >= 2


# ----------------------------------------------------------------------------
# The fallback paths under patch(): the original's code, no recursion.


def test_linen_fallbacks_run_flax_code_under_patch():
  x = normal((3, 20))
  mask = jnp.arange(20) < 15
  xg = normal((2, 4, 4, 8))
  gmask = jnp.arange(8) < 6
  expected = {}
  for name, kw, xx, m in [("LayerNorm", {}, x, mask), ("RMSNorm", {}, x, mask),
                          ("GroupNorm", {"num_groups": 2}, xg, gmask)]:
    layer = getattr(jf, "_" + name)(**kw)
    params = random_like(layer.init(jax.random.key(0), xx))
    expected[name] = (kw, xx, m, params, layer.apply(params, xx, mask=m))
  with jf.patch():
    for name, (kw, xx, m, params, y) in expected.items():
      with expect_fallback(True):
        got = getattr(nn, name)(**kw).apply(params, xx, mask=m)
      np.testing.assert_array_equal(got, y)
    # flax's own error for a group count that does not divide C (its code, under patch)
    with pytest.raises(ValueError):
      nn.GroupNorm(num_groups=3).init(jax.random.key(0), xg)


def test_nnx_fallbacks_run_flax_code_under_patch():
  x = normal((3, 20))
  mask = jnp.arange(20) < 15
  want = {n: getattr(jx, "_" + n)(20, rngs=nnx.Rngs(0)) if n != "GroupNorm" else
          jx._GroupNorm(20, num_groups=4, rngs=nnx.Rngs(0)) for n in NAMES}
  expected = {n: layer(x, mask=mask) for n, layer in want.items()}
  with jx.patch():
    for n in NAMES:
      layer = (nnx.GroupNorm(20, num_groups=4, rngs=nnx.Rngs(0)) if n == "GroupNorm"
               else getattr(nnx, n)(20, rngs=nnx.Rngs(0)))
      assert type(layer) is getattr(jx, n)
      with expect_fallback(True):
        np.testing.assert_array_equal(layer(x, mask=mask), expected[n])


def test_equinox_fallbacks_run_equinox_code_under_patch():
  x = normal((12,))
  empty = jnp.zeros((4, 0))  # zero-sized: equinox's own code, with a warning
  expected = [je._LayerNorm(12)(x), je._GroupNorm(2, 4)(empty),
              je._RMSNorm((4, 0))(empty)]
  with je.patch():
    assert eqx.nn.LayerNorm is je.LayerNorm
    with expect_fallback(True):
      np.testing.assert_array_equal(eqx.nn.GroupNorm(2, 4)(empty), expected[1])
    with expect_fallback(True):
      np.testing.assert_array_equal(eqx.nn.RMSNorm((4, 0))(empty), expected[2])
    with expect_fallback(False):
      np.testing.assert_allclose(eqx.nn.LayerNorm(12)(x), expected[0], rtol=1e-5, atol=1e-5)
