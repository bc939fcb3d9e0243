"""The Pallas Mosaic GPU kernels: lowering for CUDA on CPU (``jax.export``, an H100's), and
interpreted (Pallas' GPU interpret mode); the fixed-order reductions in XLA over their CTAs'
partials (``common``).

The GPU backend choice: Triton by default, Mosaic GPU when asked for. No GPU is needed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from jax_normgrad import reference
from jax_normgrad._operands import NormFwd
from jax_normgrad.pallas import config
from jax_normgrad.primitives.layer_norm import layer_norm_bwd_p, layer_norm_fwd_p
import cases
from cases import bind, export_for, needs_mosaic_gpu, norm_bwd_operands, random
import reference_np as ref
from test_pallas import TRITON, _export_text, _grad_of, _sds
from tolerances import assert_close

F32 = jnp.float32

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
