"""The dispatcher (``jax_normgrad._dispatch``): which implementation runs, and why, in one place.

Every outcome of ``choose`` (the platform's preference list, a named implementation, the
forward option, the environment's GPU backend, a fallback and its one warning), and
``explain`` on traced functions. The lowerings that follow a choice are tested by the op
suites (the custom calls in the lowered text); where Pallas Triton cannot lower for a GPU,
tests/test_gpu_target.py.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_normgrad as jn
from jax_normgrad import _dispatch, _settings
from jax_normgrad.pallas import common, gpu_target, kernels
from cases import TRITON_LOWERING_NEEDS_GPU_KIND, abstract_gpu, needs_mosaic_gpu

OP = "jax_normgrad_layer_norm_fwd"


def _gpu(platform):
  """On a GPU platform from jax 0.11, an abstract H100 to lower for (no GPU is attached here)."""
  if platform in ("cuda", "rocm") and TRITON_LOWERING_NEEDS_GPU_KIND:
    return abstract_gpu()
  return contextlib.nullcontext()


def _choose(implementation, platform, **kw):
  with _gpu(platform):
    return _dispatch.choose(OP, implementation, platform, **kw)


@pytest.fixture(autouse=True)
def _default_settings(settings_env):
  for name in _settings.CHOICES:
    settings_env(name, None)
  return settings_env


@pytest.mark.parametrize("platform,implementation,expected", [
    ("cpu", None, "ffi"), ("cpu", "pallas", "triton"), ("cpu", "xla", "xla"),
    ("cpu", "triton", "triton"), ("cpu", "mosaic_tpu", "mosaic_tpu"),
    ("cuda", None, "triton"), ("cuda", "pallas", "triton"), ("cuda", "xla", "xla"),
    ("rocm", None, "triton"), ("tpu", None, "mosaic_tpu"), ("tpu", "pallas", "mosaic_tpu"),
    ("tpu", "mosaic_tpu", "mosaic_tpu")])
def test_first_choice(platform, implementation, expected):
  choice = _choose(implementation, platform)
  assert choice.implementation == expected and not choice.skipped and choice.warning is None
  assert platform in choice.why or implementation in choice.why


@pytest.mark.parametrize("platform,implementation,reason", [
    ("cuda", "ffi", "the C\\+\\+ kernels run on cpu$"),
    ("tpu", "ffi", "the C\\+\\+ kernels run on cpu$"),
    ("tpu", "triton", "the Triton kernels run on cuda and rocm, interpreted on cpu$"),
    ("rocm", "mosaic_gpu", "the Mosaic GPU kernels run on cuda, interpreted on cpu$"),
    ("cuda", "mosaic_tpu", "the TPU kernels run on tpu, interpreted on cpu$")])
def test_a_named_implementation_that_cannot_run_raises(platform, implementation, reason):
  with pytest.raises(ValueError, match=f"{OP}: implementation='{implementation}' cannot run on "
                     f"{platform}: {reason}"):
    _choose(implementation, platform)


def test_forward_option():
  # "xla" runs the reference whatever the implementation: a choice, not a fallback.
  for implementation in (None, "ffi", "pallas"):
    choice = _choose(implementation, "cpu", forward="xla")
    assert choice.implementation == "xla" and choice.warning is None
  assert _choose(None, "cpu", forward="kernel").implementation == "ffi"
  assert _choose(None, "cpu", forward="auto").implementation == (
      "ffi" if jn.LAYER_FORWARD_DEFAULT["cpu"] == "kernel" else "xla")
  with pytest.raises(ValueError, match="forward: expected one of"):
    _choose(None, "cpu", forward="fused")


def test_forward_default_from_the_environment(_default_settings):
  _default_settings(_settings.FORWARD_ENV, "xla")
  choice = _choose(None, "cuda", forward="auto")
  assert choice.implementation == "xla" and "JAX_NORMGRAD_FORWARD=xla" in choice.why
  # A named implementation is run as named; a forward named in the call wins.
  assert _choose("ffi", "cpu", forward="auto").implementation == "ffi"
  assert _choose(None, "cpu", forward="kernel").implementation == "ffi"


def test_the_preference_lists():
  plain, mosaic = _settings.Settings(), _settings.Settings(gpu_backend="mosaic_gpu")
  assert _dispatch.preferences("cpu", None, plain) == ("ffi", "xla")
  assert _dispatch.preferences("cpu", "pallas", plain) == ("triton",)
  assert _dispatch.preferences("cuda", None, plain) == ("triton", "mosaic_gpu", "xla")
  assert _dispatch.preferences("cuda", "pallas", mosaic) == ("mosaic_gpu", "triton", "xla")
  assert _dispatch.preferences("rocm", None, plain) == ("triton", "xla")
  assert _dispatch.preferences("tpu", None, mosaic) == ("mosaic_tpu", "xla")


def test_one_warning_names_every_implementation_passed_over(monkeypatch):
  monkeypatch.setattr(gpu_target, "triton_problem", lambda **_: "Triton does not lower here")
  monkeypatch.setattr(gpu_target, "mosaic_gpu_problem",
                      lambda known_device: "they need sm_90+ (the device is sm_75)")
  choice = _choose(None, "cuda")
  assert choice.implementation == "xla"
  assert [n for n, _ in choice.skipped] == ["triton", "mosaic_gpu"]
  assert choice.warning == (
      f"jax_normgrad: {OP} on cuda: the Triton kernels cannot run it: Triton does not lower "
      "here; the Mosaic GPU kernels cannot run it: they need sm_90+ (the device is sm_75). The "
      "pure-JAX reference ('xla') runs it instead. Pass implementation='xla' to silence this.")
  with pytest.raises(ValueError, match="implementation='triton' cannot run on cuda: Triton "
                     "does not lower here"):
    _choose("triton", "cuda")


def test_a_cpu_without_the_extension_falls_back_to_the_reference(monkeypatch):
  """Where the C++ extension did not import, the FFI implementation says so to ``choose`` and
  ``explain`` (instead of being chosen and failing at lowering); the default runs the reference
  with one warning, and ``implementation="ffi"`` raises, naming the import error."""
  from jax_normgrad import _ffi  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_ffi, "available", lambda: False)
  monkeypatch.setattr(_ffi, "import_error", lambda: ImportError("no _jax_normgrad here"))
  choice = _choose(None, "cpu")
  assert choice.implementation == "xla" and [n for n, _ in choice.skipped] == ["ffi"]
  assert ("the C++ kernels cannot run it: jax_normgrad's C++ extension failed to import: no "
          "_jax_normgrad here. The pure-JAX reference ('xla') runs it instead.") in choice.warning
  with pytest.raises(ValueError, match="implementation='ffi' cannot run on cpu: jax_normgrad's "
                     "C\\+\\+ extension failed to import"):
    _choose("ffi", "cpu")
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  (explained,) = jn.explain(lambda x: jn.layer_norm_fwd(x, (8,)), x, platform="cpu")
  assert explained.choice.implementation == "xla"


@needs_mosaic_gpu
def test_the_environments_gpu_backend_falls_back_to_triton(_default_settings):
  _default_settings(_settings.GPU_BACKEND_ENV, "mosaic_gpu")
  seg = common.Segments("channels_last", 2, 4, 70_000, groups=4, param_groups=1)
  problem = lambda: kernels.forward_problem(seg, jnp.float32, size=2 * 4 * 70_000)
  choice = _choose(None, "cuda", problem=problem)
  assert choice.implementation == "triton" and "the C of GroupNorm" in choice.warning
  assert choice.warning.endswith("The Triton kernels run it instead.")
  rows = common.Segments("rows", 8, 1, 1024, groups=1, param_groups=1)
  fits = lambda: kernels.forward_problem(rows, jnp.float32, size=8 * 1024)
  choice = _choose(None, "cuda", problem=fits)
  assert choice.implementation == "mosaic_gpu" and "JAX_NORMGRAD_GPU_BACKEND" in choice.why
  # On ROCm, where Mosaic GPU does not run, the preference is passed over with a warning.
  choice = _choose(None, "rocm", problem=fits)
  assert choice.implementation == "triton" and "run on cuda" in choice.warning


def test_tpu_in_a_multi_device_jit_falls_back_to_the_reference():
  choice = _choose(None, "tpu", auto_partitioned=lambda: True)
  assert choice.implementation == "xla" and "jax.shard_map" in choice.warning
  with pytest.raises(ValueError, match="implementation='mosaic_tpu' cannot run on tpu"):
    _choose("mosaic_tpu", "tpu", auto_partitioned=lambda: True)
  assert _choose(None, "cpu", auto_partitioned=lambda: True).implementation == "ffi"


def test_empty_problems_run_anywhere():
  seg = common.Segments("rows", 0, 1, 64, 1, 1)
  assert kernels.forward_problem(seg, jnp.float32, size=0).empty
  assert kernels.backward_problem(seg, jnp.float32, (False, False, False), size=64).empty


def _model(x, w, b):
  h = jn.layer_norm(x, w, b)
  h = jax.vmap(lambda r: jn.rms_norm(r, w))(h)
  g = jn.group_norm(h.reshape(2, 4, 3, 4), 2, channel_axis=1, activation="silu")

  def body(carry, _):
    return jn.layer_norm(carry, w, forward="xla"), None

  h, _ = jax.lax.scan(body, h, None, length=2)
  return jnp.sum(h) + jnp.sum(g)


def test_explain_a_training_step():
  x, w, b = jnp.ones((8, 12)), jnp.ones(12), jnp.zeros(12)
  step = jax.grad(jax.checkpoint(_model), argnums=(0, 1, 2))
  found = jn.explain(jax.jit(step), x, w, b)
  ops = [e.op for e in found]
  assert ops.count("jax_normgrad_layer_norm_fwd") >= 4  # layer_norm, rms_norm, scan's
  assert "jax_normgrad_group_norm_bwd" in ops and "jax_normgrad_layer_norm_bwd" in ops
  assert all(e.where.startswith(__file__) for e in found), [e.where for e in found]
  scan_forward = [e for e in found if "forward='xla'" in e.choice.why]
  assert scan_forward and all(e.choice.implementation == "xla" for e in scan_forward)
  assert {e.choice.implementation for e in found} == {"ffi", "xla"}
  text = str(found)
  assert "runs ffi: the default on cpu (ffi, xla)" in text and "float32[8, 12]" in text
  on_tpu = jn.explain(step, x, w, b, platform="tpu")
  assert {e.choice.implementation for e in on_tpu} == {"mosaic_tpu", "xla"}
  assert str(jn.explain(lambda x: x * 2, x)) == "no jax_normgrad op"


def test_explain_refuses_what_the_lowering_refuses():
  x = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="implementation='ffi' cannot run on tpu"):
    jn.explain(lambda x: jn.layer_norm(x, implementation="ffi"), x, platform="tpu")
  with pytest.raises(ValueError, match="platform: expected one of"):
    jn.explain(jn.layer_norm, x, platform="gpu")


def test_explain_compiles_nothing_and_warns_nothing():
  x = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with _gpu("cuda"):
      found = jn.explain(lambda x: jn.add_rms_norm(x, x)[0], x, platform="cuda")
  assert [e.choice.implementation for e in found] == ["triton"]
  assert found[0].operands[0] == "bfloat16[4, 8]"
