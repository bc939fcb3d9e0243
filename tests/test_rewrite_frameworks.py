"""jax_normgrad.rewrite on the norm layers of the frameworks that install here: every norm found, values and gradients kept.

flax linen and nnx, equinox, keras 3 (JAX backend), dm-haiku and transformers'
Flax RMSNorm modules; each skips where its framework is missing. Each check
compares the rewritten function's values and gradients with the original's
(under ``jit`` and ``grad``; flax's blocks under ``nn.scan`` and ``nn.remat``,
equinox's under ``vmap``) and counts the backward kernels under ``jax.grad``.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_normgrad as jn  # noqa: E402
from test_rewrite import kernel_calls  # noqa: E402
from tolerances import ATOL32, RTOL, assert_close  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
X = jnp.asarray(np.random.default_rng(7).standard_normal((2, 4, 4, 16)) * 1.3 + 0.4, F32)


def _noise(tree, scale, seed=1):
  """The tree's leaves plus normal noise (drawn in NumPy: jax.random compiles once per shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float32) + scale * rng.standard_normal(
      np.shape(a)), jnp.asarray(a).dtype), tree)


def _same(f, params, x, norms, op_counts=None, dtype=F32):
  """f(params, x) rewritten: values and gradients (of params and x) as the original's; kernels counted.

  ``dtype``: the model's computation dtype. A bfloat16 model rounds where the
  ops do not (xhat before its scale, the statistics), so in bfloat16 a few
  roundings of the largest value are allowed (RTOL[bfloat16] relative to it).
  """
  new = jn.rewrite(f)
  out = jax.eval_shape(f, params, x)
  ct = _noise(jnp.zeros(out.shape, F32), 1.0, 11)
  loss = lambda g: lambda p, x: jnp.sum(g(p, x).astype(F32) * ct)
  wrt = (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0  # token ids: the parameters only
  both = lambda g: jax.jit(lambda p, x: (g(p, x), jax.grad(loss(g), wrt)(p, x)))(params, x)
  want, got = both(f), both(new)
  n = x.shape[-1] * 8
  unit = RTOL[jnp.dtype(BF16)] * 4 / (ATOL32 * np.sqrt(n)) if dtype == BF16 else 1.0
  # A gradient leaf is a sum of terms of the gradients' size, which may cancel (an attention
  # key's bias: zero up to rounding), so the largest gradient sets the scale of each.
  top = lambda t: max(float(np.abs(np.asarray(a, np.float32)).max()) for a in jax.tree.leaves(t))
  for name, got_t, want_t in (("value", got[0], want[0]), ("gradient", got[1], want[1])):
    scale = top(want_t) * 4 * unit
    for a, e in zip(jax.tree.leaves(got_t), jax.tree.leaves(want_t)):
      assert_close(a, e, dtype, n, name, scale=scale)
  report = jn.explain_rewrite(f, params, x)
  assert len(report.matches) == norms, str(report)
  if op_counts:
    assert report.counts() == op_counts, str(report)
  assert kernel_calls(jax.grad(loss(new), wrt), params, x, kind="bwd") == norms


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_flax_linen_under_scan_and_remat(dtype):
  """Blocks as large models stack them: ``nn.scan`` over ``nn.remat``, a residual sum that flows on."""
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.GroupNorm(num_groups=4, dtype=dtype)(x)
      h = nn.Conv(16, (1, 1), dtype=dtype)(nn.silu(h)) + x
      return (nn.RMSNorm(dtype=dtype)(nn.LayerNorm(dtype=dtype)(h)) + h).astype(x.dtype), None

  stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                  length=2)()
  x = X.astype(dtype)
  p = jax.jit(stack.init)(jax.random.key(0), x, None)
  p = _noise(p, 0.1)
  f = lambda p, x: stack.apply(p, x, None)[0]
  _same(f, p, x, 3, {"group_norm": 1, "add_layer_norm": 1, "rms_norm": 1}, dtype)
  (gn,) = [mi for mi in jn.explain_rewrite(f, p, x).matches if mi.op == "group_norm"]
  assert gn.activation == "silu" and "scan" in gn.where and "remat" in gn.where


def test_flax_nnx_and_equinox():
  nnx = pytest.importorskip("flax.nnx")
  eqx = pytest.importorskip("equinox")
  ln = nnx.LayerNorm(16, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(ln)
  _same(lambda s, x: nnx.merge(graphdef, s)(x), state, X, 1, {"layer_norm": 1})
  rms = nnx.RMSNorm(16, rngs=nnx.Rngs(0))
  graphdef2, state2 = nnx.split(rms)
  _same(lambda s, x: nnx.merge(graphdef2, s)(x), state2, X, 1, {"rms_norm": 1})
  e = eqx.nn.LayerNorm(16)
  _same(lambda m, x: jax.vmap(jax.vmap(jax.vmap(m)))(x), e, X, 1, {"layer_norm": 1})
  g = eqx.nn.GroupNorm(4, 16)  # channels first: (C, H, W) per sample
  xc = jnp.transpose(X, (0, 3, 1, 2))
  _same(lambda m, x: jax.vmap(m)(x), g, xc, 1)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_keras(policy):
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("keras runs another backend")
  layers = [keras.layers.LayerNormalization(dtype=policy), keras.layers.RMSNormalization(dtype=policy),
            keras.layers.GroupNormalization(groups=4, dtype=policy)]
  for layer in layers:
    layer.build(X.shape)
  params = [[v.value + 0.1 * jnp.arange(v.shape[0]) / v.shape[0] for v in layer.trainable_variables]
            for layer in layers]

  def f(params, x):
    for layer, p in zip(layers, params):
      x, _ = layer.stateless_call(p, [], x)
    return x

  # mixed_bfloat16: float32 statistics, each layer's result rounded to bfloat16 (the next one's x).
  _same(f, params, X, 3, {"layer_norm": 1, "rms_norm": 1, "group_norm": 1},
        BF16 if policy == "mixed_bfloat16" else F32)


def test_haiku():
  hk = pytest.importorskip("haiku")
  f = hk.without_apply_rng(hk.transform(
      lambda x: hk.RMSNorm(-1)(hk.LayerNorm(-1, True, True)(x))))
  p = f.init(jax.random.key(0), X)
  _same(f.apply, p, X, 2, {"layer_norm": 1, "rms_norm": 1})


def test_transformers_flax_rmsnorms():
  llama = pytest.importorskip("transformers.models.llama.modeling_flax_llama")
  gemma = pytest.importorskip("transformers.models.gemma.modeling_flax_gemma")
  import transformers
  for mod, cfg in ((llama.FlaxLlamaRMSNorm, transformers.LlamaConfig(hidden_size=16)),
                   (gemma.FlaxGemmaRMSNorm, transformers.GemmaConfig(hidden_size=16))):
    m = mod(cfg, dtype=jnp.bfloat16)
    x = X.astype(jnp.bfloat16)
    p = m.init(jax.random.key(0), x)
    p = _noise(p, 0.1)
    _same(lambda p, x: m.apply(p, x), p, x, 1, {"rms_norm": 1}, BF16)


def test_transformers_flax_bert():
  """A whole model: post-norm residual blocks, LayerNorm with BERT's eps of 1e-12."""
  transformers = pytest.importorskip("transformers")
  if not hasattr(transformers, "FlaxBertModel"):
    pytest.skip("transformers without its Flax models")
  cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_hidden_layers=1, vocab_size=97, max_position_embeddings=16)
  m = transformers.FlaxBertModel(cfg, _do_init=False)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 8)), jnp.int32)
  # Random parameters of the model's shapes (its own init runs op by op: seconds).
  shapes = jax.eval_shape(lambda k: m.init_weights(k, ids.shape), jax.random.key(0))
  params = _noise(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), 0.3)
  _same(lambda p, x: m(input_ids=x, params=p).last_hidden_state, params, ids, 3,
        {"layer_norm": 3})
