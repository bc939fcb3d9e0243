"""Test inputs shared by the op test modules: shapes, dtypes, random arrays."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os

import pytest

import jax
import jax.numpy as jnp
import numpy as np

from jax_normgrad import _platforms

DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
MASKS = list(itertools.product([True, False], repeat=3))
#: The output masks whose paths differ in the Pallas and Mosaic GPU backward kernels (dx or
#: not; none, one or both parameter gradients' partials, and which one): for their
#: interpreted op suites, which run every gradient in test_backward; tests/test_pallas.py
#: runs every mask through both kernel sets.
KERNEL_MASKS = [(True, False, False), (False, True, False), (True, False, True),
                (False, True, True), (False, False, False)]

# (x shape, normalized_shape): non-powers of two, multi-axis, rows of 1, empty.
LN_CASES = [
    ((7, 1000), (1000,)),
    ((3, 5, 42), (42,)),
    ((4, 6, 10), (6, 10)),
    ((9, 1), (1,)),
    ((0, 64), (64,)),
    ((2, 0, 3), (3,)),
    ((301, 257), (257,)),
]
LONG_ROW = ((2, 1_000_003), (1_000_003,))

# (x shape, N, C, HxW, group, channels_last)
GN_CASES = [
    ((3, 12, 5, 7), 3, 12, 35, 4, False),
    ((3, 5, 7, 12), 3, 12, 35, 4, True),
    ((2, 10, 17), 2, 10, 17, 10, False),
    ((2, 17, 10), 2, 10, 17, 5, True),
    ((2, 6), 2, 6, 1, 3, False),
    ((4, 64, 9), 4, 64, 9, 1, False),
    ((0, 8, 5), 0, 8, 5, 2, False),
    ((5, 96, 33), 5, 96, 33, 32, True),
]


def rotate(cases, *choices):
  """Each case once, with one value of each ``choices`` list cycling alongside.

  A cover of the cases and the choices in ``len(cases)`` tests instead of
  their product, for the slow interpreted implementations; the values come
  first: ``rotate([(s, n)], DTYPES)`` gives ``[(float32, s, n)]``.
  """
  cycles = [itertools.cycle(c) for c in choices]
  return [tuple(next(c) for c in cycles) + tuple(case) for case in cases]


def random(rng, shape, dtype, scale=1.0, offset=0.0):
  return jnp.asarray(rng.normal(offset, scale, size=shape).astype(np.float32)).astype(dtype)



def build_against_csrc(source: str, exe: str, flags: list[str]) -> None:
  """Compiles the C++ program ``source`` (a path) against ``csrc/`` and the XLA FFI headers into
  ``exe`` with ``flags``; skips the test where no C++ compiler is found."""
  import shutil
  import subprocess
  cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
  if cxx is None:
    pytest.skip("no C++ compiler")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([cxx, "-std=gnu++17", "-Wno-psabi", *flags, "-isystem", jax.ffi.include_dir(),
                  "-I", os.path.join(root, "csrc"), source, "-o", exe],
                 check=True, capture_output=True)

#: From jax 0.11 the Pallas Triton lowering asks which GPU it compiles for.
TRITON_LOWERING_NEEDS_GPU_KIND = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11)


EXPORT_SKIP = ("jax >= 0.11 lowers Pallas Triton only for a GPU or an abstract device, and "
               "shard_map refuses an abstract context mesh")


def single_device_sharding(device):
  """A sharding of one device: ``jax.sharding.make_single_device_sharding`` where jax has it
  (SingleDeviceSharding is deprecated from jax 0.12.1), else the class."""
  make = getattr(jax.sharding, "make_single_device_sharding", None)
  return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def export_for(platform, f, args, *, mesh=None, device_kind=None, no_device=False, **kwargs):
  """``jax.export.export(f, platforms=[platform], **kwargs)(*args)`` on a machine with no accelerator.

  From jax 0.11 the Pallas Triton lowering asks which GPU it compiles for
  (jax 0.10 assumed sm_90) and, with no GPU present, raises "No supported
  GPU devices found". JAX's answer is an abstract device: under
  ``jax.sharding.use_abstract_mesh`` with ``AbstractDevice("NVIDIA H100")``
  the kernels lower for an H100. The operands are committed to a concrete
  device (a CPU one; ``jax.export`` lowers for ``platform`` all the same),
  because XLA's ``custom_partitioning`` (the layers' partitioning rule) needs
  devices during lowering. ``mesh``: the ``shard_map`` mesh of ``f`` if any;
  shard_map refuses an abstract context mesh, so that export is skipped where
  the abstract device is needed. ``device_kind``: the abstract device's kind,
  named with any jax (default: "NVIDIA H100", where needed). ``no_device``: no
  abstract device with any jax (what a lowering does with none).
  """
  exported = jax.export.export(f, platforms=[platform], **kwargs)
  if no_device or (device_kind is None and (platform != "cuda"
                                            or not TRITON_LOWERING_NEEDS_GPU_KIND)):
    return exported(*args)
  if mesh is not None:
    # shard_map requires the context mesh to be its own, concrete one.
    pytest.skip(EXPORT_SKIP)
  one = single_device_sharding(jax.devices()[0])
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None) or one)
          for a in args]
  with abstract_gpu(platform, device_kind or "NVIDIA H100"):
    return exported(*args)


@contextlib.contextmanager
def abstract_gpu(platform="cuda", device_kind="NVIDIA H100"):
  """Lowerings inside target one abstract GPU of ``device_kind`` (``jax.sharding.use_abstract_mesh``).

  What a machine with no GPU needs from jax 0.11 for Pallas Triton to lower
  (``export_for``) and for the dispatcher to pick it (``gpu_target.triton_problem``).
  """
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
  mesh = jax.sharding.AbstractMesh((1,), ("_",), (jax.sharding.AxisType.Auto,),
                                   abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def narrow(request, reason: str, tests=(), **allowed):
  """Skips the test of ``request`` if it is in ``tests`` or a parameter is not in ``allowed``.

  For the suites whose cases are ``pytest.mark.parametrize``'d (not a
  ``argument_values`` dict of the class), to keep a slow interpreted implementation's run short.
  """
  params = getattr(request.node, "callspec", None)
  params = params.params if params else {}
  if request.node.originalname in tests or any(
      name in params and params[name] not in values for name, values in allowed.items()):
    pytest.skip(reason)


def narrow_rotated(request, reason, key: str, values, choice: str, choices) -> None:
  """Skips the test of ``request`` unless its ``choice`` parameter is the one that
  :func:`rotate` pairs with its ``key`` parameters' value in ``values`` (``key``: one name,
  or several, comma-separated, as in ``parametrize``): each value once, ``choices`` cycling
  alongside, for the suites whose cases are ``pytest.mark.parametrize``'d."""
  params = getattr(request.node, "callspec", None)
  params = params.params if params else {}
  names = key.split(",")
  if choice not in params or not all(n in params for n in names):
    return
  value = tuple(params[n] for n in names) if len(names) > 1 else params[names[0]]
  if params[choice] is not choices[values.index(value) % len(choices)]:
    pytest.skip(reason)


def needs_mosaic_gpu(obj):
  """Skips a Mosaic GPU test (class or function) where this jax lacks the API the kernels use."""
  from jax_normgrad import _compat  # pylint: disable=g-import-not-at-top
  missing = _compat.mosaic_gpu_api_missing()
  return pytest.mark.skipif(missing is not None, reason=str(missing))(obj)


def skip_unless_interpretable(backend: str) -> None:
  """Skips a test of the ``backend`` kernels ("gpu" / "tpu") where they can neither run nor be
  interpreted: the TPU kernels are interpreted on the CPU platform only, so on a GPU host (whose
  default platform is cuda) their interpreted tests skip; the GPU kernels run there for real."""
  if backend == "tpu" and PLATFORM not in ("cpu", "tpu"):
    pytest.skip(f"the TPU kernels are interpreted on cpu only; this host lowers for {PLATFORM}")


def child_env(**extra) -> dict:
  """The environment for a test's child ``python -m pytest``: this one, plus ``extra``, with
  ``PYTEST_ADDOPTS="--numprocesses=0"`` (none without pytest-xdist). The suite runs on every
  core (pyproject.toml's ``addopts``: pytest-xdist); the child runs whole inside one worker,
  serially, and its own plugins (the third-party suites' patch counter) see every test in one
  process."""
  env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
  if importlib.util.find_spec("xdist") is not None:
    env["PYTEST_ADDOPTS"] = "--numprocesses=0"
  env.update(extra)
  return env


#: The lowering platform the suite runs on ("cpu", "cuda", "rocm", "tpu"): the default
#: implementation is the CPU custom call on "cpu" and the Pallas kernels elsewhere.
PLATFORM = _platforms.default_platform()

# The Pallas kernels' names (``pallas_call(name=...)``) by direction, whatever the op.
_PALLAS_KERNELS = {"fwd": "jax_normgrad_norm_fwd", "bwd": "jax_normgrad_norm_bwd"}


def kernel_launches(text: str, target: str = "jax_normgrad_") -> int:
  """The launches, in lowered ``text``, of the kernels that serve ``target`` on :data:`PLATFORM`.

  ``target`` is a CPU custom-call target (``jax_normgrad_layer_norm_fwd``) or a
  prefix of them. On CPU the count is of custom calls to it. On a GPU or TPU the
  Pallas kernels serve it, named by direction and shared by the ops
  (``jax_normgrad_norm_fwd...`` for a ``_fwd`` target, ``jax_normgrad_norm_bwd...``
  for ``_bwd``, any ``jax_normgrad_`` kernel for a prefix); the count is of the
  custom-call lines naming one. A primitive can launch several Pallas kernels
  (statistics, partial sums), so only the CPU count is exact: see
  :func:`assert_launches`.
  """
  if PLATFORM == "cpu":
    return text.count(f"custom_call @{target}")
  name = next((n for d, n in _PALLAS_KERNELS.items() if target.endswith(f"_{d}")), "jax_normgrad_")
  return sum(1 for line in text.splitlines() if "custom_call" in line and name in line)


def runs_kernels(implementation) -> bool:
  """Whether ``implementation`` lowers to kernel launches on :data:`PLATFORM`: the default and
  "ffi" on CPU (where the Pallas test classes run interpreted, with no custom call), every
  implementation but "xla" on a GPU or TPU."""
  if PLATFORM == "cpu":
    return implementation in (None, "ffi")
  return implementation != "xla"


def repeats_can_differ(implementation) -> bool:
  """Whether two runs of ``implementation`` on :data:`PLATFORM` could give different bits, so
  that a determinism test's repeated runs test something: the C++ kernels (a thread pool),
  XLA, and every implementation on a GPU or TPU. Not a Pallas or Mosaic GPU kernel
  interpreted on the CPU as the op suites run them (Pallas' ``interpret=True``, Mosaic GPU's
  interpret mode with its default one thread): the interpreters run its programs one after
  another in one fixed order, uninitialized memory as NaN, so a repeat gives the first run's
  bits by construction; the kernels' own determinism is tested where they run (a GPU or TPU).
  (The TPU interpret mode with simulated cores, tests/test_tpu_interpret.py, is another
  matter: it does not use this.)"""
  return PLATFORM != "cpu" or implementation in (None, "ffi", "xla")


def assert_launches(count: int, cpu_count: int, what: str = "") -> None:
  """``count`` (of :func:`kernel_launches`) is ``cpu_count`` on CPU; on a GPU or TPU, at least
  one where the CPU has any and none where it has none (the Pallas kernels split the work
  their own way)."""
  if PLATFORM == "cpu":
    assert count == cpu_count, (what, count, cpu_count)
  else:
    assert (count > 0) == (cpu_count > 0), (what, count, cpu_count)


def on_cpu():
  """A context in which jitted code without committed operands lowers and runs on the CPU:
  for the tests of the CPU kernels themselves (their FFI attributes, errors and call
  structure), which a GPU machine's default device would otherwise not reach."""
  return jax.default_device(jax.devices("cpu")[0])


def bind(prim, ops, **params):
  """``prim`` bound on ``ops`` (a structure of ``jax_normgrad._operands``), the ops' way."""
  from jax_normgrad._operands import pack  # pylint: disable=g-import-not-at-top
  args, names = pack(ops)
  return prim.bind(*args, operands=names, **params)


def norm_bwd_operands(dy, x, stats, weight=None, dh=None):
  """``NormBwd`` from a forward's statistics (``[mean, rstd]``, or ``[rstd]`` for RMSNorm)."""
  from jax_normgrad._operands import NormBwd  # pylint: disable=g-import-not-at-top
  mean, rstd = stats if len(stats) == 2 else (None, stats[0])
  return NormBwd(dy, x, mean, rstd, weight, dh)
