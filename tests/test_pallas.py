"""Pallas kernels: lowering for CUDA (Triton) and TPU (Mosaic) on CPU; both kernel sets interpreted.

No GPU or TPU is needed. ``jax.export`` lowers for a platform without one:
the tests check that the Pallas custom call is what runs there (no
fallback). The op suites run the GPU kernels interpreted; here the TPU
kernels are interpreted too, and both with tiny tiles so that chunked
segments, ragged blocks and idle steps are exercised on small inputs. The
RMSNorm variant (``centered=False``) is checked through its primitives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from jax_normgrad import reference
from jax_normgrad._operands import GroupNormBwd, GroupNormFwd, NormBwd, NormFwd
from jax_normgrad.pallas import config
from jax_normgrad.primitives.group_norm import group_norm_bwd_p, group_norm_fwd_p
from jax_normgrad.primitives.layer_norm import layer_norm_bwd_p, layer_norm_fwd_p
import cases
from cases import (DTYPES, MASKS, bind, export_for, needs_mosaic_gpu, norm_bwd_operands, random,
                   rotate)
import reference_np as ref
from tolerances import assert_close, assert_group_norm_close

F32 = jnp.float32
TRITON = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"cuda": TRITON, "tpu": "tpu_custom_call"}
PLATFORMS = ["cuda", "tpu"]


def _export_text(f, args, platform):
  """The StableHLO text of ``f`` exported for ``platform``; a fallback warning fails."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    exported = export_for(platform, jax.jit(f), args,
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])
  return exported.mlir_module()


def _assert_pallas(text, platform, kernels=("fwd", "bwd")):
  assert CUSTOM_CALL[platform] in text
  for k in kernels:
    assert f"jax_normgrad_norm_{k}" in text, k
  # Only the platform's own kernels are lowered, and no CPU FFI call.
  assert not any(CUSTOM_CALL[p] in text for p in PLATFORMS if p != platform)
  assert "custom_call @jax_normgrad_" not in text


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _grad_of(norm):
  return jax.grad(lambda x, w, b: jnp.sum(norm(x, w, b).astype(F32)), argnums=(0, 1, 2))


# ----------------------------------------------------------------------------
# Lowering for GPU and TPU


# One width per tile plan (config.gpu_plan, the TPU kernels' layout): a small tile of two
# stages (768 to 1000), a large one of one stage (4096 to 8192), and a backward in two
# chunks, whose TPU kernels chunk it too in bfloat16 (12288).
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hidden", [1000, 4096, 12288])
def test_layer_norm_grad_lowers_to_pallas(platform, dtype, hidden):
  text = _export_text(_grad_of(jn.layer_norm),
                      (_sds((4, 8, hidden), dtype), _sds((hidden,), dtype), _sds((hidden,), dtype)),
                      platform)
  _assert_pallas(text, platform)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_group_norm_grad_lowers_to_pallas(platform, dtype, channel_axis):
  shape = (8, 256, 32, 32) if channel_axis == 1 else (8, 32, 32, 256)
  norm = lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=channel_axis)
  text = _export_text(_grad_of(norm), (_sds(shape, dtype), _sds((256,), dtype),
                                       _sds((256,), dtype)), platform)
  _assert_pallas(text, platform)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_float32_result_of_bfloat16_x_lowers_to_pallas(platform):
  # out_dtype=float32 (Flax's promotion of a bfloat16 x with float32 parameters).
  bf = jnp.bfloat16
  ln = _grad_of(lambda x, w, b: jn.layer_norm(x, w, b, out_dtype=F32))
  _assert_pallas(_export_text(ln, (_sds((16, 1000), bf), _sds((1000,), F32), _sds((1000,), F32)),
                              platform), platform)
  gn = _grad_of(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1, out_dtype=F32))
  _assert_pallas(_export_text(gn, (_sds((2, 9, 9, 24), bf), _sds((24,), F32), _sds((24,), F32)),
                              platform), platform)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_with_batched_parameters_lowers_to_pallas(platform):
  # A batched weight makes param_groups = 3 inside the kernels.
  ln = jax.vmap(_grad_of(jn.layer_norm))
  _assert_pallas(_export_text(ln, (_sds((3, 16, 1000), F32), _sds((3, 1000), F32),
                                   _sds((3, 1000), F32)), platform), platform)
  gn = jax.vmap(_grad_of(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1)))
  _assert_pallas(_export_text(gn, (_sds((3, 2, 9, 9, 24), jnp.bfloat16),
                                   _sds((3, 24), jnp.bfloat16), _sds((3, 24), jnp.bfloat16)),
                              platform), platform)


@pytest.mark.parametrize("norm,shape", [
    (jn.layer_norm, (4, 8, 1000)),
    (lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=-1), (32, 16, 16, 64)),  # sample-wide
    (lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1), (2, 9, 9, 24)),
    (lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=1, activation="silu"), (2, 24, 9, 9)),
])
@pytest.mark.parametrize("argnums", [(0, 1, 2), (2,)])
def test_parameter_gradients_take_one_partials_launch(norm, shape, argnums):
  # dweight and dbias come out of one partial-sums kernel (a launch per norm, not per
  # parameter: inside a model's step on the GPU the launches cost more than the bytes).
  # (The layers' backward asks for all three gradients whichever are used.)
  c = shape[-1] if shape[-1] in (1000, 64, 24) else shape[1]
  f = jax.grad(lambda x, w, b: jnp.sum(norm(x, w, b).astype(F32)), argnums=argnums)
  text = _export_text(f, (_sds(shape, F32), _sds((c,), F32), _sds((c,), F32)), "cuda")
  _assert_pallas(text, "cuda")
  launches = sum("jax_normgrad_sum_partials" in line for line in text.splitlines()
                 if "custom_call" in line)
  assert launches == 1, launches


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("y_dtype", [None, F32])
def test_rms_norm_primitives_lower_to_pallas(platform, y_dtype):
  # y_dtype=float32: a bfloat16 x with a float32 y, and its float32 dy.
  def f(x, w, dy):
    y, rstd = bind(layer_norm_fwd_p, NormFwd(x, weight=w), eps=1e-6, centered=False,
                   param_groups=1, write_xhat=False, y_dtype=y_dtype, implementation=None)
    return bind(layer_norm_bwd_p, NormBwd(dy, x, rstd=rstd, weight=w), centered=False,
                output_mask=(True, True, False), param_groups=1, normalized=False,
                write_xhat=False, implementation=None) + [y]
  args = (_sds((64, 4096), jnp.bfloat16), _sds((1, 4096), F32),
          _sds((64, 4096), y_dtype or jnp.bfloat16))
  _assert_pallas(_export_text(f, args, platform), platform)


# ----------------------------------------------------------------------------
# Both kernel sets, interpreted; tiny tiles force chunks, ragged blocks, idle steps.


@contextlib.contextmanager
def _kernels(backend, tiny):
  """The implementation interpreting the ``backend`` ("gpu" / "tpu") kernels, with tiny tiles
  if asked."""
  cases.skip_unless_interpretable(backend)
  tuning = {}
  if tiny:
    tuning.update(gpu_max_tile_bwd=256, gpu_max_tile_fwd=256, tpu_block_elems=2048,
                  gpu_nhwc_max_tile_fwd=128, gpu_nhwc_max_tile_bwd=64)
  # The tuning is read when a function is lowered: the tests lower fresh
  # jax.jit(lambda ...) functions inside, so no compiled function is reused.
  with config.override(**tuning):
    yield "mosaic_tpu" if backend == "tpu" else "pallas"


def _f32(*arrays):
  return [None if a is None else a.astype(F32) for a in arrays]


def _names(mask):
  """The names of the outputs an output_mask asks for."""
  return [n for n, on in zip(("dx", "dweight", "dbias"), mask) if on]


# Every (backend, tiny tiles, centered) once, with dtype, output mask and the
# presence of weight rotating alongside.
LN_RUNS = rotate(list(itertools.product(["gpu", "tpu"], [False, True], [True, False])),
                 DTYPES, MASKS, [True, True, False])


@pytest.mark.parametrize("dtype,mask,has_weight,backend,tiny,centered", LN_RUNS)
def test_layer_norm_primitives_interpreted(rng, dtype, mask, has_weight, backend, tiny, centered):
  # 57 rows in 3 parameter groups (param_groups as under vmap), 300 per row:
  # not a power of two, longer than the tiny tiles, ragged row blocks.
  m, h, w = 57, 300, 3
  x = random(rng, (m, h), dtype, scale=2.0, offset=0.5)
  dy = random(rng, (m, h), dtype)
  weight = random(rng, (w, h), F32, offset=1.0) if has_weight else None
  bias = random(rng, (w, h), F32)
  kw = dict(centered=centered, param_groups=w)
  with _kernels(backend, tiny) as impl:
    y, *stats = jax.jit(lambda x, w, b: bind(
        layer_norm_fwd_p, NormFwd(x, None, w, b), eps=1e-5, write_xhat=False, y_dtype=None,
        implementation=impl, **kw))(x, weight, bias)
    outs = jax.jit(lambda dy, x, stats, w: bind(
        layer_norm_bwd_p, norm_bwd_operands(dy, x, stats, w), output_mask=mask,
        normalized=False, write_xhat=False, implementation=impl, **kw))(dy, x, stats, weight)
  # The float32 reference before the final rounding: only that rounding may differ.
  y_ref, *stats_ref = reference.layer_norm_fwd(*_f32(x, weight, bias), eps=1e-5, **kw)
  assert y.dtype == dtype and len(stats) == 1 + centered
  assert_close(y, y_ref, dtype, h, "y")
  for s, s_ref in zip(stats, stats_ref):
    assert_close(s, s_ref, F32, h, "mean/rstd")
  refs = reference.layer_norm_bwd(norm_bwd_operands(*_f32(dy, x), _f32(*stats), *_f32(weight)),
                                  output_mask=mask, **kw)
  assert len(outs) == len(refs) == sum(mask)
  for name, out, expected in zip(_names(mask), outs, refs):
    if name == "dx":
      assert out.dtype == dtype
      assert_close(out, expected, dtype, h, name, scale=ref.dx_scale(dy, stats[-1], weight))
    else:
      assert out.dtype == F32 and out.shape == (w, h)
      assert_close(out, expected, F32, m // w, name)


# (N, C, HW, group, channels_last, param_groups, tiny tiles): with tiny tiles,
# ragged chunks of the spatial axis in both layouts and of the channel axis
# (C/G = 40); with the default tiles, segments fused in one block. Channels-last
# groups of a few power-of-two channels run the GPU's sample-wide kernels
# (config.gpu_nhwc_plan; C = 12 and 48: padding groups, 24 of 2 channels
# padded to 32); groups of 24 channels (not a power of two) and of 16 float32
# ones (64 bytes) the per-group kernels.
GN_SHAPES = [
    (6, 12, 300, 3, False, 2, True),
    (6, 12, 300, 3, True, 2, True),
    (2, 40, 3, 1, False, 1, True),
    (4, 24, 20, 6, False, 1, False),
    (4, 24, 20, 6, True, 1, False),
    (6, 48, 50, 24, True, 3, True),
    (3, 48, 50, 2, True, 1, True),
    (2, 64, 30, 4, True, 1, False),
]
GN_RUNS = rotate([s + (b,) for s in GN_SHAPES for b in ("gpu", "tpu")], DTYPES, MASKS)


@pytest.mark.parametrize("dtype,mask,n,c,hw,group,channels_last,w,tiny,backend", GN_RUNS)
def test_group_norm_primitives_interpreted(rng, dtype, mask, n, c, hw, group, channels_last, w,
                                           tiny, backend):
  shape = (n, hw, c) if channels_last else (n, c, hw)
  x = random(rng, shape, dtype, scale=2.0, offset=-0.3)
  dy = random(rng, shape, dtype)
  gamma, beta = random(rng, (w, c), F32, offset=1.0), random(rng, (w, c), F32)
  kw = dict(group=group, channels_last=channels_last, param_groups=w)
  with _kernels(backend, tiny) as impl:
    y, mean, rstd = jax.jit(lambda x, g, b: bind(
        group_norm_fwd_p, GroupNormFwd(x, g, b), eps=1e-5, y_dtype=None, activation=None,
        implementation=impl, **kw))(
            x, gamma, beta)
    outs = jax.jit(lambda *a: bind(
        group_norm_bwd_p, GroupNormBwd(*a), activation=None, output_mask=mask,
        implementation=impl, **kw))(
            dy, x, mean, rstd, gamma)
  block = c // group * hw
  y_ref, mean_ref, rstd_ref = reference.group_norm_fwd(*_f32(x, gamma, beta), eps=1e-5, **kw)
  assert y.dtype == dtype and mean.shape == rstd.shape == (n, group)
  assert_close(y, y_ref, dtype, block, "y")
  assert_close(mean, mean_ref, F32, block, "mean")
  assert_close(rstd, rstd_ref, F32, block, "rstd")
  refs = reference.group_norm_bwd(GroupNormBwd(*_f32(dy, x, mean, rstd, gamma)),
                                  output_mask=mask, **kw)
  assert len(outs) == len(refs) == sum(mask)
  for name, out, expected in zip(_names(mask), outs, refs):
    if name == "dx":
      assert out.dtype == dtype
      assert_close(out, expected, dtype, block, name, scale=ref.dx_scale(dy, rstd, gamma))
    else:
      assert out.dtype == F32 and out.shape == (w, c)
      assert_close(out, expected, F32, n // w * hw, name)


@pytest.mark.parametrize("parts,activation", [(1, None), (2, "silu"), (13, None), (13, "gelu")])
def test_channels_last_sample_wide_kernels_split_and_vmapped(rng, parts, activation):
  """The GPU's sample-wide channels-last kernels (config.gpu_nhwc_plan) with each sample whole
  in a program or split in parts over two kernels (config.gpu_nhwc_parts), two parameter
  groups (vmap), ragged tiles and padding groups (C = 48 as 32 groups of 2 in a 64-wide tile):
  y, the statistics and every gradient against the float64 reference."""
  n, hw, c, g, w = 3, 50, 48, 24, 2
  x = random(rng, (w, n, hw, c), F32, 2.0, 0.3)
  dy = random(rng, x.shape, F32)
  gamma, beta = random(rng, (w, c), F32, offset=1.0), random(rng, (w, c), F32)
  plan = config.gpu_nhwc_plan(hw, c, c // g, 4, backward=False)
  assert plan is not None and plan.cols == 64
  tuning = dict(gpu_nhwc_max_tile_fwd=256, gpu_nhwc_max_tile_bwd=256,
                interpret_programs=3 if parts == 1 else parts * n)
  layer = lambda x, gm, bt: jn.group_norm(x, g, gm, bt, channel_axis=-1, activation=activation,
                                          implementation="pallas")
  with config.override(**tuning):
    jax.clear_caches()
    p = config.gpu_nhwc_parts(config.gpu_nhwc_plan(hw, c, 2, 4, backward=True), n,
                              interpret=True)
    assert p == parts, p
    y, pullback = jax.vjp(jax.vmap(layer), x, gamma, beta)
    dx, dgamma, dbeta = pullback(dy)
  jax.clear_caches()
  for k in range(w):
    assert_group_norm_close((y[k], dx[k], dgamma[k], dbeta[k]), x[k], gamma[k], beta[k], dy[k],
                            g, channels_last=True, dtype=F32, activation=activation)


@pytest.mark.parametrize("c,g,hw,parts,activation", [(60, 6, 50, 1, None), (40, 4, 30, 4, "silu")])
def test_channels_last_sample_wide_kernels_odd_groups(rng, c, g, hw, parts, activation):
  """``gpu_nhwc_odd_groups``: groups of 10 channels (not a power of two) in the sample-wide
  kernels, their columns summed by a 0/1 matrix; C = 60 (6 groups padded to 8, the padding
  channels 60-63 in a padding group) whole, C = 40 split in parts. y, the statistics and every
  gradient against the float64 reference."""
  n = 3
  x = random(rng, (n, hw, c), F32, 2.0, 0.3)
  dy = random(rng, x.shape, F32)
  gamma, beta = random(rng, (c,), F32, offset=1.0), random(rng, (c,), F32)
  tuning = dict(gpu_nhwc_odd_groups=True, gpu_nhwc_group_bytes=64, gpu_nhwc_group_bytes_fwd=64,
                gpu_nhwc_max_tile_fwd=256, gpu_nhwc_max_tile_bwd=256,
                interpret_programs=2 if parts == 1 else parts * n)
  with config.override(gpu_nhwc_odd_groups=False):  # the per-group tiles where it is off
    assert config.gpu_nhwc_plan(hw, c, c // g, 4, backward=True) is None
  layer = lambda x, gm, bt: jn.group_norm(x, g, gm, bt, channel_axis=-1, activation=activation,
                                          implementation="pallas")
  with config.override(**tuning):
    plan = config.gpu_nhwc_plan(hw, c, c // g, 4, backward=True)
    assert plan.odd_groups == 8 // (1 + (c == 40)) and plan.groups == plan.odd_groups
    assert config.gpu_nhwc_parts(plan, n, interpret=True) == parts
    jax.clear_caches()
    y, pullback = jax.vjp(layer, x, gamma, beta)
    dx, dgamma, dbeta = pullback(dy)
  jax.clear_caches()
  assert_group_norm_close((y, dx, dgamma, dbeta), x, gamma, beta, dy, g, channels_last=True,
                          dtype=F32, activation=activation)


@pytest.mark.parametrize("shape,kernels", [
    ((32, 32, 32, 64), ("fwd_nhwc_moments", "fwd_nhwc", "bwd_nhwc_sums", "bwd_nhwc")),
    # 8 float32 channels a group: 32 bytes, the per-group forward (gpu_nhwc_group_bytes_fwd).
    ((32, 8, 8, 256), ("fwd", "bwd_nhwc_sums", "bwd_nhwc")),
    # 10 float32 channels a group (not a power of two): the sample-wide backward (40 bytes a
    # group), the per-group forward (at least gpu_nhwc_group_bytes_fwd) ...
    ((4, 16, 16, 320), ("fwd", "bwd_nhwc_sums", "bwd_nhwc")),
    # ... and without gpu_nhwc_odd_groups, the per-group kernels both ways.
    ((4, 16, 16, 320, "per-group"), ("fwd", "bwd"))])
def test_channels_last_kernels_chosen_for_cuda(shape, kernels):
  """A UNet's GroupNorms (32 groups of 2 and 8 channels) lower to the sample-wide kernels, split
  where the batch alone leaves SMs idle; groups of 10 channels too (``gpu_nhwc_odd_groups``),
  or to the per-group ones where that is off."""
  odd = shape[-1] != "per-group"
  shape = shape[:4]
  c = shape[-1]
  gn = _grad_of(lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=-1))
  with config.override(gpu_nhwc_odd_groups=odd):
    text = _export_text(gn, (_sds(shape, F32), _sds((c,), F32), _sds((c,), F32)), "cuda")
  names = set(re.findall(r"jax_normgrad_norm_\w+", text))
  assert names == {f"jax_normgrad_norm_{k}" for k in kernels}, names


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_deterministic_across_programs(rng, backend):
  # Uneven rows per program and tiny tiles; four runs, bitwise equal.
  x, dy = random(rng, (301, 300), F32), random(rng, (301, 300), F32)
  stats = reference.layer_norm_fwd(x, eps=1e-5, centered=True, param_groups=1)[1:]
  with _kernels(backend, tiny=True) as impl:
    f = jax.jit(lambda *a: bind(
        layer_norm_bwd_p, NormBwd(*a), centered=True, output_mask=(True, True, True),
        param_groups=1, normalized=False, write_xhat=False, implementation=impl))
    first = [np.asarray(o) for o in f(dy, x, *stats)]
    for _ in range(3):
      for a, b in zip(first, f(dy, x, *stats)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("cols,tile", [(256, 256), (128, 512), (32, 4096), (8, 64)])
@pytest.mark.parametrize("w,p,c", [(1, 1, 1), (2, 3, 40), (1, 37, 300), (3, 16, 129)])
def test_sum_partials_tiles(rng, cols, tile, w, p, c):
  """The backward's partials reduction: the float32 sum over axis 1, whatever the tile
  (one row per step; tiles that overhang the last partial or the last column)."""
  from jax_normgrad.pallas import gpu  # pylint: disable=g-import-not-at-top
  parts = random(rng, (w, p, c), F32)
  with config.override(gpu_partials_cols=cols, gpu_partials_tile=tile):
    got = gpu._sum_partials(parts, interpret=True)  # pylint: disable=protected-access
  assert got.shape == (w, c) and got.dtype == F32
  np.testing.assert_allclose(np.asarray(got), np.asarray(parts, np.float64).sum(axis=1),
                             rtol=1e-5, atol=1e-5 * p)


@pytest.mark.parametrize("norm,shape", [
    (jn.layer_norm, (37, 300)),
    (functools.partial(jn.group_norm, num_groups=4, channel_axis=-1), (2, 5, 7, 24)),  # sample-wide
    (functools.partial(jn.group_norm, num_groups=4, channel_axis=1, activation="silu"),
     (2, 24, 5, 7)),
])
def test_partials_summed_in_xla(rng, norm, shape):
  """``gpu_partials_in_xla``: the parameter gradients' partials (20 programs' rows: the tree,
  not the chain) summed in XLA (no kernel of their own): the same gradients as the partials
  kernel's, to float32 reordering, and bitwise the same from call to call."""
  c = 24 if len(shape) == 4 else shape[-1]
  x, ct = random(rng, shape, F32, offset=0.5), random(rng, shape, F32)
  w, b = random(rng, (c,), F32, offset=1.0), random(rng, (c,), F32)
  loss = lambda w, b: jnp.sum(norm(x, weight=w, bias=b, implementation="pallas") * ct)
  grads = {}
  for in_xla in (False, True):
    with config.override(gpu_partials_in_xla=in_xla, interpret_programs=20):
      f = jax.jit(jax.grad(loss, argnums=(0, 1)))
      grads[in_xla] = [np.asarray(g) for g in f(w, b)]
      again = f(w, b)
    jax.clear_caches()
    for first, second in zip(grads[in_xla], again):
      np.testing.assert_array_equal(first, np.asarray(second))
  for got, want in zip(grads[True], grads[False]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * x.size / c)
  with config.override(gpu_partials_in_xla=True):
    text = _export_text(jax.grad(lambda x, w, b: jnp.sum(norm(x, weight=w, bias=b)),
                                 argnums=(0, 1, 2)),
                        (_sds(shape, F32), _sds((c,), F32), _sds((c,), F32)), "cuda")
  assert "jax_normgrad_norm_bwd" in text and "jax_normgrad_sum_partials" not in text


@pytest.mark.parametrize("segment,itemsize,kind,warps", [
    # forward: 32 bytes of each input per thread (2026-11-26 sweep, BENCHMARKS-history.md)
    ((1, 1024), 2, "fwd", 2), ((1, 1024), 4, "fwd", 4), ((1, 4096), 4, "fwd", 16),
    ((1, 16384), 4, "fwd", 32),
    # the residual form's forward: 8 elements per thread in every dtype (16 bfloat16 elements took
    # 72 registers; 4 float32 ran the tile of 4096 at 32 warps, 1.35x slower on an H200)
    ((1, 1024), 2, "residual", 4), ((1, 1024), 4, "residual", 4), ((1, 4096), 4, "residual", 16),
    # backward: 16 bytes, at most 16 warps while 8 elements per thread suffice
    ((1, 1024), 2, "bwd", 4), ((1, 4096), 2, "bwd", 16), ((1, 4096), 4, "bwd", 16),
    ((1, 8192), 4, "bwd", 32), ((1, 16384), 2, "bwd", 32), ((64, 64), 4, "bwd", 16),
])
def test_gpu_plan_warps(segment, itemsize, kind, warps):
  """The Triton tile heuristics' warp counts: what the GPU sweep measured, pinned."""
  plan = config.gpu_plan(segment, itemsize, backward=kind == "bwd", residual=kind == "residual")
  assert plan.num_warps == warps, plan
  per_thread = plan.tile[0] * plan.tile[1] // (32 * plan.num_warps)
  assert per_thread <= (16 if kind == "fwd" else 8), plan  # the register budgets cited in config


def test_vmap_with_batched_weight_matches_xla(rng):
  # vmap of the layers with batched parameters: param_groups = 3 in the kernels.
  cases = [
      (jn.layer_norm, (3, 10, 130), 130),
      (lambda x, w, b, **k: jn.group_norm(x, 4, w, b, channel_axis=-1, **k), (3, 2, 5, 5, 12), 75),
  ]
  for norm, shape, reduced in cases:
    x, ct = random(rng, shape, F32), random(rng, shape, F32)
    w, b = random(rng, (3, shape[-1]), F32, offset=1.0), random(rng, (3, shape[-1]), F32)
    grads = {}
    for impl in ("pallas", "xla"):
      loss = lambda x, w, b, ct, impl=impl: jnp.sum(norm(x, w, b, implementation=impl) * ct)
      grads[impl] = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(x, w, b, ct)
    for got, want in zip(grads["pallas"], grads["xla"]):
      assert got.shape == want.shape
      assert_close(got, want, F32, reduced)


# ----------------------------------------------------------------------------
# The GPU backend choice: Triton by default, Mosaic GPU when asked for.

MOSAIC_GPU = "mosaic_gpu_v2"


def _export_cuda(f, args):
  return _export_text(f, args, "cuda")


def _assert_mosaic_gpu(text):
  assert MOSAIC_GPU in text and TRITON not in text
  for k in ("fwd", "bwd"):
    assert f"jax_normgrad_norm_{k}" in text, k


@needs_mosaic_gpu
@pytest.mark.parametrize("dtype,hidden", [(jnp.float32, 1000), (jnp.bfloat16, 4096),
                                          (jnp.float32, 768), (jnp.float32, 16384)])
def test_layer_norm_grad_lowers_to_mosaic_gpu(dtype, hidden):
  # Realistic rows: 768 and 4096 a whole number of 256-wide chunks, 1000 padded; 16384 float32
  # forward in place (y over x, two stages), its backward in pieces.
  ln = lambda x, w, b: jn.layer_norm(x, w, b, implementation="mosaic_gpu")
  _assert_mosaic_gpu(_export_cuda(_grad_of(ln), (_sds((4, 512, hidden), dtype),
                                                 _sds((hidden,), dtype), _sds((hidden,), dtype))))


@needs_mosaic_gpu
def test_rms_norm_and_vmap_lower_to_mosaic_gpu():
  rms = jax.vmap(_grad_of(lambda x, w, b: jn.rms_norm(x, w, implementation="mosaic_gpu") + b))
  _assert_mosaic_gpu(_export_cuda(rms, (_sds((3, 64, 2048), jnp.bfloat16),
                                        _sds((3, 2048), F32), _sds((3, 2048), F32))))


@needs_mosaic_gpu
@pytest.mark.parametrize("dtype,activation", [(F32, None), (jnp.bfloat16, "silu"),
                                              (jnp.bfloat16, "gelu"), (F32, "relu")])
@pytest.mark.parametrize("shape,axis", [((8, 32, 32, 320), -1), ((8, 320, 32, 32), 1)])
def test_group_norm_grad_lowers_to_mosaic_gpu(dtype, activation, shape, axis):
  # A UNet block's GroupNorm (32 groups of 10 channels, 32x32; + SiLU), both layouts:
  # every kernel is a Mosaic GPU one, none Triton: channels-last sums and apply each way;
  # NCHW segments of 10 x 1024 held whole, a kernel each way, but for the float32 backward
  # (x, dy, dx and two partial rows of 40 KiB: one stage only), which takes the two passes.
  gn = lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=axis, activation=activation,
                                     implementation="mosaic_gpu")
  text = _export_cuda(_grad_of(gn), (_sds(shape, dtype), _sds((320,), dtype),
                                     _sds((320,), dtype)))
  _assert_mosaic_gpu(text)
  two_pass = ("jax_normgrad_norm_fwd_stats" in text, "jax_normgrad_norm_bwd_sums" in text)
  expected = (True, True) if axis == -1 else (False, dtype == F32)
  assert two_pass == expected, two_pass


@needs_mosaic_gpu
def test_mosaic_gpu_group_norm_param_groups_and_partials(rng):
  # vmap with per-example parameters (param_groups = 3; the same XLA code for
  # both layouts), and 2 CTAs per channels-last sample over 9 rows (5 and 4:
  # uneven partial moments, merged in order).
  axis, shape = -1, (3, 1, 3, 3, 12)
  x, ct = random(rng, shape, F32, offset=0.5), random(rng, shape, F32)
  w, b = random(rng, (3, 12), F32, offset=1.0), random(rng, (3, 12), F32)
  grads = {}
  with config.override(interpret_programs=6):
    for impl in ("mosaic_gpu", "xla"):
      loss = lambda x, w, b, ct, impl=impl: jnp.sum(
          jn.group_norm(x, 4, w, b, channel_axis=axis, implementation=impl) * ct)
      grads[impl] = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(x, w, b, ct)
  jax.clear_caches()
  for got, want in zip(grads["mosaic_gpu"], grads["xla"]):
    assert got.shape == want.shape
    assert_close(got, want, F32, 27)


@needs_mosaic_gpu
def test_mosaic_gpu_group_norm_whole_segments(rng, monkeypatch):
  # NCHW segments held whole (one kernel each way, x and dy read once): HW = 256 and 128
  # (chunk widths 256 and 128) under vmap with per-example parameters (param_groups 2), the
  # fused SiLU, every gradient; then the backward's output masks. Per-channel parameter
  # gradients from per-CTA partials (6 interpreted CTAs).
  from jax_normgrad.pallas import common, mosaic_gpu_group_norm
  used = []
  for name in ("_forward_whole", "_backward_whole"):
    real = getattr(mosaic_gpu_group_norm, name)
    monkeypatch.setattr(mosaic_gpu_group_norm, name,
                        lambda *a, real=real, name=name, **k: (used.append(name), real(*a, **k))[1])
  c, groups = 6, 3
  with config.override(interpret_programs=6):
    for hw, act in ((256, "silu"), (128, None)):
      shape = (2, 2, c, hw)
      x, ct = random(rng, shape, F32, offset=0.5), random(rng, shape, F32)
      w, b = random(rng, (2, c), F32, offset=1.0), random(rng, (2, c), F32)
      seg = common.Segments("channels_first", 2, c, hw, groups, 1, activation=act)
      assert mosaic_gpu_group_norm.whole_segments(seg, 4, backward=True) is not None
      grads = {}
      for impl in ("mosaic_gpu", "xla"):
        loss = lambda x, w, b, ct, impl=impl: jnp.sum(jn.group_norm(
            x, groups, w, b, channel_axis=1, activation=act, implementation=impl) * ct)
        grads[impl] = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))(x, w, b, ct)
      for got, want in zip(jax.tree.leaves(grads["mosaic_gpu"]), jax.tree.leaves(grads["xla"])):
        assert got.shape == want.shape
        assert_close(got, want, F32, 2 * hw)
    n, hw, group = 3, 128, 2
    x, dy = random(rng, (n, c * hw), F32, offset=0.5), random(rng, (n, c * hw), F32)
    w = random(rng, (c,), F32, offset=1.0)
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group, 1e-5, False)
    refs = ref.gn_bwd(dy, x, mean, rstd, w, n, c, hw, group, False)
    for mask in ((True, False, False), (False, True, True), (False, False, True)):
      outs = jn.group_norm_backward(dy, x, mean.astype(np.float32), rstd.astype(np.float32), w,
                                    n, c, hw, group, mask, implementation="mosaic_gpu")
      for out, expected, m, reduced in zip(outs, refs, mask, (c // group * hw, n * hw, n * hw)):
        assert (out is None) == (not m)
        if m:
          assert_close(out, expected, F32, reduced)
  jax.clear_caches()
  assert used.count("_forward_whole") >= 2 and used.count("_backward_whole") >= 5, used


@needs_mosaic_gpu
def test_mosaic_gpu_group_norm_whole_segments_need_two_stages():
  # HW not a multiple of 128, channels-last, or a segment leaving room for one stage only:
  # the two-pass kernels (which read several rows of HW ahead).
  from jax_normgrad.pallas import common, mosaic_gpu_group_norm
  whole = lambda seg, **kw: mosaic_gpu_group_norm.whole_segments(seg, 4, **kw)
  nchw = lambda hw, c=64: common.Segments("channels_first", 8, c, hw, 32, 1)
  assert whole(nchw(1024), backward=False)[1].stages >= 2
  assert whole(nchw(1024), backward=True)[1].stages >= 2
  assert whole(nchw(81), backward=False) is None
  assert whole(common.Segments("channels_last", 8, 1024, 64, 32, 1), backward=False) is None
  # 8 channels of 64x64 in float32: 128 KiB a segment, y over x gives one stage only.
  assert whole(nchw(4096, c=256), backward=False) is None


@needs_mosaic_gpu
def test_gpu_backend_environment_variable(settings_env):
  args = (_sds((64, 1024), F32), _sds((1024,), F32), _sds((1024,), F32))
  settings_env("JAX_NORMGRAD_GPU_BACKEND", None)
  assert TRITON in _export_cuda(_grad_of(jn.layer_norm), args)  # the default
  settings_env("JAX_NORMGRAD_GPU_BACKEND", "mosaic_gpu")
  _assert_mosaic_gpu(_export_cuda(_grad_of(jn.layer_norm), args))
  assert TRITON in _export_cuda(
      _grad_of(lambda x, w, b: jn.layer_norm(x, w, b, implementation="triton")), args)
  # What Mosaic GPU cannot run (channels-last rows of 70,000 channels) Triton runs, announced.
  from jax_normgrad import _fallback
  _fallback.warn_once.cache_clear()
  gn = _grad_of(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1))
  c = 70_000
  with pytest.warns(jn.FallbackWarning, match="Triton kernels run it instead"):
    text = export_for(
        "cuda", jax.jit(gn), (_sds((2, 2, 2, c), F32), _sds((c,), F32), _sds((c,), F32)),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]).mlir_module()
  assert TRITON in text and MOSAIC_GPU not in text
  settings_env("JAX_NORMGRAD_GPU_BACKEND", "cuda")
  with pytest.raises(ValueError, match="JAX_NORMGRAD_GPU_BACKEND"):
    _export_cuda(_grad_of(jn.layer_norm), args)


@needs_mosaic_gpu
def test_forced_mosaic_gpu_raises_where_it_cannot_run():
  x, w = _sds((8, 64), F32), _sds((64,), F32)
  ln = lambda x, w: jn.layer_norm(x, w, implementation="mosaic_gpu")
  for platform in ("rocm", "tpu"):
    with pytest.raises(ValueError, match="cannot run on " + platform):
      jax.export.export(jax.jit(ln), platforms=[platform])(x, w)
  gn = lambda x, w: jn.group_norm(x, 4, w, channel_axis=-1, implementation="mosaic_gpu")
  with pytest.raises(ValueError, match="the C of GroupNorm"):
    jax.export.export(jax.jit(gn), platforms=["cuda"])(_sds((2, 8, 70_000), F32),
                                                       _sds((70_000,), F32))


@needs_mosaic_gpu
@pytest.mark.parametrize("smem_bytes,backward", [(6000, False), (10300, True)])
def test_mosaic_gpu_single_stage_and_parameters_from_gmem(rng, smem_bytes, backward):
  # A small SMEM budget: one buffer per streamed row and the parameters read from
  # GMEM chunk by chunk (forward at 6000 bytes, backward at 10300; 300 columns padded to 512).
  m, h = 11, 300
  x, dy = random(rng, (m, h), F32, scale=2.0, offset=0.5), random(rng, (m, h), F32)
  w, b = random(rng, (1, h), F32, offset=1.0), random(rng, (1, h), F32)
  kw = dict(centered=True, param_groups=1)
  with config.override(mosaic_gpu_smem_bytes=smem_bytes):
    plan = config.mosaic_gpu_plan(h, 4, backward=backward, params=1 if backward else 2)
    assert (plan.stages, plan.params_in_smem) == (1, False)
    y, *stats = jax.jit(lambda x, w, b: bind(
        layer_norm_fwd_p, NormFwd(x, None, w, b), eps=1e-5, write_xhat=False, y_dtype=None,
        implementation="mosaic_gpu", **kw))(x, w, b)
    if backward:
      outs = jax.jit(lambda dy, x, stats, w: bind(
          layer_norm_bwd_p, norm_bwd_operands(dy, x, stats, w), output_mask=(True, True, True),
          normalized=False, write_xhat=False, implementation="mosaic_gpu", **kw))(
              dy, x, stats, w)
  y_ref, *stats_ref = reference.layer_norm_fwd(x, w, b, eps=1e-5, **kw)
  assert_close(y, y_ref, F32, h, "y")
  if backward:
    refs = reference.layer_norm_bwd(norm_bwd_operands(dy, x, stats, w),
                                    output_mask=(True, True, True), **kw)
    for name, out, expected in zip(("dx", "dweight", "dbias"), outs, refs):
      assert_close(out, expected, F32, h if name == "dx" else m, name)


@needs_mosaic_gpu
@pytest.mark.parametrize("centered", [True, False])
def test_mosaic_gpu_forward_in_place(rng, centered):
  # A budget (7000 bytes) where a 300-long float32 row with its y gets one stage: the plain
  # forward writes y over x instead, three stages of x, the parameters read from GMEM
  # (11 rows over 3 interpreted CTAs: each slot refilled once its y has been stored). The
  # interpreter runs a TMA copy when it is issued, so only a GPU tests that order: there,
  # 20 rows for each of the persistent CTAs.
  m, h = (11 if cases.PLATFORM == "cpu" else 20 * 132 * 4), 300
  x = random(rng, (m, h), F32, scale=2.0, offset=0.5)
  w, b = random(rng, (1, h), F32, offset=1.0), random(rng, (1, h), F32)
  kw = dict(centered=centered, param_groups=1)
  # A cap above the default double buffer: the refill order of three slots.
  with config.override(mosaic_gpu_smem_bytes=7000, mosaic_gpu_max_stages=8):
    assert config.mosaic_gpu_plan(h, 4, backward=False).stages == 1
    plan = config.mosaic_gpu_plan(h, 4, backward=False, in_place=True)
    assert (plan.in_place, plan.stages, plan.params_in_smem) == (True, 3, False)
    # The residual form's rows (more than one output) never: one stage still.
    res = config.mosaic_gpu_plan(h, 4, backward=False, in_place=True, extra_bytes=2)
    assert (res.stages, res.in_place) == (1, False)
    y, *stats = jax.jit(lambda x, w, b: bind(
        layer_norm_fwd_p, NormFwd(x, None, w, b if centered else None), eps=1e-5,
        write_xhat=False, y_dtype=None, implementation="mosaic_gpu", **kw))(x, w, b)
  jax.clear_caches()
  y_ref, *stats_ref = reference.layer_norm_fwd(x, w, b if centered else None, eps=1e-5, **kw)
  assert_close(y, y_ref, F32, h, "y")
  for got, want in zip(stats, stats_ref):
    assert_close(got, want, F32, h)


@pytest.mark.parametrize("h,itemsize,backward", [(1024, 2, False), (1024, 2, True),
                                                 (4096, 4, False), (4096, 4, True),
                                                 (768, 4, True), (16384, 2, False)])
def test_mosaic_gpu_plan_keeps_rows_in_flight(h, itemsize, backward):
  # The stages: the fewest that keep mosaic_gpu_inflight_bytes of rows in flight per SM,
  # within the SMEM budget and the stage cap; two output stages wherever two inputs fit.
  # The planning with a deep cap (8 stages), then the default cap: the double buffer.
  kw = dict(backward=backward, params=1 + (not backward))
  assert 1 <= config.mosaic_gpu_plan(h, itemsize, **kw).stages <= 2
  with config.override(mosaic_gpu_max_stages=8):
    t, budget = config.current(), config.device().mosaic_gpu_smem_bytes
    plan = config.mosaic_gpu_plan(h, itemsize, **kw)
  assert plan.smem <= budget and 1 <= plan.stages <= t.mosaic_gpu_max_stages
  assert plan.out_stages == min(plan.stages, 2)
  in_row = plan.padded * itemsize * (1 + backward)
  inflight = lambda stages: config.mosaic_gpu_ctas_per_sm(plan.smem) * (stages - 1) * in_row
  if plan.stages > 2:  # one fewer would not have reached the target
    fewer = dataclasses.replace(plan, smem=plan.smem - in_row)
    assert config.mosaic_gpu_ctas_per_sm(fewer.smem) * (plan.stages - 2) * in_row < (
        t.mosaic_gpu_inflight_bytes)
  if plan.stages < t.mosaic_gpu_max_stages and plan.stages > 1:  # reached it, or SMEM is full
    assert (inflight(plan.stages) >= t.mosaic_gpu_inflight_bytes
            or plan.smem + in_row > budget)
  # Rows of 1K-4K elements: at least 48 KiB in flight per SM (the target, or the cap's 7 rows
  # of 1024 bf16).
  if h <= 4096:
    assert inflight(plan.stages) >= 48 * 1024


@needs_mosaic_gpu
@pytest.mark.parametrize("centered", [True, False])
def test_mosaic_gpu_long_rows_in_pieces(rng, centered):
  # A 6000-byte SMEM budget holds no 1000-long row: rows are cut in pieces
  # (2 of 512 forward, the second masked to 488; 4 of 256 backward, the last
  # 232 long), the statistics and c1, c2 merged over the pieces in XLA.
  m, h = 5, 1000
  x, dy = random(rng, (m, h), F32, scale=2.0, offset=0.5), random(rng, (m, h), F32)
  w, b = random(rng, (1, h), F32, offset=1.0), random(rng, (1, h), F32)
  kw = dict(centered=centered, param_groups=1)
  mask = (True, True, True)
  with config.override(mosaic_gpu_smem_bytes=6000):
    assert config.mosaic_gpu_plan(h, 4, backward=False) is None
    assert config.mosaic_gpu_pieces(h, 4, backward=False)[0] == 2
    assert config.mosaic_gpu_pieces(h, 4, backward=True, params=1, outputs=1, partials=2)[0] == 4
    y, *stats = jax.jit(lambda x, w, b: bind(
        layer_norm_fwd_p, NormFwd(x, None, w, b), eps=1e-5, write_xhat=False, y_dtype=None,
        implementation="mosaic_gpu", **kw))(x, w, b)
    outs = jax.jit(lambda dy, x, stats, w: bind(
        layer_norm_bwd_p, norm_bwd_operands(dy, x, stats, w), output_mask=mask,
        normalized=False, write_xhat=False, implementation="mosaic_gpu", **kw))(dy, x, stats, w)
  jax.clear_caches()
  y_ref, *stats_ref = reference.layer_norm_fwd(x, w, b, eps=1e-5, **kw)
  assert_close(y, y_ref, F32, h, "y")
  for got, want in zip(stats, stats_ref):
    assert_close(got, want, F32, h)
  refs = reference.layer_norm_bwd(norm_bwd_operands(dy, x, stats, w), output_mask=mask, **kw)
  for name, out, expected in zip(("dx", "dweight", "dbias"), outs, refs):
    assert_close(out, expected, F32, h if name == "dx" else m, name)


@needs_mosaic_gpu
@pytest.mark.parametrize("dtype,h", [(F32, 65536), (jnp.bfloat16, 65536), (F32, 70001)])
def test_long_rows_lower_to_mosaic_gpu(dtype, h):
  # Rows in pieces: 65536 in float32 is 8 of 8192 forward, 12 of 5632 backward;
  # 70001 leaves a short, masked last piece (9 of 7936 forward, the last 6513).
  ln = lambda x, w, b: jn.layer_norm(x, w, b, implementation="mosaic_gpu")
  text = _export_cuda(_grad_of(ln), (_sds((16, h), dtype), _sds((h,), dtype), _sds((h,), dtype)))
  _assert_mosaic_gpu(text)
  assert "jax_normgrad_norm_fwd_stats" in text and "jax_normgrad_norm_bwd_sums" in text


@needs_mosaic_gpu
def test_mosaic_gpu_group_norm_long_rows_in_pieces(rng):
  # NCHW rows (HW = 600) that a 6000-byte SMEM budget does not hold: 3 pieces of 256
  # (the last 88 long, masked), merged per channel in XLA; with SiLU fused.
  shape, c = (2, 3, 20, 30), 3
  x, ct = random(rng, shape, F32, scale=2.0, offset=0.5), random(rng, shape, F32)
  w, b = random(rng, (c,), F32, offset=1.0), random(rng, (c,), F32)
  outs = {}
  for impl in ("mosaic_gpu", "xla"):
    layer = lambda x, w, b, impl=impl: jn.group_norm(x, 3, w, b, activation="silu",
                                                     implementation=impl)
    with config.override(mosaic_gpu_smem_bytes=6000):
      y, vjp = jax.vjp(jax.jit(layer), x, w, b)
      outs[impl] = (y,) + vjp(ct)
  jax.clear_caches()
  for name, got, want in zip(("y", "dx", "dweight", "dbias"), outs["mosaic_gpu"], outs["xla"]):
    assert_close(got, want, F32, 600, name)


@needs_mosaic_gpu
def test_long_group_norm_rows_lower_to_mosaic_gpu():
  # A VAE decoder's GroupNorm at 512x512 (NCHW, HW = 262144 per channel row): in pieces.
  gn = lambda x, w, b: jn.group_norm(x, 32, w, b, activation="silu", implementation="mosaic_gpu")
  _assert_mosaic_gpu(_export_cuda(_grad_of(gn), (_sds((1, 128, 512, 512), jnp.bfloat16),
                                                 _sds((128,), F32), _sds((128,), F32))))


# ----------------------------------------------------------------------------
# The reductions in XLA over CTAs / programs, in a fixed order and a small HLO (common).


def _pairwise_np(terms):
  """The order ``common.fixed_order`` documents: a chain up to 16 terms, else pairs
  (0, 1), (2, 3), ... level by level, an odd last term carried up."""
  terms = list(terms)
  if len(terms) <= 16:
    total = terms[0]
    for t in terms[1:]:
      total = total + t
    return total
  while len(terms) > 1:
    terms = [terms[j] + terms[j + 1] for j in range(0, len(terms) - 1, 2)] + (
        [terms[-1]] if len(terms) % 2 else [])
  return terms[0]


@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 40, 521])
def test_fixed_order_sum_and_moments(rng, n):
  # The documented order, bitwise (float32 adds in numpy are the same IEEE adds), close
  # to the float64 sum; the CTA partial moments merged by the same order (Chan) give the
  # moments of the whole.
  from jax_normgrad.pallas import common
  a = rng.normal(1.0, 3.0, size=(n, 2, 33)).astype(np.float32)
  got = np.asarray(jax.jit(lambda a: common.ordered_sum(a, 1))(np.moveaxis(a, 0, 1)))
  np.testing.assert_array_equal(got, _pairwise_np(a))
  assert_close(got, a.astype(np.float64).sum(0), F32, n)
  counts = rng.integers(1, 5, size=n)
  data = rng.normal(2.0, 1.5, size=(int(counts.sum()), 33)).astype(np.float32)
  parts = np.split(data, np.cumsum(counts)[:-1])
  means = np.stack([p.mean(0) for p in parts])
  m2s = np.stack([((p - p.mean(0)) ** 2).sum(0) for p in parts])
  merge = lambda m, q: common.fixed_order(
      (jnp.asarray(counts, F32).reshape(-1, 1), m, q), common.combine_moments)
  _, mean, m2 = jax.jit(merge)(means, m2s)
  assert_close(mean, data.astype(np.float64).mean(0), F32, data.shape[0])
  assert_close(m2, ((data - data.astype(np.float64).mean(0)) ** 2).sum(0), F32, data.shape[0])


@needs_mosaic_gpu
def test_mosaic_gpu_many_cta_partials(rng):
  # More CTAs than the chain's 16: LayerNorm's dweight / dbias partials of 17 CTAs (a row
  # each: the interpreter walks every row) and a channels-last GroupNorm's moments and sums
  # of 17 CTAs per sample, reduced by the tree (an odd last term carried up).
  x, dy = random(rng, (17, 256), F32, offset=0.5), random(rng, (17, 256), F32)
  w, b = random(rng, (256,), F32, offset=1.0), random(rng, (256,), F32)
  gx, gct = random(rng, (1, 34, 8), F32, offset=0.5), random(rng, (1, 34, 8), F32)
  gw, gb = random(rng, (8,), F32, offset=1.0), random(rng, (8,), F32)
  cases = [(lambda x, w, b, impl: jn.layer_norm(x, w, b, implementation=impl), (x, w, b), dy,
            17, 17),
           (lambda x, w, b, impl: jn.group_norm(x, 2, w, b, channel_axis=-1, implementation=impl),
            (gx, gw, gb), gct, 17, 136)]
  for layer, args, ct, programs, reduced in cases:
    outs = {}
    with config.override(interpret_programs=programs):
      for impl in ("mosaic_gpu", "xla"):
        y, vjp = jax.vjp(jax.jit(functools.partial(layer, impl=impl)), *args)
        outs[impl] = (y,) + vjp(ct)
    jax.clear_caches()
    for name, got, want in zip(("y", "dx", "dweight", "dbias"), outs["mosaic_gpu"], outs["xla"]):
      assert_close(got, want, F32, reduced, name)


@needs_mosaic_gpu
def test_mosaic_gpu_backward_exports_a_small_xla_epilogue():
  # On a GPU the backward runs 500-odd CTAs: their partials summed as a chain made the
  # grad 3.1K HLO ops (the backward compiled in 11-14 s on an H200); as a tree, 118-156.
  # GroupNorm's channels-last CTA partials: no XLA while loop (a launch per CTA).
  ln = lambda x, w, b: jn.layer_norm(x, w, b, implementation="mosaic_gpu")
  for rows in (1024, 32768):
    text = _export_cuda(_grad_of(ln), (_sds((rows, 1024), jnp.bfloat16),
                                       _sds((1024,), jnp.bfloat16), _sds((1024,), jnp.bfloat16)))
    _assert_mosaic_gpu(text)
    assert text.count("stablehlo.") < 300, rows
  gn = lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=-1, implementation="mosaic_gpu")
  text = _export_cuda(_grad_of(gn), (_sds((8, 32, 32, 320), jnp.bfloat16),
                                     _sds((320,), F32), _sds((320,), F32)))
  _assert_mosaic_gpu(text)
  assert "stablehlo.while" not in text
