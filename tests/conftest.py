"""Shared pytest set-up: which jax_normgrad is tested, hypothesis profiles, random inputs, case lists."""

import os
import pathlib
import sys

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

# flax's and equinox's own tests, vendored: tests/test_third_party.py runs them in a
# subprocess under patch() (they set process-wide JAX options of their own).
collect_ignore = ["third_party"]

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


def pytest_report_header(config):
  ext = _extension()
  if ext is None:
    return ["jax_normgrad extension: not importable"]
  return [f"jax_normgrad extension: {ext.__file__} "
          f"(sanitizers: {getattr(ext, 'sanitizers', '') or 'none'})"]


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
  of the CPU kernels themselves, which a GPU machine's default device would not reach."""
  import cases  # pylint: disable=g-import-not-at-top
  with cases.on_cpu():
    yield


def pytest_generate_tests(metafunc):
  """Parametrizes test arguments from the ``cases`` dict of the test's class.

  A key names one argument or several (``"shape,norm_shape"``); the first
  key that covers an argument wins. A subclass narrows a suite by
  overriding entries, e.g. to keep an interpreted implementation's run short.
  """
  done = set()
  for names, values in (getattr(metafunc.cls, "cases", None) or {}).items():
    args = set(names.split(","))
    if args <= set(metafunc.fixturenames) and not args & done:
      metafunc.parametrize(names, values)
      done |= args
