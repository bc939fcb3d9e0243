"""flax's and equinox's own normalization tests, unmodified, with the drop-ins patched in.

The files under ``tests/third_party/`` are copies of the libraries' test
files at the versions the test extra installs (see its README); each suite
runs in a subprocess with the ``jax_normgrad_patch`` plugin, which applies
``jax_normgrad.{flax,nnx,equinox}.patch()`` before the tests import flax or
equinox names. Every LayerNorm, RMSNorm and GroupNorm those tests build is
then the drop-in; where an option is outside the kernels' scope (a mask,
non-trailing axes) the drop-in runs the original's code, as documented.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import cases

pytest.importorskip("flax")
pytest.importorskip("equinox")

HERE = pathlib.Path(__file__).resolve().parent / "third_party"

SUITES = {
    # flax.linen's NormalizationTest and flax.nnx's normalization tests of LayerNorm, RMSNorm and
    # GroupNorm (their masks and axes, linen against nnx, one norm against another); not the
    # BatchNorm, InstanceNorm, WeightNorm and SpectralNorm tests beside them (96 of the files'
    # 165), which build none of the patched classes.
    "flax": (["flax/linen_test.py::NormalizationTest", "flax/normalization_test.py"],
             "layer_norm or rms_norm or group_norm or layernorm or rmsnorm or groupnorm"
             " or normalization_equivalence"),
    # equinox's LayerNorm and GroupNorm tests (equinox has none for RMSNorm).
    "equinox": (["equinox/test_nn.py"], "layer_norm or group_norm"),
}
PATCHED = {
    "flax": ["flax.linen.LayerNorm", "flax.linen.RMSNorm", "flax.linen.GroupNorm",
             "flax.linen.normalization.LayerNorm", "flax.nnx.LayerNorm", "flax.nnx.GroupNorm",
             "flax.nnx.RMSNorm", "flax.nnx.nn.normalization.LayerNorm"],
    "equinox": ["equinox.nn.LayerNorm", "equinox.nn.GroupNorm", "equinox.nn.RMSNorm"],
}


@pytest.mark.parametrize("suite", list(SUITES))
def test_library_suite_passes_under_patch(suite):
  files, select = SUITES[suite]
  env = cases.child_env(PYTHONPATH=str(HERE))
  cmd = [sys.executable, "-m", "pytest", "-p", "jax_normgrad_patch", "-p",
         "no:cacheprovider", f"--confcutdir={HERE}", "-o", "addopts=", *files]
  if select:
    cmd += ["-k", select]
  run = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-6000:]
  header = re.search(r"jax_normgrad patch\(\): (\d+) names replaced: (.*)", out)
  assert header, out[:3000]
  for name in PATCHED[suite]:
    assert name in header.group(2), (name, header.group(2))
  used = re.search(r"jax_normgrad kernels: (\d+) layer calls in (\d+) tests", out)
  assert used and int(used.group(2)) >= (50 if suite == "flax" else 2), out[-3000:]
  summary = out.strip().splitlines()[-1]
  passed = int(re.search(r"(\d+) passed", summary).group(1))
  assert passed >= (65 if suite == "flax" else 2), summary
  assert "failed" not in summary and "error" not in summary, summary
