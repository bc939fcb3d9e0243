"""The TPU kernels in Pallas' TPU interpret mode: TensorCores, VMEM and block copies simulated.

Elsewhere the TPU kernels run under Pallas' generic interpreter
(``implementation="mosaic_tpu"`` on the CPU), which walks the grid in order as one program
and models no memory spaces, cores or write-backs. Here they run with
``pltpu.InterpretParams`` (``pallas.tpu.tpu_interpret_mode``): each block
copied between simulated HBM and VMEM; VMEM (outputs, scratch, the padding
of ragged blocks) NaN until written, so a kernel that reads what it never
wrote gives NaN; an out-of-bounds access raises; an output block revisited
after another one raises (a TPU does not read an output block back: what a
revisit does not rewrite is lost); the race detector is on (a race prints
"RACE DETECTED", which fails the test), and with ``num_cores_or_threads=2``
the "parallel" grid axes are shared out between two simulated TensorCores,
as on a megacore chip. Values are checked against the float64 NumPy
reference.

The cases, chosen so that every path of ``pallas/tpu.py`` runs at least once
on small inputs (``tiny``: ``tpu_block_elems=2048``, which chunks a segment
of a few hundred elements); each asserts its path (whole segments in a
block or chunked, idle steps, ragged blocks) from the kernels' own tiling
and the kernels it ran by name:

* rows, the LayerNorm / RMSNorm ops: ``ln-fused``: whole rows, weight and
  bias, every gradient; ``ln-chunked``: bfloat16 rows of 200 in chunks of
  128 and 33 rows in blocks of 16 (both ragged), two programs with an idle
  step, every gradient; ``rms-params-only``: dweight alone (no dx).
* the residual form, gradients by ``jax.vjp``: ``add-rms-f16-f32-chunked``:
  float16 x (computed in float32) with a float32 residual stream (h float32,
  dy float16: dx written in both dtypes, dh added), chunked, ragged;
  ``add-ln-fused``: float32, weight and bias, whole rows.
* ``test_float32_x_with_bfloat16_y``: the forward kernel writes a bfloat16 y
  of a float32 x; the backward reads the bfloat16 dy beside the float32 x.
* ``test_vmap_param_groups_two_cores``: three parameter groups (per-example
  weights) of two programs each on two cores: the parallel axes shared out,
  each program's partial sums in its own block (a shared block is a race).
* GroupNorm layers, gradients by ``jax.vjp``: ``nchw-fused-silu`` (six
  groups on the parallel group axis; beta read backward); ``nchw-chunked-gelu``
  (channels and pixels chunked, ragged, idle step); ``nhwc-fused-bf16-f32-result``
  (six groups as lane runs; a bfloat16 x widened for a float32 y, the float32
  dy read beside the bfloat16 x); ``nhwc-one-channel-a-group-relu`` (no
  weight or bias) and ``nhwc-one-group``: the lane sums' two shortcuts;
  ``nhwc-chunked-bf16-silu`` (pixels chunked, ragged, idle step).
* ``group_norm_backward`` with dx alone (chunked: the statistics kernel, no
  partial sums) and dbias alone.
* empty batches (LayerNorm, GroupNorm): no kernel runs; empty results, zero
  parameter gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import jax_normgrad as jn
from jax_normgrad.pallas import common, config, tpu
from cases import random
import reference_np as ref
from tolerances import assert_close

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
FWD, BWD = "jax_normgrad_norm_fwd", "jax_normgrad_norm_bwd"
FUSED = {FWD, BWD}
CHUNKED = {f"{FWD}_moments", f"{FWD}_apply", f"{BWD}_stats", BWD}


@contextlib.contextmanager
def _tpu_interpreted(monkeypatch, capfd, *, cores=1, tiny=False):
  """Runs the TPU kernels lowered inside in TPU interpret mode; yields the names of the kernels
  called (each checked to run with the interpret mode's parameters). A race fails the test."""
  called = []
  # The cores' field is num_cores_per_device in older jax (0.8).
  fields = {f.name for f in dataclasses.fields(pltpu.InterpretParams)}
  cores_field = ("num_cores_or_threads" if "num_cores_or_threads" in fields
                 else "num_cores_per_device")
  params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                                 **{cores_field: cores})
  real = pl.pallas_call

  def spy(*args, interpret=False, name=None, **kwargs):
    assert interpret is params, (name, interpret)
    called.append(name)
    return real(*args, interpret=interpret, name=name, **kwargs)

  monkeypatch.setattr(pl, "pallas_call", spy)
  tuning = {"tpu_block_elems": 2048} if tiny else {}
  jax.clear_caches()
  try:
    with config.override(**tuning), tpu.tpu_interpret_mode(params):
      yield called
  finally:
    jax.clear_caches()
    pltpu.reset_tpu_interpret_mode_state()  # after a failure inside a kernel, as its docs ask
  out = capfd.readouterr().out
  assert "RACE DETECTED" not in out, out[-4000:]


def _layout(kind, n, a, b, groups, itemsize, *, tiny, param_groups=1):
  """The TPU kernels' tiling of a problem: ``{"fused", "idle", "ragged"}`` as it has them."""
  seg = common.Segments(kind, n, a, b, groups, param_groups)
  with config.override(**({"tpu_block_elems": 2048} if tiny else {})):
    lay = tpu._LAYOUTS[kind](seg, itemsize)  # pylint: disable=protected-access
    ids = {k: 0 for k in lay.sizes}
    ragged = lay.sample_mask(ids) is not None or lay.inner_mask(ids) is not None
  return {p for p, on in (("fused", lay.fused), ("idle", lay.idle), ("ragged", ragged)) if on}


def _f64(a):
  return None if a is None else np.asarray(jnp.asarray(a).astype(F32), np.float64)


# ----------------------------------------------------------------------------
# Rows: the LayerNorm / RMSNorm ops, with output masks.


@dataclasses.dataclass(frozen=True)
class RowCase:
  name: str
  centered: bool
  shape: tuple
  dtype: object
  params: str  # "wb", "w" or ""
  mask: tuple
  tiny: bool
  layout: frozenset
  kernels: frozenset


ROW_CASES = [
    RowCase("ln-fused", True, (7, 1000), F32, "wb", (True, True, True), False,
            frozenset({"fused"}), frozenset(FUSED)),
    RowCase("ln-chunked", True, (33, 200), BF16, "wb", (True, True, True), True,
            frozenset({"idle", "ragged"}), frozenset(CHUNKED)),
    RowCase("rms-params-only", False, (13, 300), F32, "w", (False, True), False,
            frozenset({"fused"}), frozenset(FUSED)),
]


@pytest.mark.parametrize("case", ROW_CASES, ids=[c.name for c in ROW_CASES])
def test_rows(rng, monkeypatch, capfd, case):
  m, h = case.shape
  x = random(rng, case.shape, case.dtype, scale=2.0, offset=0.5)
  dy = random(rng, case.shape, case.dtype)
  w = random(rng, (h,), case.dtype, offset=1.0) if "w" in case.params else None
  b = random(rng, (h,), case.dtype) if "b" in case.params else None
  itemsize = max(jnp.dtype(case.dtype).itemsize, 4 * (case.dtype == F16))
  assert _layout("rows", m, 1, h, 1, itemsize, tiny=case.tiny) == case.layout
  impl = dict(implementation="mosaic_tpu")
  with _tpu_interpreted(monkeypatch, capfd, tiny=case.tiny) as called:
    if case.centered:
      y, mean, rstd = jn.layer_norm_fwd(x, (h,), w, b, **impl)
      outs = jn.layer_norm_backward(dy, x, (h,), mean, rstd, w, b, case.mask, **impl)
    else:
      y, rstd = jn.rms_norm_fwd(x, (h,), w, **impl)
      outs = jn.rms_norm_backward(dy, x, (h,), rstd, w, case.mask, **impl)
  assert set(called) == case.kernels, called
  if case.centered:
    y_ref, mean_ref, rstd_ref = ref.ln_fwd(x, 1, w, b, 1e-5)
    assert_close(mean, mean_ref, F32, h, "mean", scale=ref.fwd_scales(x, rstd_ref, w)[1])
    refs = ref.ln_bwd(dy, x, 1, mean, rstd, w)
  else:
    y_ref, rstd_ref = ref.rms_fwd(x, 1, w)
    refs = ref.rms_bwd(dy, x, 1, rstd, w)
  scales = ref.fwd_scales(x, rstd_ref, w)
  assert y.dtype == case.dtype
  assert_close(y, y_ref, case.dtype, h, "y", scale=scales[0])
  assert_close(rstd, rstd_ref, F32, h, "rstd", scale=scales[2])
  for name, out, want, on, reduced in zip(("dx", "dweight", "dbias"), outs, refs, case.mask,
                                          (h, m, m)):
    assert (out is None) == (not on), name
    if on:
      assert_close(out, want, out.dtype, reduced, name,
                   scale=ref.dx_scale(dy, rstd, w) if name == "dx" else None)


# ----------------------------------------------------------------------------
# The residual form; a 16-bit y of a float32 x; per-example weights.


@pytest.mark.parametrize("centered,dtype,res_dtype,params,shape,tiny,layout", [
    (False, F16, F32, "w", (13, 300), True, {"ragged"}),
    (True, F32, None, "wb", (7, 1000), False, {"fused"}),
    (True, BF16, None, "wb", (13, 300), True, {"ragged"}),  # h rounded in both kernels
    (False, F16, None, "w", (7, 1000), False, {"fused"}),  # a float16 h: summed by XLA
], ids=["add-rms-f16-f32-chunked", "add-ln-fused", "add-ln-bf16-chunked", "add-rms-f16-h"])
def test_residual_form(rng, monkeypatch, capfd, centered, dtype, res_dtype, params, shape, tiny,
                       layout):
  h = shape[-1]
  x = random(rng, shape, dtype, scale=2.0, offset=0.5)
  r = random(rng, shape, res_dtype or dtype, scale=3.0, offset=-0.25)
  w = random(rng, (h,), dtype, offset=1.0)
  b = random(rng, (h,), dtype) if "b" in params else None
  h_dtype = res_dtype or dtype
  dy, dh = random(rng, shape, dtype), random(rng, shape, h_dtype, scale=0.5)
  assert _layout("rows", shape[0], 1, h, 1, 4, tiny=tiny) == layout  # float16: in float32
  eps = 1e-5 if centered else 1e-6

  def f(x, r, w, *b):
    fn = jn.add_layer_norm if centered else jn.add_rms_norm
    return fn(x, r, w, *b, eps=eps, residual_dtype=res_dtype, implementation="mosaic_tpu")

  with _tpu_interpreted(monkeypatch, capfd, tiny=tiny) as called:
    (y, hs), vjp = jax.vjp(jax.jit(f), x, r, w, *([b] if b is not None else []))
    gx, gr, gw, *gb = vjp((dy, dh))
  assert set(called) == (FUSED if tiny is False else CHUNKED), called
  h_stored = ref.stored_sum(x, r, h_dtype)  # what the kernels normalize
  if centered:
    y_ref, mean, rstd = ref.ln_fwd(h_stored, 1, _f64(w), _f64(b), eps)
    dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, h_stored, 1, mean, rstd, _f64(w))
  else:
    y_ref, rstd = ref.rms_fwd(h_stored, 1, _f64(w), eps)
    dx_ref, dw_ref = ref.rms_bwd(dy, h_stored, 1, rstd, _f64(w))
  assert y.dtype == dtype and hs.dtype == h_dtype
  assert_close(y, y_ref, dtype, h, "y")
  np.testing.assert_array_equal(_f64(hs), h_stored)
  scale = ref.dx_scale(dy, rstd, _f64(w)) + float(np.max(np.abs(_f64(dh))))
  assert gx.dtype == dtype and gr.dtype == r.dtype
  assert_close(gx, dx_ref + _f64(dh), dtype, h, "grad x", scale=scale)
  assert_close(gr, dx_ref + _f64(dh), r.dtype, h, "grad residual", scale=scale)
  assert_close(gw, dw_ref, dtype, shape[0], "grad weight")
  if gb:
    assert_close(gb[0], db_ref, dtype, shape[0], "grad bias")


def test_float32_x_with_bfloat16_y(rng, monkeypatch, capfd):
  """``ln-f32-x-bf16-y``: the forward kernel rounds y to bfloat16 itself; the backward reads
  the bfloat16 dy beside the float32 x."""
  x = random(rng, (7, 1000), F32, scale=2.0, offset=0.5)
  w, b = random(rng, (1000,), F32, offset=1.0), random(rng, (1000,), F32)
  dy = random(rng, x.shape, BF16)
  with _tpu_interpreted(monkeypatch, capfd) as called:
    y, vjp = jax.vjp(jax.jit(lambda *a: jn.layer_norm(*a, out_dtype=BF16,
                                                      implementation="mosaic_tpu")), x, w, b)
    gx, gw, gb = vjp(dy)
  assert set(called) == FUSED, called
  y_ref, mean, rstd = ref.ln_fwd(x, 1, w, b)
  assert y.dtype == BF16 and gx.dtype == F32
  assert_close(y, y_ref, BF16, 1000, "y")
  dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, x, 1, mean, rstd, w)
  assert_close(gx, dx_ref, F32, 1000, "grad x", scale=ref.dx_scale(dy, rstd, w))
  assert_close(gw, dw_ref, F32, 7, "grad weight")
  assert_close(gb, db_ref, F32, 7, "grad bias")


def test_vmap_param_groups_two_cores(rng, monkeypatch, capfd):
  """``vmap-2cores``: three parameter groups (per-example weights) of two programs each (24
  rows in blocks of 16, ragged): the six points of the "parallel" axes shared out between two
  cores, each program's partial sums its own output block."""
  x = random(rng, (3, 24, 100), F32, scale=2.0, offset=0.5)
  ct = random(rng, x.shape, F32)
  w, b = random(rng, (3, 100), F32, offset=1.0), random(rng, (3, 100), F32)
  loss = lambda x, w, b, ct: jnp.sum(jn.layer_norm(x, w, b, implementation="mosaic_tpu") * ct)
  assert _layout("rows", 72, 1, 100, 1, 4, tiny=True, param_groups=3) == {"fused", "ragged"}
  with _tpu_interpreted(monkeypatch, capfd, cores=2, tiny=True) as called:
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(x, w, b, ct)
  assert set(called) == FUSED, called
  for k in range(3):
    _, mean, rstd = ref.ln_fwd(x[k], 1, w[k], b[k])
    for got, want, name, reduced in zip(grads, ref.ln_bwd(ct[k], x[k], 1, mean, rstd, w[k]),
                                        ("dx", "dweight", "dbias"), (100, 24, 24)):
      assert_close(got[k], want, F32, reduced, name,
                   scale=ref.dx_scale(ct[k], rstd, w[k]) if name == "dx" else None)


# ----------------------------------------------------------------------------
# GroupNorm: both layouts, the fused activations, the chunked paths.


@dataclasses.dataclass(frozen=True)
class GnCase:
  name: str
  shape: tuple  # NCHW (channels_last False) or NHWC
  groups: int
  channels_last: bool
  dtype: object
  params: str  # "wb" or "": weight and bias of ``param_dtype``, or none
  activation: str | None
  tiny: bool
  layout: frozenset
  param_dtype: object = None  # None: x's
  out_dtype: object = None


GN_CASES = [
    GnCase("nchw-fused-silu", (4, 24, 4, 5), 6, False, F32, "wb", "silu", False,
           frozenset({"fused"})),
    GnCase("nchw-chunked-gelu", (3, 40, 3), 2, False, F32, "wb", "gelu", True,
           frozenset({"idle", "ragged"})),
    GnCase("nhwc-fused-bf16-f32-result", (4, 4, 5, 24), 6, True, BF16, "wb", None, False,
           frozenset({"fused"}), param_dtype=F32, out_dtype=F32),
    GnCase("nhwc-one-channel-a-group-relu", (2, 9, 8), 8, True, F32, "", "relu", False,
           frozenset({"fused"})),
    GnCase("nhwc-one-group", (2, 9, 8), 1, True, F32, "wb", None, False, frozenset({"fused"})),
    GnCase("nhwc-chunked-bf16-silu", (3, 5, 5, 48), 2, True, BF16, "wb", "silu", True,
           frozenset({"idle", "ragged"})),
]


def _gn_dims(case):
  n, c = case.shape[0], case.shape[-1] if case.channels_last else case.shape[1]
  return n, c, math.prod(case.shape) // (n * c)


@pytest.mark.parametrize("case", GN_CASES, ids=[c.name for c in GN_CASES])
def test_group_norm(rng, monkeypatch, capfd, case):
  n, c, hw = _gn_dims(case)
  pd = case.param_dtype or case.dtype
  x = random(rng, case.shape, case.dtype, scale=2.0, offset=-0.3)
  w = random(rng, (c,), pd, offset=1.0) if case.params else None
  b = random(rng, (c,), pd) if case.params else None
  out_dtype = case.out_dtype or case.dtype
  dy = random(rng, case.shape, out_dtype)
  kind = "channels_last" if case.channels_last else "channels_first"
  a, bb = (hw, c) if case.channels_last else (c, hw)
  itemsize = 4 if case.out_dtype == F32 else jnp.dtype(case.dtype).itemsize
  assert _layout(kind, n, a, bb, case.groups, itemsize, tiny=case.tiny) == case.layout

  def layer(x, *p):
    return jn.group_norm(x, case.groups, *p, channel_axis=-1 if case.channels_last else 1,
                         activation=case.activation, out_dtype=case.out_dtype,
                         implementation="mosaic_tpu")

  params = [p for p in (w, b) if p is not None]
  with _tpu_interpreted(monkeypatch, capfd, tiny=case.tiny) as called:
    y, vjp = jax.vjp(jax.jit(layer), x, *params)
    gx, *gp = vjp(dy)
  assert set(called) == (FUSED if "fused" in case.layout else CHUNKED), called
  z, mean, rstd = ref.gn_fwd(x, _f64(w), _f64(b), n, c, hw, case.groups,
                             channels_last=case.channels_last)
  y_ref, dz = z, _f64(dy)
  if case.activation:
    y_ref, dz = ref.activation(z, case.activation), dz * ref.activation_grad(z, case.activation)
  block = c // case.groups * hw
  assert y.dtype == out_dtype and gx.dtype == case.dtype
  assert_close(y, y_ref, out_dtype, block, "y", scale=ref.fwd_scales(x, rstd, _f64(w))[0])
  dx_ref, dw_ref, db_ref = ref.gn_bwd(dz, x, mean, rstd, _f64(w), n, c, hw, case.groups,
                                      case.channels_last)
  assert_close(gx, dx_ref, case.dtype, block, "grad x", scale=ref.dx_scale(dz, rstd, _f64(w)))
  for got, want, name in zip(gp, (dw_ref, db_ref), ("grad weight", "grad bias")):
    assert got.dtype == pd
    assert_close(got, want, pd, n * hw, name, scale=float(np.abs(dz).max()) * 4)


@pytest.mark.parametrize("mask,tiny,layout", [((True, False, False), True, {"idle", "ragged"}),
                                              ((False, False, True), False, {"fused"})],
                         ids=["dx-chunked", "dbias-fused"])
def test_group_norm_backward_masks(rng, monkeypatch, capfd, mask, tiny, layout):
  """dx alone, chunked (the statistics kernel, no partial sums), and dbias alone (no dx), NHWC."""
  n, c, hw, g = 3, 24, 20, 4
  x, dy = random(rng, (n, hw, c), F32, offset=0.5), random(rng, (n, hw, c), F32)
  gamma = random(rng, (c,), F32, offset=1.0)
  _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, g, channels_last=True)
  mean32, rstd32 = mean.astype(np.float32), rstd.astype(np.float32)
  assert _layout("channels_last", n, hw, c, g, 4, tiny=tiny) == layout
  with _tpu_interpreted(monkeypatch, capfd, tiny=tiny) as called:
    outs = jn.group_norm_backward(dy, x, mean32, rstd32, gamma, n, c, hw, g, mask,
                                  channels_last=True, implementation="mosaic_tpu")
  assert set(called) == ({f"{BWD}_stats", BWD} if mask[0] else {BWD}), called
  refs = ref.gn_bwd(dy, x, mean32, rstd32, gamma, n, c, hw, g, True)
  for out, want, on, reduced in zip(outs, refs, mask, (c // g * hw, n * hw, n * hw)):
    assert (out is None) == (not on)
    if on:
      assert_close(out, want, F32, reduced, scale=ref.dx_scale(dy, rstd, gamma))


def test_empty_batches_run_no_kernel(monkeypatch, capfd):
  """A batch of no rows or samples: empty results, zero parameter gradients, no kernel."""
  loss_ln = lambda x, w, b: jnp.sum(jn.layer_norm(x, w, b, implementation="mosaic_tpu"))
  loss_gn = lambda x, w, b: jnp.sum(jn.group_norm(x, 2, w, b, implementation="mosaic_tpu"))
  with _tpu_interpreted(monkeypatch, capfd) as called:
    for loss, shape, c in ((loss_ln, (0, 64), 64), (loss_gn, (0, 8, 5), 8)):
      gx, gw, gb = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
          jnp.zeros(shape), jnp.ones((c,)), jnp.zeros((c,)))
      assert gx.shape == shape
      np.testing.assert_array_equal(np.asarray(gw), np.zeros(c))
      np.testing.assert_array_equal(np.asarray(gb), np.zeros(c))
  assert not called, called
