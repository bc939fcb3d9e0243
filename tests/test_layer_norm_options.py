"""layer_norm's save="normalized" (InfiniOp's backward) and scale_offset, against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from cases import DTYPES, kernel_launches, random, runs_kernels
import reference_np as ref
from tolerances import assert_close

EPS = 1e-5


def _inputs(rng, shape, norm_shape, dtype, affine=True):
  x = random(rng, shape, dtype, scale=2.0, offset=0.5)
  dy = random(rng, shape, dtype)
  w = random(rng, norm_shape, dtype, offset=1.0) if affine else None
  b = random(rng, norm_shape, dtype) if affine else None
  return x, dy, w, b


def _f64(a):
  return None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


class LayerNormOptionTests:
  """The layer options suite; subclasses set ``implementation``."""

  implementation = None

  def _vjp(self, x, w, b, dy, norm_shape, **kw):
    f = jax.jit(lambda x, w, b: jn.layer_norm(x, w, b, normalized_shape=norm_shape, eps=EPS,
                                              implementation=self.implementation, **kw))
    y, vjp = jax.vjp(f, x, w, b)
    return y, vjp(dy)

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("affine", [True, False])
  def test_save_normalized(self, rng, dtype, affine):
    """Gradients from the saved xhat and rstd: InfiniOp's formula on the xhat the forward rounded to x's dtype."""
    shape, norm_shape = (3, 7, 48), (48,)
    x, dy, w, b = _inputs(rng, shape, norm_shape, dtype, affine)
    y, (gx, gw, gb) = self._vjp(x, w, b, dy, norm_shape, save="normalized")
    y_ref, mean, rstd = ref.ln_fwd(x, 1, w, b, EPS)
    assert_close(y, y_ref, dtype, 48, "y")
    xhat = np.asarray(jnp.asarray((_f64(x) - mean) * rstd, jnp.float32).astype(dtype)
                      .astype(jnp.float32), np.float64)
    dx_ref, dw_ref, db_ref = ref.ln_bwd_from_normalized(dy, w, xhat, 1 / rstd)
    assert gx.dtype == dtype
    assert_close(gx, dx_ref, dtype, 48, "grad x", scale=ref.dx_scale(dy, rstd, w))
    if affine:
      assert gw.dtype == gb.dtype == dtype
      assert_close(gw, dw_ref, dtype, 21, "grad weight")
      assert_close(gb, db_ref, dtype, 21, "grad bias")
    else:
      assert gw is None and gb is None
    if dtype == jnp.float32:  # Within float32 rounding of save="input".
      _, (ix, iw, ib) = self._vjp(x, w, b, dy, norm_shape)
      for a, e in ((gx, ix), (gw, iw), (gb, ib)):
        if e is not None:
          np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)

  def test_save_normalized_keeps_no_x(self, rng):
    """The residuals are xhat (x's dtype) and (M,) float32 rstd: neither x nor mean."""
    x, dy, w, b = _inputs(rng, (8, 32), (32,), jnp.bfloat16)
    f = lambda x, w, b: jn.layer_norm(x, w, b, save="normalized",
                                      implementation=self.implementation)
    _, vjp = jax.vjp(f, x, w, b)
    leaves = jax.tree.leaves(vjp)
    shapes = sorted((tuple(a.shape), str(a.dtype)) for a in leaves if hasattr(a, "shape"))
    assert shapes == sorted([((8, 32), "bfloat16"), ((8,), "float32"), ((32,), "bfloat16"),
                             ((32,), "bfloat16")]), shapes
    assert not any(a is x for a in leaves)
    # The lowered backward is the custom call in normalized mode.
    text = jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b)), argnums=(0, 1, 2))).lower(
        x, w, b).as_text()
    assert ((kernel_launches(text, "jax_normgrad_layer_norm_bwd") > 0)
            == runs_kernels(self.implementation))

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("save", ["input", "normalized"])
  def test_scale_offset(self, rng, dtype, save):
    shape, norm_shape = (5, 4, 6, 10), (6, 10)
    x, dy, w, b = _inputs(rng, shape, norm_shape, dtype)
    w = w - 1  # Zero-centered.
    w_eff = _f64(w) + 1.0
    y, (gx, gw, gb) = self._vjp(x, w, b, dy, norm_shape, scale_offset=1.0, save=save)
    y_ref, mean, rstd = ref.ln_fwd(x, 2, w_eff, b, EPS)
    assert_close(y, y_ref, dtype, 60, "y")
    if save == "input":
      dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, x, 2, mean, rstd, w_eff)
      assert_close(gx, dx_ref, dtype, 60, "grad x", scale=ref.dx_scale(dy, rstd, w_eff))
      assert_close(gw, dw_ref, dtype, 20, "grad weight")
      assert_close(gb, db_ref, dtype, 20, "grad bias")
    # The fwd/backward ops take the same offset.
    y2, mean2, rstd2 = jn.layer_norm_fwd(x, norm_shape, w, b, EPS, scale_offset=1.0,
                                         implementation=self.implementation)
    if self.implementation == "xla":
      # Two jnp programs, which XLA may fuse differently (on a GPU, with other FMA
      # contractions): equal to the reference, not always to the last bit of each other.
      assert_close(y2, y_ref, dtype, 60, "y of layer_norm_fwd")
    else:  # one kernel, the same forward pass in both
      np.testing.assert_array_equal(np.asarray(y2.astype(jnp.float32)),
                                    np.asarray(y.astype(jnp.float32)))
    dx, dw, db = jn.layer_norm_backward(dy, x, norm_shape, mean2, rstd2, w, b, scale_offset=1.0,
                                        implementation=self.implementation)
    dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, x, 2, mean2, rstd2, w_eff)
    assert_close(dx, dx_ref, dtype, 60, "grad_input", scale=ref.dx_scale(dy, rstd2, w_eff))
    assert_close(dw, dw_ref, dtype, 20, "grad_weight")
    assert_close(db, db_ref, dtype, 20, "grad_bias")

  def test_vmap_batched_weight(self, rng):
    x, dy, _, _ = _inputs(rng, (3, 5, 24), (24,), jnp.float32)
    w = random(rng, (3, 24), jnp.float32, offset=1.0)
    b = random(rng, (24,), jnp.float32)
    impl = self.implementation
    loss = lambda x, w, b, dy: jnp.sum(
        jn.layer_norm(x, w, b, scale_offset=0.5, save="normalized", implementation=impl) * dy)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    batched = jax.jit(jax.vmap(grad, in_axes=(0, 0, None, 0)))(x, w, b, dy)
    for i in range(3):
      for a, s in zip(batched, grad(x[i], w[i], b, dy[i])):
        np.testing.assert_allclose(a[i], s, rtol=1e-6, atol=1e-5)


class TestLayerNormOptionsDefault(LayerNormOptionTests):
  implementation = None


class TestLayerNormOptionsXla(LayerNormOptionTests):
  implementation = "xla"


class TestLayerNormOptionsPallas(LayerNormOptionTests):
  implementation = "pallas"
