"""Every setting that changes a lowering is seen by the compiler, or refused once a trace has read it.

The environment's settings (``jax_normgrad._settings``) are fixed at the first trace; the
kernels' tuning (``pallas.config.override``, for tests and benchmarks) travels with each op
traced under it as its static ``tuning`` parameter; the device's figures are read when an op
is lowered for it. Each is changed here after a first call.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from jax_normgrad import _settings
from jax_normgrad.pallas import config, device

F32 = jnp.float32


def _params(fn, *args):
  """The parameters of every jax_normgrad primitive in ``fn``'s jaxpr."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith("jax_normgrad_"):
        found.append(eqn.params)
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_gpu_backend_changed_after_a_first_call_is_refused(settings_env):
  settings_env(_settings.GPU_BACKEND_ENV, None)
  x = jnp.ones((4, 64))
  jn.layer_norm(x)
  os.environ[_settings.GPU_BACKEND_ENV] = "mosaic_gpu"
  try:
    with pytest.raises(jn.SettingsChangedError,
                       match="JAX_NORMGRAD_GPU_BACKEND from None to 'mosaic_gpu'"):
      jax.jit(lambda x: jn.layer_norm(x) * 2)(x)
    with pytest.raises(jn.SettingsChangedError):
      jn.explain(jn.layer_norm, x)
  finally:
    del os.environ[_settings.GPU_BACKEND_ENV]
  jax.jit(lambda x: jn.layer_norm(x) * 3)(x)  # back as fixed: no error


def test_a_bad_value_is_named():
  with pytest.raises(ValueError, match="JAX_NORMGRAD_GPU_BACKEND: expected one of"):
    os.environ[_settings.GPU_BACKEND_ENV] = "cuda"
    try:
      _settings.read()
    finally:
      del os.environ[_settings.GPU_BACKEND_ENV]


def test_the_tuning_travels_with_the_traced_op():
  x = jnp.ones((5, 300))
  f = lambda x: jn.layer_norm(x, implementation="pallas")
  assert all("tuning" not in p for p in _params(f, x))
  with config.override(gpu_max_tile_fwd=256, interpret_programs=5):
    assert config.current().gpu_max_tile_fwd == 256 and config.interpret_programs() == 5
    inside = _params(f, x)
    with config.override(tpu_block_elems=2048):
      nested = _params(f, x)
  assert config.current() == config.Tuning() and config.interpret_programs() == 3
  # (The op is staged once per platform branch: _sharding.bind.)
  assert {p["tuning"] for p in inside} == {(("gpu_max_tile_fwd", 256), ("interpret_programs", 5))}
  assert {p["tuning"] for p in nested} == {(("gpu_max_tile_fwd", 256), ("interpret_programs", 5),
                                            ("tpu_block_elems", 2048))}
  with pytest.raises(TypeError, match="no setting named 'gpu_max_tile'"):
    with config.override(gpu_max_tile=1):
      pass


def test_a_configuration_value_per_call():
  """A backend's configuration passed whole (a frozen, hashable value) sets each of its fields
  for what is traced inside, over an outer block's; the op carries them as its ``tuning``, and
  lowers as with the same fields passed by name."""
  x = jnp.ones((5, 300))
  f = lambda x: jn.layer_norm(x, implementation="pallas")
  value = config.TritonConfig(gpu_max_tile_fwd=256)
  assert hash(value) == hash(config.TritonConfig(gpu_max_tile_fwd=256))
  with pytest.raises(dataclasses.FrozenInstanceError):
    value.gpu_max_tile_fwd = 128
  with config.override(gpu_max_tile_bwd=512, tpu_block_elems=2048):
    with config.override(value) as tuning:
      assert tuning.triton == value and config.triton() == value
      assert config.mosaic_tpu().tpu_block_elems == 2048  # another backend's: kept
      (tuned,) = {p["tuning"] for p in _params(f, x)}
      text = jax.jit(f).lower(x).as_text()
  assert dict(tuned) == {**dataclasses.asdict(value), "tpu_block_elems": 2048}
  with config.override(gpu_max_tile_fwd=256):
    assert jax.jit(f).lower(x).as_text() == text
  with config.override(config.MosaicTpuConfig(tpu_block_elems=4096), config.Device(sms=8)):
    assert config.current().tpu_block_elems == 4096 and config.device().sms == 8
  with pytest.raises(TypeError, match="expected a value of"):
    with config.override(config.Tuning()):
      pass


def test_a_jitted_function_follows_the_override_with_no_cache_clearing():
  """The override is part of jit's cache key: one jitted function, called inside and outside
  a block, is traced and lowered with the block's tiles and with the defaults; a program
  traced inside carries its tiles wherever it is lowered."""
  x = jax.random.normal(jax.random.key(0), (5, 300))
  f = jax.jit(lambda x: jn.layer_norm(x, implementation="pallas"))
  text = lambda: f.lower(x).as_text()
  default_text = text()
  with config.override(gpu_max_tile_fwd=256):
    tuned_text = text()
    tuned = f(x)
    traced = f.trace(x)
  assert tuned_text != default_text and text() == default_text
  assert traced.lower().as_text() == tuned_text
  np.testing.assert_allclose(tuned, f(x), rtol=1e-6, atol=1e-6)


def test_device_figures():
  h100 = device.gpu_device("NVIDIA H100 80GB HBM3", "9.0", None)
  assert h100 == config.Device()  # the defaults are an H100's
  a100 = device.gpu_device("NVIDIA A100-SXM4-40GB", "8.0", None)
  assert a100.sms == 108 and a100.smem_per_sm == 164 * 1024
  assert device.gpu_device("NVIDIA GeForce RTX 4080 Laptop GPU", "8.9", 58).sms == 58
  unknown = device.gpu_device("cpu", None, None)
  assert unknown == config.Device()
  # Outside a lowering the plans read the defaults; a lowering for the CPU (interpreted) too.
  with config.lowering((), "cpu"):
    assert config.device() == config.Device()
  with config.lowering((("mosaic_gpu_smem_bytes", 6000),), "cpu"):
    assert config.device().mosaic_gpu_smem_bytes == 6000
