"""Shared pytest set-up: which jax_normgrad is tested, the hypothesis profiles, random inputs."""

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

@pytest.fixture
def rng():
  return np.random.default_rng(0)
