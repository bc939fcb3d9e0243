"""LayerNorm forward/backward ops against the float64 NumPy reference, once per implementation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
import cases
from cases import DTYPES, KERNEL_MASKS, LN_CASES, LONG_ROW, MASKS, kernel_launches, random, rotate
import reference_np as ref
from tolerances import assert_close


def _inputs(rng, shape, norm_shape, dtype, weight_dtype=None, with_bias=True):
  x = random(rng, shape, dtype, scale=2.0, offset=0.5)
  dy = random(rng, shape, dtype)
  wd = weight_dtype or dtype
  w = random(rng, norm_shape, wd, offset=1.0) if weight_dtype is not False else None
  b = random(rng, norm_shape, wd) if with_bias and weight_dtype is not False else None
  return x, dy, w, b



def _check_forward_rows(x, w, b):
  """LayerNorm's and RMSNorm's forward over x's last axis against the float64 reference."""
  h, dtype = x.shape[-1], x.dtype
  y, mean, rstd = jn.layer_norm_fwd(x, (h,), w, b)
  y_ref, mean_ref, rstd_ref = ref.ln_fwd(x, 1, w, b, 1e-5)
  y_scale, mean_scale, rstd_scale = ref.fwd_scales(x, rstd_ref, w)
  assert_close(y, y_ref, dtype, h, "y", scale=y_scale)
  assert_close(mean, mean_ref, jnp.float32, h, "mean", scale=mean_scale)
  assert_close(rstd, rstd_ref, jnp.float32, h, "rstd", scale=rstd_scale)
  y, rs = jn.rms_norm_fwd(x, (h,), w)
  y_ref, rs_ref = ref.rms_fwd(x, 1, w)
  assert_close(y, y_ref, dtype, h, "rms y")
  assert_close(rs, rs_ref, jnp.float32, h, "rms rstd")

class LayerNormOpTests:
  """The LayerNorm op suite; subclasses set ``implementation`` and may narrow ``argument_values``."""

  implementation = None
  argument_values = {
      "dtype": DTYPES,
      "shape,norm_shape": LN_CASES,
      "with_weight": [True, False],
      "mask": MASKS,
      "half_dtype": [jnp.bfloat16, jnp.float16],
  }
  long_row = LONG_ROW
  #: Enough rows for many tasks and per-task dweight partials.
  deterministic_shape = (4099, 257)
  #: Shapes of the float32-result layer test (16-bit x, float32 parameters).
  mixed_shapes = [((33, 130), (130,)), ((3, 5, 2, 35), (2, 35))]

  def test_forward(self, rng, dtype, shape, norm_shape):
    x, _, w, b = _inputs(rng, shape, norm_shape, dtype)
    y, mean, rstd = jn.layer_norm_fwd(x, norm_shape, w, b, eps=1e-5,
                                      implementation=self.implementation)
    y_ref, mean_ref, rstd_ref = ref.ln_fwd(x, len(norm_shape), w, b, 1e-5)
    h = math.prod(norm_shape)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == jnp.float32
    assert mean.shape == rstd.shape == shape[:len(shape) - len(norm_shape)] + (1,) * len(norm_shape)
    assert_close(y, y_ref, dtype, h, "y")
    assert_close(mean, mean_ref, jnp.float32, h, "mean")
    assert_close(rstd, rstd_ref, jnp.float32, h, "rstd")

  def test_backward(self, rng, dtype, shape, norm_shape, with_weight):
    x, dy, w, b = _inputs(rng, shape, norm_shape, dtype, None if with_weight else False)
    mean, rstd = ref.ln_stats(x, len(norm_shape), 1e-5)
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    dx, dw, db = jn.layer_norm_backward(dy, x, norm_shape, mean, rstd, w, b,
                                        implementation=self.implementation)
    dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, x, len(norm_shape), mean, rstd, w)
    h = math.prod(norm_shape)
    rows = math.prod(shape) // max(h, 1) if h else 0
    assert dx.dtype == dtype and dw.dtype == db.dtype == dtype
    assert dw.shape == db.shape == norm_shape
    assert_close(dx, dx_ref, dtype, h, "grad_input", scale=ref.dx_scale(dy, rstd, w))
    assert_close(dw, dw_ref, dtype, rows, "grad_weight")
    assert_close(db, db_ref, dtype, rows, "grad_bias")

  def test_output_mask(self, rng, mask):
    shape, norm_shape = (13, 42), (42,)
    x, dy, w, b = _inputs(rng, shape, norm_shape, jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    outs = jn.layer_norm_backward(dy, x, norm_shape, mean.astype(np.float32),
                                  rstd.astype(np.float32), w, b, mask,
                                  implementation=self.implementation)
    refs = ref.ln_bwd(dy, x, 1, mean, rstd, w)
    for out, expected, m, reduced in zip(outs, refs, mask, (42, 13, 13)):
      if m:
        assert_close(out, expected, jnp.float32, reduced)
      else:
        assert out is None

  @pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:invalid value encountered")
  def test_no_leading_dims(self, rng, mask):
    # x is one row (lead 0), also an empty one: the (0,) row operand must not
    # be taken for an empty placeholder (a hypothesis find).
    for h in (5, 0):
      x, dy, w, b = _inputs(rng, (h,), (h,), jnp.float32)
      mean, rstd = ref.ln_stats(x, 1, 1e-5)
      outs = jn.layer_norm_backward(dy, x, (h,), mean.astype(np.float32),
                                    rstd.astype(np.float32), w, b, mask,
                                    implementation=self.implementation)
      for out, expected, m in zip(outs, ref.ln_bwd(dy, x, 1, mean, rstd, w), mask):
        assert (out is None) == (not m)
        if m:
          assert out.shape == (h,)
          assert_close(out, expected, jnp.float32, max(h, 1))
    y, mean, rstd = jn.layer_norm_fwd(x := random(rng, (7,), jnp.float32), (7,),
                                      implementation=self.implementation)
    y_ref, mean_ref, rstd_ref = ref.ln_fwd(x, 1, None, None, 1e-5)
    assert mean.shape == rstd.shape == (1,)
    assert_close(y, y_ref, jnp.float32, 7, "y")
    assert_close(rstd, rstd_ref, jnp.float32, 7, "rstd")

  def test_mixed_precision_weight_and_stats_in_x_dtype(self, rng, half_dtype):
    dtype = half_dtype
    shape, norm_shape = (33, 130), (130,)
    x, dy, w, b = _inputs(rng, shape, norm_shape, dtype, weight_dtype=jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    # Statistics in x's dtype are accepted too.
    mean_d, rstd_d = jnp.asarray(mean, dtype), jnp.asarray(rstd, dtype)
    dx, dw, db = jn.layer_norm_backward(dy, x, norm_shape, mean_d, rstd_d, w, b,
                                        implementation=self.implementation)
    assert dx.dtype == dtype and dw.dtype == db.dtype == jnp.float32
    refs = ref.ln_bwd(dy, x, 1, np.asarray(mean_d.astype(jnp.float32)),
                      np.asarray(rstd_d.astype(jnp.float32)), w)
    assert_close(dx, refs[0], dtype, 130)
    assert_close(dw, refs[1], jnp.float32, 33)
    assert_close(db, refs[2], jnp.float32, 33)

  @pytest.mark.parametrize("centered", [True, False])
  @pytest.mark.parametrize("widen", [True, False], ids=["f32_y_of_half_x", "half_y_of_f32_x"])
  def test_layer_mixed_result_dtype(self, rng, half_dtype, centered, widen):
    """out_dtype not x's: y rounded once from float32 statistics, its cotangent read in y's
    dtype, the gradient of x in x's dtype, float32 parameter gradients.

    ``widen``: a float32 y of a 16-bit x (what Flax computes for a 16-bit x
    with float32 parameters). Else a 16-bit y of a float32 x (a float32
    residual stream's norm feeding 16-bit matmuls). On the default path no
    tensor-sized convert runs: the CPU kernels read x and dy and write y
    each in its own dtype.
    """
    x_dtype, y_dtype = (half_dtype, jnp.float32) if widen else (jnp.float32, half_dtype)
    for shape, norm_shape in self.mixed_shapes:
      x, _, w, b = _inputs(rng, shape, norm_shape, x_dtype, weight_dtype=jnp.float32,
                           with_bias=centered)
      dy = random(rng, shape, y_dtype)  # y's cotangent is in y's dtype
      nd = len(norm_shape)
      impl = self.implementation
      if centered:
        layer = lambda x, w, b: jn.layer_norm(x, w, b, normalized_shape=norm_shape,
                                              out_dtype=y_dtype, implementation=impl)
        args = (x, w, b)
        y_ref, mean, rstd = ref.ln_fwd(x, nd, w, b)
        refs = ref.ln_bwd(dy, x, nd, mean, rstd, w)
      else:
        layer = lambda x, w: jn.rms_norm(x, w, normalized_shape=norm_shape, eps=1e-5,
                                         out_dtype=y_dtype, implementation=impl)
        args = (x, w)
        y_ref, rstd = ref.rms_fwd(x, nd, w, 1e-5)
        refs = ref.rms_bwd(dy, x, nd, rstd, w)
      f = jax.jit(lambda *a: jax.vjp(layer, *a)[1](dy))
      y = jax.jit(layer)(*args)
      grads = f(*args)
      h, rows = math.prod(norm_shape), math.prod(shape[:len(shape) - nd])
      assert y.dtype == y_dtype and grads[0].dtype == x_dtype
      assert_close(y, y_ref, y_dtype, h, "y", scale=ref.fwd_scales(x, rstd, w)[0])
      assert_close(grads[0], refs[0], x_dtype, h, "grad x", scale=ref.dx_scale(dy, rstd, w))
      for g, r, name in zip(grads[1:], refs[1:], ("grad weight", "grad bias")):
        assert g.dtype == jnp.float32
        assert_close(g, r, jnp.float32, rows, name)
      if impl is None:
        text = f.lower(*args).as_text()
        assert kernel_launches(text, "jax_normgrad_layer_norm_fwd") > 0
        assert kernel_launches(text, "jax_normgrad_layer_norm_bwd") > 0
        shapes = ("x".join(map(str, (rows, h))) + "x", "x".join(map(str, shape)) + "x")
        assert not [l for l in text.splitlines()
                    if "stablehlo.convert" in l and any(f"<{d}" in l for d in shapes)]

  def test_bias_only_sets_param_grad_dtype(self, rng):
    x, dy, _, b = _inputs(rng, (5, 24), (24,), jnp.bfloat16, weight_dtype=jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    _, dw, db = jn.layer_norm_backward(dy, x, 24, mean.astype(np.float32),
                                       rstd.astype(np.float32), None, b,
                                       implementation=self.implementation)
    assert dw.dtype == db.dtype == jnp.float32

  def test_stats_of_any_shape(self, rng):
    x, dy, w, b = _inputs(rng, (4, 6, 10), (10,), jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    flat = jn.layer_norm_backward(dy, x, (10,), mean.reshape(24).astype(np.float32),
                                  rstd.reshape(2, 12).astype(np.float32), w, b,
                                  implementation=self.implementation)
    expected = ref.ln_bwd(dy, x, 1, mean, rstd, w)
    for out, e, r in zip(flat, expected, (10, 24, 24)):
      assert_close(out, e, jnp.float32, r)

  def test_long_row(self, rng):
    shape, norm_shape = self.long_row
    x, dy, w, b = _inputs(rng, shape, norm_shape, jnp.float32)
    y, mean, rstd = jn.layer_norm_fwd(x, norm_shape, w, b, implementation=self.implementation)
    y_ref, mean_ref, rstd_ref = ref.ln_fwd(x, 1, w, b)
    assert_close(y, y_ref, jnp.float32, shape[1])
    assert_close(rstd, rstd_ref, jnp.float32, shape[1])
    dx, dw, db = jn.layer_norm_backward(dy, x, norm_shape, mean, rstd, w, b,
                                        implementation=self.implementation)
    refs = ref.ln_bwd(dy, x, 1, mean, rstd, w)
    assert_close(dx, refs[0], jnp.float32, shape[1])
    assert_close(dw, refs[1], jnp.float32, 2)
    assert_close(db, refs[2], jnp.float32, 2)

  def test_deterministic(self, rng):
    """The same bits in four runs; an interpreted kernel (whose repeats give the same bits by
    construction, cases.repeats_can_differ) runs once, against the reference."""
    shape = self.deterministic_shape
    x, dy, w, b = _inputs(rng, shape, shape[1:], jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    args = (dy, x, shape[1], mean.astype(np.float32), rstd.astype(np.float32), w, b)
    f = jax.jit(lambda *a: jn.layer_norm_backward(*a[:2], shape[1], *a[3:],
                                                  implementation=self.implementation))
    first = [np.asarray(o) for o in f(*args)]
    if not cases.repeats_can_differ(self.implementation):
      for out, e, r in zip(first, ref.ln_bwd(dy, x, 1, mean, rstd, w),
                           (shape[1], shape[0], shape[0])):
        assert_close(out, e, jnp.float32, r)
      return
    for _ in range(3):
      again = f(*args)
      for a, b_ in zip(first, again):
        np.testing.assert_array_equal(a, np.asarray(b_))


class TestLayerNormDefault(LayerNormOpTests):
  implementation = None
  # Also long rows, which the CPU kernels split into column chunks.
  mixed_shapes = LayerNormOpTests.mixed_shapes + [((2, 40_000), (40_000,))]

  # Rows of at least 2 * 16,384 that the CPU kernels split into column chunks
  # (ColumnChunkedBwd, LayerNormFwdChunked): fewer than 4 rows per parameter
  # group, or (backward only) x and dy within 32 MiB with a row's x and dy
  # over half the L2 (5 rows of 131,075: over 1 MiB, so on any CPU; 6 of
  # 40,007 take row tasks where the L2 is over 640 KiB).
  FEW_LONG_ROWS = [((3, 40_007), jnp.float32), ((1, 2, 33_001), jnp.bfloat16),
                   ((6, 40_007), jnp.float32), ((5, 131_075), jnp.float32)]

  def test_long_rows_by_row_tasks(self, rng):
    # x and dy over 32 MiB: long rows go to row tasks with per-task partials.
    shape = (9, 1_000_003)
    x, dy, w, b = _inputs(rng, shape, shape[1:], jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    outs = jn.layer_norm_backward(dy, x, shape[1:], mean, rstd, w, b)
    refs = ref.ln_bwd(dy, x, 1, mean, rstd, w)
    for out, e, reduced in zip(outs, refs, (shape[1], 9, 9)):
      assert_close(out, e, jnp.float32, reduced)

  def test_few_long_rows_every_mask(self, rng, mask):
    for shape, dtype in self.FEW_LONG_ROWS:
      h, rows = shape[-1], math.prod(shape[:-1])
      x, dy, w, b = _inputs(rng, shape, (h,), dtype)
      mean, rstd = ref.ln_stats(x, 1, 1e-5)
      mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
      outs = jn.layer_norm_backward(dy, x, (h,), mean, rstd, w, b, mask)
      refs = ref.ln_bwd(dy, x, 1, mean, rstd, w)
      scales = (ref.dx_scale(dy, rstd, w), None, None)
      for out, expected, m, reduced, scale in zip(outs, refs, mask, (h, rows, rows), scales):
        assert (out is None) == (not m)
        if m:
          assert_close(out, expected, dtype, reduced, scale=scale)
      # RMSNorm runs the same kernel without the mean terms.
      rs = ref.rms_fwd(x, 1, w)[1].astype(np.float32)
      got = jn.rms_norm_backward(dy, x, (h,), rs, w, mask[:2])
      for out, expected, m in zip(got, ref.rms_bwd(dy, x, 1, rs, w), mask[:2]):
        if m:
          assert_close(out, expected, dtype, h if out.shape == x.shape else rows)

  def test_long_rows_forward_by_row_tasks(self, rng):
    # Rows of over 64 KiB, 4 or more of them: row tasks whose statistics come
    # from L1-sized chunks merged per row (csrc/moments.h ChunkedMoments),
    # lengths not a multiple of the chunk, offsets that a naive merge loses,
    # and a trend along the row, so the chunks' means differ and the merge's
    # between-chunk term matters.
    for (shape, dtype), offset in zip((((5, 20_011), jnp.float32), ((4, 40_007), jnp.bfloat16)),
                                      (1000.0, 30.0)):
      h = shape[-1]
      x = random(rng, shape, jnp.float32, scale=2.0, offset=offset)
      x = (x + jnp.linspace(-6.0, 6.0, h, dtype=jnp.float32)).astype(dtype)
      w, b = random(rng, (h,), dtype, offset=1.0), random(rng, (h,), dtype)
      _check_forward_rows(x, w, b)

  def test_few_long_rows_forward(self, rng):
    for (shape, dtype), offset in zip(self.FEW_LONG_ROWS, (1000.0, 0.5, 3.0)):
      h = shape[-1]
      # A large offset: the chunk moments must merge without cancellation.
      x = random(rng, shape, dtype, scale=2.0, offset=offset)
      w, b = random(rng, (h,), dtype, offset=1.0), random(rng, (h,), dtype)
      _check_forward_rows(x, w, b)
      # save="normalized": the forward also writes xhat.
      g = jax.grad(lambda x, w, b: jnp.vdot(jn.layer_norm(x, w, b, save="normalized")
                                            .astype(jnp.float32), jnp.ones(shape)), (0, 1, 2))
      g_ref = jax.grad(lambda x, w, b: jnp.vdot(jn.layer_norm(x, w, b, implementation="xla")
                                                .astype(jnp.float32), jnp.ones(shape)), (0, 1, 2))
      for a, e in zip(g(x, w, b), g_ref(x, w, b)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32),
                                   rtol=0.05, atol=0.05 * float(jnp.max(jnp.abs(e))))

  def test_few_long_rows_deterministic_and_per_example_weights(self, rng):
    shape = (2, 40_007)
    x, dy, w, b = _inputs(rng, shape, shape[1:], jnp.float32)
    mean, rstd = ref.ln_stats(x, 1, 1e-5)
    args = (dy, x, mean.astype(np.float32), rstd.astype(np.float32), w, b)
    f = jax.jit(lambda dy, x, m, r, w, b: jn.layer_norm_backward(dy, x, shape[1], m, r, w, b))
    first = [np.asarray(o) for o in f(*args)]
    for _ in range(3):
      for a, b_ in zip(first, f(*args)):
        np.testing.assert_array_equal(a, np.asarray(b_))
    # vmap with a weight per example: two parameter groups of one row each.
    ws = np.stack([w, w[::-1]])
    got = jax.vmap(lambda dy, x, m, r, w: jn.layer_norm_backward(dy[None], x[None], shape[1],
                                                                  m[None], r[None], w, b))(
        dy, x, args[2].reshape(2), args[3].reshape(2), ws)
    for i in range(2):
      expected = ref.ln_bwd(dy[i:i + 1], x[i:i + 1], 1, args[2][i:i + 1], args[3][i:i + 1], ws[i])
      for out, e, reduced in zip(got, expected, (shape[1], 1, 1)):
        assert_close(out[i].reshape(e.shape), e, jnp.float32, reduced)
    # And the forward, per example.
    y = jax.vmap(lambda x, w: jn.layer_norm_fwd(x[None], shape[1], w, b)[0])(x, ws)
    for i in range(2):
      assert_close(y[i], ref.ln_fwd(x[i:i + 1], 1, ws[i], b, 1e-5)[0], jnp.float32, shape[1])


class TestLayerNormXla(LayerNormOpTests):
  implementation = "xla"


class TestLayerNormPallas(LayerNormOpTests):
  """The Pallas kernels, interpreted on CPU (about 1.5 s of compilation per test).

  Every case once, with the dtype and the presence of weight rotating rather
  than multiplied out; the output masks whose kernel paths differ; a
  70,000-long row (chunked: longer than one tile) for the 1,000,003-long one;
  fewer rows for determinism; the mixed result dtypes with one 16-bit dtype
  (the kernels only convert) on one shape (the op reshapes the other).
  """

  implementation = "pallas"
  argument_values = {
      "dtype,with_weight,shape,norm_shape": rotate(LN_CASES, DTYPES, [True, False]),
      "dtype,shape,norm_shape": rotate(LN_CASES, DTYPES),
      **LayerNormOpTests.argument_values,
      "mask": KERNEL_MASKS,
      "half_dtype": [jnp.bfloat16],
  }
  long_row = ((2, 70_000), (70_000,))
  deterministic_shape = (515, 257)
  mixed_shapes = [((5, 130), (130,))]


MOSAIC_GPU_CASES = [c for c in LN_CASES if c[0] != (301, 257)]


@cases.needs_mosaic_gpu
class TestLayerNormMosaicGpu(LayerNormOpTests):
  """The Mosaic GPU kernels in Pallas' GPU interpret mode on CPU (threads, SMEM, TMA and
  barriers simulated).

  Every case once but the 301 x 257 one (the interpreter walks each row;
  ``deterministic_shape`` has those 257-long rows, padded to two chunks, with
  many rows per CTA), the dtype and the presence of weight rotating; the
  output masks and mixed result dtypes as TestLayerNormPallas.
  """

  implementation = "mosaic_gpu"
  argument_values = {
      **TestLayerNormPallas.argument_values,
      "dtype,with_weight,shape,norm_shape": rotate(MOSAIC_GPU_CASES, DTYPES, [True, False]),
      "dtype,shape,norm_shape": rotate(MOSAIC_GPU_CASES, DTYPES),
      "half_dtype": [jnp.bfloat16],
  }
  long_row = ((2, 4_100), (4_100,))
  deterministic_shape = (37, 257)  # 13 rows per CTA, padded to 512 columns
  mixed_shapes = TestLayerNormPallas.mixed_shapes

  @pytest.fixture(autouse=True)
  def _narrow(self, request):
    # The float32 y of a 16-bit x is a conversion before the kernels (kernels.forward):
    # once, centered, is enough for the interpreted kernels.
    cases.narrow(request, "interpreted Mosaic GPU: the float32 result once, centered",
                 centered=[True])


def _moments_rows(rng, rows, h, offset):
  """Rows whose statistics test the forward's moments (csrc/moments.h RowMoments): a mean that
  dwarfs the spread (the one-pass shifted sums must not cancel), a first element 1000 standard
  deviations off (the one-pass form would lose most bits there: the second pass must take
  over), a constant row (variance 0) and, for float32, values whose squared distance from the
  first element overflows float32 while the two-pass sum of squares does not."""
  base = rng.normal(offset, 1.0, size=(rows, h))
  outlier = base.copy()
  outlier[:, 0] = offset + 1000.0
  const = np.full((rows, h), offset)
  huge = np.zeros((rows, h))
  huge[:, 0], huge[:, 1] = 1.2e19, -1.2e19
  return {"offset": base, "outlier": outlier, "constant": const, "huge": huge}


@pytest.mark.parametrize("h", [512, 40_007])  # rows in cache; long rows by L1 chunks
def test_moments_one_pass_where_exact_else_two(rng, h):
  """The forward's mean and rstd stay within float32 accumulation error of the float64 ones on
  rows where one-pass moments cancel, in every op that shares them (LayerNorm, its residual
  form, GroupNorm's channels-first blocks); the CPU kernels switch to two passes there."""
  rows, tight = 3, 2e-6 * math.sqrt(h)
  for kind, x in _moments_rows(rng, rows, h, 1e4).items():
    if h > 512 and kind != "huge":  # also at a chunk's start (moments.h kMomentsChunk = 2048)
      x[:, 2048] = x[:, 0]
    x32 = jnp.asarray(x.astype(np.float32))
    y, mean, rstd = jn.layer_norm_fwd(x32, (h,), None, None)
    y_ref, mean_ref, rstd_ref = ref.ln_fwd(x32, 1, None, None, 1e-5)
    for got, expected in ((rstd, rstd_ref), (mean, mean_ref)):
      np.testing.assert_allclose(np.asarray(got).reshape(rows), expected.reshape(rows), rtol=tight,
                                 err_msg=kind)
    y_scale = ref.fwd_scales(x32, rstd_ref)[0]  # x - mean keeps the float32 mean's rounding
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=tight * y_scale, err_msg=kind)
    if kind == "constant":
      np.testing.assert_array_equal(np.asarray(mean).reshape(rows), x[:, 0].astype(np.float32))
      np.testing.assert_array_equal(np.asarray(y), 0.0)
    # The residual form: the moments of the float32 sum x + residual, summed as they are read.
    r = rng.normal(0.0, 1.0, size=x.shape).astype(np.float32)
    xr = (x32 - r) if kind != "huge" else x32
    r = r if kind != "huge" else np.zeros_like(r)
    h32 = np.asarray(xr) + r  # the kernel's float32 sum
    y_add, h_add = jn.add_layer_norm(xr, jnp.asarray(r))
    np.testing.assert_array_equal(np.asarray(h_add), h32)
    ya_ref, _, ra_ref = ref.ln_fwd(h32, 1, None, None, 1e-5)
    np.testing.assert_allclose(np.asarray(y_add), ya_ref, rtol=0,
                               atol=tight * ref.fwd_scales(h32, ra_ref)[0], err_msg=kind)
    if kind != "constant":  # its rstd: y's slope against h, free of the mean's rounding
      hc = h32 - h32.mean(axis=1, keepdims=True, dtype=np.float64)
      slope = (np.asarray(y_add, np.float64) * hc).sum(axis=1) / (hc * hc).sum(axis=1)
      np.testing.assert_allclose(slope, ra_ref.reshape(rows), rtol=tight, err_msg=kind)
    if kind == "huge" or h > 512:
      continue
    # GroupNorm, channels first: each (n, group) block is a row of x's memory.
    gx = x32.reshape(rows, 4, h // 4)
    gy, gmean, grstd = jn.group_norm_fwd(gx, None, None, rows, 4, h // 4, 1, 1e-5)
    np.testing.assert_allclose(np.asarray(grstd).reshape(rows), rstd_ref.reshape(rows),
                               rtol=tight, err_msg=kind)
    np.testing.assert_allclose(np.asarray(gy).reshape(rows, h), y_ref, rtol=0,
                               atol=tight * y_scale, err_msg=kind)
