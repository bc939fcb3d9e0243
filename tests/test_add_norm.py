"""add_layer_norm / add_rms_norm (the residual form) against the float64 NumPy reference, once per implementation."""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from jax_normgrad.pallas import common, config, gpu as pallas_gpu, tpu as pallas_tpu
import cases
from cases import (MASKS, assert_launches, export_for, kernel_launches, needs_mosaic_gpu, random,
                   rotate)
import reference_np as ref
from tolerances import assert_close

F32 = jnp.float32
BF16 = jnp.bfloat16
F16 = jnp.float16

# (x shape, normalized_shape, params: "wb" weight and bias, "w", "" none,
# x dtype, residual dtype (None: x's), residual_dtype (None: x's)).
CASES = [
    ((7, 1000), (1000,), "wb", F32, None, None),
    ((3, 5, 42), (42,), "w", BF16, None, None),
    ((3, 5, 42), (42,), "wb", BF16, F32, F32),
    ((4, 6, 10), (6, 10), "", F16, None, F32),
    ((9, 2), (2,), "wb", F16, F32, F32),
    ((0, 64), (64,), "wb", F32, None, None),
    ((2, 3000), (3000,), "w", BF16, None, None),  # more than one moments chunk
    ((5, 33), (33,), "wb", F16, None, None),  # a float16 h, an odd width
    ((2, 4097), (4097,), "wb", F16, F32, None),  # two whole moments chunks and one element
]
EPS = 1e-5
# test_normalizes_h_as_stored: (centered, bfloat16 x shape, x's mean, x's spread); the
# residual's spread is 0.5.
STORED_H_CASES = [
    (True, (6, 40), 0.5, 2.0),
    (False, (6, 40), 0.5, 2.0),
    (True, (5, 2), 4.0, 0.01),  # short rows far from zero
    (True, (5, 3), 4.0, 0.01),
    (True, (5, 4), 4.0, 0.01),
]
SHORT_SHIFTED_ROWS = 3  # the interpreted kernels' case of short rows far from zero


def _inputs(rng, shape, norm_shape, params, dtype, res_dtype):
  x = random(rng, shape, dtype, scale=2.0, offset=0.5)
  r = random(rng, shape, res_dtype or dtype, scale=3.0, offset=-0.25)
  w = random(rng, norm_shape, dtype, offset=1.0) if "w" in params else None
  b = random(rng, norm_shape, dtype) if "b" in params else None
  return x, r, w, b


def _f64(a):
  return None if a is None else np.asarray(jnp.asarray(a).astype(F32), np.float64)


def _ref_forward(x, r, w, b, norm_ndim, centered, h_dtype, eps):
  """y, h as stored (the float32 sum rounded to h_dtype, float64) and the statistics, all of
  that h (docs/spec.md, the residual form)."""
  h = ref.stored_sum(x, r, h_dtype)
  if centered:
    y, mean, rstd = ref.ln_fwd(h, norm_ndim, _f64(w), _f64(b), eps)
  else:
    y, rstd = ref.rms_fwd(h, norm_ndim, _f64(w), eps)
    mean = np.zeros_like(rstd)
  return y, h, mean, rstd


def _call(centered, x, r, w, b, **kw):
  if centered:
    return jn.add_layer_norm(x, r, w, b, **kw)
  return jn.add_rms_norm(x, r, w, **kw)


class AddNormTests:
  """The residual-form suite; subclasses set ``implementation``."""

  implementation = None
  #: test_vmap_batched_residual_and_weights against the reference implementation under the
  #: same vmap, not each example unbatched (for an interpreted kernel: fewer compiles).
  vmap_against_xla = False

  def _run(self, fn, *args):
    with warnings.catch_warnings():
      # Every implementation runs the residual form itself: no fallback.
      warnings.simplefilter("error", jn.FallbackWarning)
      return fn(*args)

  def _same_bits_again(self, first, fn):
    """``fn()`` gives ``first``'s bits again, where a repeat could differ (not for a kernel
    interpreted on the CPU, whose repeat gives the same bits by construction:
    cases.repeats_can_differ)."""
    if not cases.repeats_can_differ(self.implementation):
      return
    for a, c in zip(first, self._run(fn)):
      assert (a is None) == (c is None)
      if a is not None:
        np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(c.astype(F32)))

  def _narrow(self, case, centered):
    """Skips the (case, centered) pairs a slow (interpreted) subclass leaves to another."""

  def _narrow_stored(self, case):
    """Skips the STORED_H_CASES a slow (interpreted) subclass leaves out."""

  @pytest.mark.parametrize("centered", [True, False])
  @pytest.mark.parametrize("case", range(len(CASES)))
  def test_forward_and_gradients(self, rng, centered, case):
    """y and h of h as stored; one gradient for x and residual, plus dh; parameter gradients."""
    self._narrow(case, centered)
    shape, norm_shape, params, dtype, res_dtype, h_dtype = CASES[case]
    if not centered:
      params = params.replace("b", "")
    x, r, w, b = _inputs(rng, shape, norm_shape, params, dtype, res_dtype)
    nd = len(norm_shape)
    hd = h_dtype or dtype
    eps = EPS if centered else 1e-6
    impl = self.implementation

    def f(x, r, w, b):
      return _call(centered, x, r, w, b, normalized_shape=norm_shape, eps=eps,
                   residual_dtype=h_dtype, implementation=impl)

    (y, h), vjp = self._run(lambda: jax.vjp(jax.jit(f), x, r, w, b))
    y_ref, h_ref, mean, rstd = _ref_forward(x, r, w, b, nd, centered, hd, eps)
    width = math.prod(norm_shape)
    rows = math.prod(shape) // width
    assert y.dtype == dtype and h.dtype == hd and h.shape == y.shape == shape
    assert_close(y, y_ref, dtype, width, "y")
    np.testing.assert_array_equal(_f64(h), h_ref, err_msg="h")
    dy = random(rng, shape, dtype)
    dh = random(rng, shape, hd, scale=0.5)
    gx, gr, gw, gb = self._run(lambda: vjp((dy, dh)))
    # The backward's xhat is the stored h's, with its statistics.
    dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, h_ref, nd, mean if centered else np.zeros_like(rstd),
                                        rstd, _f64(w))
    if not centered:  # RMSNorm: no mean(g) term
      dx_ref, dw_ref = ref.rms_bwd(dy, h_ref, nd, rstd, _f64(w))
    dx_ref = dx_ref + _f64(dh)
    scale = ref.dx_scale(dy, rstd, _f64(w)) + float(np.max(np.abs(_f64(dh)), initial=0.0))
    assert gx.dtype == dtype and gr.dtype == r.dtype
    # The float32 gradient rounded once to h's dtype (x's or float32), then to x's and residual's.
    assert_close(gx, dx_ref, dtype, width, "grad x", scale=scale)
    wide, narrow = (gr, gx) if jnp.dtype(r.dtype).itemsize >= jnp.dtype(dtype).itemsize else (gx, gr)
    np.testing.assert_array_equal(np.asarray(narrow.astype(F32)),
                                  np.asarray(wide.astype(narrow.dtype).astype(F32)))
    if w is not None:
      assert gw.dtype == w.dtype
      assert_close(gw, dw_ref, dtype, rows, "grad weight")
    if b is not None:
      assert gb.dtype == b.dtype
      assert_close(gb, db_ref, dtype, rows, "grad bias")

  def test_y_from_stored_h(self):
    """y normalizes h rounded to bfloat16, as stored, not the float32 sum.

    Row [1, 1 + 2^-7, 1 + 3 * 2^-9]: the third sum rounds to 1 + 2^-7 in
    bfloat16, which changes the LayerNorm output by O(1). (RMSNorm's
    output moves by an ulp only; its kernels share the code path.)
    """
    x = jnp.asarray([[1.0, 1.0 + 2 ** -7, 1.0]], BF16)
    r = jnp.asarray([[0.0, 0.0, 3 * 2 ** -9]], BF16)
    y, h = self._run(lambda: jn.add_layer_norm(x, r, eps=0.0, implementation=self.implementation))
    exact = _f64(x) + _f64(r)
    fwd = lambda a: ref.ln_fwd(a, 1, eps=0.0)[0]
    assert _f64(h)[0, 2] == 1.0 + 2 ** -7
    np.testing.assert_allclose(_f64(y), fwd(_f64(h)), rtol=2 ** -8, atol=1e-6)
    assert not np.allclose(fwd(_f64(h)), fwd(exact), atol=0.05)

  @pytest.mark.parametrize("case", range(len(STORED_H_CASES)))
  def test_normalizes_h_as_stored(self, rng, case):
    """bfloat16 x and residual: ``add_layer_norm(x, r)`` (``add_rms_norm``) is
    ``(layer_norm(h), h)`` with ``h = x + r`` the bfloat16 jnp sum, and its gradients are
    those of that unfused pair: with y's cotangent alone, the plain norm's backward at h;
    with h's added too, both the float64 derivative's at h to the dtype's rounding. Bit for
    bit on CPU, where both forms compute the statistics and y by the same operations in the
    same order (the CPU kernel for rows of one moments chunk; the reference; the interpreted
    kernels); an accelerator's kernels plan the residual form's tiles apart from the plain
    form's. Rows of 2 to 4 far from zero (``shift``, small ``spread``: dx a near-total
    cancellation) are where the unrounded sum's statistics beside the stored h would break
    the gradients."""
    self._narrow_stored(case)
    centered, shape, shift, spread = STORED_H_CASES[case]
    x = jnp.asarray(rng.normal(size=shape) * spread + shift, BF16)
    r = jnp.asarray(rng.normal(size=shape) * 0.5, BF16)
    w = random(rng, shape[-1:], BF16, offset=1.0)
    b = random(rng, shape[-1:], BF16) if centered else None
    dy, dh = random(rng, shape, BF16), random(rng, shape, BF16, scale=0.5)
    width = shape[-1]
    impl = self.implementation
    h = x + r  # the bfloat16 sum, as the unfused code stores it
    if centered:
      plain = lambda h, w, b: jn.layer_norm(h, w, b, implementation=impl)
    else:
      plain = lambda h, w, b: jn.rms_norm(h, w, implementation=impl)
    (y, hf), vjp = self._run(lambda: jax.vjp(jax.jit(
        lambda *a: _call(centered, *a, implementation=impl)), x, r, w, b))
    y_plain, plain_vjp = self._run(lambda: jax.vjp(jax.jit(plain), h, w, b))
    grads = self._run(lambda: vjp((dy, jnp.zeros_like(h))))
    plain_grads = self._run(lambda: plain_vjp(dy))
    np.testing.assert_array_equal(_f64(hf), _f64(h), err_msg="h")
    # (dx, dresidual, dweight[, dbias]) against the plain norm's (dh, dweight[, dbias]).
    pairs = [("y", y, y_plain), ("grad x", grads[0], plain_grads[0]),
             ("grad residual", grads[1], plain_grads[0]), ("grad weight", grads[2], plain_grads[1])]
    if centered:
      pairs.append(("grad bias", grads[3], plain_grads[2]))
    _, mean, rstd = (ref.ln_fwd(_f64(h), 1, eps=EPS) if centered else
                     (None, None, ref.rms_fwd(_f64(h), 1, eps=1e-6)[1]))
    scale = ref.dx_scale(dy, rstd, _f64(w))
    for name, got, want in pairs:
      assert got.dtype == want.dtype, name
      if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(_f64(got), _f64(want), err_msg=name)
      else:
        reduced = shape[0] if name in ("grad weight", "grad bias") else width
        assert_close(got, _f64(want), BF16, reduced, name,
                     scale=scale if name in ("grad x", "grad residual") else None)
    # With h's cotangent: the one gradient of x and residual, dx(h) + dh, against the float64
    # derivative at the stored h with its statistics.
    gx, gr = self._run(lambda: vjp((dy, dh)))[:2]
    if centered:
      dx_ref = ref.ln_bwd(dy, _f64(h), 1, mean, rstd, _f64(w))[0]
    else:
      dx_ref = ref.rms_bwd(dy, _f64(h), 1, rstd, _f64(w))[0]
    scale += float(np.max(np.abs(_f64(dh))))
    for name, got in (("grad x with dh", gx), ("grad residual with dh", gr)):
      assert_close(got, dx_ref + _f64(dh), BF16, width, name, scale=scale)

  def test_vmap_batched_residual_and_weights(self, rng):
    """vmap over x, a batched residual and per-example weight and bias, forward and gradients:
    each example's against the same implementation unbatched, or (``vmap_against_xla``) the
    batch against the reference implementation's, vmapped the same way."""
    x = random(rng, (3, 5, 24), F32)
    r = random(rng, (3, 5, 24), F32)
    w = random(rng, (3, 24), F32, offset=1.0)
    b = random(rng, (3, 24), F32)
    dy = random(rng, (3, 5, 24), F32)

    def loss(x, r, w, b, dy, impl=self.implementation):
      y, h = jn.add_layer_norm(x, r, w, b, implementation=impl)
      return jnp.sum(y * dy) + jnp.sum(jnp.sin(h))

    def batched(loss):
      grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(x, r, w, b, dy)
      unbatched_r = jax.vmap(jax.grad(loss, argnums=(0, 2)),
                             in_axes=(0, None, 0, 0, 0))(x, r[0], w, b, dy)
      return grads, unbatched_r

    grads, unbatched_r = self._run(lambda: batched(loss))
    if self.vmap_against_xla:
      for got, want in zip(grads + unbatched_r,
                           sum(batched(functools.partial(loss, impl="xla")), ())):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
      return
    for i in range(3):
      single = self._run(lambda: jax.grad(loss, argnums=(0, 1, 2, 3))(x[i], r[i], w[i], b[i], dy[i]))
      for got, want in zip(grads, single):
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
      single = self._run(lambda: jax.grad(loss, argnums=(0, 2))(x[i], r[0], w[i], b[i], dy[i]))
      for got, want in zip(unbatched_r, single):
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)

  def test_second_order(self, rng):
    """grad(grad) through the residual form equals the pure-JAX reference's."""
    x = random(rng, (4, 16), F32)
    r = random(rng, (4, 16), F32)
    w = random(rng, (16,), F32, offset=1.0)

    def outer(impl):
      def inner(x, r, w):
        y, h = jn.add_rms_norm(x, r, w, implementation=impl)
        return jnp.sum(jnp.tanh(y)) + jnp.sum(h * h)
      g = lambda x, r, w: jnp.sum(jax.grad(inner, argnums=(0, 2))(x, r, w)[0] ** 2)
      return jax.grad(g, argnums=(0, 1, 2))(x, r, w)

    for got, want in zip(self._run(lambda: outer(self.implementation)), outer("xla")):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class TestAddNormDefault(AddNormTests):
  implementation = None

  @pytest.mark.usefixtures("cpu_device")
  def test_one_kernel_call_each_way(self, rng):
    """The CPU kernels run fused: one forward and one backward custom call, no separate add pass.

    On the CPU device wherever the suite runs: the GPU and TPU kernels' fusion is
    test_pallas_export_lowers_to_the_fused_kernels'."""
    x, r, w, b = _inputs(rng, (4, 32), (32,), "wb", F32, None)

    def loss(x, r, w, b):
      y, h = jn.add_layer_norm(x, r, w, b)
      return jnp.sum(y) + jnp.sum(h)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, r, w, b).as_text()
    assert text.count('jax_normgrad_layer_norm_fwd') == 1
    assert text.count('jax_normgrad_layer_norm_bwd') == 1
    # A zero cotangent stays symbolic: an unread h (the last block's) adds no dh operand (no
    # tensor of zeros written and read); an unread y runs no backward kernel, dh passes through.
    y_only = lambda x, r: jnp.sum(jn.add_layer_norm(x, r)[0])
    text = jax.jit(jax.grad(y_only, argnums=(0, 1))).lower(x, r).as_text()
    assert "has_dh = false" in text and "has_dh = true" not in text
    h_only = lambda x, r: jnp.sum(jn.add_layer_norm(x, r)[1] ** 2)
    assert 'jax_normgrad_layer_norm_bwd' not in jax.jit(jax.grad(h_only)).lower(x, r).as_text()
    np.testing.assert_array_equal(jax.grad(h_only, argnums=1)(x, r), 2 * (x + r))
    # add_rms_norm: the same kernels (centered=False).
    text = jax.jit(lambda x, r: jn.add_rms_norm(x, r)).lower(x, r).as_text()
    assert 'jax_normgrad_layer_norm_fwd' in text and 'stablehlo.add' not in text

  @pytest.mark.usefixtures("cpu_device")
  @pytest.mark.parametrize("res_dtype", [F32, BF16])
  def test_float32_stream_backward_converts_nothing(self, rng, res_dtype):
    """A bfloat16 x with a float32 h: the backward kernel reads the bfloat16 dy and writes the
    gradient in both dtypes (write_dx_dy), so no tensor-sized convert runs around it."""
    x, r, w, b = _inputs(rng, (4, 32), (32,), "wb", BF16, res_dtype)

    def bwd(x, r, w, b, dy, dh):
      _, vjp = jax.vjp(lambda *a: jn.add_layer_norm(*a, residual_dtype=F32), x, r, w, b)
      return vjp((dy, dh))

    args = (x, r, w, b, random(rng, x.shape, BF16), random(rng, x.shape, F32))
    text = jax.jit(bwd).lower(*args).as_text()
    assert text.count("jax_normgrad_layer_norm_bwd") == 1 and "write_dx_dy = true" in text
    assert not [l for l in text.splitlines() if "stablehlo.convert" in l and "4x32" in l]
    # An unread h (the last block's): its cotangent stays a symbolic zero, the same kernel
    # runs without a dh operand.
    y_only = lambda x, r: jnp.sum(jn.add_layer_norm(x, r, residual_dtype=F32)[0].astype(F32))
    text = jax.jit(jax.grad(y_only, argnums=(0, 1))).lower(x, r).as_text()
    assert "write_dx_dy = true" in text and "has_dh = false" in text
    gx, gr, _, _ = jax.jit(bwd)(*args)
    gx_ref, gr_ref, _, _ = jax.jit(lambda *a: jax.vjp(
        lambda *p: jn.add_layer_norm(*p, residual_dtype=F32, implementation="xla"),
        *a[:4])[1]((a[4], a[5])))(*args)
    for got, want in ((gx, gx_ref), (gr, gr_ref)):
      assert got.dtype == want.dtype
      np.testing.assert_allclose(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)),
                                 rtol=2e-2, atol=1e-2)

  @pytest.mark.parametrize("dtype,res_dtype,h_dtype",
                           [(F32, None, None), (BF16, None, None), (BF16, F32, F32)])
  def test_long_rows_deterministic(self, rng, dtype, res_dtype, h_dtype):
    """Few long rows (the column-chunked backward) against the reference; the same bits twice."""
    x, r, w, b = _inputs(rng, (3, 70_000), (70_000,), "wb", dtype, res_dtype)
    dy = random(rng, x.shape, dtype)
    f = jax.jit(lambda x, r, w, b: jax.vjp(
        lambda *a: jn.add_layer_norm(*a, residual_dtype=h_dtype), x, r, w, b)[1](
            (dy, jnp.ones(x.shape, h_dtype or dtype))))
    first, second = f(x, r, w, b), f(x, r, w, b)
    for a, c in zip(first, second):
      np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(c.astype(F32)))
    y, h = jn.add_layer_norm(x, r, w, b, residual_dtype=h_dtype)
    y_ref, h_ref, mean, rstd = _ref_forward(x, r, w, b, 1, True, h_dtype or dtype, EPS)
    assert_close(y, y_ref, dtype, 70_000, "y")
    np.testing.assert_array_equal(_f64(h), h_ref)
    dx_ref, dw_ref, _ = ref.ln_bwd(dy, h_ref, 1, mean, rstd, _f64(w))
    assert_close(first[0], dx_ref + 1.0, dtype, 70_000, "grad x",
                 scale=ref.dx_scale(dy, rstd, _f64(w)))
    assert_close(first[2], dw_ref, dtype, 3, "grad weight")


class TestAddNormXla(AddNormTests):
  implementation = "xla"


class PallasAddNormTests(AddNormTests):
  """The Pallas kernels, interpreted on CPU (``backend``: which kernel set, "gpu" = Triton or "tpu").

  Interpreted kernels are slow: the two subclasses split the forward /
  gradient cases between them (``half``), and the vmap and second-order
  tests run on the faster TPU interpretation only (their kernel code is the
  plain path's; what the residual adds is covered by the other tests).
  """

  implementation = "pallas"
  backend = None
  half = 0
  slow = ()  # tests this subclass skips

  @pytest.fixture(autouse=True)
  def _interpreted(self, request):
    cases.skip_unless_interpretable(self.backend)
    if request.node.originalname in self.slow:
      pytest.skip(f"left to the other interpreted kernel set ({self.backend} runs the rest)")
    jax.clear_caches()
    yield
    jax.clear_caches()

  def _narrow(self, case, centered):
    if (case + centered) % 2 != self.half:
      pytest.skip(f"interpreted {self.backend} kernels: half of the cases, the other kernel set "
                  "runs the rest")

  def _narrow_stored(self, case):
    if case not in (self.half, SHORT_SHIFTED_ROWS):
      pytest.skip(f"interpreted {self.backend} kernels: the short shifted rows and the generic "
                  f"{'RMSNorm' if self.half else 'LayerNorm'} case")

  def test_the_fused_kernels_run(self, rng, monkeypatch):
    """The forward kernel reads the residual and writes h; the backward kernel adds dh (no
    XLA adds around an unchanged kernel), with chunked segments too (tiny tiles). The
    backward also reads the bfloat16 dy and writes the gradient in both dtypes (dx_dy)."""
    module = pallas_gpu if self.backend == "gpu" else pallas_tpu
    seen, seen_dx_dy = [], []
    for name, flag in (("_fwd_kernel", "has_residual"), ("_normalize_kernel", "has_residual"),
                       ("_moments_kernel", "has_residual"), ("_bwd_kernel", "has_dh")):
      kernel = getattr(module, name, None)
      if kernel is not None:
        def spy(*refs, _kernel=kernel, _flag=flag, _name=name, **kw):
          seen.append((_name, kw.get(_flag)))
          if _name == "_bwd_kernel":
            seen_dx_dy.append(kw.get("dx_dy"))
          return _kernel(*refs, **kw)
        monkeypatch.setattr(module, name, spy)
    x, r, w, b = _inputs(rng, (3, 300), (300,), "wb", BF16, F32)
    dy, dh = random(rng, x.shape, BF16), random(rng, x.shape, F32)
    with config.override(gpu_max_tile_bwd=256, gpu_max_tile_fwd=256, tpu_block_elems=2048):
      (y, h), vjp = self._run(lambda: jax.vjp(
          lambda *a: jn.add_layer_norm(*a, residual_dtype=F32,
                                       implementation=self.implementation),
          x, r, w, b))
      gx, gr, gw, gb = self._run(lambda: vjp((dy, dh)))
    assert ("_bwd_kernel", True) in seen and all(flag for _, flag in seen), seen
    assert seen_dx_dy == [True], seen_dx_dy
    assert any(n in ("_fwd_kernel", "_normalize_kernel") for n, _ in seen), seen
    y_ref, h_ref, mean, rstd = _ref_forward(x, r, w, b, 1, True, F32, EPS)
    assert_close(y, y_ref, BF16, 300, "y")
    np.testing.assert_array_equal(_f64(h), h_ref)
    dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, h_ref, 1, mean, rstd, _f64(w))
    assert_close(gx, dx_ref + _f64(dh), BF16, 300, "grad x",
                 scale=ref.dx_scale(dy, rstd, _f64(w)) + float(np.max(np.abs(_f64(dh)))))
    np.testing.assert_array_equal(np.asarray(gx.astype(F32)), np.asarray(gr.astype(BF16).astype(F32)))
    assert_close(gw, dw_ref, BF16, 3, "grad weight")
    assert_close(gb, db_ref, BF16, 3, "grad bias")


class TestAddNormPallas(PallasAddNormTests):
  backend, half = "gpu", 0
  slow = ("test_vmap_batched_residual_and_weights", "test_second_order")


class TestAddNormPallasTpu(PallasAddNormTests):
  implementation, backend, half = "mosaic_tpu", "tpu", 1


TRITON = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"cuda": TRITON, "tpu": "tpu_custom_call"}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("centered,dtype", [(True, BF16), (False, F32)])
def test_pallas_export_lowers_to_the_fused_kernels(platform, centered, dtype):
  """Exported for GPU / TPU, the residual form is the platform's Pallas kernels with the adds
  inside them: no FallbackWarning and no tensor-sized add (or float32 copy) around them."""
  s = lambda shape, d=dtype: jax.ShapeDtypeStruct(shape, d)

  def loss(x, r, w):
    y, h = _call(centered, x, r, w, None)
    return jnp.sum(y.astype(F32)) + jnp.sum(jnp.sin(h.astype(F32)))

  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    text = export_for(platform, jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                      (s((16, 1000)), s((16, 1000)), s((1000,), F32)),
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
                      ).mlir_module()
  assert CUSTOM_CALL[platform] in text
  assert "jax_normgrad_norm_fwd" in text and "jax_normgrad_norm_bwd" in text
  assert "custom_call @jax_normgrad_" not in text  # no CPU kernel
  # The loss's own converts (h to float32) aside, no tensor-sized add: h = x + residual and
  # dx + dh are in the kernels.
  assert not [l for l in text.splitlines() if "stablehlo.add" in l and "16x1000" in l]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_pallas_float32_stream_backward_converts_nothing(platform):
  """Exported for GPU / TPU, a bfloat16 x with a float32 h: the Pallas backward reads the bfloat16
  dy and writes the gradient in both dtypes, so no tensor-sized convert runs around the kernels
  (XLA's fusion of the jnp form has none either)."""
  s = jax.ShapeDtypeStruct

  def bwd(x, r, w, dy, dh):
    _, vjp = jax.vjp(lambda *a: jn.add_rms_norm(*a, residual_dtype=F32), x, r, w)
    return vjp((dy, dh))

  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    text = export_for(platform, jax.jit(bwd),
                      (s((16, 1000), BF16), s((16, 1000), F32), s((1000,), F32),
                       s((16, 1000), BF16), s((16, 1000), F32)),
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
                      ).mlir_module()
  assert CUSTOM_CALL[platform] in text and "jax_normgrad_norm_bwd" in text
  assert not [l for l in text.splitlines() if "stablehlo.convert" in l and "16x1000" in l]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("centered", [True, False])
def test_pallas_half_y_of_float32_x_converts_nothing(platform, centered):
  """Exported for GPU / TPU, the norm of a float32 stream with a bfloat16 y (``out_dtype``):
  the forward kernel writes the bfloat16 y and the backward reads the bfloat16 dy, no
  tensor-sized convert around them (what the unfused pre-norm stack's first norm needs)."""
  s = jax.ShapeDtypeStruct
  norm = ((lambda x, w: jn.layer_norm(x, w, out_dtype=BF16)) if centered
          else (lambda x, w: jn.rms_norm(x, w, out_dtype=BF16)))

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(norm, x, w)
    return y, vjp(dy)

  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    text = export_for(platform, jax.jit(fwd_bwd),
                      (s((16, 1000), F32), s((1000,), F32), s((16, 1000), BF16)),
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
                      ).mlir_module()
  assert "jax_normgrad_norm_fwd" in text and "jax_normgrad_norm_bwd" in text
  assert not [l for l in text.splitlines() if "stablehlo.convert" in l and "16x1000" in l]


class TestAddNormValidation:
  """Bad arguments fail at trace time, naming the argument."""

  def test_errors(self, rng):
    x = random(rng, (4, 8), BF16)
    with pytest.raises(ValueError, match=r"residual: expected shape \(4, 8\)"):
      jn.add_layer_norm(x, jnp.zeros((4, 9), BF16))
    with pytest.raises(TypeError, match="residual: expected dtype bfloat16 .* or float32"):
      jn.add_rms_norm(x, jnp.zeros((4, 8), F16))
    with pytest.raises(TypeError, match="residual: expected an array, got None"):
      jn.add_layer_norm(x, None)
    with pytest.raises(TypeError, match="residual_dtype: expected None, bfloat16"):
      jn.add_layer_norm(x, x, residual_dtype=F16)
    with pytest.raises(TypeError, match="residual_dtype: expected"):
      jn.add_rms_norm(x, x, residual_dtype="nope")
    with pytest.raises(ValueError, match="weight: expected shape"):
      jn.add_layer_norm(x, x, jnp.ones((9,), BF16))
    with pytest.raises(ValueError, match="eps"):
      jn.add_rms_norm(x, x, eps=-1.0)
    with pytest.raises(ValueError, match="implementation"):
      jn.add_rms_norm(x, x, implementation="cuda")
    # The primitive: no xhat output with a residual (the docstring of primitives.layer_norm).
    from jax_normgrad._operands import NormFwd
    from jax_normgrad.primitives.layer_norm import layer_norm_fwd_p
    with pytest.raises(ValueError, match="write_xhat: not available with a residual"):
      cases.bind(layer_norm_fwd_p, NormFwd(x, x), eps=1e-5, centered=True, param_groups=1,
                 write_xhat=True, y_dtype=None, implementation="xla", h_dtype=None)


class TestAddNormDropins:
  """flax.linen and nnx AddLayerNorm / AddRMSNorm: the plain layer's parameters, the fused kernels."""

  def test_linen(self, rng):
    nn = pytest.importorskip("flax.linen")
    import jax_normgrad.flax as jnf
    x, r = random(rng, (4, 6, 32), F32), random(rng, (4, 6, 32), F32)
    for cls, plain in ((jnf.AddLayerNorm, nn.LayerNorm), (jnf.AddRMSNorm, nn.RMSNorm)):
      layer = cls()
      params = layer.init(jax.random.key(0), x, r)
      plain_params = plain().init(jax.random.key(0), x)
      assert jax.tree.structure(params) == jax.tree.structure(plain_params)

      def loss(p, x, r):
        y, h = layer.apply(p, x, r)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h ** 2)

      ref_loss = lambda p, x, r: jnp.sum(jnp.sin(plain().apply(p, x + r))) + jnp.sum((x + r) ** 2)
      got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, r)
      want = jax.grad(ref_loss, argnums=(0, 1, 2))(params, x, r)
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
      text = jax.jit(jax.grad(loss)).lower(params, x, r).as_text()
      assert_launches(kernel_launches(text, "jax_normgrad_layer_norm_fwd"), 1)
      # flax's float32 result of a 16-bit x: the add before the plain drop-in, announced.
      with pytest.warns(jn.FallbackWarning, match="result dtype float32"):
        y, h = layer.apply(params, x.astype(BF16), r.astype(BF16))
      assert y.dtype == F32 and h.dtype == BF16

  def test_nnx(self, rng):
    nnx = pytest.importorskip("flax.nnx")
    import jax_normgrad.nnx as jnn
    x, r = random(rng, (4, 6, 32), F32), random(rng, (4, 6, 32), F32)
    for cls, plain in ((jnn.AddLayerNorm, nnx.LayerNorm), (jnn.AddRMSNorm, nnx.RMSNorm)):
      layer, ref_layer = cls(32, rngs=nnx.Rngs(0)), plain(32, rngs=nnx.Rngs(0))
      y, h = layer(x, r)
      np.testing.assert_allclose(y, ref_layer(x + r), rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(h, x + r)
      got = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x, r)[0])))(layer)
      want = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x + r))))(ref_layer)
      for g, w in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want))):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
      layer = cls(32, residual_dtype=F32, dtype=BF16, param_dtype=BF16, rngs=nnx.Rngs(0))
      y, h = layer(x.astype(BF16), r.astype(BF16))
      assert y.dtype == BF16 and h.dtype == F32


# ----------------------------------------------------------------------------
# Mosaic GPU: the residual fused in its row kernels and in the pieces of long rows.

MOSAIC_GPU = "mosaic_gpu_v2"


def _spy_kernels(monkeypatch):
  """Records the Mosaic GPU kernels that run, with their residual flags.

  Each is patched in the module that defines it; the pieces of long rows
  (``mosaic_gpu_pieces``) look them up there too."""
  from jax_normgrad.pallas import mosaic_gpu_group_norm, mosaic_gpu_rows
  seen = []
  for module, name, flag in ((mosaic_gpu_rows, "fwd_kernel", "has_residual"),
                             (mosaic_gpu_group_norm, "sums_kernel", "has_residual"),
                             (mosaic_gpu_rows, "bwd_kernel", "has_dh")):
    def spy(*refs, _kernel=getattr(module, name), _flag=flag, _name=name, **kw):
      seen.append((_name, bool(kw.get(_flag)), bool(kw.get("given"))))
      return _kernel(*refs, **kw)
    monkeypatch.setattr(module, name, spy)
  return seen


@needs_mosaic_gpu
class TestAddNormMosaicGpu(AddNormTests):
  """The Mosaic GPU kernels in Pallas' GPU interpret mode on CPU (threads, SMEM, TMA and
  barriers simulated): the residual read and h written by the forward kernels, dh added by
  the backward's, in the row kernels and in the pieces of long rows.

  Interpreted, so the shared cases run once each (LayerNorm for the even ones, RMSNorm for
  the odd ones); vmap (per-example parameters: parameter groups; against the reference
  implementation's) and grad(grad) run whole.
  """

  implementation = "mosaic_gpu"
  vmap_against_xla = True

  @pytest.fixture(autouse=True)
  def _fresh(self):
    jax.clear_caches()
    yield
    jax.clear_caches()

  def _narrow(self, case, centered):
    if (case % 2 == 0) != centered:
      pytest.skip("interpreted Mosaic GPU: each case once (even cases LayerNorm, odd RMSNorm)")

  def _narrow_stored(self, case):
    if case not in (1, SHORT_SHIFTED_ROWS):
      pytest.skip("interpreted Mosaic GPU: the short shifted rows and the generic RMSNorm case")

  @pytest.mark.parametrize("mask", [m for m in MASKS if m[0]])
  def test_backward_output_masks(self, rng, mask):
    """Every output mask with dx, dh added to it; 37 columns (padded to 128), bfloat16 h."""
    from jax_normgrad.ops._layer_norm_core import bwd
    centered = mask[1] != mask[2]
    shape = (5, 37)
    h, dy, dh = (random(rng, shape, BF16, scale=2.0, offset=0.5), random(rng, shape, BF16),
                 random(rng, shape, BF16))
    w = random(rng, (37,), F32, offset=1.0)
    if centered:
      _, mean, rstd = ref.ln_fwd(_f64(h), 1, eps=EPS)
    else:
      mean, rstd = None, ref.rms_fwd(_f64(h), 1, eps=EPS)[1]
    stats = lambda a: None if a is None else jnp.asarray(a.reshape(5), F32)
    outs = self._run(lambda: jax.jit(lambda *a: bwd(
        *a, mask, 1, self.implementation, centered=centered, dh=dh))(
            dy, h, stats(mean), stats(rstd), w))
    m = mean if centered else np.zeros_like(rstd)
    dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, h, 1, m, rstd, _f64(w))
    if not centered:
      dx_ref, dw_ref = ref.rms_bwd(dy, h, 1, rstd, _f64(w))
    assert_close(outs.dx, dx_ref + _f64(dh), BF16, 37, "dx",
                 scale=ref.dx_scale(dy, rstd, _f64(w)) + float(np.max(np.abs(_f64(dh)))))
    for name, want, got, expected in (("dweight", mask[1], outs.dweight, dw_ref),
                                      ("dbias", mask[2], outs.dbias, db_ref)):
      assert (got is not None) == want, name
      if want:
        assert_close(got, expected, BF16, 5, name)

  @pytest.mark.parametrize("centered,dtype,res_dtype,h_dtype,smem,pieces", [
      (True, BF16, None, None, 6000, (2, 4)),   # forward 2 pieces of 512, the last 488 long
      (False, F32, None, None, 7000, (4, 4)),
      (True, BF16, F32, F32, 8000, (2, 4)),     # float32 h: the backward's rows are float32
  ])
  def test_long_rows_in_pieces_deterministic(self, rng, monkeypatch, centered, dtype, res_dtype,
                                             h_dtype, smem, pieces):
    """Rows too long for the SMEM budget: the pieces' moments of x + residual, h written by
    the kernel writing y, dh added by the one writing dx; against the reference, and twice bitwise
    where a repeat could differ."""
    seen = _spy_kernels(monkeypatch)
    shape = (5, 1000)
    params = "wb" if centered else "w"
    x, r, w, b = _inputs(rng, shape, (1000,), params, dtype, res_dtype)
    hd = jnp.dtype(h_dtype or dtype)
    dy, dh = random(rng, shape, dtype), random(rng, shape, hd, scale=0.5)
    eps = EPS if centered else 1e-6
    kw = dict(implementation=self.implementation, residual_dtype=h_dtype, eps=eps)

    def run(x, r, w, b):
      (y, h), vjp = jax.vjp(lambda *a: _call(centered, *a, **kw), x, r, w, b)
      return (y, h) + vjp((dy, dh))

    with config.override(mosaic_gpu_smem_bytes=smem):
      r_bytes = jnp.dtype(res_dtype or dtype).itemsize
      n_params = len(params)
      assert config.mosaic_gpu_plan(1000, x.dtype.itemsize, backward=False, params=n_params,
                                    extra_bytes=r_bytes + hd.itemsize) is None
      fwd = config.mosaic_gpu_pieces(1000, x.dtype.itemsize, backward=False, params=n_params,
                                     extra_bytes=r_bytes + hd.itemsize)
      bwd = config.mosaic_gpu_pieces(1000, hd.itemsize, backward=True, params=1, outputs=1,
                                     partials=n_params, extra_bytes=hd.itemsize)
      assert (fwd[0], bwd[0]) == pieces, (fwd, bwd)
      first = self._run(lambda: jax.jit(run)(x, r, w, b))
      self._same_bits_again(first, lambda: jax.jit(run)(x, r, w, b))
    assert ("sums_kernel", True, False) in seen, seen  # the pieces' moments of x + residual
    assert ("fwd_kernel", True, True) in seen and ("bwd_kernel", True, True) in seen, seen
    y, h, gx, gr, gw, gb = first
    y_ref, h_ref, mean, rstd = _ref_forward(x, r, w, b, 1, centered, hd, eps)
    assert_close(y, y_ref, dtype, 1000, "y")
    np.testing.assert_array_equal(_f64(h), h_ref)
    if centered:
      dx_ref, dw_ref, db_ref = ref.ln_bwd(dy, h_ref, 1, mean, rstd, _f64(w))
    else:
      (dx_ref, dw_ref), db_ref = ref.rms_bwd(dy, h_ref, 1, rstd, _f64(w)), None
    scale = ref.dx_scale(dy, rstd, _f64(w)) + float(np.max(np.abs(_f64(dh))))
    assert_close(gx, dx_ref + _f64(dh), dtype, 1000, "grad x", scale=scale)
    assert gr.dtype == r.dtype
    assert_close(gw, dw_ref, dtype, 5, "grad weight")
    if centered:
      assert_close(gb, db_ref, dtype, 5, "grad bias")

  def test_row_kernels_deterministic(self, rng, monkeypatch):
    """Several rows per CTA, double-buffered (13 of 37 rows, 300 columns padded to 512), bfloat16
    x with a float32 residual and h: the fused row kernels, against the reference, and the same
    bits twice where a repeat could differ."""
    seen = _spy_kernels(monkeypatch)
    x, r, w, b = _inputs(rng, (37, 300), (300,), "wb", BF16, F32)
    dy, dh = random(rng, x.shape, BF16), random(rng, x.shape, F32)

    def run(x, r, w, b):
      (y, h), vjp = jax.vjp(lambda *a: jn.add_layer_norm(
          *a, residual_dtype=F32, implementation=self.implementation), x, r, w, b)
      return (y, h) + vjp((dy, dh))

    first = self._run(lambda: jax.jit(run)(x, r, w, b))
    self._same_bits_again(first, lambda: jax.jit(run)(x, r, w, b))
    assert set(seen) == {("fwd_kernel", True, False), ("bwd_kernel", True, False)}, seen
    y_ref, h_ref, mean, rstd = _ref_forward(x, r, w, b, 1, True, F32, EPS)
    assert_close(first[0], y_ref, BF16, 300, "y")
    np.testing.assert_array_equal(_f64(first[1]), h_ref)
    dx_ref, _, _ = ref.ln_bwd(dy, h_ref, 1, mean, rstd, _f64(w))
    assert_close(first[2], dx_ref + _f64(dh), BF16, 300, "grad x",
                 scale=ref.dx_scale(dy, rstd, _f64(w)) + float(np.max(np.abs(_f64(dh)))))


@needs_mosaic_gpu
def test_pallas_mosaic_gpu_fuses_the_residual_unannounced(rng):
  """The Mosaic GPU kernels fuse the residual: no FallbackWarning, the reference's numbers."""
  from jax_normgrad import _fallback
  _fallback.warn_once.cache_clear()
  x, r, w, b = _inputs(rng, (8, 128), (128,), "wb", BF16, None)
  dy, dh = random(rng, x.shape, BF16), random(rng, x.shape, BF16)

  def run(impl):
    (y, h), vjp = jax.vjp(lambda *a: jn.add_layer_norm(*a, implementation=impl), x, r, w, b)
    return (y, h) + vjp((dy, dh))

  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    got = run("mosaic_gpu")
  jax.clear_caches()
  for a, c in zip(got, run("xla")):
    np.testing.assert_allclose(np.asarray(a.astype(F32)), np.asarray(c.astype(F32)),
                               rtol=2e-2, atol=2e-2)


@needs_mosaic_gpu
@pytest.mark.parametrize("centered,dtype,res_dtype,hidden", [
    (True, BF16, None, 1000), (False, F32, None, 4096), (True, BF16, F32, 4096),
    (True, F32, None, 65536), (False, BF16, F32, 65536)])
def test_mosaic_gpu_export_lowers_to_the_fused_kernels(centered, dtype, res_dtype, hidden):
  """Exported for cuda with implementation="mosaic_gpu": Mosaic GPU kernels only (no Triton),
  and no tensor-sized add around them (h = x + residual and dx + dh are in the kernels); a
  float32 residual stream beside 16-bit x; 65536-long rows in pieces too (their moments
  kernel reads the residual)."""
  s = lambda shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  rows = 16 if hidden < 10_000 else 4

  def loss(x, r, w):
    y, h = _call(centered, x, r, w, None, implementation="mosaic_gpu", residual_dtype=res_dtype)
    return jnp.sum(y.astype(F32)) + jnp.sum(jnp.sin(h.astype(F32)))

  with warnings.catch_warnings():
    warnings.simplefilter("error", jn.FallbackWarning)
    text = export_for("cuda", jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                      (s((rows, hidden)), s((rows, hidden), res_dtype or dtype),
                       s((hidden,), F32))).mlir_module()
  assert MOSAIC_GPU in text and TRITON not in text
  assert "jax_normgrad_norm_fwd" in text and "jax_normgrad_norm_bwd" in text
  if hidden > 10_000:
    assert "jax_normgrad_norm_fwd_stats" in text
  assert "custom_call @jax_normgrad_" not in text  # no CPU kernel
  assert not [l for l in text.splitlines() if "stablehlo.add" in l and f"{rows}x{hidden}" in l]


@needs_mosaic_gpu
def test_mosaic_gpu_residual_rows_that_do_not_fit(rng, settings_env):
  """An SMEM budget that holds a plain row's pieces but not the residual form's (3000 bytes,
  float32): forced, Mosaic GPU raises naming the residual rows; chosen by the environment
  variable, Triton runs it, announced."""
  from jax_normgrad import _fallback
  from jax_normgrad.pallas import mosaic_gpu
  x, r = random(rng, (4, 1000), F32), random(rng, (4, 1000), F32)
  seg = common.Segments("rows", 4, 1, 1000, groups=1, param_groups=1)
  with config.override(mosaic_gpu_smem_bytes=3000):
    assert mosaic_gpu.unsupported(seg, 4, backward=False) is None
    assert "residual form" in mosaic_gpu.unsupported(seg, 4, backward=False, extra_bytes=8)
    with pytest.raises(ValueError, match="implementation='mosaic_gpu' cannot run"):
      jax.jit(lambda x, r: jn.add_layer_norm(x, r, implementation="mosaic_gpu")).lower(x, r)
    settings_env("JAX_NORMGRAD_GPU_BACKEND", "mosaic_gpu")
    _fallback.warn_once.cache_clear()
    with pytest.warns(jn.FallbackWarning, match="Triton kernels run it instead"):
      text = export_for("cuda", jax.jit(lambda x, r: jn.add_layer_norm(x, r)),
                        (x, r), disabled_checks=[
                            jax.export.DisabledSafetyCheck.custom_call(TRITON)]).mlir_module()
  jax.clear_caches()
  assert TRITON in text and MOSAIC_GPU not in text
