"""64-bit sizes: the kernels' index arithmetic beyond 2^31 elements, and the largest case CI holds."""

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

# Element and row counts around 2^31 and 2^32 (where int32 and uint32 index
# arithmetic would wrap) up to 2^40, odd and even.
BIG = [2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32 + 3, 3 * 2**33 + 7, 2**40 - 1, 2**40, 2**40 + 1]
# Task counts the kernels use: 1, odd ones, and kMaxTasks = 32.
TASKS = [1, 2, 3, 7, 31, 32]


def test_ceil_div_beyond_2_31():
  for n in BIG:
    for b in (1, 2, 3, 1 << 15, 2**31 - 1, 2**31, 2**33 + 1, n):
      assert ext._ceil_div(n, b) == -(-n // b), (n, b)


def test_num_tasks_beyond_2_31():
  for n in BIG:
    for min_per_task in (1, 7, 1 << 15, 2**31, 2**40):
      for max_tasks in (1, 32):
        assert ext._num_tasks(n, min_per_task, max_tasks) == max(1, min(-(-n // min_per_task), max_tasks))


def test_block_begin_partitions_beyond_2_31():
  for n in BIG:
    for tasks in TASKS:
      begins = [ext._block_begin(n, tasks, i) for i in range(tasks + 1)]
      assert begins == [(n // tasks) * i + min(i, n % tasks) for i in range(tasks + 1)], (n, tasks)
      assert begins[0] == 0 and begins[-1] == n
      # Contiguous blocks whose sizes differ by at most one.
      assert {b - a for a, b in zip(begins, begins[1:])} <= {n // tasks, -(-n // tasks)}


@pytest.mark.parametrize("groups", [1, 3, 64])
@pytest.mark.parametrize("per_group", [1, 5, 32])
def test_row_group_tasks_beyond_2_31(groups, per_group):
  # Rows of vmapped parameter groups; each group alone is beyond 2^31 rows.
  for rows_per_group in (2**31 + 1, 2**38 - 3):
    rows = groups * rows_per_group
    end = 0
    for t in range(groups * per_group):
      group, begin, stop = ext._row_group_task(rows, groups, per_group, t)
      assert group == t // per_group
      assert begin == end, "tasks must tile the rows contiguously"
      assert group * rows_per_group <= begin <= stop <= (group + 1) * rows_per_group
      end = stop
    assert end == rows


def test_index_helpers_refuse_bad_arguments():
  with pytest.raises(ValueError):
    ext._block_begin(10, 0, 0)
  with pytest.raises(ValueError):
    ext._row_group_task(10, 3, 1, 0)
  with pytest.raises(ValueError):
    ext._ceil_div(10, 0)


# The largest cases: 2^28 bfloat16 elements (512 MiB) per tensor, a few GiB in
# all. Inputs are a small random block tiled many times, so every tile's
# outputs must equal the first tile's bit for bit (rows and (n, g) blocks are
# computed independently); the first tile is checked against the float64
# reference and the parameter gradients against reps times the tile's. A
# wrong offset anywhere in the tensor would break the equality.


def _bits(a):
  return jax.lax.bitcast_convert_type(a, jnp.uint16 if a.dtype.itemsize == 2 else jnp.uint32)


def _tiles_equal(a, reps):
  """All ``reps`` leading tiles of ``a`` equal the first, bitwise (a scalar, inside jit)."""
  t = _bits(a).reshape((reps, -1))
  return jnp.all(t == t[:1])


def test_layer_norm_largest_case():
  h, k, reps = 4099, 8, 8186  # 65488 rows of 4099: 2^28 elements
  rng = np.random.default_rng(0)
  bx = random(rng, (k, h), jnp.bfloat16, scale=2.0, offset=0.5)
  bdy = random(rng, (k, h), jnp.bfloat16)
  w = random(rng, (h,), jnp.bfloat16, offset=1.0)
  b = random(rng, (h,), jnp.bfloat16)

  @jax.jit
  def run(bx, bdy, w, b):
    x, dy = jnp.tile(bx, (reps, 1)), jnp.tile(bdy, (reps, 1))
    y, mean, rstd = jn.layer_norm_fwd(x, h, w, b)
    dx, dw, db = jn.layer_norm_backward(dy, x, h, mean, rstd, w, b)
    same = jnp.stack([_tiles_equal(a, reps) for a in (y, mean, rstd, dx)])
    return same, y[:k], mean[:k], rstd[:k], dx[:k], dw, db

  same, y, mean, rstd, dx, dw, db = run(bx, bdy, w, b)
  assert np.all(np.asarray(same)), "(y, mean, rstd, dx) tiles differ"
  y_ref, mean_ref, rstd_ref = ref.ln_fwd(bx, 1, w, b)
  assert_close(y, y_ref, jnp.bfloat16, h, "y")
  assert_close(mean, mean_ref, jnp.float32, h, "mean")
  assert_close(rstd, rstd_ref, jnp.float32, h, "rstd")
  dx_ref, dw_ref, db_ref = ref.ln_bwd(bdy, bx, 1, mean, rstd, w)
  assert_close(dx, dx_ref, jnp.bfloat16, h, "grad_input", scale=ref.dx_scale(bdy, rstd, w))
  assert_close(dw, reps * dw_ref, jnp.bfloat16, k * reps, "grad_weight")
  assert_close(db, reps * db_ref, jnp.bfloat16, k * reps, "grad_bias")


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_largest_case(channels_last):
  c, hw, group, k, reps = 48, 2731, 6, 2, 1024  # N = 2048: 2048*48*2731 ~ 2^28 elements
  n = k * reps
  rng = np.random.default_rng(1)
  shape = (k, hw, c) if channels_last else (k, c, hw)
  bx = random(rng, shape, jnp.bfloat16, scale=2.0, offset=-0.3)
  bdy = random(rng, shape, jnp.bfloat16)
  w = random(rng, (c,), jnp.bfloat16, offset=1.0)
  b = random(rng, (c,), jnp.bfloat16)

  @jax.jit
  def run(bx, bdy, w, b):
    x, dy = jnp.tile(bx, (reps, 1, 1)), jnp.tile(bdy, (reps, 1, 1))
    y, mean, rstd = jn.group_norm_fwd(x, w, b, n, c, hw, group, channels_last=channels_last)
    dx, dg, db = jn.group_norm_backward(dy, x, mean, rstd, w, n, c, hw, group,
                                        channels_last=channels_last)
    same = jnp.stack([_tiles_equal(a, reps) for a in (y, mean, rstd, dx)])
    return same, y[:k], mean[:k], rstd[:k], dx[:k], dg, db

  same, y, mean, rstd, dx, dg, db = run(bx, bdy, w, b)
  assert np.all(np.asarray(same)), "(y, mean, rstd, dx) tiles differ"
  block = c // group * hw
  y_ref, mean_ref, rstd_ref = ref.gn_fwd(bx, w, b, k, c, hw, group, 1e-5, channels_last)
  assert_close(y, y_ref, jnp.bfloat16, block, "y")
  assert_close(mean, mean_ref, jnp.float32, block, "mean")
  assert_close(rstd, rstd_ref, jnp.float32, block, "rstd")
  dx_ref, dg_ref, db_ref = ref.gn_bwd(bdy, bx, mean, rstd, w, k, c, hw, group, channels_last)
  assert_close(dx, dx_ref, jnp.bfloat16, block, "grad_input", scale=ref.dx_scale(bdy, rstd, w))
  assert_close(dg, reps * dg_ref, jnp.bfloat16, n * hw, "grad_gamma")
  assert_close(db, reps * db_ref, jnp.bfloat16, n * hw, "grad_beta")
