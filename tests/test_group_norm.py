"""GroupNorm forward/backward ops against the float64 NumPy reference, once per implementation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
import cases
from cases import DTYPES, GN_CASES, MASKS, kernel_launches, random, rotate
import reference_np as ref
from tolerances import assert_close


def _inputs(rng, shape, c, dtype, param_dtype=None, with_params=True):
  x = random(rng, shape, dtype, scale=2.0, offset=-0.3)
  dy = random(rng, shape, dtype)
  pd = param_dtype or dtype
  w = random(rng, (c,), pd, offset=1.0) if with_params else None
  b = random(rng, (c,), pd) if with_params else None
  return x, dy, w, b


class GroupNormOpTests:
  """The GroupNorm op suite; subclasses set ``implementation`` and may narrow ``argument_values``."""

  implementation = None
  argument_values = {
      "dtype": DTYPES,
      "shape,n,c,hw,group,channels_last": GN_CASES,
      "with_gamma": [True, False],
      "mask": MASKS,
      "channels_last": [False, True],
      "half_dtype": [jnp.bfloat16, jnp.float16],
      "activation,act_dtype,with_params,act_layout": [
          ("silu", jnp.float32, True, False), ("silu", jnp.bfloat16, True, True),
          ("gelu", jnp.float32, True, True), ("gelu", jnp.float16, False, False),
          ("relu", jnp.float32, False, True), ("relu", jnp.bfloat16, True, False)],
  }
  #: (N, C, HW, group) of test_output_mask, test_large_group_size and test_deterministic.
  mask_shape = (3, 12, 35, 4)
  #: (N, C, spatial, group) of test_activation.
  activation_shape = (3, 24, (5, 7), 6)
  large_group = (2, 9000, 3, 1)
  deterministic_shape = (8, 64, 1024, 8)

  def test_forward(self, rng, dtype, shape, n, c, hw, group, channels_last):
    x, _, w, b = _inputs(rng, shape, c, dtype)
    y, mean, rstd = jn.group_norm_fwd(x, w, b, n, c, hw, group, 1e-5,
                                      channels_last=channels_last,
                                      implementation=self.implementation)
    y_ref, mean_ref, rstd_ref = ref.gn_fwd(x, w, b, n, c, hw, group, 1e-5, channels_last)
    block = c // group * hw
    assert y.dtype == dtype and mean.shape == rstd.shape == (n, group)
    assert mean.dtype == rstd.dtype == jnp.float32
    assert_close(y, y_ref, dtype, block, "y")
    assert_close(mean, mean_ref, jnp.float32, block, "mean")
    assert_close(rstd, rstd_ref, jnp.float32, block, "rstd")

  def test_backward(self, rng, dtype, shape, n, c, hw, group, channels_last, with_gamma):
    x, dy, w, _ = _inputs(rng, shape, c, dtype, with_params=with_gamma)
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group, 1e-5, channels_last)
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    dx, dg, db = jn.group_norm_backward(dy, x, mean, rstd, w, n, c, hw, group,
                                        channels_last=channels_last,
                                        implementation=self.implementation)
    dx_ref, dg_ref, db_ref = ref.gn_bwd(dy, x, mean, rstd, w, n, c, hw, group, channels_last)
    assert dx.dtype == dg.dtype == db.dtype == dtype
    assert dx.shape == x.shape and dg.shape == db.shape == (c,)
    assert_close(dx, dx_ref, dtype, c // group * hw, "grad_input",
                 scale=ref.dx_scale(dy, rstd, w))
    assert_close(dg, dg_ref, dtype, n * hw, "grad_gamma")
    assert_close(db, db_ref, dtype, n * hw, "grad_beta")

  def test_output_mask(self, rng, mask, channels_last):
    n, c, hw, group = self.mask_shape
    x, dy, w, _ = _inputs(rng, (n, c * hw), c, jnp.float32)
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group, 1e-5, channels_last)
    outs = jn.group_norm_backward(dy, x, mean.astype(np.float32), rstd.astype(np.float32), w,
                                  n, c, hw, group, mask, channels_last=channels_last,
                                  implementation=self.implementation)
    refs = ref.gn_bwd(dy, x, mean, rstd, w, n, c, hw, group, channels_last)
    for out, expected, m, reduced in zip(outs, refs, mask, (c // group * hw, n * hw, n * hw)):
      if m:
        assert_close(out, expected, jnp.float32, reduced)
      else:
        assert out is None

  def test_mixed_precision(self, rng, half_dtype):
    dtype = half_dtype
    n, c, hw, group = 4, 16, 20, 4
    x, dy, w, _ = _inputs(rng, (n, c, hw), c, dtype, param_dtype=jnp.float32)
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group)
    mean_d, rstd_d = jnp.asarray(mean, dtype), jnp.asarray(rstd, dtype)
    dx, dg, db = jn.group_norm_backward(dy, x, mean_d, rstd_d, w, n, c, hw, group,
                                        implementation=self.implementation)
    assert dx.dtype == dtype and dg.dtype == db.dtype == jnp.float32
    refs = ref.gn_bwd(dy, x, np.asarray(mean_d.astype(jnp.float32)),
                      np.asarray(rstd_d.astype(jnp.float32)), w, n, c, hw, group)
    assert_close(dx, refs[0], dtype, 80)
    assert_close(dg, refs[1], jnp.float32, 80)
    assert_close(db, refs[2], jnp.float32, 80)

  def test_layer_float32_result_of_half_x(self, rng, half_dtype, channels_last):
    """out_dtype=float32: y rounded once to float32, dx in x's dtype, float32 parameter grads."""
    n, c, spatial, group = 3, 12, (5, 7), 4
    hw = 35
    shape = (n,) + spatial + (c,) if channels_last else (n, c) + spatial
    x, _, w, b = _inputs(rng, shape, c, half_dtype, param_dtype=jnp.float32)
    dy = random(rng, shape, jnp.float32)
    impl = self.implementation
    axis = -1 if channels_last else 1
    layer = lambda x, w, b: jn.group_norm(x, group, w, b, channel_axis=axis,
                                          out_dtype=jnp.float32, implementation=impl)
    y = jax.jit(layer)(x, w, b)
    grads = jax.jit(lambda *a: jax.vjp(layer, *a)[1](dy))(x, w, b)
    y_ref, mean, rstd = ref.gn_fwd(x, w, b, n, c, hw, group, 1e-5, channels_last)
    refs = ref.gn_bwd(dy, x, mean, rstd, w, n, c, hw, group, channels_last)
    assert y.dtype == jnp.float32 and grads[0].dtype == half_dtype
    assert_close(y, y_ref, jnp.float32, c // group * hw, "y",
                 scale=ref.fwd_scales(x, rstd, w)[0])
    assert_close(grads[0], refs[0], half_dtype, c // group * hw, "grad x",
                 scale=ref.dx_scale(dy, rstd, w))
    for g, r, name in zip(grads[1:], refs[1:], ("grad weight", "grad bias")):
      assert g.dtype == jnp.float32
      assert_close(g, r, jnp.float32, n * hw, name)
    if impl is None:
      text = jax.jit(lambda *a: jax.vjp(layer, *a)[1](dy)).lower(x, w, b).as_text()
      assert kernel_launches(text, "jax_normgrad_group_norm_fwd") > 0
      assert kernel_launches(text, "jax_normgrad_group_norm_bwd") > 0
      assert f"{jnp.dtype(half_dtype).name}>) -> tensor<{'x'.join(map(str, shape))}xf32>" not in text

  def test_activation(self, rng, activation, act_dtype, with_params, act_layout, act_shape=None):
    """group_norm(activation=...): y = act(z) and the gradients through it, against float64.

    z = group_norm(x) is never an output: the reference chains act'(z) into
    the float64 GroupNorm backward. Shapes with a ragged tail (C/G * HW not a
    multiple of a vector) and parameters that push z across 0.
    """
    channels_last = act_layout
    n, c, spatial, group = act_shape or self.activation_shape
    hw = math.prod(spatial)
    shape = (n,) + spatial + (c,) if channels_last else (n, c) + spatial
    x, dy, w, b = _inputs(rng, shape, c, act_dtype, param_dtype=jnp.float32,
                          with_params=with_params)
    axis = -1 if channels_last else 1
    impl = self.implementation
    layer = lambda x, w, b: jn.group_norm(x, group, w, b, channel_axis=axis,
                                          activation=activation, implementation=impl)
    y = jax.jit(layer)(x, w, b)
    grads = jax.jit(lambda *a: jax.vjp(layer, *a)[1](dy))(x, w, b)
    z, mean, rstd = ref.gn_fwd(x, w, b, n, c, hw, group, 1e-5, channels_last)
    dz = np.asarray(dy, np.float64) * ref.activation_grad(z, activation)
    refs = ref.gn_bwd(dz, x, mean, rstd, w, n, c, hw, group, channels_last)
    block = c // group * hw
    assert y.dtype == act_dtype and grads[0].dtype == act_dtype
    assert_close(y, ref.activation(z, activation), act_dtype, block, "y",
                 scale=ref.fwd_scales(x, rstd, w)[0])
    assert_close(grads[0], refs[0], act_dtype, block, "grad x", scale=ref.dx_scale(dz, rstd, w))
    if with_params:
      for g, r, name in zip(grads[1:], refs[1:], ("grad weight", "grad bias")):
        assert g.dtype == jnp.float32
        assert_close(g, r, jnp.float32, n * hw, name)
    if impl is None:
      text = jax.jit(lambda *a: jax.vjp(layer, *a)[1](dy)).lower(x, w, b).as_text()
      assert kernel_launches(text, "jax_normgrad_group_norm_bwd") > 0
      assert "exponential" not in text and "logistic" not in text and "maximum" not in text

  def test_activation_wide_rows(self, rng, channels_last):
    """SiLU through the CPU kernels' vector paths, float32 (whose backward keeps dz in dx).

    Channels-last 72 channels: the backward's sums run 64 channels as 16-wide
    vectors (avx512bf16 build), then 8-wide; NCHW rows of 105 elements.
    """
    if self.implementation is not None:
      pytest.skip("the CPU kernels' vector paths")
    self.test_activation(rng, "silu", jnp.float32, True, channels_last,
                         act_shape=(2, 72, (7, 15), 8))

  def test_large_group_size(self, rng):
    # C/group far above the vendor's 8000 limit.
    n, c, hw, group = self.large_group
    x, dy, w, _ = _inputs(rng, (n, c, hw), c, jnp.float32)
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group)
    outs = jn.group_norm_backward(dy, x, mean.astype(np.float32), rstd.astype(np.float32), w,
                                  n, c, hw, group, implementation=self.implementation)
    refs = ref.gn_bwd(dy, x, mean, rstd, w, n, c, hw, group)
    for out, e, r in zip(outs, refs, (c * hw, n * hw, n * hw)):
      assert_close(out, e, jnp.float32, r)

  def test_deterministic(self, rng, channels_last):
    """The same bits in four runs; an interpreted kernel (whose repeats give the same bits by
    construction, cases.repeats_can_differ) runs once, against the reference."""
    n, c, hw, group = self.deterministic_shape
    x, dy, w, _ = _inputs(rng, (n, c, hw), c, jnp.float32)
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group, 1e-5, channels_last)
    f = jax.jit(lambda dy, x, m, r, w: jn.group_norm_backward(
        dy, x, m, r, w, n, c, hw, group, channels_last=channels_last,
        implementation=self.implementation))
    args = (dy, x, mean.astype(np.float32), rstd.astype(np.float32), w)
    first = [np.asarray(o) for o in f(*args)]
    if not cases.repeats_can_differ(self.implementation):
      refs = ref.gn_bwd(dy, x, mean, rstd, w, n, c, hw, group, channels_last)
      for out, e, r in zip(first, refs, (c * hw, n * hw, n * hw)):
        assert_close(out, e, jnp.float32, r)
      return
    for _ in range(3):
      for a, b in zip(first, f(*args)):
        np.testing.assert_array_equal(a, np.asarray(b))


class TestGroupNormDefault(GroupNormOpTests):
  implementation = None


class TestGroupNormXla(GroupNormOpTests):
  implementation = "xla"


# Per layout, the output masks whose kernel paths differ (cases.KERNEL_MASKS): dx with
# none or one parameter gradient, and without dx one or both (test_backward has all three).
KERNEL_MASK_RUNS = [(False, (True, False, False)), (False, (False, True, False)),
                    (False, (False, True, True)), (True, (True, False, False)),
                    (True, (False, False, True)), (True, (True, False, True))]


class TestGroupNormPallas(GroupNormOpTests):
  """The Pallas kernels, interpreted on CPU: every case once, dtype and presence of
  gamma rotating; the output masks whose paths differ, in each layout; one 16-bit
  dtype beside float32 parameters."""

  implementation = "pallas"
  argument_values = {
      "dtype,with_gamma,shape,n,c,hw,group,channels_last": rotate(GN_CASES, DTYPES,
                                                                    [True, False]),
      "dtype,shape,n,c,hw,group,channels_last": rotate(GN_CASES, DTYPES),
      "channels_last,mask": KERNEL_MASK_RUNS,
      **GroupNormOpTests.argument_values,
      "half_dtype": [jnp.bfloat16],  # 16-bit x beside float32 parameters: the kernels convert
  }


# Mosaic GPU: rows of more than one 256-wide chunk in both layouts (C = 300
# channels-last, HW = 300 NCHW), NCHW segments held whole (HW = 128: a
# segment of 2 channels is one row of two chunks), and fewer rows than
# GN_CASES' largest; channels-last groups of 3 channels in 12 rows, not 105.
MOSAIC_GPU_CASES = [c if c[0] != (3, 5, 7, 12) else ((2, 2, 3, 12), 2, 12, 6, 4, True)
                    for c in GN_CASES if c[0] not in ((4, 64, 9), (5, 96, 33))] + [
    ((2, 4, 300), 2, 300, 4, 10, True),
    ((2, 8, 300), 2, 8, 300, 2, False),
    ((2, 8, 128), 2, 8, 128, 4, False),
]


@cases.needs_mosaic_gpu
class TestGroupNormMosaicGpu(GroupNormOpTests):
  """The Mosaic GPU kernels in GPU interpret mode (CPU), rotated as TestGroupNormPallas.

  The interpreter walks every row (NCHW rows are (sample, channel),
  channels-last (sample, hw)), so the cases are few rows each: GN_CASES less
  its two largest, plus two of two 256-wide chunks per row; smaller shapes
  for the masks, the long group and determinism (channels-last); each
  activation once, the layout and the presence of parameters varying.
  """

  implementation = "mosaic_gpu"
  argument_values = {
      **TestGroupNormPallas.argument_values,
      "dtype,with_gamma,shape,n,c,hw,group,channels_last": rotate(MOSAIC_GPU_CASES, DTYPES,
                                                                    [True, False]),
      "dtype,shape,n,c,hw,group,channels_last": rotate(MOSAIC_GPU_CASES, DTYPES),
      "half_dtype": [jnp.bfloat16],
      "activation,act_dtype,with_params,act_layout": [
          ("silu", jnp.float32, True, False), ("gelu", jnp.bfloat16, False, True)],
  }
  mask_shape = (2, 6, 10, 2)
  activation_shape = (2, 12, (2, 5), 3)
  large_group = (1, 40, 3, 1)
  deterministic_shape = (2, 8, 12, 2)

  # The float32 y of a 16-bit x is a conversion before the kernels (kernels.forward),
  # tested on the Mosaic GPU kernels by TestLayerNormMosaicGpu.
  test_layer_float32_result_of_half_x = None

  def test_deterministic(self, rng):
    super().test_deterministic(rng, True)  # channels-last: CTA partials and their merge
