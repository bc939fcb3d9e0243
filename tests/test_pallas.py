"""Pallas kernels: lowering for CUDA (Triton) and TPU (Mosaic) on CPU; both kernel sets interpreted.

No GPU or TPU is needed. ``jax.export`` lowers for a platform without one:
the tests check that the Pallas custom call is what runs there (no
fallback). The op suites run the GPU kernels interpreted; here the TPU
kernels are interpreted too, and both with tiny tiles so that chunked
segments, ragged blocks and idle steps are exercised on small inputs. The
RMSNorm variant (``centered=False``) is checked through its primitives.
The Mosaic GPU kernels' tests are ``tests/test_mosaic_gpu.py``'s; ``explain``'s account of the
kernels, against the lowered modules, ``tests/test_explain_kernels.py``'s.
"""

from __future__ import annotations

import contextlib
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
from cases import DTYPES, MASKS, bind, export_for, norm_bwd_operands, random, rotate
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
  """Uneven rows per program and tiny tiles: four runs, bitwise equal; interpreted (a repeat
  gives the same bits by construction, cases.repeats_can_differ), one run against the
  reference."""
  x, dy = random(rng, (301, 300), F32), random(rng, (301, 300), F32)
  stats = reference.layer_norm_fwd(x, eps=1e-5, centered=True, param_groups=1)[1:]
  with _kernels(backend, tiny=True) as impl:
    f = jax.jit(lambda *a: bind(
        layer_norm_bwd_p, NormBwd(*a), centered=True, output_mask=(True, True, True),
        param_groups=1, normalized=False, write_xhat=False, implementation=impl))
    first = [np.asarray(o) for o in f(dy, x, *stats)]
    if not cases.repeats_can_differ(impl):
      mean, rstd = (np.asarray(s, np.float64) for s in stats)
      for out, want, reduced in zip(first, ref.ln_bwd(dy, x, 1, mean, rstd, None), (300, 301, 301)):
        assert_close(out.reshape(want.shape), want, F32, reduced)  # dweight, dbias: (1, 300)
      return
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
