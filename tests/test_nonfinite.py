"""Non-finite inputs stay where they are: in their row (LayerNorm) or (n, g) block (GroupNorm).

A NaN or Inf in x makes its row's (block's) statistics and y non-finite; in
x or dy, it makes its row's (block's) grad_input non-finite, and the
parameter-gradient entries that sum over it. Every other row's (block's)
outputs, and every other parameter-gradient entry, are bitwise the same as
without it. The shapes give many tasks with per-task partial sums, the path
by which a poisoned value could leak across rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from cases import DTYPES, random

IMPLEMENTATIONS = [None, "xla"]
POISONS = [("x", np.nan), ("x", np.inf), ("dy", np.nan), ("dy", -np.inf)]


def _bits(a):
  """The raw bits of an array, so NaNs compare equal to themselves."""
  a = np.asarray(jnp.asarray(a))
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _poison(a, index, value):
  return jnp.asarray(a).at[index].set(value)


# ----------------------------------------------------------------------------
# LayerNorm: x (M, H), the poison at (ROW, COL).

M, H, ROW, COL = 4099, 257, 1234, 100


@functools.partial(jax.jit, static_argnums=4)
def _ln_grads(x, dy, w, b, implementation):
  # Statistics from the forward, as in training: a poisoned x poisons its row's.
  y, mean, rstd = jn.layer_norm_fwd(x, H, w, b, implementation=implementation)
  grads = jn.layer_norm_backward(dy, x, H, mean, rstd, w, b, implementation=implementation)
  return (y, mean, rstd), grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where,value", POISONS)
def test_layer_norm_poison_stays_in_its_row(implementation, dtype, where, value):
  rng = np.random.default_rng(0)
  x = random(rng, (M, H), dtype, scale=2.0, offset=0.5)
  dy = random(rng, (M, H), dtype)
  w = random(rng, (H,), dtype, offset=1.0)
  b = random(rng, (H,), dtype)

  clean = _ln_grads(x, dy, w, b, implementation)
  if where == "x":
    x = _poison(x, (ROW, COL), value)
  else:
    dy = _poison(dy, (ROW, COL), value)
  fwd, (dx, dw, db) = _ln_grads(x, dy, w, b, implementation)
  fwd0, (dx0, dw0, db0) = clean

  others = np.arange(M) != ROW
  # The forward: x poisons its row; dy is not read.
  for got, ref in zip(fwd, fwd0):
    if where == "x":
      np.testing.assert_array_equal(_bits(got)[others], _bits(ref)[others])
      assert not np.isfinite(np.asarray(got[ROW], np.float32)).any()
    else:
      np.testing.assert_array_equal(_bits(got), _bits(ref))
  np.testing.assert_array_equal(_bits(dx)[others], _bits(dx0)[others])
  assert not np.isfinite(np.asarray(dx[ROW], np.float32)).any(), "the poisoned row must be non-finite"
  # x poisons its row's statistics, so all of xhat's row: every grad_weight
  # entry; grad_bias does not read x. dy poisons column COL of both.
  for got, ref, reads_x in ((dw, dw0, True), (db, db0, False)):
    hit = np.full(H, reads_x) if where == "x" else np.arange(H) == COL
    assert not np.isfinite(np.asarray(got, np.float32)[hit]).any()
    np.testing.assert_array_equal(_bits(got)[~hit], _bits(ref)[~hit])


# ----------------------------------------------------------------------------
# GroupNorm: (N, C, HW), the poison in block (N0, G0) at channel C0.

N, C, HW, G = 6, 64, 515, 8
N0, C0, HW0 = 4, 21, 300
G0 = C0 // (C // G)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _gn_grads(x, dy, w, b, channels_last, implementation):
  y, mean, rstd = jn.group_norm_fwd(x, w, b, N, C, HW, G, channels_last=channels_last,
                                    implementation=implementation)
  grads = jn.group_norm_backward(dy, x, mean, rstd, w, N, C, HW, G,
                                 channels_last=channels_last, implementation=implementation)
  return (y, mean, rstd), grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where,value", POISONS)
def test_group_norm_poison_stays_in_its_block(implementation, channels_last, dtype, where, value):
  rng = np.random.default_rng(1)
  shape = (N, HW, C) if channels_last else (N, C, HW)
  x = random(rng, shape, dtype, scale=2.0, offset=-0.3)
  dy = random(rng, shape, dtype)
  w = random(rng, (C,), dtype, offset=1.0)
  b = random(rng, (C,), dtype)

  clean = _gn_grads(x, dy, w, b, channels_last, implementation)
  index = (N0, HW0, C0) if channels_last else (N0, C0, HW0)
  if where == "x":
    x = _poison(x, index, value)
  else:
    dy = _poison(dy, index, value)
  (y, mean, rstd), (dx, dg, db) = _gn_grads(x, dy, w, b, channels_last, implementation)
  (y0, mean0, rstd0), (dx0, dg0, db0) = clean

  # (N, G, C/G, HW) views, so a block is [n, g].
  def blocks(a):
    a = a.reshape(N, HW, G, C // G).transpose(0, 2, 3, 1) if channels_last else a.reshape(N, G, C // G, HW)
    return a.reshape(N, G, -1)

  poisoned = np.zeros((N, G), bool)
  poisoned[N0, G0] = True
  # The forward: x poisons its block; dy is not read.
  for got, ref in ((blocks(_bits(y)), blocks(_bits(y0))), (_bits(mean), _bits(mean0)),
                   (_bits(rstd), _bits(rstd0))):
    if where == "x":
      np.testing.assert_array_equal(got[~poisoned], ref[~poisoned])
    else:
      np.testing.assert_array_equal(got, ref)
  if where == "x":
    for got in (blocks(np.asarray(y, np.float32)), np.asarray(mean), np.asarray(rstd)):
      assert not np.isfinite(got[N0, G0]).any()
  np.testing.assert_array_equal(blocks(_bits(dx))[~poisoned], blocks(_bits(dx0))[~poisoned])
  assert not np.isfinite(blocks(np.asarray(dx, np.float32))[N0, G0]).any()
  # x poisons its block's statistics: grad_gamma of the group's channels;
  # grad_beta does not read x. dy poisons channel C0 of both.
  channels = np.arange(C)
  in_group = channels // (C // G) == G0
  for got, ref, reads_x in ((dg, dg0, True), (db, db0, False)):
    if where == "x":
      hit = in_group if reads_x else np.zeros(C, bool)
    else:
      hit = channels == C0
    assert not np.isfinite(np.asarray(got, np.float32)[hit]).any()
    np.testing.assert_array_equal(_bits(got)[~hit], _bits(ref)[~hit])
