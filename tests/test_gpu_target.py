"""Every GPU jax runs: where Pallas Triton does not lower for the device, the package still runs.

From jax 0.11 Pallas Triton lowers only for the GPU kinds jax lists
(``jax.experimental.pallas.triton.get_gpu_info``) and attached "NVIDIA ..."
GPUs; any other kind (an attached "Tesla V100", an unlisted kind named by an
abstract device) raises "No supported GPU devices found" at ``jit`` time.
The package asks the same question first (``pallas.gpu_target``): it
registers the device's compute capability with Pallas Triton where it can,
else runs the Mosaic GPU kernels (sm_90+) or the pure-JAX reference, with a
``FallbackWarning`` naming the device.

No GPU is needed: the lowering is exported for ``cuda`` with the device named
by an abstract mesh (``AbstractDevice`` of an unlisted kind) or by a fake
attached device (``gpu_target._default_device`` patched: a CPU machine has no
device with a compute capability), which the abstract mesh then mirrors (its
kind the attached device's, as jax reads it: not an ahead-of-time target).

The ``triton_list`` fixture is jax's list of GPUs. From jax 0.11 it is jax's
own: ``get_gpu_info`` and its registry (``_compat.register_triton_gpu``,
spied on; the registry a copy for the test). jax 0.11.2 and 0.12 also lower
for an *attached* GPU named "NVIDIA ..." that they do not list (they read the
device's compute capability), but their check sees the machine's real
devices, not the fake attached one, so here it refuses every unlisted kind;
a kind not named "NVIDIA ..." (a "Tesla V100") goes through the registry.
jax before 0.11 has no list (its Triton lowering accepts every device): there
the fixture stands a fake of jax 0.11's check in for it (``_compat.triton_gpu_info``
and ``_compat.register_triton_gpu`` patched, the two functions that read jax's
list). Either way all the rest (which device is targeted, the choice, the
warning, the lowering) runs for real. ``test_this_jax`` checks the unpatched
functions against the installed jax.
"""

from __future__ import annotations

import re
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_normgrad as jn
from jax_normgrad import _compat, _fallback, _settings
from jax_normgrad.pallas import gpu_target
from cases import TRITON_LOWERING_NEEDS_GPU_KIND, export_for, needs_mosaic_gpu

F32 = jnp.float32
TRITON = "__gpu$xla.gpu.triton"
MOSAIC_GPU = "mosaic_gpu_v2"
UNLISTED = "NVIDIA GeForce RTX 4080 Laptop GPU"
#: An unlisted kind that jax's registry serves (jax 0.11.2 and 0.12 read an "NVIDIA ..." kind's
#: compute capability from the attached device, never from their registry).
REGISTRABLE = "Tesla V100-SXM2-16GB"
#: A part of jax 0.11's list (GpuVersion), matched at the start of the kind as jax does.
LISTED = ("NVIDIA A100", "NVIDIA H100", "NVIDIA GeForce RTX 4090")


class _Jax011:
  """jax 0.11's Triton GPU list, for a jax without one: ``get_gpu_info`` raises ValueError for a
  kind neither listed nor registered."""

  def __init__(self):
    self.registry: dict[str, str] = {}

  def get_gpu_info(self):
    kind = gpu_target.target().kind
    if re.match("|".join(LISTED), kind) or kind in self.registry:
      return types.SimpleNamespace(kind=kind)
    raise ValueError(f"Unsupported GPU device kind: {kind}")

  def register(self, kind: str, compute_capability: str) -> bool:
    self.registry.setdefault(kind, compute_capability)
    return True


class _TritonList:
  """The list the lowering consults: ``registry`` holds the kinds the package registered in the
  test (kind -> compute capability); ``can_register`` False: this jax offers no way to register
  (as a jax 0.11 without the registry would)."""

  def __init__(self, register):
    self.can_register = True
    self.registry: dict[str, str] = {}
    self._register = register

  def register(self, kind: str, compute_capability: str) -> bool:
    if not self.can_register:
      return False
    done = self._register(kind, compute_capability)
    if done:
      self.registry.setdefault(kind, compute_capability)
    return done


@pytest.fixture
def triton_list(monkeypatch, settings_env):
  """jax's Triton GPU list: jax's own from 0.11, else a fake of jax 0.11's (see the module doc)."""
  if TRITON_LOWERING_NEEDS_GPU_KIND:
    # The registry a copy, restored after the test: jax's module global, read at each lookup
    # (a private path: _compat's, as _compat.register_triton_gpu reads it).
    gpu_info = _compat.triton_gpu_info_module()
    monkeypatch.setattr(gpu_info, "registry", dict(gpu_info.registry))
    listing = _TritonList(_compat.register_triton_gpu)
  else:
    fake = _Jax011()
    monkeypatch.setattr(_compat, "triton_gpu_info", lambda: fake.get_gpu_info)
    listing = _TritonList(fake.register)
  monkeypatch.setattr(_compat, "register_triton_gpu", listing.register)
  registrable = (_compat.triton_gpu_registrable if TRITON_LOWERING_NEEDS_GPU_KIND
                 else lambda kind, compute_capability: True)
  monkeypatch.setattr(_compat, "triton_gpu_registrable",
                      lambda *a: listing.can_register and registrable(*a))
  # jax caches lowerings by program and abstract mesh; the fakes change what
  # a lowering of the same program does (the settings' reset clears jax's caches).
  settings_env(_settings.GPU_BACKEND_ENV, None)
  _fallback.warn_once.cache_clear()
  listing.settings_env = settings_env
  yield listing
  jax.clear_caches()
  _fallback.warn_once.cache_clear()


def _attached(monkeypatch, compute_capability, kind=UNLISTED):
  """A GPU attached as the default device, as the lowering's device lookup sees it; returns its
  kind, for the abstract mesh of the export to mirror (``_export``'s ``device_kind``)."""
  device = types.SimpleNamespace(device_kind=kind, platform="gpu",
                                 compute_capability=compute_capability)
  monkeypatch.setattr(gpu_target, "_default_device", lambda: device)
  return kind


def _sds(shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _grad_of(norm):
  return jax.grad(lambda x, w, b: jnp.sum(norm(x, w, b).astype(F32)), argnums=(0, 1, 2))


LN_ARGS = (_sds((64, 1024)), _sds((1024,)), _sds((1024,)))

#: One program per kernel family: LayerNorm, RMSNorm, GroupNorm (both layouts), the residual form.
PROGRAMS = {
    "layer_norm": (_grad_of(jn.layer_norm), LN_ARGS),
    "rms_norm": (_grad_of(lambda x, w, b: jn.rms_norm(x, w) + b), LN_ARGS),
    "group_norm": (_grad_of(lambda x, w, b: jn.group_norm(x, 4, w, b)),
                   (_sds((2, 32, 8, 8)), _sds((32,)), _sds((32,)))),
    "group_norm_nhwc": (_grad_of(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1)),
                        (_sds((2, 8, 8, 32)), _sds((32,)), _sds((32,)))),
    "add_layer_norm": (_grad_of(lambda x, w, b: sum(jn.add_layer_norm(x, x * 2, w, b))), LN_ARGS),
}


def _export(f, args, device_kind=None, *, expect_warning=None, expect_one=None,
            no_device=False):
  """The exported StableHLO text; a ``FallbackWarning`` fails unless ``expect_warning`` matches it.

  ``device_kind``: the abstract device's (``cases.export_for``); ``no_device``: none, whatever
  the jax. ``expect_one``: a pattern that at least one of the warnings must match.
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = export_for("cuda", jax.jit(f), args, device_kind=device_kind, no_device=no_device,
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
                      ).mlir_module()
  fallbacks = [str(w.message) for w in caught if issubclass(w.category, jn.FallbackWarning)]
  if expect_warning is None:
    assert not fallbacks, fallbacks
  else:
    assert fallbacks and all(re.search(expect_warning, m) for m in fallbacks), fallbacks
  assert expect_one is None or any(re.search(expect_one, m) for m in fallbacks), fallbacks
  return text


def _assert_reference(text):
  """No Pallas kernel of either GPU backend: the pure-JAX reference was lowered."""
  assert TRITON not in text and MOSAIC_GPU not in text and "jax_normgrad_norm" not in text


def test_listed_gpu_runs_triton(triton_list):
  f, args = PROGRAMS["layer_norm"]
  assert TRITON in _export(f, args, "NVIDIA H100 80GB HBM3")
  assert not triton_list.registry


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_unlisted_abstract_gpu_runs_the_reference(triton_list, program):
  # An abstract device has no compute capability to register: the reference
  # runs, and the warning names the device and why.
  f, args = PROGRAMS[program]
  text = _export(f, args, UNLISTED, expect_warning=re.escape(repr(UNLISTED)) + ".*no compute "
                 "capability to register.*pure-JAX reference \\('xla'\\) runs it instead")
  _assert_reference(text)
  assert not triton_list.registry


def test_the_warning_comes_once_per_op(triton_list):
  f, args = PROGRAMS["layer_norm"]
  with pytest.warns(jn.FallbackWarning) as record:
    for _ in range(2):
      jax.clear_caches()  # lowered twice, not taken from jax's cache
      export_for("cuda", jax.jit(f), args, device_kind=UNLISTED)
  ops = [re.search(r"jax_normgrad: (\w+) on cuda:", str(w.message)).group(1) for w in record]
  assert sorted(ops) == ["jax_normgrad_layer_norm_bwd", "jax_normgrad_layer_norm_fwd"]


def test_forced_backends_on_an_unlisted_gpu(triton_list):
  # implementation="triton" cannot run there: it raises, naming the device;
  # "xla" is silent (no warning).
  ln = lambda x, w, b, impl: jn.layer_norm(x, w, b, implementation=impl)
  with pytest.raises(ValueError, match="implementation='triton' cannot run on cuda.*" + UNLISTED):
    _export(lambda x, w, b: ln(x, w, b, "triton"), LN_ARGS, UNLISTED)
  _assert_reference(_export(lambda x, w, b: ln(x, w, b, "xla"), LN_ARGS, UNLISTED))


@needs_mosaic_gpu
def test_forced_mosaic_gpu_on_an_unlisted_gpu(triton_list):
  ln = _grad_of(lambda x, w, b: jn.layer_norm(x, w, b, implementation="mosaic_gpu"))
  text = _export(ln, LN_ARGS, UNLISTED)
  assert MOSAIC_GPU in text and TRITON not in text


def test_attached_gpu_is_registered_with_triton(triton_list, monkeypatch):
  # The device's compute capability is told to Pallas Triton, whose kernels
  # then run as on a listed GPU, unannounced.
  kind = _attached(monkeypatch, "7.0", kind=REGISTRABLE)
  f, args = PROGRAMS["layer_norm"]
  assert TRITON in _export(f, args, kind)
  assert triton_list.registry == {REGISTRABLE: "7.0"}


def test_explain_registers_nothing(triton_list, monkeypatch):
  # explain answers as the lowering will (Triton, once the device is registered) and leaves
  # jax's list as it was; the lowering registers the device.
  kind = _attached(monkeypatch, "7.0", kind=REGISTRABLE)
  f, args = PROGRAMS["layer_norm"]
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="cuda")
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)):
    explained = jn.explain(f, *args, platform="cuda")
  assert {e.choice.implementation for e in explained} == {"triton"}, str(explained)
  assert not triton_list.registry
  assert TRITON in _export(f, args, kind)
  assert triton_list.registry == {REGISTRABLE: "7.0"}


@pytest.mark.skipif(not TRITON_LOWERING_NEEDS_GPU_KIND,
                    reason="this jax (before 0.11) has no Pallas Triton GPU registry")
def test_explain_leaves_jax_triton_registry_unchanged(monkeypatch, settings_env):
  """jax's own registry, unpatched (``gpu_info.registry``, a private path: the one the package
  registers in), is the same dict with the same entries after ``explain`` of a GPU it lacks."""
  gpu_info = _compat.triton_gpu_info_module()
  settings_env(_settings.GPU_BACKEND_ENV, None)
  kind = _attached(monkeypatch, "7.0", kind=REGISTRABLE)
  registry = gpu_info.registry
  before = dict(registry)
  assert kind not in before
  f, args = PROGRAMS["layer_norm"]
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="cuda")
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)):
    explained = jn.explain(f, *args, platform="cuda")
    jn.default_implementations("cuda")
  assert {e.choice.implementation for e in explained} == {"triton"}, str(explained)
  assert gpu_info.registry is registry and registry == before


def test_attached_gpu_that_cannot_be_registered_runs_the_reference(triton_list, monkeypatch):
  triton_list.can_register = False
  kind = _attached(monkeypatch, "8.9")
  f, args = PROGRAMS["group_norm"]
  _assert_reference(_export(f, args, kind, expect_warning="no way to register its compute "
                            "capability.*Mosaic GPU kernels cannot run it: they need sm_90\\+ \\(the "
                            "device is sm_89\\)"))
  with pytest.raises(ValueError, match="implementation='triton' cannot run on cuda"):
    _export(lambda x, w, b: jn.layer_norm(x, w, b, implementation="triton"), LN_ARGS, kind)


@needs_mosaic_gpu
def test_attached_sm90_gpu_that_cannot_be_registered_runs_mosaic_gpu(triton_list, monkeypatch):
  # sm_90+: the Mosaic GPU kernels stand in for Triton; what they cannot run
  # (channels-last GroupNorm rows of 70,000 channels) the reference runs, not Triton.
  triton_list.can_register = False
  kind = _attached(monkeypatch, "9.0", kind="NVIDIA H20")
  f, args = PROGRAMS["layer_norm"]
  text = _export(f, args, kind, expect_warning="'NVIDIA H20'.*Mosaic GPU kernels run it instead")
  assert MOSAIC_GPU in text and TRITON not in text
  c = 70_000
  gn = _grad_of(lambda x, w, b: jn.group_norm(x, 4, w, b, channel_axis=-1))
  text = _export(gn, (_sds((2, 2, 2, c)), _sds((c,)), _sds((c,))), kind,
                 expect_warning="'NVIDIA H20'",
                 expect_one="'NVIDIA H20'.*Mosaic GPU kernels cannot run it: .*the C of "
                            "GroupNorm.*pure-JAX reference \\('xla'\\) runs it instead")
  _assert_reference(text)
  # JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu takes the same path: no Triton either.
  triton_list.settings_env(_settings.GPU_BACKEND_ENV, "mosaic_gpu")
  _fallback.warn_once.cache_clear()
  _assert_reference(_export(gn, (_sds((2, 2, 2, c)), _sds((c,)), _sds((c,))), kind,
                            expect_warning="'NVIDIA H20'", expect_one="the C of GroupNorm"))


def test_no_gpu_attached_runs_the_reference(triton_list):
  # Exported for CUDA on a CPU machine with no abstract device: jax 0.11's
  # Triton lowering has no GPU to compile for.
  f, args = PROGRAMS["rms_norm"]
  text = _export(jax.jit(f), args, no_device=True,
                 expect_warning="'cpu' \\(cpu device\\); with no GPU attached")
  _assert_reference(text)


def test_target_reads_the_abstract_device():
  assert gpu_target.target() == gpu_target.Target(
      jax.devices()[0].device_kind, jax.devices()[0].platform, None)
  device = jax.sharding.AbstractDevice(device_kind=UNLISTED, num_cores=None, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    assert gpu_target.target() == gpu_target.Target(UNLISTED, "cuda", None, abstract=True)


def test_this_jax():
  """The unpatched check against the installed jax."""
  if not TRITON_LOWERING_NEEDS_GPU_KIND:
    # jax before 0.11 lowers Triton for any GPU: nothing to check or register.
    assert _compat.triton_gpu_info() is None and gpu_target.triton_problem() is None
    assert not _compat.register_triton_gpu("NVIDIA Test GPU", "8.9")
    return
  for kind, supported in (("NVIDIA H100", True), (UNLISTED, False)):
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)):
      assert (gpu_target.triton_problem() is None) == supported, kind
