"""The layers' ``forward`` option: XLA's jnp forward with the backward kernel, or the forward kernel.

Every layer (LayerNorm, RMSNorm, GroupNorm with and without its fused
activation, the residual forms) and every drop-in, with ``forward`` None,
"kernel" and "xla": y and every gradient against the float64 reference,
which kernels the step lowers to, the default per platform and its
environment override, vmap, export, and the argument's checks. The sharded
runs are in tests/test_sharding.py.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
import reference_np as ref
from cases import PLATFORM, kernel_launches, random
from jax_normgrad import _settings
from tolerances import assert_close, assert_group_norm_close

FORWARDS = [None, "kernel", "xla"]
F32, BF16 = jnp.float32, jnp.bfloat16


def _kernel_forward(forward) -> bool:
  """Whether ``forward`` lowers to the forward kernel here (None: the platform's default)."""
  return forward == "kernel" or (forward is None and
                                 _settings.current().layer_forward(PLATFORM) == "kernel")


def _grads(f, args, ct):
  y, pullback = jax.vjp(f, *args)
  return y, pullback(ct)


def _check_launches(f, args, forward, fwd_target, bwd_target):
  """The step ``jax.grad`` lowers to runs the backward kernel, and the forward kernel only with
  a kernel forward."""
  text = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0] if isinstance(f(*a), tuple) else f(*a)),
                          argnums=tuple(range(len(args))))).lower(*args).as_text()
  assert kernel_launches(text, bwd_target) >= 1, "the backward kernel is not in the step"
  assert (kernel_launches(text, fwd_target) >= 1) == _kernel_forward(forward), text[-2000:]


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("dtype,shape,norm_ndim,params", [
    (F32, (7, 300), 1, "both"), (BF16, (3, 5, 128), 1, "weight"), (F32, (4, 6, 10), 2, "none"),
    (F32, (0, 64), 1, "both")])
def test_layer_norm(rng, forward, dtype, shape, norm_ndim, params):
  ns = shape[len(shape) - norm_ndim:]
  x = random(rng, shape, dtype, 2.0, 0.5)
  w = random(rng, ns, F32, 1.0, 1.0) if params != "none" else None
  b = random(rng, ns, F32) if params == "both" else None
  ct = random(rng, shape, dtype)
  f = lambda x, w, b: jn.layer_norm(x, w, b, normalized_shape=ns, forward=forward)
  y, (dx, dw, db) = _grads(f, (x, w, b), ct)
  y64, mean, rstd = ref.ln_fwd(x, norm_ndim, w, b)
  dx64, dw64, db64 = ref.ln_bwd(ct, x, norm_ndim, mean, rstd, w)
  h = int(np.prod(ns))
  assert_close(y, y64, dtype, h, "y", scale=ref.fwd_scales(x, rstd, w)[0])
  assert_close(dx, dx64, dtype, h, "dx", scale=ref.dx_scale(ct, rstd, w))
  if w is not None:
    assert_close(dw, dw64, F32, max(x.size // h, 1) * h, "dw")
  if b is not None:
    assert_close(db, db64, F32, max(x.size // h, 1), "db")
  if x.size:
    _check_launches(f, (x, w, b), forward, "jax_normgrad_layer_norm_fwd",
                    "jax_normgrad_layer_norm_bwd")


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rms_norm(rng, forward, dtype):
  x = random(rng, (6, 200), dtype, 1.5, 0.3)
  w = random(rng, (200,), F32, 1.0, 1.0)
  ct = random(rng, x.shape, dtype)
  f = lambda x, w: jn.rms_norm(x, w, forward=forward)
  y, (dx, dw) = _grads(f, (x, w), ct)
  y64, rstd = ref.rms_fwd(x, 1, w)
  dx64, dw64 = ref.rms_bwd(ct, x, 1, rstd, w)
  assert_close(y, y64, dtype, 200, "y", scale=ref.fwd_scales(x, rstd, w)[0])
  assert_close(dx, dx64, dtype, 200, "dx", scale=ref.dx_scale(ct, rstd, w))
  assert_close(dw, dw64, F32, x.size, "dw")
  _check_launches(f, (x, w), forward, "jax_normgrad_layer_norm_fwd", "jax_normgrad_layer_norm_bwd")


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("channels_last,activation,dtype", [
    (False, None, F32), (True, "silu", F32), (True, "gelu", BF16), (False, "silu", BF16)])
def test_group_norm(rng, forward, channels_last, activation, dtype):
  n, c, g = 3, 12, 4
  shape = (n, 5, 7, c) if channels_last else (n, c, 5, 7)
  x = random(rng, shape, dtype, 2.0, -0.4)
  w = random(rng, (c,), F32, 1.0, 1.0)
  b = random(rng, (c,), F32, 0.5)
  ct = random(rng, shape, dtype)
  f = lambda x, w, b: jn.group_norm(x, g, w, b, channel_axis=-1 if channels_last else 1,
                                    activation=activation, forward=forward)
  y, (dx, dw, db) = _grads(f, (x, w, b), ct)
  assert_group_norm_close((y, dx, dw, db), x, w, b, ct, g, channels_last=channels_last,
                          dtype=dtype, activation=activation)
  _check_launches(f, (x, w, b), forward, "jax_normgrad_group_norm_fwd",
                  "jax_normgrad_group_norm_bwd")


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("centered,dtype,residual_dtype", [
    (True, F32, None), (False, BF16, None), (True, BF16, F32)])
def test_residual_forms(rng, forward, centered, dtype, residual_dtype):
  shape = (5, 96)
  x = random(rng, shape, dtype, 1.0, 0.2)
  r = random(rng, shape, residual_dtype or dtype, 2.0)
  w = random(rng, (96,), F32, 1.0, 1.0)
  b = random(rng, (96,), F32) if centered else None
  dy = random(rng, shape, dtype)
  dh = random(rng, shape, residual_dtype or dtype)
  if centered:
    f = lambda x, r, w, b: jn.add_layer_norm(x, r, w, b, residual_dtype=residual_dtype,
                                             forward=forward)
  else:
    f = lambda x, r, w, b: jn.add_rms_norm(x, r, w, residual_dtype=residual_dtype,
                                           forward=forward)
  (y, h), pullback = jax.vjp(f, x, r, w, b)
  dx, dr, dw, _ = pullback((dy, dh))
  # h as stored (the float32 sum rounded to its dtype): the forward's statistics and y are
  # its, and the backward works from it.
  hk = ref.stored_sum(x, r, residual_dtype or dtype)
  np.testing.assert_array_equal(ref.f64(h.astype(F32)), hk)
  if centered:
    y64, mean, rstd = ref.ln_fwd(hk, 1, w, b)
    dg64, dw64, _ = ref.ln_bwd(dy, hk, 1, mean, rstd, w)
  else:
    y64, rstd = ref.rms_fwd(hk, 1, w)
    dg64, dw64 = ref.rms_bwd(dy, hk, 1, rstd, w)
  assert_close(y, y64, dtype, 96, "y", scale=ref.fwd_scales(hk, rstd, w)[0])
  scale = ref.dx_scale(dy, rstd, w) + float(np.abs(ref.f64(dh)).max())
  assert_close(dx, dg64 + ref.f64(dh), dtype, 96, "dx", scale=scale)
  assert_close(dr, dg64 + ref.f64(dh), residual_dtype or dtype, 96, "dresidual", scale=scale)
  assert_close(dw, dw64, F32, x.size, "dw", scale=float(np.abs(ref.f64(dy)).max() * 4))
  _check_launches(lambda x, r: f(x, r, w, b), (x, r), forward, "jax_normgrad_layer_norm_fwd",
                  "jax_normgrad_layer_norm_bwd")


@pytest.mark.parametrize("forward", ["kernel", "xla"])
def test_both_forwards_give_the_same_gradients(rng, forward):
  """The backward kernel reads the same float32 statistics from either forward: the gradients
  agree with the kernel forward's to float32 rounding (the statistics' summation orders differ)."""
  x = random(rng, (16, 384), F32, 3.0, 1.0)
  w, b = random(rng, (384,), F32, 1.0, 1.0), random(rng, (384,), F32)
  loss = lambda fw: lambda x, w, b: jnp.sum(jnp.sin(jn.layer_norm(x, w, b, forward=fw)))
  ours = jax.jit(jax.grad(loss(forward), argnums=(0, 1, 2)))(x, w, b)
  kernel = jax.jit(jax.grad(loss("kernel"), argnums=(0, 1, 2)))(x, w, b)
  for a, k in zip(ours, kernel):
    np.testing.assert_allclose(np.asarray(a), np.asarray(k), rtol=2e-5, atol=2e-5 * float(
        np.abs(np.asarray(k)).max()))


@pytest.mark.parametrize("forward", ["kernel", "xla"])
def test_vmap_over_a_batched_weight(rng, forward):
  x = random(rng, (3, 4, 64), F32, 1.0, 0.5)
  w = random(rng, (3, 64), F32, 1.0, 1.0)
  f = lambda x, w: jnp.sum(jnp.tanh(jn.layer_norm(x, w, forward=forward)))
  ours = jax.vmap(jax.grad(f, argnums=(0, 1)))(x, w)
  xla = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.tanh(jn.layer_norm(x, w, implementation="xla"))),
                          argnums=(0, 1)))(x, w)
  for a, e in zip(ours, xla):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)


def test_export_round_trip_keeps_the_choice(rng):
  """A serialized step keeps the forward it was lowered with: no forward custom call with "xla"."""
  x = random(rng, (8, 128), F32, 1.0, 0.5)
  w = random(rng, (128,), F32, 1.0, 1.0)
  step = jax.jit(jax.grad(lambda x, w: jnp.sum(jn.layer_norm(x, w, forward="xla") ** 2),
                          argnums=(0, 1)))
  triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exported = jax.export.export(step, platforms=[PLATFORM],
                               disabled_checks=jn.export_safety_checks() + [triton])(x, w)
  text = exported.mlir_module()
  assert kernel_launches(text, "jax_normgrad_layer_norm_fwd") == 0
  assert kernel_launches(text, "jax_normgrad_layer_norm_bwd") >= 1
  back = jax.export.deserialize(exported.serialize())
  for a, e in zip(back.call(x, w), step(x, w)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_default_per_platform_and_its_environment_override(rng, settings_env):
  x = random(rng, (8, 128), F32)
  text = lambda: jax.jit(jax.grad(lambda x: jnp.sum(jn.layer_norm(x) ** 2))).lower(x).as_text()
  default = _settings.LAYER_FORWARD_DEFAULT[PLATFORM]
  assert default in ("kernel", "xla")
  assert (kernel_launches(text(), "jax_normgrad_layer_norm_fwd") >= 1) == (default == "kernel")
  for choice in ("kernel", "xla"):
    settings_env(_settings.FORWARD_ENV, choice)
    assert (kernel_launches(text(), "jax_normgrad_layer_norm_fwd") >= 1) == (choice == "kernel")
    assert kernel_launches(text(), "jax_normgrad_layer_norm_bwd") >= 1
  settings_env(_settings.FORWARD_ENV, "fused")
  with pytest.raises(ValueError, match="JAX_NORMGRAD_FORWARD.*'fused'"):
    text()
  # A forward named in the call wins over the environment; so does implementation="xla".
  settings_env(_settings.FORWARD_ENV, "xla")
  t = jax.jit(jax.grad(lambda x: jnp.sum(jn.layer_norm(x, forward="kernel") ** 2))).lower(x).as_text()
  assert kernel_launches(t, "jax_normgrad_layer_norm_fwd") >= 1
  assert dict(jn.LAYER_FORWARD_DEFAULT) == dict(_settings.LAYER_FORWARD_DEFAULT)
  with pytest.raises(TypeError):
    jn.LAYER_FORWARD_DEFAULT["cpu"] = "xla"  # read-only: the environment variable sets it


def test_the_environment_changed_after_a_first_trace_is_refused(rng, settings_env):
  """A function traced before the change keeps its forward; a new trace raises instead of
  taking the new value (which would give one program two answers)."""
  x = random(rng, (8, 128), F32)
  settings_env(_settings.FORWARD_ENV, None)
  step = jax.jit(jax.grad(lambda x: jnp.sum(jn.layer_norm(x) ** 2)))
  before = step(x)
  # Set without forgetting: as a user's os.environ change after the first trace.
  os.environ[_settings.FORWARD_ENV] = "xla" if _kernel_forward(None) else "kernel"
  np.testing.assert_array_equal(step(x), before)  # traced already: jit's cache, unchanged
  for trace in (lambda: jax.jit(jax.grad(lambda x: jnp.sum(jn.layer_norm(x) ** 2)))(x),
                lambda: jn.layer_norm(x), lambda: jax.make_jaxpr(jn.rms_norm)(x)):
    with pytest.raises(jn.SettingsChangedError, match="JAX_NORMGRAD_FORWARD from None to"):
      trace()
  del os.environ[_settings.FORWARD_ENV]
  np.testing.assert_array_equal(jax.jit(jax.grad(lambda x: jnp.sum(jn.layer_norm(x) ** 2)))(x),
                                before)


def test_the_public_forward_ops_run_the_kernel_whatever_the_layers_default(rng, settings_env):
  settings_env(_settings.FORWARD_ENV, "xla")
  x = random(rng, (8, 128), F32)
  text = jax.jit(lambda x: jn.layer_norm_fwd(x, 128)).lower(x).as_text()
  assert kernel_launches(text, "jax_normgrad_layer_norm_fwd") >= 1


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "group_norm", "add_layer_norm",
                                "add_rms_norm"])
def test_bad_forward_is_a_value_error_naming_it(fn):
  x = jnp.ones((2, 4, 6))
  call = {"layer_norm": lambda f: jn.layer_norm(x, forward=f),
          "rms_norm": lambda f: jn.rms_norm(x, forward=f),
          "group_norm": lambda f: jn.group_norm(x, 2, forward=f),
          "add_layer_norm": lambda f: jn.add_layer_norm(x, x, forward=f),
          "add_rms_norm": lambda f: jn.add_rms_norm(x, x, forward=f)}[fn]
  with pytest.raises(ValueError, match=r"forward: expected one of \(None, 'kernel', 'xla'\), got 'XLA'"):
    call("XLA")


def test_drop_ins_pass_forward_through(rng):
  flax = pytest.importorskip("flax")
  eqx = pytest.importorskip("equinox")
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jax_normgrad.equinox as je
  import jax_normgrad.flax as jf
  import jax_normgrad.nnx as jx
  del flax
  x = random(rng, (4, 8, 16), F32)
  layers = {
      "linen LayerNorm": lambda fw: (lambda m: lambda x: m.apply(m.init(jax.random.key(0), x), x))(
          jf.LayerNorm(forward=fw)),
      "linen GroupNorm": lambda fw: (lambda m: lambda x: m.apply(m.init(jax.random.key(0), x), x))(
          jf.GroupNorm(num_groups=4, activation="silu", forward=fw)),
      "nnx RMSNorm": lambda fw: jx.RMSNorm(16, rngs=nnx.Rngs(0), forward=fw),
      "equinox LayerNorm": lambda fw: jax.vmap(jax.vmap(je.LayerNorm(16, forward=fw))),
  }
  del eqx
  for name, make in layers.items():
    for fw in ("kernel", "xla"):
      layer = make(fw)
      text = jax.jit(jax.grad(lambda x: jnp.sum(layer(x) ** 2))).lower(x).as_text()
      assert kernel_launches(text, "jax_normgrad_") >= 1, name
      fwd = (kernel_launches(text, "jax_normgrad_layer_norm_fwd")
             + kernel_launches(text, "jax_normgrad_group_norm_fwd"))
      assert (fwd >= 1) == (fw == "kernel"), (name, fw)
