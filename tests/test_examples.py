"""examples/third_party_unet.py: flaxdiff's UNet (a PyPI package, unchanged) under jax_normgrad.flax.patch().

Skips where flaxdiff is not installed (``pip install --no-deps flaxdiff==0.2.11
einops``); CI installs it (``.ci/examples``) and sets
``JAX_NORMGRAD_REQUIRE_EXAMPLES=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import numpy as np
import pytest

_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "third_party_unet.py"


@pytest.fixture(scope="module")
def example():
  missing = [m for m in ("flaxdiff", "einops", "optax", "flax")
             if importlib.util.find_spec(m) is None]
  if missing:
    if os.environ.get("JAX_NORMGRAD_REQUIRE_EXAMPLES") == "1":
      pytest.fail(f"JAX_NORMGRAD_REQUIRE_EXAMPLES=1 but {missing} are not installed")
    pytest.skip(f"{missing} not installed (pip install --no-deps flaxdiff==0.2.11 einops)")
  spec = importlib.util.spec_from_file_location("third_party_unet", _EXAMPLE)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_flaxdiff_unet_patched_matches_flax_and_runs_the_kernels(example):
  r = example.compare("small", steps=20)
  assert r["kernel_calls"]["flax"] == 0
  assert r["kernel_calls"]["ours"] >= 20  # every GroupNorm/LayerNorm, forward and backward
  assert r["loss"]["ours"] == pytest.approx(r["loss"]["flax"], rel=1e-5)
  assert r["max_grad_rel_err"] < 1e-4, r["max_grad_rel_err"]
  np.testing.assert_allclose(r["curves"]["ours"], r["curves"]["flax"], rtol=1e-4)
  assert r["curves"]["ours"][-1] < 0.5 * r["curves"]["ours"][0]  # it trains
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  import jax_normgrad.flax as jf  # pylint: disable=g-import-not-at-top
  assert nn.GroupNorm is jf._GroupNorm and nn.LayerNorm is jf._LayerNorm  # the patch was undone

