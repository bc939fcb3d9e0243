"""Every Pallas kernel compiled by Triton (sm_80, sm_90) and by libtpu's Mosaic (v4 to v6e), no accelerator.

See ``accel_check`` for how. Where the extra's packages are missing (``pip install
".[accel-check]"``), tests/conftest.py leaves this module out of a run that does not name it;
named, the tests skip with the reason. CI (.ci/accel-check) sets
``JAX_NORMGRAD_REQUIRE_ACCEL_CHECK=1``, which collects it and turns that skip into a failure.
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest

import accel_check as ac

REQUIRED = os.environ.get("JAX_NORMGRAD_REQUIRE_ACCEL_CHECK") == "1"
MISSING = ac.tools_missing()


def test_tools_present_where_required():
  if MISSING and REQUIRED:
    pytest.fail(f"JAX_NORMGRAD_REQUIRE_ACCEL_CHECK=1 but the check cannot run: {MISSING}")
  if MISSING:
    pytest.skip(MISSING)


needs_tools = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
GPU_CASE_IDS = [c.name for c in ac.GPU_CASES]


@needs_tools
@pytest.mark.parametrize("case", ac.GPU_CASES, ids=GPU_CASE_IDS)
def test_triton_kernels_compile_without_spills(case):
  """Each of the case's kernels compiles for sm_80 and sm_90 without spills, and the tile
  heuristics' plan holds: every program of a persistent kernel's grid fits on the SMs
  together (registers and warps allow that many blocks per SM), so none waits for a second
  wave (docs/gpu-resources.md, 'per SM' <= 'blocks/SM'). One test for both checks: each
  kernel is compiled once (ac.compile_triton caches it in the process)."""
  for kernel in ac.triton_kernels(case):
    for arch in ac.GPU_ARCHS:
      r = ac.compile_triton(kernel, arch)
      assert r.local_bytes == 0, (kernel.name, arch, r)
      assert r.registers <= 255 and r.blocks_per_sm >= 1, (kernel.name, arch, r)
      # jax_normgrad_sum_partials is not persistent: one program per column block.
      if kernel.name != "jax_normgrad_sum_partials":
        assert kernel.programs_per_sm <= r.blocks_per_sm, (kernel.name, arch, kernel.grid, r)


@needs_tools
def test_row_kernels_move_rows_by_128_bit_accesses():
  """x, dy and dx move 16 bytes per thread where rows are 16-byte aligned (4096 float32)."""
  case = next(c for c in ac.CASES if c.name == "grad(layer_norm) 64x4096 float32")
  for kernel in ac.triton_kernels(case):
    if kernel.name in ("jax_normgrad_norm_fwd", "jax_normgrad_norm_bwd"):
      r = ac.memory_accesses(kernel, 90)
      assert r.loads_128 >= 2 and r.stores_128 >= 1, (kernel.name, r)


# Each case is compiled for one TPU generation, the generations in turn, so
# every case and every generation is compiled (4x fewer compiles than every
# pair, for CI's time); the first cases, the LayerNorm/RMSNorm/GroupNorm
# mainstays, on all four. `python tests/accel_check.py` compiles every pair.
_GENERATIONS = list(ac.TPU_TOPOLOGIES)
TPU_PAIRS = [pytest.param(case, gen, id=f"{case.name}-{gen}")
             for i, case in enumerate(ac.CASES)
             for gen in (_GENERATIONS if i < 3 else [_GENERATIONS[i % len(_GENERATIONS)]])]


@needs_tools
@pytest.mark.parametrize("case,generation", TPU_PAIRS)
def test_mosaic_kernels_compile(case, generation):
  ac.compile_tpu(case, generation)


# ----------------------------------------------------------------------------
# A sharded training step compiled for a 4-chip TPU topology (no TPU).


def _sharded_step(shard_map: bool):
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

  import jax_normgrad as jn

  mesh = Mesh(np.array(ac.tpu_device("v5e")).reshape(2, 2), ("data", "seq"),
              axis_types=(AxisType.Auto,) * 2)
  spec = P("data", "seq", None)
  args = (jax.ShapeDtypeStruct((8, 256, 1024), jnp.float32, sharding=NamedSharding(mesh, spec)),
          *[jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=NamedSharding(mesh, P()))] * 2)
  loss = lambda x, w, b: jnp.sum(jn.layer_norm(x, w, b) ** 2)
  grad = jax.grad(loss, argnums=(0, 1, 2))
  if shard_map:
    grad = jax.shard_map(grad, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P(), P()))
  return jax.jit(grad).lower(*args).compile().as_text()


@needs_tools
def test_tpu_shard_map_step_runs_the_kernels_on_local_rows():
  """The layers inside shard_map on 4 chips: the Mosaic kernels, no all-gather of x, one
  all-reduce (the replicated parameters' gradients, psum-ed by shard_map's typing)."""
  hlo = _sharded_step(shard_map=True)
  assert hlo.count('custom_call_target="tpu_custom_call"') >= 2
  assert "all-gather" not in hlo
  assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") == 1, hlo.count("all-reduce")


@needs_tools
def test_tpu_sharded_jit_compiles_on_the_reference_with_a_warning():
  """Sharded jit (no shard_map) on TPU: XLA cannot partition a Mosaic kernel and JAX's
  custom_partitioning rules do not run there (jax-ml/jax#38196, the same error on real TPUs,
  so not an artifact of compiling without one): the reference runs, announced."""
  import jax_normgrad as jn
  from jax_normgrad import _fallback

  _fallback.warn_once.cache_clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hlo = _sharded_step(shard_map=False)
  # The warning names both ways to the kernels: Explicit mesh axes, or shard_map.
  assert any(issubclass(w.category, jn.FallbackWarning) and "shard_map" in str(w.message)
             and "Explicit" in str(w.message) for w in caught), [str(w.message) for w in caught]
  assert "tpu_custom_call" not in hlo and "all-gather" not in hlo


@needs_tools
def test_tpu_explicitly_sharded_model_step_runs_the_kernels_in_every_norm():
  """tests/norm_model.py's training step (LayerNorm, add_layer_norm, add_rms_norm, RMSNorm,
  GroupNorm NHWC and NCHW) jitted with Explicit mesh axes over a v5e 2x2 topology: every norm
  is a Mosaic kernel each way on each chip's local shapes (256 of the 1024 token rows, 2 of
  the 8 images), no fallback (a FallbackWarning fails), no all-gather; the parameter
  gradients all-reduced."""
  import norm_model

  hlo = ac.compile_tpu_model_step("v5e")
  calls = [l for l in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in l]
  for direction in ("fwd", "bwd"):
    named = [l for l in calls if re.match(rf"\s*(ROOT )?%jax_normgrad_norm_{direction}\b", l)]
    assert len(named) >= norm_model.NORMS, (direction, len(named))
  for line in calls:
    assert not re.search(r"f32\[1,(1024|8),", line), line[:300]  # global rows or images
  assert "all-gather" not in hlo
  assert "all-reduce" in hlo
