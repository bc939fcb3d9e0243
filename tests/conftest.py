"""Shared pytest set-up: which jax_normgrad is tested, hypothesis profiles, random inputs, case lists."""

import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

import hypothesis
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _prefer_installed_package() -> None:
  """Makes ``import jax_normgrad`` find the installed package, not the source tree.

  ``python -m pytest`` (the README's command, run from the repository root)
  puts the root first on sys.path, where ``jax_normgrad/`` has no compiled
  extension: pip builds it into the installed copy. Dropping the root lets the
  installed copy (or the build that PYTHONPATH names, as in .ci/sanitize) be
  imported. An in-place build, with the extension beside the sources, keeps
  the root; an editable install maps the package itself, whatever sys.path is.
  """
  if any((ROOT / "jax_normgrad").glob("_jax_normgrad*")):
    return
  sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.curdir).resolve() != ROOT]


_prefer_installed_package()

#: jax's persistent compilation cache: the directory, and the two settings that let it keep
#: every program (jax's defaults keep only those whose compile took a second or more).
COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"
COMPILATION_CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
#: The cache directory this process made (removed at its end), or None.
_OWN_COMPILATION_CACHE = None


def _share_compiled_programs() -> None:
  """One persistent compilation cache for the session's processes: a compiled program is reused.

  The suite compiles the same programs many times: each test builds its own ``jax.jit`` of a
  function another test compiled too (the same shapes and dtypes, other values), and the
  xdist workers and the child processes some tests start compile theirs apart. jax's
  persistent cache keys a compiled program by its HLO, the compile options, the backend and
  jax's version, and reads a program it has back instead of compiling it again; nothing
  else changes (each program is traced and lowered as before, so the lowering's warnings
  and checks still run). A directory that JAX_COMPILATION_CACHE_DIR names (.ci/run's, shared
  by its stages) is used as it is; otherwise the session's first process makes a temporary
  one, which its workers and children inherit, and removes it at the end. Set before jax is
  imported, which reads these variables then.
  """
  global _OWN_COMPILATION_CACHE
  if not os.environ.get(COMPILATION_CACHE):
    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="jax_normgrad-tests-compiled-")
    os.environ[COMPILATION_CACHE] = _OWN_COMPILATION_CACHE
  for name, value in COMPILATION_CACHE_SETTINGS.items():
    os.environ.setdefault(name, value)
  if "jax" in sys.modules:  # imported already (by a plugin): its settings are read
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_compilation_cache_dir", os.environ[COMPILATION_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


_share_compiled_programs()

#: XLA's LLVM optimization level for the programs the tests compile.
XLA_OPT_LEVEL = "--xla_backend_optimization_level"


def _compile_xla_programs_unoptimized() -> None:
  """XLA compiles the tests' programs at LLVM's -O0, unless XLA_FLAGS names a level.

  What the suite checks is jax_normgrad's kernels (compiled C++, or Pallas kernels run by
  their interpreters), its lowerings and transformations, not XLA's code generation; much of
  its time is XLA compiling small programs, which -O0 does in less CPU (BENCHMARKS-history.md,
  "CI time"). The level is LLVM's, for the machine code XLA makes of a program: the programs
  and their custom calls (the kernels) are the same, and XLA's CPU code does no fast math,
  so values change at most by float32 rounding, within every tolerance. Set before jax
  initialises its backend, which reads XLA_FLAGS then; child processes inherit it (the same
  compilation-cache keys as theirs). `XLA_FLAGS=--xla_backend_optimization_level=3 python -m
  pytest` runs the default level.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if XLA_OPT_LEVEL not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {XLA_OPT_LEVEL}=0".strip()


_compile_xla_programs_unoptimized()


def pytest_unconfigure(config):
  if _OWN_COMPILATION_CACHE is not None:
    shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)

# flax's and equinox's own tests, vendored: tests/test_third_party.py runs them in a
# subprocess under patch() (they set process-wide JAX options of their own).
collect_ignore = ["third_party"]

#: The accelerator compile checks: every Pallas kernel compiled by Triton and libtpu with no
#: accelerator. They need the accel-check extra (``pip install ".[accel-check]"``), which CI
#: installs in a step of its own (.ci/accel-check, with JAX_NORMGRAD_REQUIRE_ACCEL_CHECK=1).
ACCEL_CHECK_MODULE = ROOT / "tests" / "test_accel_compile.py"
ACCEL_CHECK_PACKAGES = ("triton", "libtpu")
REQUIRE_ACCEL_CHECK = "JAX_NORMGRAD_REQUIRE_ACCEL_CHECK"


def _arg_paths(config) -> list[pathlib.Path]:
  """The paths the session collects from: its positional arguments, or ``testpaths``."""
  here = config.invocation_params.dir
  return [pathlib.Path(here, str(arg).split("::")[0]).resolve() for arg in config.args]


def _accel_check_left_out(config) -> list[str]:
  """The accel-check packages missing here, when that leaves the module out of the collection.

  Without the extra, each of the module's ~270 cases would only report a skip. Named on the
  command line (``python -m pytest tests/test_accel_compile.py``), or with
  JAX_NORMGRAD_REQUIRE_ACCEL_CHECK=1 (CI, where a missing tool must fail), it is collected.
  """
  if os.environ.get(REQUIRE_ACCEL_CHECK) == "1":
    return []
  missing = [p for p in ACCEL_CHECK_PACKAGES if importlib.util.find_spec(p) is None]
  if not missing or ACCEL_CHECK_MODULE in _arg_paths(config):
    return []
  return missing


def pytest_ignore_collect(collection_path, config):
  if collection_path == ACCEL_CHECK_MODULE and _accel_check_left_out(config):
    return True
  return None


def _accel_check_note(config) -> str | None:
  """One line saying the module was left out, where the session's paths hold it."""
  missing = _accel_check_left_out(config)
  if not missing or not any(p == ACCEL_CHECK_MODULE or p in ACCEL_CHECK_MODULE.parents
                            for p in _arg_paths(config)):
    return None
  return (f"left out: {ACCEL_CHECK_MODULE.relative_to(ROOT)}, the accelerator compile checks "
          f"({' and '.join(missing)} not installed); run them with `bash .ci/accel-check`, or "
          f"`pip install \".[accel-check]\"` and `python -m pytest tests/test_accel_compile.py`")

# The "ci" profile is the default, so the README's plain `python -m pytest -q`
# (which CI runs verbatim) gets a fixed, derandomized example budget: the same
# examples on every run, within the suite's time budget. Run more with
# `python -m pytest --hypothesis-profile=thorough tests/test_properties.py`.
hypothesis.settings.register_profile(
    "ci", max_examples=50, derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.register_profile(
    "thorough", max_examples=400, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("ci")


#: Set by .ci/sanitize: the session must test the sanitized build of the kernels.
EXPECT_SANITIZED = "JAX_NORMGRAD_EXPECT_SANITIZED"


def _extension():
  """The compiled module the tests will use, or None when it does not import."""
  try:
    from jax_normgrad import _jax_normgrad
  except ImportError:
    return None
  return _jax_normgrad


def pytest_addoption(parser, pluginmanager):
  """pyproject.toml's ``addopts`` (xdist's ``--numprocesses``, ``--dist``) accepted where xdist
  is not loaded (``-p no:xdist``, or not installed): the run is then serial."""
  if not pluginmanager.has_plugin("xdist"):
    group = parser.getgroup("xdist (not loaded: these options are ignored)")
    group.addoption("--numprocesses", default=None)
    group.addoption("--dist", default="no")


def pytest_report_header(config):
  ext = _extension()
  if ext is None:
    lines = ["jax_normgrad extension: not importable"]
  else:
    lines = [f"jax_normgrad extension: {ext.__file__} "
             f"(sanitizers: {getattr(ext, 'sanitizers', '') or 'none'})"]
  note = _accel_check_note(config)
  return lines + ([note] if note else [])


def pytest_terminal_summary(terminalreporter, config):
  # The header is not printed under -q (the README's command); this line is.
  note = _accel_check_note(config)
  if note:
    terminalreporter.write_line(note)


def pytest_sessionstart(session):
  if os.environ.get(EXPECT_SANITIZED) == "1":
    ext = _extension()
    if ext is None or not getattr(ext, "sanitizers", ""):
      where = ext.__file__ if ext is not None else "the extension (not importable)"
      pytest.exit(f"{EXPECT_SANITIZED}=1 but {where} is not a sanitized build",
                  returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture
def cpu_device():
  """The test runs on the CPU device wherever the suite runs (``cases.on_cpu``): for the tests
  of the CPU kernels themselves, which a GPU machine's default device would not reach.

  Skipped where the C++ extension is not built (a GPU machine running the package from its
  sources): those kernels are then absent, not broken. A build that fails to import is
  test_kernels' failure (it asserts the extension is there)."""
  import cases  # pylint: disable=g-import-not-at-top
  from jax_normgrad import _ffi  # pylint: disable=g-import-not-at-top
  if not _ffi.available():
    pytest.skip("the CPU kernels' test: jax_normgrad's C++ extension is not built here")
  with cases.on_cpu():
    yield


def pytest_generate_tests(metafunc):
  """Parametrizes test arguments from the ``argument_values`` dict of the test's class.

  A key names one argument or several (``"shape,norm_shape"``); the first
  key that covers an argument wins. A subclass narrows a suite by
  overriding entries, e.g. to keep an interpreted implementation's run short.
  """
  done = set()
  for names, values in (getattr(metafunc.cls, "argument_values", None) or {}).items():
    args = set(names.split(","))
    if args <= set(metafunc.fixturenames) and not args & done:
      metafunc.parametrize(names, values)
      done |= args


@pytest.fixture
def settings_env():
  """``set(name, value)``: one of jax_normgrad's environment settings for this test (None: unset).

  They are read once per process, at the first trace (``jax_normgrad._settings``): each
  change forgets the fixed settings and jax's compiled functions, and the end of the test
  restores the variables the run started with and forgets again.
  """
  from jax_normgrad import _settings  # pylint: disable=g-import-not-at-top
  saved = {name: os.environ.get(name) for name in _settings.CHOICES}

  def set_(name, value):
    assert name in saved, name
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value
    _settings.reset()

  yield set_
  for name, value in saved.items():
    set_(name, value)
