"""RMSNorm ops and layer against the float64 NumPy reference, once per implementation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
import cases
from cases import DTYPES, kernel_launches, narrow, narrow_rotated, random, runs_kernels
import reference_np as ref
from tolerances import assert_close

EPS = 1e-6
# (x shape, normalized_shape, weight dtype: None = x's, False = no weight).
RMS_CASES = [
    ((7, 1000), (1000,), None),
    ((3, 5, 42), (42,), jnp.float32),
    ((4, 6, 10), (6, 10), False),
    ((9, 1), (1,), None),
    ((0, 64), (64,), None),
]


def _inputs(rng, shape, norm_shape, dtype, weight_dtype):
  x = random(rng, shape, dtype, scale=2.0, offset=0.5)
  dy = random(rng, shape, dtype)
  w = None if weight_dtype is False else random(rng, norm_shape, weight_dtype or dtype, offset=1.0)
  return x, dy, w


def _f64(a):
  return None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


class RmsNormTests:
  """The RMSNorm suite; subclasses set ``implementation``."""

  implementation = None

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("shape,norm_shape,weight_dtype", RMS_CASES)
  def test_forward(self, rng, dtype, shape, norm_shape, weight_dtype):
    x, _, w = _inputs(rng, shape, norm_shape, dtype, weight_dtype)
    y, rstd = jn.rms_norm_fwd(x, norm_shape, w, EPS, implementation=self.implementation)
    y_ref, rstd_ref = ref.rms_fwd(x, len(norm_shape), w, EPS)
    h = math.prod(norm_shape)
    assert y.dtype == dtype and rstd.dtype == jnp.float32
    assert rstd.shape == shape[:len(shape) - len(norm_shape)] + (1,) * len(norm_shape)
    assert_close(y, y_ref, dtype, h, "y")
    assert_close(rstd, rstd_ref, jnp.float32, h, "rstd")

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("shape,norm_shape,weight_dtype", RMS_CASES)
  def test_backward(self, rng, dtype, shape, norm_shape, weight_dtype):
    x, dy, w = _inputs(rng, shape, norm_shape, dtype, weight_dtype)
    _, rstd = ref.rms_fwd(x, len(norm_shape), None, EPS)
    rstd = rstd.astype(np.float32)
    dx, dw = jn.rms_norm_backward(dy, x, norm_shape, rstd, w, implementation=self.implementation)
    dx_ref, dw_ref = ref.rms_bwd(dy, x, len(norm_shape), rstd, w)
    h = math.prod(norm_shape)
    rows = math.prod(shape) // h
    pdtype = dtype if w is None else w.dtype
    assert dx.dtype == dtype and dw.dtype == pdtype and dw.shape == norm_shape
    assert_close(dx, dx_ref, dtype, h, "grad_input", scale=ref.dx_scale(dy, rstd, w))
    assert_close(dw, dw_ref, pdtype, rows, "grad_weight")

  @pytest.mark.parametrize("mask", [(True, False), (False, True), (False, False)])
  def test_output_mask(self, rng, mask):
    x, dy, w = _inputs(rng, (13, 42), (42,), jnp.float32, None)
    _, rstd = ref.rms_fwd(x, 1, None, EPS)
    outs = jn.rms_norm_backward(dy, x, 42, rstd.astype(np.float32), w, mask,
                                implementation=self.implementation)
    refs = ref.rms_bwd(dy, x, 1, rstd, w)
    for out, expected, m, reduced in zip(outs, refs, mask, (42, 13)):
      if m:
        assert_close(out, expected, jnp.float32, reduced)
      else:
        assert out is None

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  def test_scale_offset(self, rng, dtype):
    """y uses weight + scale_offset; grad_weight is sum dy * xhat, unchanged by the offset."""
    x, dy, w = _inputs(rng, (6, 5, 40), (40,), dtype, None)
    w = w - 1  # Zero-centered, as Gemma stores it.
    y, rstd = jn.rms_norm_fwd(x, 40, w, EPS, scale_offset=1.0, implementation=self.implementation)
    w_eff = _f64(w) + 1.0
    y_ref, rstd_ref = ref.rms_fwd(x, 1, w_eff, EPS)
    assert_close(y, y_ref, dtype, 40, "y")
    dx, dw = jn.rms_norm_backward(dy, x, 40, rstd, w, scale_offset=1.0,
                                  implementation=self.implementation)
    dx_ref, dw_ref = ref.rms_bwd(dy, x, 1, rstd, w_eff)
    assert_close(dx, dx_ref, dtype, 40, "grad_input", scale=ref.dx_scale(dy, rstd, w_eff))
    assert_close(dw, dw_ref, dtype, 30, "grad_weight")
    # The layer's gradients are the same ones.
    _, vjp = jax.vjp(lambda x, w: jn.rms_norm(x, w, eps=EPS, scale_offset=1.0,
                                              implementation=self.implementation), x, w)
    gx, gw = vjp(dy)
    assert_close(gx, dx_ref, dtype, 40, "layer grad x", scale=ref.dx_scale(dy, rstd, w_eff))
    assert_close(gw, dw_ref, dtype, 30, "layer grad weight")

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("with_weight", [True, False])
  def test_layer_gradients(self, rng, dtype, with_weight):
    shape, norm_shape = (3, 4, 6, 10), (6, 10)
    x, dy, w = _inputs(rng, shape, norm_shape, dtype, None if with_weight else False)
    f = jax.jit(lambda x, w: jn.rms_norm(x, w, normalized_shape=norm_shape, eps=EPS,
                                         implementation=self.implementation))
    y, vjp = jax.vjp(f, x, w)
    y_ref, rstd = ref.rms_fwd(x, 2, w, EPS)
    assert y.dtype == dtype
    assert_close(y, y_ref, dtype, 60, "y")
    gx, gw = vjp(dy)
    dx_ref, dw_ref = ref.rms_bwd(dy, x, 2, rstd, w)
    assert gx.dtype == dtype
    assert_close(gx, dx_ref, dtype, 60, "grad x", scale=ref.dx_scale(dy, rstd, w))
    if with_weight:
      assert gw.dtype == w.dtype
      assert_close(gw, dw_ref, dtype, 12, "grad weight")
    else:
      assert gw is None

  def test_vmap_batched_weight(self, rng):
    """vmap over x and a per-example weight, of the layer's gradients and of the ops."""
    x, dy, _ = _inputs(rng, (3, 5, 24), (24,), jnp.float32, None)
    w = random(rng, (3, 24), jnp.float32, offset=1.0)
    impl = self.implementation
    loss = lambda x, w, dy: jnp.sum(jn.rms_norm(x, w, scale_offset=0.5, implementation=impl) * dy)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(x, w, dy)
    fwd = lambda x, w: jn.rms_norm_fwd(x, 24, w, implementation=impl)
    bwd = lambda dy, x, r, w: jn.rms_norm_backward(dy, x, 24, r, w, implementation=impl)
    y, rstd = jax.jit(jax.vmap(fwd))(x, w)
    dx, dw = jax.jit(jax.vmap(bwd))(dy, x, rstd, w)
    for i in range(3):
      single = jax.grad(loss, argnums=(0, 1))(x[i], w[i], dy[i])
      for b, s in zip(grads, single):
        np.testing.assert_allclose(b[i], s, rtol=1e-6, atol=1e-5)
      y_i, r_i = fwd(x[i], w[i])
      np.testing.assert_allclose(y[i], y_i, rtol=1e-6, atol=1e-6)
      for b, s in zip((dx, dw), bwd(dy[i], x[i], r_i, w[i])):
        np.testing.assert_allclose(b[i], s, rtol=1e-6, atol=1e-5)

  def test_lowering(self, rng):
    """The default runs the LayerNorm custom calls (centered=False) forward and backward."""
    x, dy, w = _inputs(rng, (4, 16), (16,), jnp.float32, None)
    impl = self.implementation
    f = lambda x, w: jnp.sum(jn.rms_norm(x, w, implementation=impl) * dy)
    text = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).as_text()
    for target in ("jax_normgrad_layer_norm_fwd", "jax_normgrad_layer_norm_bwd"):
      assert (kernel_launches(text, target) > 0) == runs_kernels(impl)
    text = jax.jit(lambda: jn.rms_norm_backward(dy, x, 16, jnp.ones((4, 1)), w,
                                                implementation=impl)).lower().as_text()
    assert (kernel_launches(text, "jax_normgrad_layer_norm_bwd") > 0) == runs_kernels(impl)


class TestRmsNormDefault(RmsNormTests):
  implementation = None


class TestRmsNormXla(RmsNormTests):
  implementation = "xla"


class TestRmsNormPallas(RmsNormTests):
  """The Pallas kernels, interpreted on CPU: every case once, the dtype rotating alongside
  (the kernels only convert it), and the presence of weight rotating over the dtypes."""

  implementation = "pallas"

  @pytest.fixture(autouse=True)
  def _rotate(self, request):
    reason = "interpreted Pallas: each case once, the dtype rotating"
    narrow_rotated(request, reason, "shape,norm_shape,weight_dtype", RMS_CASES, "dtype", DTYPES)
    narrow_rotated(request, reason, "dtype", DTYPES, "with_weight", [True, False])


@cases.needs_mosaic_gpu
class TestRmsNormMosaicGpu(RmsNormTests):
  """The Mosaic GPU kernels in GPU interpret mode (CPU): float32 cases only (16-bit x is
  covered by TestLayerNormMosaicGpu, RMSNorm included), to keep the run short."""

  implementation = "mosaic_gpu"

  @pytest.fixture(autouse=True)
  def _narrow(self, request):
    narrow(request, "interpreted Mosaic GPU: float32 only", dtype=[jnp.float32])
