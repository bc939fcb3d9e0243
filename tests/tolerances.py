"""The one per-dtype tolerance table of the test suite.

An output in dtype d computed with float32 accumulation and rounded once can
be off by d's rounding (``RTOL``, relative) plus the float32 accumulation
error, which grows with the number of reduced elements (``ATOL32`` times
sqrt(n) times the output's scale).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

#: Relative error of one rounding to the dtype (half an ulp: 2^-(mantissa bits + 1)).
RTOL = {
    jnp.dtype(jnp.float32): 2.0 ** -24,
    jnp.dtype(jnp.float16): 2.0 ** -11,
    jnp.dtype(jnp.bfloat16): 2.0 ** -8,
}
#: Float32 accumulation error per sqrt(reduced element), relative to the scale.
ATOL32 = 2e-6


def assert_close(actual, expected, dtype, reduced, name="", scale=None):
  """|actual - expected| <= RTOL[dtype] |expected| + ATOL32 sqrt(reduced) scale.

  ``scale`` defaults to max|expected|; pass the magnitude of the terms that
  cancel where the result is a small difference of large terms (grad_input).
  """
  actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), dtype=np.float64)
  expected = np.asarray(expected, dtype=np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  if expected.size == 0:
    return
  scale = max(float(np.max(np.abs(expected))), scale or 0.0, 1e-30)
  atol = ATOL32 * math.sqrt(max(reduced, 1)) * scale
  np.testing.assert_allclose(actual, expected, rtol=RTOL[jnp.dtype(dtype)], atol=atol, err_msg=name)


def assert_group_norm_close(outs, x, weight, bias, cotangent, groups, *, channels_last, dtype,
                            activation=None):
  """A GroupNorm layer's ``(y, dx, dweight, dbias)`` (``outs``, for a cotangent of y) against the
  float64 reference of the contract's math, each to this table's tolerance."""
  import reference_np as ref  # pylint: disable=g-import-not-at-top  (a sibling test helper)
  y, dx, dw, db = outs
  n = x.shape[0]
  c = x.shape[-1] if channels_last else x.shape[1]
  hw = x.size // (n * c)
  z, mean, rstd = ref.gn_fwd(x, weight, bias, n, c, hw, groups, channels_last=channels_last)
  dz = ref.f64(cotangent)
  if activation is not None:
    dz = dz * ref.activation_grad(z, activation)
  y_ref = z if activation is None else ref.activation(z, activation)
  dx_ref, dw_ref, db_ref = ref.gn_bwd(dz, x, mean, rstd, weight, n, c, hw, groups, channels_last)
  block = c // groups * hw
  assert_close(y, y_ref, dtype, block, "y", scale=ref.fwd_scales(x, rstd, weight)[0])
  assert_close(dx, dx_ref, dtype, block, "dx", scale=ref.dx_scale(dz, rstd, weight))
  assert_close(dw, dw_ref, jnp.float32, n * hw, "dweight", scale=float(np.abs(dz).max() * 4))
  assert_close(db, db_ref, jnp.float32, n * hw, "dbias")
