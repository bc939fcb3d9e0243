"""Outputs past the non-temporal-store threshold: every row in place, bit for bit the plain-store values.

A kernel that moves at least ``_stream_min_bytes`` writes y or dx by
streaming stores where a row is vector-aligned and by plain stores elsewhere
(common.h: StreamOutput). Each case tiles a small random block ``reps`` times
into a tensor past the threshold and checks that every tile of y / dx equals,
bitwise, the result of the same kernel on the block alone (below the
threshold: plain stores), and the block's result against the float64
reference. Rows and (n, g) blocks are computed independently of each other,
so a store that went to the wrong place, or was lost before the task ended,
breaks the equality. Odd row lengths make the rows alternate between
streamed and plain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from jax_normgrad import _jax_normgrad as ext
from cases import random
import reference_np as ref
from tolerances import assert_close

STREAM_MIN = ext._stream_min_bytes


def _reps(block_elements, bytes_per_element):
  """Tiles of a block so that a kernel moving bytes_per_element per element streams."""
  return -(-STREAM_MIN // (block_elements * bytes_per_element)) + 1


def _assert_tiles_equal(big, small, reps, name):
  big, small = np.asarray(big), np.asarray(small)
  tiles = big.reshape((reps,) + small.shape)
  bad = [i for i in range(reps) if not np.array_equal(tiles[i], small, equal_nan=True)]
  assert not bad, f"{name}: tiles {bad[:5]} (of {reps}) differ from the block's own result"


@pytest.mark.parametrize("h,dtype", [(1024, jnp.float32), (1001, jnp.float32),
                                     (1001, jnp.bfloat16)])
def test_layer_norm_streams_y_and_dx(h, dtype):
  # A 16-bit dx streams in the avx512bf16 build only (simd.h:
  # kStreamNarrowRows); the tiles must equal the block's either way.
  k = 8
  # The forward moves x and y, the backward x, dy and dx.
  reps = _reps(k * h, 2 * jnp.dtype(dtype).itemsize)
  rng = np.random.default_rng(h)
  bx = random(rng, (k, h), dtype, scale=2.0, offset=0.5)
  bdy = random(rng, (k, h), dtype)
  w = random(rng, (h,), jnp.float32, offset=1.0)
  b = random(rng, (h,), jnp.float32)

  def run(x, dy):
    y, mean, rstd = jn.layer_norm_fwd(x, h, w, b)
    dx, dw, db = jn.layer_norm_backward(dy, x, h, mean, rstd, w, b)
    return y, mean, rstd, dx, dw, db

  small = jax.jit(run)(bx, bdy)
  big = jax.jit(run)(jnp.tile(bx, (reps, 1)), jnp.tile(bdy, (reps, 1)))
  for name, i in (("y", 0), ("mean", 1), ("rstd", 2), ("grad_input", 3)):
    _assert_tiles_equal(big[i], small[i], reps, name)
  y, mean, rstd, dx, dw, db = small
  y_ref, mean_ref, rstd_ref = ref.ln_fwd(bx, 1, w, b)
  assert_close(y, y_ref, dtype, h, "y")
  dx_ref, dw_ref, db_ref = ref.ln_bwd(bdy, bx, 1, mean, rstd, w)
  assert_close(dx, dx_ref, dtype, h, "grad_input", scale=ref.dx_scale(bdy, rstd, w))
  # The parameter gradients sum over every row: reps times the block's.
  assert_close(big[4], reps * dw_ref, jnp.float32, k * reps, "grad_weight")
  assert_close(big[5], reps * db_ref, jnp.float32, k * reps, "grad_bias")


@pytest.mark.parametrize("y_dtype", [jnp.bfloat16, jnp.float32])
def test_layer_norm_bfloat16_x_streams_y(y_dtype):
  # 16-bit y: 16-byte streaming stores; a float32 y of a bfloat16 x (the
  # mixed-precision forward) streams float32 rows.
  k, h = 8, 1001
  reps = _reps(k * h, 2 + jnp.dtype(y_dtype).itemsize)
  rng = np.random.default_rng(7)
  bx = random(rng, (k, h), jnp.bfloat16, scale=2.0, offset=0.5)
  w = random(rng, (h,), jnp.float32, offset=1.0)
  b = random(rng, (h,), jnp.float32)
  run = jax.jit(lambda x: jn.layer_norm(x, w, b, out_dtype=y_dtype))
  small = run(bx)
  assert small.dtype == y_dtype
  _assert_tiles_equal(run(jnp.tile(bx, (reps, 1))), small, reps, "y")
  y_ref, _, _ = ref.ln_fwd(bx, 1, w, b)
  assert_close(small, y_ref, y_dtype, h, "y")


def test_layer_norm_long_rows_stream_by_column_chunks():
  # Rows of 2^18 + 5: the backward of the tiled block (14 rows) splits them
  # into column chunks, as that of the 2-row block does, and streams dx. Both
  # take column chunks on any machine: the block's because it has few rows,
  # the tiled one's because x and dy fit 32 MiB and a row's x and dy (2 MiB)
  # do not fit half of any L2 up to 4 MiB (layer_norm_bwd.cc, LayerNormBwdImpl).
  # With rows of 2^16 + 5 the tiled one took row tasks where the L2 is >= 1.05
  # MiB (a 2 MiB-L2 Xeon), and another summation order than the block's.
  # The statistics are the block's, tiled: the forward of 2 rows takes column
  # chunks too, that of many rows does not.
  k, h = 2, (1 << 18) + 5
  reps = _reps(k * h, 12)
  assert reps * k * h * 8 <= 32 << 20 and 2 * (2 * h * 4) > 4 << 20  # the conditions above
  rng = np.random.default_rng(3)
  bx = random(rng, (k, h), jnp.float32, scale=2.0, offset=-0.5)
  bdy = random(rng, (k, h), jnp.float32)
  w = random(rng, (h,), jnp.float32, offset=1.0)
  _, mean, rstd = jn.layer_norm_fwd(bx, h, w)
  bwd = jax.jit(lambda dy, x, mean, rstd: jn.layer_norm_backward(dy, x, h, mean, rstd, w))
  small = bwd(bdy, bx, mean, rstd)
  tile = lambda a: jnp.tile(a, (reps, 1))  # every operand is (rows, ...)
  big = bwd(tile(bdy), tile(bx), tile(mean), tile(rstd))
  _assert_tiles_equal(big[0], small[0], reps, "grad_input")
  dx_ref, dw_ref, _ = ref.ln_bwd(bdy, bx, 1, mean, rstd, w)
  assert_close(small[0], dx_ref, jnp.float32, h, "grad_input", scale=ref.dx_scale(bdy, rstd, w))
  assert_close(big[1], reps * dw_ref, jnp.float32, k * reps, "grad_weight")
  # The forward of few, long rows by column chunks: one row of a 2-row call
  # (streamed) against the 1-row call (plain stores).
  long_h = STREAM_MIN // 16 + 3
  lx = random(rng, (2, long_h), jnp.float32, offset=1.0)
  fwd = jax.jit(lambda x: jn.layer_norm_fwd(x, long_h)[0])
  y2, y1 = fwd(lx), fwd(lx[1:])
  np.testing.assert_array_equal(np.asarray(y2[1:]), np.asarray(y1))
  assert_close(y2, ref.ln_fwd(lx, 1)[0], jnp.float32, long_h, "y")


@pytest.mark.parametrize("channels_last,c,group,hw,dtype", [
    (False, 64, 8, 181 * 181, jnp.float32),  # odd HxW: rows alternate streamed / plain
    # Channels-last samples under 2 * 32768 elements: one statistics chunk per
    # sample whatever N (common.h kMinElementsPerTask), so the block alone
    # computes as each tile does. 520-byte pixel rows alternate too.
    (True, 130, 10, 25 * 19, jnp.float32),
    (True, 128, 8, 500, jnp.bfloat16),
])
def test_group_norm_streams_y_and_dx(channels_last, c, group, hw, dtype):
  k = 1
  size = jnp.dtype(dtype).itemsize
  reps = _reps(k * c * hw, 2 * size)  # the forward moves x and y, the backward three arrays
  n = k * reps
  rng = np.random.default_rng(c)
  shape = (k, hw, c) if channels_last else (k, c, hw)
  bx = random(rng, shape, dtype, scale=2.0, offset=-0.3)
  bdy = random(rng, shape, dtype)
  w = random(rng, (c,), jnp.float32, offset=1.0)
  b = random(rng, (c,), jnp.float32)

  def run(x, dy, n):
    y, mean, rstd = jn.group_norm_fwd(x, w, b, n, c, hw, group, channels_last=channels_last)
    dx, dg, db = jn.group_norm_backward(dy, x, mean, rstd, w, n, c, hw, group,
                                        channels_last=channels_last)
    return y, mean, rstd, dx, dg, db

  small = jax.jit(run, static_argnums=2)(bx, bdy, k)
  big = jax.jit(run, static_argnums=2)(jnp.tile(bx, (reps, 1, 1)), jnp.tile(bdy, (reps, 1, 1)), n)
  for name, i in (("y", 0), ("mean", 1), ("rstd", 2), ("grad_input", 3)):
    _assert_tiles_equal(big[i], small[i], reps, name)
  y, mean, rstd, dx, _, _ = small
  block = c // group * hw
  y_ref, _, _ = ref.gn_fwd(bx, w, b, k, c, hw, group, 1e-5, channels_last)
  assert_close(y, y_ref, dtype, block, "y")
  dx_ref, dg_ref, db_ref = ref.gn_bwd(bdy, bx, mean, rstd, w, k, c, hw, group, channels_last)
  assert_close(dx, dx_ref, dtype, block, "grad_input", scale=ref.dx_scale(bdy, rstd, w))
  assert_close(big[4], reps * dg_ref, jnp.float32, n * hw, "grad_gamma")
  assert_close(big[5], reps * db_ref, jnp.float32, n * hw, "grad_beta")


@pytest.mark.parametrize("channels_last,c,group,hw", [
    (False, 64, 8, 181 * 181),
    (True, 130, 10, 25 * 19),
])
def test_group_norm_silu_streamed_backward_equals_kept(channels_last, c, group, hw):
  """A float32 backward with a fused SiLU keeps dz = dy silu'(z) in dx between
  its passes unless dx streams, where it computes dz twice: the streamed
  call's tiles equal the small call's results bitwise, y and dx."""
  reps = _reps(c * hw, 2 * 4)
  rng = np.random.default_rng(c)
  shape = (1, hw, c) if channels_last else (1, c, hw)
  bx = random(rng, shape, jnp.float32, scale=2.0, offset=-0.3)
  bdy = random(rng, shape, jnp.float32)
  w = random(rng, (c,), jnp.float32, offset=1.0)
  b = random(rng, (c,), jnp.float32)
  layer = lambda x, w, b: jn.group_norm(x, group, w, b, channel_axis=-1 if channels_last else 1,
                                        activation="silu")

  def run(x, dy):
    y, vjp = jax.vjp(layer, x, w, b)
    return (y,) + vjp(dy)

  small = jax.jit(run)(bx, bdy)
  big = jax.jit(run)(jnp.tile(bx, (reps, 1, 1)), jnp.tile(bdy, (reps, 1, 1)))
  for name, i in (("y", 0), ("grad_input", 1)):
    _assert_tiles_equal(big[i], small[i], reps, name)
  assert_close(big[2], reps * np.asarray(small[2], np.float64), jnp.float32, reps * hw,
               "grad_weight")
