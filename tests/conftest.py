"""Shared pytest fixtures: deterministic random inputs; case lists from the test classes."""

import numpy as np
import pytest


@pytest.fixture
def rng():
  return np.random.default_rng(0)


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
