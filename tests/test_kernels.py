"""The real kernels are used: custom calls in the lowered text, FFI error handling, announced fallbacks."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import jax_normgrad as jn
from jax_normgrad import _ffi

# These are the CPU kernels' tests: on the CPU device wherever the suite runs.
pytestmark = pytest.mark.usefixtures("cpu_device")


x = jnp.ones((8, 32), jnp.float32)
w = jnp.ones((32,), jnp.float32)
gx = jnp.ones((2, 8, 3, 3), jnp.float32)


def _ln_loss(implementation):
  return lambda x, w: jnp.sum(jn.layer_norm(x, w, w, implementation=implementation) ** 2)


def _gn_loss(implementation):
  return lambda x, w: jnp.sum(jn.group_norm(x, 4, w[:8], w[:8], implementation=implementation) ** 2)


@pytest.mark.parametrize("loss,args,op", [(_ln_loss, (x, w), "layer_norm"), (_gn_loss, (gx, w), "group_norm")])
def test_default_cpu_path_is_the_custom_call(loss, args, op):
  text = jax.jit(jax.grad(loss(None), argnums=(0, 1))).lower(*args).as_text()
  assert f"custom_call @jax_normgrad_{op}_fwd" in text
  assert f"custom_call @jax_normgrad_{op}_bwd" in text
  forced = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1))).lower(*args).as_text()
  assert f"custom_call @jax_normgrad_{op}_bwd" in forced


@pytest.mark.parametrize("loss,args", [(_ln_loss, (x, w)), (_gn_loss, (gx, w))])
def test_xla_implementation_has_no_custom_call(loss, args):
  text = jax.jit(jax.grad(loss("xla"), argnums=(0, 1))).lower(*args).as_text()
  assert "custom_call @jax_normgrad_" not in text


def test_backward_ops_lower_to_custom_call():
  mean = jnp.zeros((8,))
  f = jax.jit(lambda dy, x: jn.layer_norm_backward(dy, x, 32, mean, mean + 1, w))
  assert "custom_call @jax_normgrad_layer_norm_bwd" in f.lower(x, x).as_text()
  g = jax.jit(lambda dy, x: jn.group_norm_backward(dy, x, jnp.zeros((2, 4)), jnp.ones((2, 4)),
                                                   None, 2, 8, 9, 4))
  assert "custom_call @jax_normgrad_group_norm_bwd" in g.lower(gx, gx).as_text()


def test_16bit_layer_norm_parameters_reach_the_kernels_unconverted():
  """A 16-bit weight and bias are the custom calls' operands as they are (no float32 copy first)."""
  x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  text = jax.jit(jax.grad(lambda x, w: jnp.sum(jn.layer_norm(x, w, w).astype(jnp.float32) ** 2),
                          argnums=(0, 1))).lower(x16, w16).as_text()
  calls = [l for l in text.splitlines() if "custom_call @jax_normgrad_layer_norm" in l]
  assert len(calls) == 2
  # x, (no residual), w, b
  assert "(tensor<8x32xbf16>, tensor<0xf32>, tensor<1x32xbf16>, tensor<1x32xbf16>) ->" in calls[0]
  assert "tensor<8xf32>, tensor<1x32xbf16>, tensor<0xf32>) ->" in calls[1]  # ..., rstd, w, (no dh)
  assert "convert" not in text.split("custom_call @jax_normgrad_layer_norm_fwd")[0]


# Row tasks with per-task partials and parameters widened to float32 copies
# (>= 32 rows per parameter row), long rows by column chunks (1 and 2 rows,
# fewer than kMinRowsForRowTasks) and per-example parameters (param_groups,
# 4 rows each), both reading the 16-bit parameters in place.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,h,groups", [(301, 67, 1), (1, 40_013, 1), (2, 33_001, 1),
                                           (12, 130, 3)])
@pytest.mark.parametrize("has_weight,has_bias", [(True, True), (True, False), (False, True)])
def test_16bit_layer_norm_parameters_compute_as_float32_ones(dtype, rows, h, groups, has_weight,
                                                             has_bias):
  """The kernels read 16-bit parameters exactly: every output bitwise that of the float32 copies."""
  from jax_normgrad._operands import NormBwd, NormFwd
  from jax_normgrad.primitives.layer_norm import layer_norm_bwd_p, layer_norm_fwd_p
  keys = jax.random.split(jax.random.PRNGKey(rows + h), 4)
  xs = jax.random.normal(keys[0], (rows, h), dtype) * 2 + 0.5
  dy = jax.random.normal(keys[1], (rows, h), dtype)
  params = [jax.random.normal(k, (groups, h), dtype) if p else None
            for k, p in zip(keys[2:], (has_weight, has_bias))]
  fwd = dict(eps=1e-5, centered=True, param_groups=groups, write_xhat=False, y_dtype=None,
             implementation="ffi")
  bwd = dict(centered=True, output_mask=(True, True, True), param_groups=groups,
             normalized=False, write_xhat=False, implementation="ffi")
  outs = {}
  for name, (w, b) in (("16-bit", params),
                       ("float32", [None if p is None else p.astype(jnp.float32) for p in params])):
    y, mean, rstd = cases.bind(layer_norm_fwd_p, NormFwd(xs, None, w, b), **fwd)
    assert y.dtype == dtype
    outs[name] = [y, mean, rstd, *cases.bind(layer_norm_bwd_p, NormBwd(dy, xs, mean, rstd, w),
                                             **bwd)]
  for a, b in zip(outs["16-bit"], outs["float32"]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_channels_last_forward_drops_y_where_unused():
  # A channels-last forward is two calls, statistics then y, so that XLA
  # drops y's pass when nothing reads y (as it drops jnp code): jax.grad of
  # vdot(y, dy) needs only the statistics.
  xl = jax.random.normal(jax.random.key(0), (3, 5, 7, 16))
  dy = jax.random.normal(jax.random.key(1), xl.shape)
  wl = jnp.linspace(0.5, 1.5, 16)
  loss = lambda x, w: jnp.vdot(jn.group_norm(x, 4, w, w, channel_axis=-1), dy)
  dead = jax.jit(jax.grad(loss, argnums=(0, 1)))
  live = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  dead_text = dead.lower(xl, wl).compile().as_text()
  live_text = live.lower(xl, wl).compile().as_text()
  for text in (dead_text, live_text):
    assert 'custom_call_target="jax_normgrad_group_norm_fwd"' in text
    assert 'custom_call_target="jax_normgrad_group_norm_bwd"' in text
  assert 'custom_call_target="jax_normgrad_group_norm_apply"' not in dead_text
  assert 'custom_call_target="jax_normgrad_group_norm_apply"' in live_text
  for a, b in zip(dead(xl, wl), live(xl, wl)[1]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_fwd_with_empty_y_gives_the_same_statistics(channels_last):
  # The statistics-only call (an empty y) is the full forward minus y, bitwise.
  xg = jax.random.normal(jax.random.key(2), (3, 37, 24) if channels_last else (3, 24, 37)) + 3.0
  stats = _sds((3, 6))
  attrs = dict(eps=1e-5, group=6, param_groups=1, channels_last=channels_last,
               has_weight=False, has_bias=False, activation=0)
  _, mean, rstd = _raw("jax_normgrad_group_norm_fwd", [_sds(xg.shape), stats, stats], xg, None,
                       None, **attrs)
  y0, mean0, rstd0 = _raw("jax_normgrad_group_norm_fwd", [_sds((0,)), stats, stats], xg, None,
                          None, **attrs)
  assert y0.shape == (0,)
  np.testing.assert_array_equal(mean0, mean)
  np.testing.assert_array_equal(rstd0, rstd)


def test_registered_targets():
  assert _ffi.available()
  assert set(_ffi.TARGETS) == set(_ffi._ext.registrations())


def test_ffi_on_other_platform_raises():
  f = jax.jit(_ln_loss("ffi"))
  with pytest.raises(ValueError, match="implementation='ffi'"):
    jax.export.export(f, platforms=["tpu"])(x, w)


# The C++ handlers check what they rely on and return an FFI error (never crash).
def _raw(target, out_types, *operands, **attrs):
  return jax.jit(lambda *ops: _ffi.call(target, out_types, *ops, **attrs))(*operands)


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


BAD_FFI_CALLS = [
    # rstd of the wrong length.
    ("jax_normgrad_layer_norm_bwd", [_sds((4, 8)), _sds((1, 8)), _sds((1, 8)), _sds((0,)), _sds((0,))],
     (np.ones((4, 8), np.float32), np.ones((4, 8), np.float32), np.ones(4, np.float32),
      np.ones(3, np.float32), None, None),
     dict(param_groups=1, has_weight=False, compute_dx=True, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=False,
          write_dx_dy=False), "rstd"),
    # dy neither x's dtype nor float32 (with a 16-bit x; a float32 x takes any).
    ("jax_normgrad_layer_norm_bwd", [_sds((4, 8), jnp.bfloat16), _sds((1, 8)), _sds((1, 8)),
                                     _sds((0,), jnp.bfloat16), _sds((0,))],
     (np.ones((4, 8), np.float16), np.ones((4, 8), jnp.bfloat16), np.ones(4, np.float32),
      np.ones(4, np.float32), None, None),
     dict(param_groups=1, has_weight=False, compute_dx=True, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=False,
          write_dx_dy=False), "grad_out"),
    # y neither x's dtype nor float32.
    ("jax_normgrad_layer_norm_fwd", [_sds((4, 8), jnp.float16), _sds((4,)), _sds((4,)),
                                     _sds((0,), jnp.bfloat16), _sds((0,), jnp.bfloat16)],
     (np.ones((4, 8), jnp.bfloat16), None, None, None),
     dict(eps=1e-5, param_groups=1, has_weight=False, has_bias=False, centered=True,
          write_xhat=False, has_residual=False),
     "y: dtype must be x's or float32"),
    # weight and bias of different dtypes.
    ("jax_normgrad_layer_norm_fwd", [_sds((4, 8), jnp.bfloat16), _sds((4,)), _sds((4,)),
                                     _sds((0,), jnp.bfloat16), _sds((0,), jnp.bfloat16)],
     (np.ones((4, 8), jnp.bfloat16), None, np.ones((1, 8), jnp.bfloat16), np.ones((1, 8), np.float32)),
     dict(eps=1e-5, param_groups=1, has_weight=True, has_bias=True, centered=True,
          write_xhat=False, has_residual=False),
     "bias: dtype must match weight's"),
    # a weight neither x's dtype nor float32.
    ("jax_normgrad_layer_norm_bwd", [_sds((4, 8), jnp.bfloat16), _sds((1, 8)), _sds((1, 8)),
                                     _sds((0,), jnp.bfloat16), _sds((0,))],
     (np.ones((4, 8), jnp.bfloat16), np.ones((4, 8), jnp.bfloat16), np.ones(4, np.float32),
      np.ones(4, np.float32), np.ones((1, 8), np.float16), None),
     dict(param_groups=1, has_weight=True, compute_dx=True, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=False,
          write_dx_dy=False),
     "weight: dtype must be x's or float32"),
    # param_groups that does not divide the rows.
    ("jax_normgrad_layer_norm_fwd", [_sds((4, 8)), _sds((4,)), _sds((4,)), _sds((0,)), _sds((0,))],
     (np.ones((4, 8), np.float32), None, None, None),
     dict(eps=1e-5, param_groups=3, has_weight=False, has_bias=False, centered=True,
          write_xhat=False, has_residual=False),
     "param_groups"),
    # integer x.
    ("jax_normgrad_layer_norm_fwd", [_sds((4, 8), jnp.int32), _sds((4,)), _sds((4,)),
                                     _sds((0,), jnp.int32), _sds((0,), jnp.int32)],
     (np.ones((4, 8), np.int32), None, None, None),
     dict(eps=1e-5, param_groups=1, has_weight=False, has_bias=False, centered=True,
          write_xhat=False, has_residual=False),
     "unsupported dtype"),
    # a residual of the wrong size.
    ("jax_normgrad_layer_norm_fwd", [_sds((4, 8)), _sds((4,)), _sds((4,)), _sds((0,)), _sds((4, 8))],
     (np.ones((4, 8), np.float32), np.ones((3, 8), np.float32), None, None),
     dict(eps=1e-5, param_groups=1, has_weight=False, has_bias=False, centered=True,
          write_xhat=False, has_residual=True), "residual"),
    # an h neither x's dtype nor float32.
    ("jax_normgrad_layer_norm_fwd", [_sds((4, 8), jnp.bfloat16), _sds((4,)), _sds((4,)),
                                     _sds((0,), jnp.bfloat16), _sds((4, 8), jnp.float16)],
     (np.ones((4, 8), jnp.bfloat16), np.ones((4, 8), jnp.bfloat16), None, None),
     dict(eps=1e-5, param_groups=1, has_weight=False, has_bias=False, centered=True,
          write_xhat=False, has_residual=True), "h: dtype must be x's or float32"),
    # dh without dx.
    ("jax_normgrad_layer_norm_bwd", [_sds((0,)), _sds((1, 8)), _sds((1, 8)), _sds((0,)), _sds((0,))],
     (np.ones((4, 8), np.float32), np.ones((4, 8), np.float32), np.ones(4, np.float32),
      np.ones(4, np.float32), None, np.ones((4, 8), np.float32)),
     dict(param_groups=1, has_weight=False, compute_dx=False, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=True,
          write_dx_dy=False),
     "dh"),
    # dx in dy's dtype without dx.
    ("jax_normgrad_layer_norm_bwd", [_sds((0,)), _sds((1, 8)), _sds((1, 8)), _sds((0,)),
                                     _sds((4, 8), jnp.bfloat16)],
     (np.ones((4, 8), jnp.bfloat16), np.ones((4, 8), np.float32), np.ones(4, np.float32),
      np.ones(4, np.float32), None, None),
     dict(param_groups=1, has_weight=False, compute_dx=False, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=False,
          write_dx_dy=True),
     "grad_input_dy_dtype: needs grad_input"),
    # dx in dy's dtype, in another dtype.
    ("jax_normgrad_layer_norm_bwd", [_sds((4, 8)), _sds((1, 8)), _sds((1, 8)), _sds((0,)),
                                     _sds((4, 8), jnp.float16)],
     (np.ones((4, 8), jnp.bfloat16), np.ones((4, 8), np.float32), np.ones(4, np.float32),
      np.ones(4, np.float32), None, None),
     dict(param_groups=1, has_weight=False, compute_dx=True, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=False,
          write_dx_dy=True),
     "grad_input_dy_dtype: dtype must match grad_out"),
    # dh with a float32 dy of a 16-bit x (no residual form brings it; not compiled).
    ("jax_normgrad_layer_norm_bwd", [_sds((4, 8), jnp.bfloat16), _sds((1, 8)), _sds((1, 8)),
                                     _sds((0,), jnp.bfloat16), _sds((0,))],
     (np.ones((4, 8), np.float32), np.ones((4, 8), jnp.bfloat16), np.ones(4, np.float32),
      np.ones(4, np.float32), None, np.ones((4, 8), jnp.bfloat16)),
     dict(param_groups=1, has_weight=False, compute_dx=True, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=True,
          write_dx_dy=False),
     "dh: needs grad_out in x's dtype"),
    # dx in dy's dtype where dy is x's (float32) dtype: only for a 16-bit dy of a float32 x.
    ("jax_normgrad_layer_norm_bwd", [_sds((4, 8)), _sds((1, 8)), _sds((1, 8)), _sds((0,)),
                                     _sds((4, 8))],
     (np.ones((4, 8), np.float32), np.ones((4, 8), np.float32), np.ones(4, np.float32),
      np.ones(4, np.float32), None, None),
     dict(param_groups=1, has_weight=False, compute_dx=True, compute_dweight=True,
          compute_dbias=True, centered=True, normalized=False, write_xhat=False, has_dh=False,
          write_dx_dy=True),
     "grad_input_dy_dtype: needs a float32 x and a 16-bit grad_out"),
    # group that does not divide C.
    ("jax_normgrad_group_norm_bwd", [_sds((2, 6, 5)), _sds((1, 6)), _sds((1, 6))],
     (np.ones((2, 6, 5), np.float32), np.ones((2, 6, 5), np.float32), np.ones((2, 4), np.float32),
      np.ones((2, 4), np.float32), None, None),
     dict(group=4, param_groups=1, channels_last=False, has_gamma=False, has_beta=False,
          activation=0, compute_dx=True, compute_dgamma=True, compute_dbeta=True), "group"),
    # beta given to a backward without an activation (it would be ignored).
    ("jax_normgrad_group_norm_bwd", [_sds((2, 6, 5)), _sds((1, 6)), _sds((1, 6))],
     (np.ones((2, 6, 5), np.float32), np.ones((2, 6, 5), np.float32), np.ones((2, 3), np.float32),
      np.ones((2, 3), np.float32), None, np.ones((1, 6), np.float32)),
     dict(group=3, param_groups=1, channels_last=False, has_gamma=False, has_beta=True,
          activation=0, compute_dx=True, compute_dgamma=True, compute_dbeta=True), "beta"),
    # gamma said present but missing.
    ("jax_normgrad_group_norm_fwd", [_sds((2, 6, 5)), _sds((2, 3)), _sds((2, 3))],
     (np.ones((2, 6, 5), np.float32), None, None),
     dict(eps=1e-5, group=3, param_groups=1, channels_last=False, has_weight=True,
          has_bias=False, activation=0), "weight"),
    # an unknown activation code.
    ("jax_normgrad_group_norm_fwd", [_sds((2, 6, 5)), _sds((2, 3)), _sds((2, 3))],
     (np.ones((2, 6, 5), np.float32), None, None),
     dict(eps=1e-5, group=3, param_groups=1, channels_last=False, has_weight=False,
          has_bias=False, activation=7), "activation"),
    # statistics of the wrong length.
    ("jax_normgrad_group_norm_apply", [_sds((2, 5, 6))],
     (np.ones((2, 5, 6), np.float32), np.ones((2, 2), np.float32), np.ones((2, 3), np.float32),
      None, None),
     dict(group=3, param_groups=1, has_weight=False, has_bias=False, activation=0), "mean"),
    # a y of the wrong size (neither empty nor x's).
    ("jax_normgrad_group_norm_fwd", [_sds((7,)), _sds((2, 3)), _sds((2, 3))],
     (np.ones((2, 6, 5), np.float32), None, None),
     dict(eps=1e-5, group=3, param_groups=1, channels_last=True, has_weight=False,
          has_bias=False, activation=0), "y"),
]


@pytest.mark.parametrize("target,out_types,operands,attrs,match", BAD_FFI_CALLS)
def test_ffi_handlers_return_errors(target, out_types, operands, attrs, match):
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(_raw(target, out_types, *operands, **attrs))


@pytest.mark.parametrize("x_dtype,dy_dtype,flag", [
    (jnp.bfloat16, jnp.float32, "dh"), (jnp.float32, jnp.float32, "write_dx_dy"),
    (jnp.bfloat16, jnp.bfloat16, "write_dx_dy"), (jnp.bfloat16, jnp.float32, "write_dx_dy")])
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_residual_flags_refuse_other_dtypes(x_dtype, dy_dtype, flag, implementation):
  """The backward primitive's residual-form flags take the residual form's dtypes only, on every
  backend (the C++ kernels are compiled for those only; their handler refuses the rest too)."""
  from jax_normgrad._operands import NormBwd
  from jax_normgrad.primitives.layer_norm import layer_norm_bwd_p
  x, dy = jnp.ones((4, 8), x_dtype), jnp.ones((4, 8), dy_dtype)
  mean, rstd = jnp.zeros((4,), jnp.float32), jnp.ones((4,), jnp.float32)
  dh = x if flag == "dh" else None
  with pytest.raises(TypeError, match=flag):
    jax.eval_shape(lambda *a: cases.bind(
        layer_norm_bwd_p, NormBwd(*a), centered=True, output_mask=(True, False, False),
        param_groups=1, normalized=False, write_xhat=False, implementation=implementation,
        write_dx_dy=flag == "write_dx_dy"), dy, x, mean, rstd, None, dh)


def _default_isa() -> str:
  from jax_normgrad import _ffi
  return _ffi.isa()


def _isa_builds() -> dict[str, bool]:
  """{build name: whether this CPU runs it} of the extension's kernel builds."""
  from jax_normgrad import _jax_normgrad
  return dict(_jax_normgrad.isa_builds())


def _cpu_best_isa() -> str:
  """The best kernel build this CPU runs, by /proc/cpuinfo (not by the module's own checks)."""
  for name in ("avx512bf16", "avx2"):
    if _cpu_has(*_ISA_BUILDS[name][1]):
      return name
  return "generic"


def test_isa_selection():
  """The best build the CPU runs is the default; JAX_NORMGRAD_ISA picks another, or fails clearly.

  Every build has the baseline ("generic") kernels last, but .ci/sanitize's, which has only the
  one its CPU selects (CMake's JAX_NORMGRAD_GENERIC=OFF). A build for the host (CMake's
  JAX_NORMGRAD_ISAS=host, a source install's) has the best one this CPU runs and no other but
  generic; one with them all (=all, .ci/isa-builds) has each the compiler makes. A name the
  install has no build of, or whose build the CPU does not run, fails the import, naming it.
  """
  import os
  import subprocess
  import sys
  from jax_normgrad import _jax_normgrad
  builds = _isa_builds()
  order = list(builds)  # best first
  if _jax_normgrad.sanitizers and "generic" not in builds:
    assert order == [_default_isa()] and builds[order[0]], builds
  else:
    assert order[-1] == "generic" and builds["generic"]
  assert _default_isa() == next(name for name in order if builds[name])
  best = _cpu_best_isa()
  if _jax_normgrad.isas_requested == "host":
    # A compiler without -mavx512bf16 makes the AVX2 build the best it has for such a CPU.
    assert _default_isa() == best or (best, _default_isa()) == ("avx512bf16", "avx2"), builds
    assert set(builds) <= {_default_isa(), "generic"}, builds
  elif _jax_normgrad.isas_requested == "all" and best != "generic":
    assert {"avx2", "generic"} <= set(builds), builds
  probe = "import jax_normgrad._ffi as f; print(f.isa())"
  for forced in ["", "generic", "avx2", "avx512bf16", "no-such-isa"]:
    got = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, JAX_NORMGRAD_ISA=forced),
                         capture_output=True, text=True)
    if not forced or builds.get(forced):
      assert got.returncode == 0, (forced, got.stderr[-2000:])
      assert got.stdout.strip() == (forced or _default_isa()), (forced, got.stdout)
    else:
      assert got.returncode != 0, (forced, got.stdout)
      assert f"ValueError: JAX_NORMGRAD_ISA={forced}: " in got.stderr, (forced, got.stderr[-2000:])


def test_isa_builds_share_only_baseline_code():
  """The FFI decoding the kernel builds share is compiled for the baseline ISA.

  Each build's kernels live in a namespace of their own (``jax_normgrad::avx2::``) with
  handler symbols of their own (``JngLayerNormFwd_avx2``), but the XLA FFI headers'
  ``Handler<...>`` class, whose virtual ``Call`` decodes a call's arguments, is the same type
  in every build (the implementations' signatures agree): each build emits a copy and the
  linker keeps one, the first in link order, behind every build's handler. Registration calls
  the selected build's handler, so that copy runs on any CPU the package imports on.
  csrc/CMakeLists.txt links the builds baseline first, so that copy is the generic build's
  (linked best first, it is the AVX-512 build's: an illegal instruction at import on a CPU
  without AVX-512). The disassembly (binutils' objdump) of these virtual functions has no
  AVX instruction: no VEX/EVEX mnemonic (``v...``), no ymm/zmm register.
  """
  import platform
  import re
  import shutil
  import subprocess
  from jax_normgrad import _jax_normgrad
  if platform.machine() not in ("x86_64", "AMD64") or len(_isa_builds()) < 2:
    pytest.skip("one kernel build only: no code is shared between builds")
  objdump = shutil.which("objdump")
  if objdump is None:
    pytest.skip("no objdump (binutils) to disassemble the extension")
  text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", _jax_normgrad.__file__],
                        check=True, capture_output=True, text=True).stdout
  virtual = re.compile(r"^xla::ffi::Handler<.*>::(Call\(XLA_FFI_CallFrame\*\) const|~Handler\(\))")
  avx = re.compile(r"\tv[a-z0-9]+\s|%[yz]mm\d")
  checked, offenders, function = 0, {}, None
  for line in text.splitlines():
    header = re.match(r"[0-9a-f]+ <(.*)>:$", line)
    if header:
      function = header.group(1) if virtual.match(header.group(1)) else None
      checked += function is not None
    elif function is not None and avx.search(line):
      offenders.setdefault(function, line.strip())
  assert checked >= 5, f"found {checked} FFI handler methods in the disassembly"
  assert not offenders, (f"{len(offenders)} of {checked} FFI handler methods use AVX: "
                         + "; ".join(f"{f[:60]}...: {i}" for f, i in offenders.items()))


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_other_isa_builds_are_correct_too(isa):
  """Each kernel build the CPU runs besides the default (the baseline ISA on any CPU; the AVX2 one
  where AVX-512 BF16's build is the default) passes the op suites."""
  import os
  import subprocess
  import sys
  if not _isa_builds().get(isa):
    # A source install has the generic build and the best one its CPU runs; .ci/isa-builds
    # tests the build with them all.
    pytest.skip(f"this CPU or build has no {isa} kernels")
  if isa == _default_isa():
    pytest.skip(f"{isa} is the default build here, tested by the whole suite")
  env = cases.child_env(JAX_NORMGRAD_ISA=isa)
  here = os.path.dirname(__file__)
  code = f"import jax_normgrad._ffi as f; assert f.isa() == {isa!r}, f.isa()"
  subprocess.run([sys.executable, "-c", code], env=env, check=True)
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
       os.path.join(here, "test_layer_norm.py"), os.path.join(here, "test_group_norm.py"),
       os.path.join(here, "test_streaming.py"), os.path.join(here, "test_add_norm.py"),
       "-k", "(Default and (backward or forward) and not long_row) or stream"],
      env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _cpu_has(*flags: str) -> bool:
  """Whether this is an x86 CPU whose /proc/cpuinfo lists every one of ``flags`` (e.g. "f16c")."""
  import platform
  if platform.machine() not in ("x86_64", "AMD64"):
    return False
  try:
    with open("/proc/cpuinfo") as f:
      info = f.read()
  except OSError:
    return False
  return all(f" {flag}" in info for flag in flags)


def _run_csrc_check(name: str, isa_flags: list[str]) -> None:
  """Compiles tests/csrc/<name>.cc against csrc/ with ``isa_flags`` and runs it; it exits 0 when all match."""
  import os
  import subprocess
  import tempfile
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as tmp:
    exe = os.path.join(tmp, name)
    cases.build_against_csrc(os.path.join(root, "tests", "csrc", name + ".cc"), exe,
                             ["-O2", *isa_flags])
    result = subprocess.run([exe], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout


# The kernel builds (CMakeLists.txt's JNG_ISA_FLAGS_<isa>), with the CPU
# flags (/proc/cpuinfo's names) each needs to run here.
_ISA_BUILDS = {
    "generic": (["-DJNG_ISA=generic"], []),
    "avx2": (["-DJNG_ISA=avx2", "-mavx2", "-mfma", "-mf16c"], ["avx2", "fma", "f16c"]),
    "avx512bf16": (["-DJNG_ISA=avx512bf16", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl",
                    "-mavx512dq", "-mavx512bf16"],
                   ["avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512dq", "avx512_bf16"]),
}


def test_generic_isa_float16_conversions_match_f16c():
  """The SSE2 build's float16 conversions (integer vector code, no F16C) equal F16C's, bit for bit.

  Compiles tests/csrc/f16_conversions.cc against csrc/ with the baseline ISA
  and runs it: every float16 widened, and float32 values on both sides of
  every rounding tie narrowed, against the F16C instructions.
  """
  if not _cpu_has("f16c"):
    pytest.skip("needs an x86 CPU with F16C to compare with")
  _run_csrc_check("f16_conversions", _ISA_BUILDS["generic"][0])


@pytest.mark.parametrize("isa", sorted(_ISA_BUILDS))
def test_bfloat16_vector_conversions_match_scalar(isa):
  """Each build's bfloat16 vector load and rounding store equal the scalar conversions, bit for bit.

  Compiles tests/csrc/bf16_conversions.cc for the build and runs it: every
  bfloat16 widened, and every float32 high part with low parts around the
  ties (and every NaN, whose payload the rounding must not carry into the
  sign) narrowed, against common.h's ToFloat / FromFloat<BF16>.
  """
  flags, needs = _ISA_BUILDS[isa]
  if not _cpu_has(*needs):
    pytest.skip(f"the {isa} build needs an x86 CPU with {needs}")
  _run_csrc_check("bf16_conversions", flags)


@pytest.mark.skipif(not _cpu_has(*_ISA_BUILDS["avx512bf16"][1]),
                    reason="the avx512bf16 build needs an x86 CPU with AVX-512 BF16")
def test_16_wide_vector_conversions_match_8_wide():
  """The avx512bf16 build's 16-wide loads and rounding stores equal its 8-wide ones, bit for bit.

  Compiles tests/csrc/wide_vectors.cc: every bfloat16 and float16 widened,
  and float32 values around every rounding tie narrowed, two high parts per
  vector (so a subnormal's exact fallback runs beside normal lanes).
  """
  _run_csrc_check("wide_vectors", _ISA_BUILDS["avx512bf16"][0])


# Layers whose outputs and gradients the builds must agree on bit for bit:
# (name, function of (x, w, b), x shape, parameter shape, dtype). Row lengths
# that are odd multiples of 8 put every other row's output off a 16-vector
# boundary (the avx512bf16 build's elementwise loops then start with one
# 8-wide vector); the others leave 8-wide and scalar tails; 2 x 40000 runs
# LayerNorm by column chunks; 64 x 520 bfloat16 widens the parameters. The
# residual form (x's rows rolled for the residual; y + h, so both count):
# a 16-bit h (stored, then normalized), rows of 3000 over two moments
# chunks, and a float32 h.
def _add_norm(fn, residual_dtype=None):
  def f(x, w, b):
    y, h = fn(x, jnp.roll(x, 1, axis=0), w, b, residual_dtype=residual_dtype)
    return y + h.astype(y.dtype)
  return f


_BUILD_CASES = [
    *((f"layer_norm {s} {d}", lambda x, w, b: jn.layer_norm(x, w, b), s, s[-1:], d)
      for s in [(5, 24), (7, 1000), (3, 1032), (2, 40_000), (64, 520)]
      for d in ["float32", "bfloat16", "float16"]),
    *((f"rms_norm {s} {d}", lambda x, w, b: jn.rms_norm(x, w), s, s[-1:], d)
      for s in [(5, 24), (6, 1003)] for d in ["float32", "bfloat16"]),
    *((f"group_norm {s} {d}", lambda x, w, b: jn.group_norm(x, 4, w, b), s, s[1:2], d)
      for s in [(2, 8, 3, 8), (2, 12, 5, 7), (1, 8, 40, 41)] for d in ["float32", "bfloat16"]),
    *((f"group_norm channels-last {s} {d}", lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1),
       s, s[-1:], d)
      for s in [(2, 3, 5, 24), (2, 4, 4, 1000), (2, 3, 3, 36)] for d in ["float32", "float16"]),
    *((f"add_layer_norm {s} {d}", _add_norm(jn.add_layer_norm), s, s[-1:], d)
      for s in [(5, 24), (7, 1000), (3, 3000), (64, 520)] for d in ["bfloat16", "float16"]),
    *((f"add_rms_norm {s} {d} float32 h", _add_norm(lambda x, r, w, b, **kw: jn.add_rms_norm(
        x, r, w, **kw), jnp.float32), s, s[-1:], d) for s in [(5, 24), (3, 1032)]
      for d in ["bfloat16"]),
]


def _build_case_outputs(index: int):
  """Forward output and (dx, dweight, dbias) of _BUILD_CASES[index], inputs from a fixed seed."""
  name, fn, shape, pshape, dtype = _BUILD_CASES[index]
  rng = np.random.default_rng(index)
  x, dy = (jnp.asarray(rng.standard_normal(shape) * 2 + 0.5, dtype) for _ in range(2))
  w, b = (jnp.asarray(rng.standard_normal(pshape), dtype) for _ in range(2))
  y, vjp = jax.vjp(jax.jit(fn), x, w, b)
  # As their bits (unsigned integers of the same width): npz keeps them all.
  return [np.asarray(a).view(f"u{np.dtype(a.dtype).itemsize}") for a in (y, *vjp(dy.astype(y.dtype)))]


def _write_build_outputs(path: str) -> None:
  np.savez(path, *(a for i in range(len(_BUILD_CASES)) for a in _build_case_outputs(i)))


def test_avx512bf16_build_computes_the_avx2_builds_bits():
  """The default build (16-wide elementwise loops) and the AVX2 build give the same bits.

  Forward outputs and all three gradients of every layer in _BUILD_CASES,
  the AVX2 build's computed in a subprocess (JAX_NORMGRAD_ISA=avx2). The
  row reductions are 8-wide on both; every elementwise loop computes each
  element by the same operations, whatever its vector width.
  """
  import os
  import subprocess
  import sys
  import tempfile
  builds = _isa_builds()
  if _default_isa() != "avx512bf16" or not builds.get("avx2"):
    pytest.skip("needs the avx512bf16 build as the default and the avx2 build (a source install "
                "has one of the two: .ci/isa-builds builds both)")
  here = os.path.dirname(os.path.abspath(__file__))
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "avx2.npz")
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_kernels as t; "
            f"import jax_normgrad._ffi as f; assert f.isa() == 'avx2', f.isa(); "
            f"t._write_build_outputs({path!r})")
    # JAX_PLATFORMS=cpu: on a GPU machine the child's default device would run the GPU kernels.
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, JAX_NORMGRAD_ISA="avx2", JAX_PLATFORMS="cpu"))
    with np.load(path) as got:
      theirs = [got[f"arr_{i}"] for i in range(len(got.files))]
  ours = [a for i in range(len(_BUILD_CASES)) for a in _build_case_outputs(i)]
  assert len(ours) == len(theirs)
  for k, (a, b) in enumerate(zip(ours, theirs)):
    name = _BUILD_CASES[k // 4][0]
    np.testing.assert_array_equal(a, b, err_msg=f"{name}: {('y', 'dx', 'dweight', 'dbias')[k % 4]}")
