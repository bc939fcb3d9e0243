"""The vendor forms of the LayerNorm backward (AscendC pair, InfiniOp) against their float64 formulas (docs/spec.md#the-vendors-other-forms)."""

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

EPS = 1e-5
# (x shape, statistics with a trailing 1, weight kind): AscendC's [B, S, H]
# example, other leading dims, a long row, rows of one element, no rows. The
# weight is absent ("none"), in the inputs' dtype ("same") or float32 with any
# inputs ("float32"; InfiniOp's mixed precision; gamma stays in the inputs'
# dtype for the AscendC op, whose inputs share one dtype).
GRAD_CASES = [
    ((2, 32, 16), False, "same"),
    ((3, 5, 42), True, "float32"),
    ((7, 1000), False, "none"),
    ((9, 1), True, "none"),
    ((0, 64), False, "float32"),
]
# (x shape, normalized_shape) of the InfiniOp bias gradient.
BETA_CASES = [((2, 32, 16), None), ((4, 6, 10), (6, 10)), ((0, 16), 16)]


def _exact_mean_rows(rng, shape):
  """Rows ``c + (v, -v, [0])`` in random order: every value and the row mean ``c`` exact in bfloat16.

  With the row mean exact in the inputs' dtype AscendC's step-by-step
  formula equals the compact one (its ``sum(x - mean)`` term is 0), so the
  kernel can be held to the dtype's tolerance against AscendC's formula.
  """
  h = shape[-1]
  rows = math.prod(shape[:-1])
  c = np.round(rng.uniform(-1, 1, size=(rows, 1)) * 8) / 8
  v = np.clip(np.round(rng.normal(0, 1.5, size=(rows, h // 2)) * 32) / 32, -3.9, 3.9)
  x = np.concatenate([v, -v, np.zeros((rows, h % 2))], axis=1)
  x = np.take_along_axis(x, np.argsort(rng.random((rows, h)), axis=1), axis=1) + c
  return x.reshape(shape)


def _grad_inputs(rng, shape, dtype, keepdim, exact_mean=True):
  """dy, x and the per-row variance/mean in x's dtype (all inputs share one dtype, as AscendC's)."""
  if exact_mean:
    x = jnp.asarray(_exact_mean_rows(rng, shape).astype(np.float32)).astype(dtype)
  else:
    x = random(rng, shape, dtype, scale=2.0, offset=0.5)
  dy = random(rng, shape, dtype)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  stat_shape = shape[:-1] + ((1,) if keepdim else ())
  mean = jnp.asarray(xf.mean(axis=-1).reshape(stat_shape), dtype)
  variance = jnp.asarray(xf.var(axis=-1).reshape(stat_shape), dtype)
  return dy, x, variance, mean


def _std_of(variance):
  return np.sqrt(np.asarray(jnp.asarray(variance).astype(jnp.float32), np.float64) + EPS)


class LayerNormGradTests:
  """The AscendC / InfiniOp backward suite; subclasses set ``implementation``."""

  implementation = None

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("shape,keepdim,weight_kind", GRAD_CASES)
  def test_layer_norm_grad(self, rng, dtype, shape, keepdim, weight_kind):
    dy, x, variance, mean = _grad_inputs(rng, shape, dtype, keepdim)
    gamma = random(rng, shape[-1:], dtype, offset=1.0) if weight_kind != "none" else None
    pd_x, res = jn.layer_norm_grad(dy, x, variance, mean, gamma, EPS,
                                   implementation=self.implementation)
    pd_x_ref, res_ref = ref.ln_grad_ascendc(dy, x, variance, mean, gamma, EPS)
    assert pd_x.dtype == res.dtype == dtype
    assert pd_x.shape == res.shape == shape
    h = shape[-1]
    assert_close(pd_x, pd_x_ref, dtype, h, "pd_x", scale=ref.dx_scale(dy, 1 / _std_of(variance), gamma))
    assert_close(res, res_ref, dtype, h, "res_for_gamma")

  @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
  def test_layer_norm_grad_rounded_mean(self, rng, dtype):
    """A mean rounded to 16 bits: the compact formula differs from AscendC's by its sum(x - mean) term.

    That term is ``rstd * mean(g * xhat) * mean(xhat)`` (``mean(xhat)`` is the
    mean's rounding error in units of std); beyond it, the dtype's tolerance.
    """
    shape = (4, 16, 16)
    dy, x, variance, mean = _grad_inputs(rng, shape, dtype, False, exact_mean=False)
    gamma = random(rng, (16,), dtype, offset=1.0)
    pd_x, _ = jn.layer_norm_grad(dy, x, variance, mean, gamma, EPS,
                                 implementation=self.implementation)
    pd_x_ref, res_ref = ref.ln_grad_ascendc(dy, x, variance, mean, gamma, EPS)
    g = np.asarray(dy.astype(jnp.float32), np.float64) * np.asarray(gamma.astype(jnp.float32))
    rstd = 1 / _std_of(variance)[..., None]
    ascendc_only = rstd * (g * res_ref).mean(-1, keepdims=True) * res_ref.mean(-1, keepdims=True)
    assert np.max(np.abs(ascendc_only)) > 0  # The case is not vacuous.
    assert_close(pd_x, pd_x_ref - ascendc_only, dtype, 16, "pd_x", scale=ref.dx_scale(dy, rstd, gamma))

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("shape,norm_shape", BETA_CASES)
  def test_layer_norm_grad_beta(self, rng, dtype, shape, norm_shape):
    dy = random(rng, shape, dtype)
    res = random(rng, shape, dtype)
    pd_gamma, pd_beta = jn.layer_norm_grad_beta(dy, res, norm_shape,
                                                implementation=self.implementation)
    ndim = 1 if norm_shape is None or isinstance(norm_shape, int) else len(norm_shape)
    g_ref, b_ref = ref.ln_grad_beta_ascendc(dy, res, ndim)
    assert pd_gamma.dtype == pd_beta.dtype == jnp.float32
    assert pd_gamma.shape == pd_beta.shape == shape[len(shape) - ndim:]
    rows = math.prod(shape[:len(shape) - ndim])
    assert_close(pd_gamma, g_ref, jnp.float32, rows, "pd_gamma")
    assert_close(pd_beta, b_ref, jnp.float32, rows, "pd_beta")

  def test_pair_gives_layer_norm_backward(self, rng):
    """LayerNormGrad + LayerNormGradBeta == layer_norm_backward on the same statistics."""
    dy, x, variance, mean = _grad_inputs(rng, (6, 7, 40), jnp.float32, False)
    gamma = random(rng, (40,), jnp.float32, offset=1.0)
    pd_x, res = jn.layer_norm_grad(dy, x, variance, mean, gamma, EPS,
                                   implementation=self.implementation)
    pd_gamma, pd_beta = jn.layer_norm_grad_beta(dy, res, implementation=self.implementation)
    rstd = 1 / jnp.sqrt(variance + EPS)
    dx, dw, db = jn.layer_norm_backward(dy, x, 40, mean, rstd, gamma, gamma,
                                        implementation=self.implementation)
    np.testing.assert_allclose(pd_x, dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pd_gamma, dw, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(pd_beta, db, rtol=1e-6, atol=1e-5)

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("shape,keepdim,weight_kind", GRAD_CASES)
  def test_from_normalized(self, rng, dtype, shape, keepdim, weight_kind):
    dy, x, variance, mean = _grad_inputs(rng, shape, dtype, keepdim)
    std = jnp.asarray(_std_of(variance), jnp.float32 if keepdim else dtype)
    xhat = ((x.astype(jnp.float32) - mean.reshape(shape[:-1] + (1,)).astype(jnp.float32))
            / std.reshape(shape[:-1] + (1,)).astype(jnp.float32)).astype(dtype)
    wd = {"none": None, "same": dtype, "float32": jnp.float32}[weight_kind]
    weight = random(rng, shape[-1:], wd, offset=1.0) if wd else None
    dx, dw, db = jn.layer_norm_backward_from_normalized(dy, weight, xhat, std,
                                                        implementation=self.implementation)
    dx_ref, dw_ref, db_ref = ref.ln_bwd_from_normalized(dy, weight, xhat, std)
    pdtype = wd or dtype
    assert dx.dtype == dtype and dw.dtype == db.dtype == pdtype
    assert dx.shape == shape and dw.shape == db.shape == shape[-1:]
    h, rows = shape[-1], math.prod(shape[:-1])
    assert_close(dx, dx_ref, dtype, h, "grad_input",
                 scale=ref.dx_scale(dy, 1 / np.asarray(std.astype(jnp.float32)), weight))
    assert_close(dw, dw_ref, pdtype, rows, "grad_weight")
    assert_close(db, db_ref, pdtype, rows, "grad_bias")

  def test_jit_and_vmap(self, rng):
    """vmap (a batched gamma included) and jit equal a loop of single calls."""
    impl = self.implementation
    dy, x, variance, mean = _grad_inputs(rng, (3, 4, 5, 24), jnp.float32, False)
    gamma = random(rng, (3, 24), jnp.float32, offset=1.0)
    std = jnp.sqrt(variance + EPS)
    fns = {
        "grad": (lambda dy, x, v, m, g: jn.layer_norm_grad(dy, x, v, m, g, EPS, implementation=impl),
                 (dy, x, variance, mean, gamma)),
        "grad_beta": (lambda dy, x: jn.layer_norm_grad_beta(dy, x, implementation=impl), (dy, x)),
        "from_normalized": (
            lambda dy, g, x, s: jn.layer_norm_backward_from_normalized(dy, g, x, s, implementation=impl),
            (dy, gamma, x, std)),
    }
    for name, (f, args) in fns.items():
      batched = jax.jit(jax.vmap(f))(*args)
      for i in range(3):
        single = f(*(a[i] for a in args))
        for b, s in zip(batched, single):
          np.testing.assert_allclose(b[i], s, rtol=1e-6, atol=1e-5, err_msg=name)
    # vmap over a non-leading axis of x with shared statistics layout.
    f = lambda dy, x: jn.layer_norm_grad_beta(dy, x, implementation=impl)
    out = jax.vmap(f, in_axes=(1, 1))(dy, x)
    for i in range(4):
      for b, s in zip(out, f(dy[:, i], x[:, i])):
        np.testing.assert_allclose(b[i], s, rtol=1e-6, atol=1e-5)

  def test_lowering(self, rng):
    """The default really runs the backward custom call on CPU; "xla" does not."""
    dy, x, variance, mean = _grad_inputs(rng, (2, 3, 8), jnp.float32, False)
    gamma = jnp.ones((8,), jnp.float32)
    impl = self.implementation
    fns = [
        (lambda: jn.layer_norm_grad(dy, x, variance, mean, gamma, EPS, implementation=impl)),
        (lambda: jn.layer_norm_grad_beta(dy, x, implementation=impl)),
        (lambda: jn.layer_norm_backward_from_normalized(dy, gamma, x, variance + 1,
                                                        implementation=impl)),
    ]
    for f in fns:
      text = jax.jit(f).lower().as_text()
      assert (kernel_launches(text, "jax_normgrad_layer_norm_bwd") > 0) == runs_kernels(impl)


class TestLayerNormGradDefault(LayerNormGradTests):
  implementation = None


class TestLayerNormGradXla(LayerNormGradTests):
  implementation = "xla"


class TestLayerNormGradPallas(LayerNormGradTests):
  """The Pallas kernels, interpreted on CPU: every case once, the dtype rotating alongside
  (the kernels only convert it)."""

  implementation = "pallas"

  @pytest.fixture(autouse=True)
  def _rotate(self, request):
    reason = "interpreted Pallas: each case once, the dtype rotating"
    narrow_rotated(request, reason, "shape,keepdim,weight_kind", GRAD_CASES, "dtype", DTYPES)
    narrow_rotated(request, reason, "shape,norm_shape", BETA_CASES, "dtype", DTYPES)


@cases.needs_mosaic_gpu
class TestLayerNormGradMosaicGpu(LayerNormGradTests):
  """The Mosaic GPU kernels in GPU interpret mode (CPU): float32 cases only, and vmap left
  to the other suites, to keep the run short."""

  implementation = "mosaic_gpu"

  @pytest.fixture(autouse=True)
  def _narrow(self, request):
    narrow(request, "interpreted Mosaic GPU: float32 only, no vmap", tests=("test_jit_and_vmap",),
           dtype=[jnp.float32])
