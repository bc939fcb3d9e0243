"""Bad input to the RMSNorm ops, the vendor-form LayerNorm backwards and the layers' options.

Checked at trace time with the argument named and the expected and actual
values in the message: ValueError for shapes and values, TypeError for dtypes
(docs/spec.md#bad-input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn

F32, BF16 = jnp.float32, jnp.bfloat16


def z(shape, dtype=F32):
  return jnp.zeros(shape, dtype)


X = z((2, 3, 8))
ROWS = z((2, 3))
H = z((8,))


def _raises(exc, fn, *fragments):
  with pytest.raises(exc) as info:
    fn()
  for f in fragments:
    assert f in str(info.value), (f, str(info.value))


# (function, exception, fragments of the message): each fragment must appear,
# so the argument is named and expected and actual values are given.
LAYER_NORM_GRAD = [
    (lambda: jn.layer_norm_grad(z((2, 3, 7)), X, ROWS, ROWS, H, 1e-5), ValueError,
     ["dy", "(2, 3, 8)", "(2, 3, 7)"]),
    (lambda: jn.layer_norm_grad(X.astype(BF16), X, ROWS, ROWS, H, 1e-5), TypeError,
     ["dy", "float32", "bfloat16"]),
    (lambda: jn.layer_norm_grad(X, X, z((2, 4)), ROWS, H, 1e-5), ValueError,
     ["variance", "(2, 3)", "(2, 3, 1)", "(2, 4)"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS, z((6,)), H, 1e-5), ValueError, ["mean", "(6,)"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS.astype(BF16), ROWS, H, 1e-5), TypeError,
     ["variance", "float32", "bfloat16"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS, ROWS, z((8,), BF16), 1e-5), TypeError,
     ["gamma", "bfloat16"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS, ROWS, z((7,)), 1e-5), ValueError,
     ["gamma", "(8,)", "(7,)"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS, ROWS, H, -1.0), ValueError, ["epsilon", "-1.0"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS, ROWS, H, "1e-5"), TypeError, ["epsilon", "str"]),
    (lambda: jn.layer_norm_grad(X.astype(jnp.int32), X.astype(jnp.int32), ROWS, ROWS, H, 1e-5),
     TypeError, ["x", "int32"]),
    (lambda: jn.layer_norm_grad(z(()), z(()), z(()), z(()), None, 1e-5), ValueError,
     ["x", "at least 1 dimension"]),
    (lambda: jn.layer_norm_grad(X, None, ROWS, ROWS, H, 1e-5), TypeError, ["x", "None"]),
    (lambda: jn.layer_norm_grad(X, X, ROWS, ROWS, H, 1e-5, implementation="cuda"), ValueError,
     ["implementation", "'cuda'"]),
]

LAYER_NORM_GRAD_BETA = [
    (lambda: jn.layer_norm_grad_beta(X, z((2, 3, 9))), ValueError,
     ["dy", "(2, 3, 9)", "(2, 3, 8)"]),
    (lambda: jn.layer_norm_grad_beta(X.astype(BF16), X), TypeError, ["dy", "bfloat16"]),
    (lambda: jn.layer_norm_grad_beta(X, X, (4, 8)), ValueError,
     ["res_for_gamma", "(3, 8)", "(4, 8)"]),
    (lambda: jn.layer_norm_grad_beta(X, X, ()), ValueError, ["normalized_shape", "()"]),
    (lambda: jn.layer_norm_grad_beta(X, X, (1, 2, 3, 8)), ValueError,
     ["res_for_gamma", "at least 4 dimensions"]),
    (lambda: jn.layer_norm_grad_beta(X, X, 8.0), TypeError, ["normalized_shape", "float"]),
]

FROM_NORMALIZED = [
    (lambda: jn.layer_norm_backward_from_normalized(z((2, 3, 7)), H, X, ROWS), ValueError,
     ["grad_output", "(2, 3, 7)"]),
    (lambda: jn.layer_norm_backward_from_normalized(X.astype(BF16), H, X, ROWS), TypeError,
     ["grad_output", "bfloat16"]),
    (lambda: jn.layer_norm_backward_from_normalized(X, z((7,)), X, ROWS), ValueError,
     ["weight", "(8,)", "(7,)"]),
    (lambda: jn.layer_norm_backward_from_normalized(X, z((8,), jnp.float16), X, ROWS),
     TypeError, ["weight", "float16"]),
    (lambda: jn.layer_norm_backward_from_normalized(X, H, X, z((3, 2))), ValueError,
     ["input_std_deviation", "(2, 3)", "(3, 2)"]),
    # Statistics narrower than the inputs.
    (lambda: jn.layer_norm_backward_from_normalized(X, H, X, ROWS.astype(BF16)), TypeError,
     ["input_std_deviation", "bfloat16"]),
    (lambda: jn.layer_norm_backward_from_normalized(X, H, X.astype(jnp.int32), ROWS),
     TypeError, ["input_standardization", "int32"]),
]

RMS = [
    (lambda: jn.rms_norm_fwd(X, ()), ValueError, ["normalized_shape", "()"]),
    (lambda: jn.rms_norm_fwd(X, (4, 8)), ValueError, ["x", "(3, 8)", "(4, 8)"]),
    (lambda: jn.rms_norm_fwd(X, 8, z((7,))), ValueError, ["weight", "(8,)", "(7,)"]),
    (lambda: jn.rms_norm_fwd(X.astype(BF16), 8, z((8,), jnp.float16)), TypeError,
     ["weight", "float16"]),
    (lambda: jn.rms_norm_fwd(X, 8, eps=-1.0), ValueError, ["eps", "-1.0"]),
    (lambda: jn.rms_norm_fwd(X, 8, scale_offset=1.0), ValueError,
     ["scale_offset", "weight=None", "1.0"]),
    (lambda: jn.rms_norm_fwd(X, 8, H, scale_offset=float("nan")), ValueError,
     ["scale_offset", "nan"]),
    (lambda: jn.rms_norm_fwd(X, 8, H, scale_offset="1"), TypeError, ["scale_offset", "str"]),
    (lambda: jn.rms_norm_fwd(X, 0), ValueError, ["x", "(8,)", "(0,)"]),
    (lambda: jn.rms_norm_backward(z((2, 3, 9)), X, 8, ROWS), ValueError,
     ["grad_out", "(2, 3, 8)", "(2, 3, 9)"]),
    (lambda: jn.rms_norm_backward(X.astype(BF16), X, 8, ROWS), TypeError,
     ["grad_out", "bfloat16"]),
    (lambda: jn.rms_norm_backward(X, X, 8, z((5,))), ValueError, ["rstd", "6", "5"]),
    (lambda: jn.rms_norm_backward(X.astype(BF16), X.astype(BF16), 8, z((6,), BF16).astype(
        jnp.float16)), TypeError, ["rstd", "float16"]),
    (lambda: jn.rms_norm_backward(X, X, 8, ROWS, H, (True, True, True)), ValueError,
     ["output_mask", "length 2", "length 3"]),
    (lambda: jn.rms_norm_backward(X, X, 8, ROWS, H, (True, 1)), TypeError, ["output_mask[1]"]),
    (lambda: jn.rms_norm_backward(X, X, 8, ROWS, None, scale_offset=0.5), ValueError,
     ["scale_offset", "weight=None"]),
    (lambda: jn.rms_norm(X, z((7,))), ValueError, ["weight", "(8,)", "(7,)"]),
    (lambda: jn.rms_norm(X, eps=float("inf")), ValueError, ["eps", "inf"]),
    (lambda: jn.rms_norm(X, normalized_shape=(2, 8)), ValueError, ["x", "(3, 8)", "(2, 8)"]),
    (lambda: jn.rms_norm(X, scale_offset=1.0), ValueError, ["scale_offset", "weight=None"]),
    (lambda: jn.rms_norm(X, implementation="gpu"), ValueError, ["implementation", "'gpu'"]),
]

LAYER_OPTIONS = [
    (lambda: jn.layer_norm(X, save="x"), ValueError, ["save", "'input'", "'normalized'", "'x'"]),
    (lambda: jn.layer_norm(X, save=None), ValueError, ["save", "None"]),
    (lambda: jn.layer_norm(X, scale_offset=1.0), ValueError, ["scale_offset", "weight=None"]),
    (lambda: jn.layer_norm(X, H, scale_offset=jnp.float32(1.0) + X.sum()), TypeError,
     ["scale_offset"]),
    (lambda: jn.layer_norm_fwd(X, 8, scale_offset=2.0), ValueError, ["scale_offset"]),
    (lambda: jn.layer_norm_backward(X, X, 8, ROWS, ROWS, None, H, scale_offset=2.0), ValueError,
     ["scale_offset", "weight=None"]),
]

ALL = [("layer_norm_grad", c) for c in LAYER_NORM_GRAD] + [
    ("layer_norm_grad_beta", c) for c in LAYER_NORM_GRAD_BETA] + [
    ("from_normalized", c) for c in FROM_NORMALIZED] + [("rms", c) for c in RMS] + [
    ("layer_options", c) for c in LAYER_OPTIONS]


@pytest.mark.parametrize("case", [c for _, c in ALL], ids=[f"{n}-{i}" for i, (n, _) in enumerate(ALL)])
def test_bad_input(case):
  fn, exc, fragments = case
  _raises(exc, fn, *fragments)


def test_float64_is_refused():
  """float64 (with jax_enable_x64 on) is refused with a hint to cast, not silently truncated.

  The first float64 argument is the one named.
  """
  with jax.enable_x64(True):
    x = jnp.zeros((2, 3, 8), jnp.float64)
    rows = jnp.zeros((2, 3), jnp.float64)
    for fn, name in ((lambda: jn.layer_norm_grad(x, x, rows, rows, None, 1e-5), "x"),
                     (lambda: jn.layer_norm_grad_beta(x, x), "dy"),
                     (lambda: jn.layer_norm_backward_from_normalized(x, None, x, rows),
                      "grad_output"),
                     (lambda: jn.rms_norm_fwd(x, 8), "x"),
                     (lambda: jn.rms_norm_backward(x, x, 8, rows), "x"),
                     (lambda: jn.rms_norm(x), "x")):
      _raises(TypeError, fn, name, "float64", "cast to float32")


def test_traced_scale_offset_is_refused_under_jit():
  f = jax.jit(lambda x, w, s: jn.rms_norm(x, w, scale_offset=s))
  _raises(TypeError, lambda: f(X, H, 1.0), "scale_offset", "static")


def test_checks_run_at_trace_time():
  """Shape errors surface while tracing under jit, before any kernel runs."""
  f = jax.jit(lambda dy, x: jn.layer_norm_grad_beta(dy, x))
  _raises(ValueError, lambda: f.lower(X, z((2, 3, 9))), "dy")


def test_accepted_variants():
  """The documented alternatives are accepted: [B, S, 1] statistics, no gamma, float32 std and weight."""
  xb = X.astype(BF16)
  jn.layer_norm_grad(X, X, z((2, 3, 1)), ROWS, None, 1e-5)
  jn.layer_norm_backward_from_normalized(xb, H, xb, z((2, 3, 1)))
  jn.layer_norm_backward_from_normalized(xb, None, xb, ROWS.astype(BF16))
  jn.rms_norm_backward(xb, xb, 8, np.zeros(6, np.float32), H.astype(BF16), (False, False))
  jn.rms_norm(X, H, scale_offset=np.float32(1.0))


@pytest.mark.usefixtures("cpu_device")  # the CPU handlers' test
@pytest.mark.parametrize("target", ["jax_normgrad_layer_norm_fwd", "jax_normgrad_layer_norm_bwd"])
def test_kernels_check_sizes(target):
  """The C++ handlers refuse inconsistent operands with an error, never a crash."""
  from jax_normgrad import _ffi

  x = jnp.zeros((4, 8), F32)
  if target.endswith("fwd"):
    outs = [jax.ShapeDtypeStruct((4, 8), F32), jax.ShapeDtypeStruct((0,), F32),
            jax.ShapeDtypeStruct((4,), F32), jax.ShapeDtypeStruct((5, 8), F32),
            jax.ShapeDtypeStruct((0,), F32)]
    call = lambda: _ffi.call(target, outs, x, None, None, None, eps=1e-5, param_groups=1,
                             has_weight=False, has_bias=False, centered=False, write_xhat=True,
                             has_residual=False)
  else:
    outs = [jax.ShapeDtypeStruct((4, 8), F32), jax.ShapeDtypeStruct((0,), F32),
            jax.ShapeDtypeStruct((0,), F32), jax.ShapeDtypeStruct((0,), F32),
            jax.ShapeDtypeStruct((0,), F32)]
    # normalized with dx computed needs an (M,) rstd; give it an empty one.
    call = lambda: _ffi.call(target, outs, x, x, None, jnp.zeros((0,), F32), None, None,
                             param_groups=1, has_weight=False, compute_dx=True,
                             compute_dweight=False, compute_dbias=False, centered=True,
                             normalized=True, write_xhat=False, has_dh=False, write_dx_dy=False)
  with pytest.raises(Exception, match="xhat|rstd"):
    jax.block_until_ready(jax.jit(call)())
