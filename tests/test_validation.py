"""Bad input: every rule of docs/spec.md#bad-input raises at trace time, naming the argument.

The aclnn error codes in the comments (PARAM_NULLPTR, PARAM_INVALID and their numbers) are
aclnnLayerNormBackward's and aclnnGroupNormBackward's, which that section lists among its rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn

F32, BF16 = jnp.float32, jnp.bfloat16
x = jnp.ones((4, 6, 10), F32)
dy = jnp.ones((4, 6, 10), F32)
stats = jnp.ones((4, 6, 1), F32)
w = jnp.ones((10,), F32)


def ln_bwd(**kw):
  args = dict(grad_out=dy, x=x, normalized_shape=(10,), mean=stats, rstd=stats, weight=w,
              bias=w, output_mask=(True, True, True))
  args.update(kw)
  return lambda: jn.layer_norm_backward(**args)


gx = jnp.ones((2, 6, 5), F32)
gstats = jnp.ones((2, 3), F32)


def gn_bwd(**kw):
  args = dict(grad_out=gx, x=gx, mean=gstats, rstd=gstats, gamma=jnp.ones(6), N=2, C=6, HxW=5,
              group=3, output_mask=(True, True, True))
  args.update(kw)
  return lambda: jn.group_norm_backward(**args)


LN_CASES = [
    # aclnn 000 PARAM_NULLPTR 1: required tensors given as None.
    (ln_bwd(grad_out=None), TypeError, "grad_out"),
    (ln_bwd(x=None), TypeError, "x"),
    (ln_bwd(mean=None), TypeError, "mean"),
    (ln_bwd(rstd=None), TypeError, "rstd"),
    (ln_bwd(normalized_shape="abc"), TypeError, "normalized_shape"),
    (ln_bwd(output_mask=None), TypeError, "output_mask"),
    # PARAM_INVALID 1: dtypes.
    (ln_bwd(x=x.astype(jnp.int32), grad_out=dy.astype(jnp.int32)), TypeError, "x"),
    (ln_bwd(x=np.ones((4, 6, 10), np.float64), grad_out=np.ones((4, 6, 10), np.float64)), TypeError, "float64"),
    (ln_bwd(grad_out=dy.astype(BF16)), TypeError, "grad_out"),
    (ln_bwd(mean=stats.astype(BF16)), TypeError, "mean"),
    (ln_bwd(rstd=stats.astype(jnp.float16)), TypeError, "rstd"),
    (ln_bwd(weight=w.astype(BF16)), TypeError, "weight"),
    (ln_bwd(weight=w.astype(jnp.int32)), TypeError, "weight"),
    (ln_bwd(x=x.astype(BF16), grad_out=dy.astype(BF16), weight=w.astype(BF16), bias=w), TypeError, "bias"),
    (ln_bwd(x=x.astype(BF16), grad_out=dy.astype(BF16), mean=stats.astype(BF16)), TypeError, "rstd"),
    # PARAM_INVALID 2: grad_out shape.
    (ln_bwd(grad_out=jnp.ones((4, 6, 11))), ValueError, "grad_out"),
    # 3: empty normalized_shape.
    (ln_bwd(normalized_shape=()), ValueError, "normalized_shape"),
    # 4, 5: mean/rstd element counts.
    (ln_bwd(mean=jnp.ones((4, 5))), ValueError, "mean"),
    (ln_bwd(rstd=jnp.ones((25,))), ValueError, "rstd"),
    # 6, 7: weight/bias shapes.
    (ln_bwd(weight=jnp.ones((11,))), ValueError, "weight"),
    (ln_bwd(bias=jnp.ones((6, 10))), ValueError, "bias"),
    # 8: x.ndim < len(normalized_shape).
    (ln_bwd(normalized_shape=(1, 4, 6, 10)), ValueError, "x"),
    # 9: trailing dims.
    (ln_bwd(normalized_shape=(6, 11)), ValueError, "normalized_shape"),
    # 10: output_mask length / element types.
    (ln_bwd(output_mask=(True, True)), ValueError, "output_mask"),
    (ln_bwd(output_mask=(True, 1, True)), TypeError, "output_mask"),
    (ln_bwd(implementation="cuda"), ValueError, "implementation"),
]

GN_CASES = [
    (gn_bwd(grad_out=None), TypeError, "grad_out"),
    (gn_bwd(x=None), TypeError, "x"),
    (gn_bwd(mean=None), TypeError, "mean"),
    (gn_bwd(rstd=None), TypeError, "rstd"),
    # 002 PARAM_INVALID 1, 2: dtypes.
    (gn_bwd(grad_out=gx.astype(jnp.int32), x=gx.astype(jnp.int32)), TypeError, "grad_out"),
    (gn_bwd(x=gx.astype(BF16)), TypeError, "x"),
    (gn_bwd(mean=gstats.astype(BF16)), TypeError, "mean"),
    (gn_bwd(rstd=gstats.astype(jnp.float16)), TypeError, "rstd"),
    (gn_bwd(gamma=jnp.ones(6, BF16)), TypeError, "gamma"),
    # 3: grad_input shape (= grad_out vs x).
    (gn_bwd(grad_out=jnp.ones((2, 6, 6))), ValueError, "grad_out"),
    # 6: group <= 0.
    (gn_bwd(group=0), ValueError, "group"),
    (gn_bwd(group=-2), ValueError, "group"),
    # 7: C % group.
    (gn_bwd(group=4), ValueError, "group"),
    # 8: x.size != N*C*HxW.
    (gn_bwd(HxW=4), ValueError, "x"),
    (gn_bwd(N=3), ValueError, "x"),
    # 9, 10: mean/rstd element counts.
    (gn_bwd(mean=jnp.ones((2, 2))), ValueError, "mean"),
    (gn_bwd(rstd=jnp.ones((7,))), ValueError, "rstd"),
    # 11: gamma element count.
    (gn_bwd(gamma=jnp.ones(5)), ValueError, "gamma"),
    (gn_bwd(output_mask=(True,)), ValueError, "output_mask"),
    (gn_bwd(N=2.0), TypeError, "N"),
    (gn_bwd(C=0), ValueError, "C"),
]

LAYER_CASES = [
    (lambda: jn.layer_norm(x, jnp.ones(9)), ValueError, "weight"),
    (lambda: jn.layer_norm(x, normalized_shape=(7,)), ValueError, "normalized_shape"),
    (lambda: jn.layer_norm(x, normalized_shape=(6, 0)), ValueError, "normalized_shape"),
    (lambda: jn.layer_norm(x, eps=-1.0), ValueError, "eps"),
    (lambda: jn.layer_norm(x, eps="1"), TypeError, "eps"),
    (lambda: jn.layer_norm(np.ones((2, 3))), TypeError, "float64"),
    (lambda: jn.layer_norm(x, implementation="mosaic"), ValueError, "implementation"),
    (lambda: jn.layer_norm(x.astype(BF16), out_dtype=jnp.float16), TypeError, "out_dtype"),
    (lambda: jn.layer_norm(x.astype(jnp.float16), out_dtype=jnp.bfloat16), TypeError,
     "out_dtype: expected None, float16 .x's dtype. or float32, or with a float32 x"),
    (lambda: jn.group_norm(x, 2, out_dtype=jnp.bfloat16), TypeError,
     r"out_dtype: expected None, float32 \(x's dtype\) or float32, got bfloat16"),
    (lambda: jn.rms_norm(x, out_dtype="int8"), TypeError, "out_dtype"),
    (lambda: jn.layer_norm(x, out_dtype="no-such-dtype"), TypeError, "out_dtype"),
    (lambda: jn.group_norm(x, 2, out_dtype=jnp.float16), TypeError, "out_dtype"),
    (lambda: jn.layer_norm_fwd(x, 10, weight=jnp.ones(10, BF16)), TypeError, "weight"),
    (lambda: jn.group_norm(gx, 4), ValueError, "group"),
    (lambda: jn.group_norm(gx, 3, activation="tanh"), ValueError, "activation"),
    (lambda: jn.group_norm(gx, 3, activation=jax.nn.silu), TypeError, "activation"),
    (lambda: jn.group_norm(gx, 3, channel_axis=0), ValueError, "channel_axis"),
    (lambda: jn.group_norm(gx, 3, channel_axis=3), ValueError, "channel_axis"),
    (lambda: jn.group_norm(jnp.ones(6), 3), ValueError, "x"),
    (lambda: jn.group_norm(gx, 3, jnp.ones(5)), ValueError, "weight"),
    (lambda: jn.group_norm(gx, 3, jnp.ones((6, 1))), ValueError, "weight"),
    (lambda: jn.group_norm(jnp.ones((2, 6, 0)), 3), ValueError, "spatial"),
    (lambda: jn.group_norm_fwd(gx, None, None, 2, 6, 0, 3), ValueError, "x"),
    (lambda: jn.group_norm_fwd(gx, None, jnp.ones(6, jnp.float16), 2, 6, 5, 3), TypeError, "bias"),
]


@pytest.mark.parametrize("call,error,name", LN_CASES + GN_CASES + LAYER_CASES)
def test_bad_input_raises(call, error, name):
  with pytest.raises(error, match=name):
    call()


@pytest.mark.parametrize("call,error,name", LN_CASES[:3] + GN_CASES[5:8])
def test_raises_at_trace_time_under_jit(call, error, name):
  # The checks run while tracing: no kernel has run when the error is raised.
  with pytest.raises(error, match=name):
    jax.jit(call)()


def test_messages_give_expected_and_actual():
  with pytest.raises(ValueError, match=r"expected 24 elements.*got 20"):
    ln_bwd(mean=jnp.ones((4, 5)))()
  with pytest.raises(TypeError, match=r"expected dtype float32.*got bfloat16"):
    ln_bwd(grad_out=dy.astype(BF16))()
  with pytest.raises(ValueError, match=r"C=6 must be divisible by group=4"):
    gn_bwd(group=4)()


def test_empty_batches_are_valid():
  x0 = jnp.ones((0, 10), F32)
  dx, dw, db = jn.layer_norm_backward(x0, x0, 10, jnp.ones((0,)), jnp.ones((0,)), w)
  assert dx.shape == (0, 10) and np.all(np.asarray(dw) == 0) and np.all(np.asarray(db) == 0)
  g0 = jnp.ones((0, 6, 5), F32)
  dx, dg, db = jn.group_norm_backward(g0, g0, jnp.ones((0, 3)), jnp.ones((0, 3)), None, 0, 6, 5, 3)
  assert dx.shape == (0, 6, 5) and dg.shape == (6,) and np.all(np.asarray(dg) == 0)
  y = jn.layer_norm(x0, w, w)
  assert y.shape == (0, 10)
  gw = jax.grad(lambda w: jnp.sum(jn.layer_norm(x0, w)))(w)
  assert np.all(np.asarray(gw) == 0)
