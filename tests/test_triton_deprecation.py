"""jax's Pallas Triton DeprecationWarning is ignored around the package's own GPU lowerings, only there.

jax 0.11+ warns "The Pallas Triton backend is deprecated and will be removed
in a future JAX version. ..." each time a Pallas Triton kernel is lowered (in
the GPU lowering rule of ``pallas_call``, ``jax/_src/pallas/pallas_call.py``).
The package chose that backend, so it filters that warning while its
primitives are lowered for CUDA and ROCm (``pallas.triton_warning.quiet_lowering``).

jax 0.10.2 (this venv) does not warn. The tests make it: ``fake_jax011``
wraps ``pallas_call``'s lowering rule so that it emits jax 0.11's warning
(and an unrelated DeprecationWarning) where jax 0.11 does, then lowers as
before. That reaches into jax's internals (``mlir._lowerings``, the rule
table), because no public API hooks a primitive's lowering. What this proves:
the filter is in force where jax 0.11 warns inside our lowerings, matches
that message and category only, and is gone afterwards (a user's own
``pallas_call`` still warns). That jax 0.11's text is still the one filtered
is checked against a jax that has it (``test_with_this_jax``, jax >= 0.11).
"""

from __future__ import annotations

import warnings

import jax
import jax.interpreters.mlir
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import jax_normgrad as jn
from jax_normgrad.pallas import triton_warning
from cases import TRITON_LOWERING_NEEDS_GPU_KIND, export_for

F32 = jnp.float32
TRITON = "__gpu$xla.gpu.triton"
#: jax 0.11.0's message, as it warns it.
JAX_MESSAGE = ("The Pallas Triton backend is deprecated and will be removed in a future JAX "
               "version. To keep using Pallas on GPU, please migrate to the Mosaic GPU backend. "
               "To keep using Triton, switch to the official Triton bindings and jax_triton.")
OTHER = "Some other deprecation inside the lowering"


@pytest.fixture
def fake_jax011(monkeypatch):
  """``pallas_call``'s lowering warns as jax 0.11's does; the list counts the calls."""
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.pallas import pallas_call  # pylint: disable=g-import-not-at-top
  prim = pallas_call.pallas_call_p
  entry = mlir._lowerings[prim]  # pylint: disable=protected-access
  original = getattr(entry, "rule", entry)  # a LoweringRuleEntry in jax 0.10
  calls = []

  def lowering(ctx, *args, **params):
    calls.append(1)
    warnings.warn(JAX_MESSAGE, DeprecationWarning, stacklevel=2)
    warnings.warn(OTHER, DeprecationWarning, stacklevel=2)
    return original(ctx, *args, **params)

  # Restored at teardown (monkeypatch), replaced through the public register_lowering.
  monkeypatch.setitem(mlir._lowerings, prim, entry)  # pylint: disable=protected-access
  jax.interpreters.mlir.register_lowering(prim, lowering)
  jax.clear_caches()  # lowered again, through the hook
  yield calls
  jax.clear_caches()


def _layer_norm_grad():
  return jax.grad(lambda x, w: jnp.sum(jn.layer_norm(x, w)), argnums=(0, 1))


def _user_kernel(x):
  """A ``pallas_call`` of the user's own, outside the package's primitives."""

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        compiler_params=pltriton.CompilerParams())(x)


def _export_warnings(f, args):
  """The warnings (messages, DeprecationWarning) of exporting ``f`` for CUDA, and its text."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = export_for("cuda", jax.jit(f), args,
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
                      ).mlir_module()
  return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)], text


def test_ignored_inside_our_lowering_only_that_warning(fake_jax011):
  before = list(warnings.filters)
  messages, text = _export_warnings(_layer_norm_grad(), (jax.ShapeDtypeStruct((8, 256), F32),
                                                         jax.ShapeDtypeStruct((256,), F32)))
  assert TRITON in text and len(fake_jax011) >= 2  # both kernels lowered through the hook
  assert JAX_MESSAGE not in messages
  assert messages.count(OTHER) == len(fake_jax011)  # other warnings pass
  assert warnings.filters == before  # nothing left behind


def test_a_users_pallas_call_still_warns(fake_jax011):
  messages, text = _export_warnings(_user_kernel, (jax.ShapeDtypeStruct((8, 128), F32),))
  assert TRITON in text and fake_jax011
  assert JAX_MESSAGE in messages and OTHER in messages


def test_overlapping_blocks_leave_the_filters_as_they_found_them():
  # Two lowerings overlapping in two threads: entered A, B, left A, then B.
  # The warning is ignored while either is open, a filter the user adds
  # meanwhile stays, and no entry of ours is left.
  def triton_warning_shown():
    with warnings.catch_warnings(record=True) as caught:
      warnings.warn(JAX_MESSAGE, DeprecationWarning)
    return bool(caught)

  with warnings.catch_warnings():
    warnings.simplefilter("always")
    before = list(warnings.filters)
    a, b = triton_warning.triton_deprecation_ignored(), triton_warning.triton_deprecation_ignored()
    a.__enter__()
    b.__enter__()
    assert not triton_warning_shown()
    warnings.filterwarnings("error", message="users own")
    a.__exit__(None, None, None)
    assert not triton_warning_shown()
    b.__exit__(None, None, None)
    assert triton_warning_shown()
    assert warnings.filters[1:] == before and warnings.filters[0][0] == "error"


@pytest.mark.skipif(not TRITON_LOWERING_NEEDS_GPU_KIND,
                    reason="jax before 0.11 has no Pallas Triton deprecation")
def test_with_this_jax():
  """jax 0.11+'s own warning: none from the package's lowering, one from a user's kernel."""
  messages, _ = _export_warnings(_layer_norm_grad(), (jax.ShapeDtypeStruct((8, 256), F32),
                                                      jax.ShapeDtypeStruct((256,), F32)))
  assert not any(m.startswith(triton_warning.TRITON_DEPRECATION) for m in messages), messages
  messages, _ = _export_warnings(_user_kernel, (jax.ShapeDtypeStruct((8, 128), F32),))
  assert any(m.startswith(triton_warning.TRITON_DEPRECATION) for m in messages), messages
