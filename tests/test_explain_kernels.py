"""``jn.explain``'s kernels against the lowered modules: for each op, the kernels it names
(``kernels.describe``) are exactly the Pallas kernels of the module the function lowers to,
for the Triton and Mosaic TPU kernels (the default backends of cuda and tpu) and the Mosaic GPU
kernels (asked for). Lowering only (``jax.export`` for a platform with no device)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest

import jax_normgrad as jn
from jax_normgrad.pallas import config
import cases
from cases import needs_mosaic_gpu
from test_pallas import PLATFORMS, _export_text, _grad_of, _sds

F32 = jnp.float32


def _ln_bwd_only_params(x, w, b):  # no dx asked for: no statistics kernel, no dx written
  mean = rstd = jnp.ones((x.shape[0],), F32)
  return jn.layer_norm_backward(jnp.ones_like(x), x, (x.shape[1],), mean, rstd, w, b,
                                output_mask=(False, True, True))


_LN = lambda x, w, b: jn.layer_norm(x, w, b)
_GN = lambda groups, axis: (lambda x, w, b: jn.group_norm(x, groups, w, b, channel_axis=axis))
EXPLAIN_CASES = {  # name: (function of (x, w, b), x's shape and dtype, tuning)
    "layer_norm fused rows": (_grad_of(_LN), (4096, 1024), jnp.bfloat16, {}),
    "layer_norm chunked rows": (_grad_of(_LN), (64, 16384), F32, {}),
    "layer_norm forward by XLA": (_grad_of(lambda x, w, b: jn.layer_norm(x, w, b, forward="xla")),
                                  (256, 768), F32, {}),
    "rms_norm": (_grad_of(lambda x, w, b: jn.rms_norm(x, w)), (512, 4096), jnp.bfloat16, {}),
    "layer_norm_backward, parameters only": (_ln_bwd_only_params, (512, 1000), F32, {}),
    "partial sums in XLA": (_grad_of(_LN), (512, 1000), F32, {"gpu_partials_in_xla": True}),
    "add_layer_norm": (_grad_of(lambda x, w, b: jn.add_layer_norm(x, x * 2, w, b)[0]),
                       (1024, 768), jnp.bfloat16, {}),
    "group_norm NCHW": (_grad_of(_GN(32, 1)), (8, 320, 16, 16), F32, {}),
    "group_norm NHWC sample-wide, split": (_grad_of(_GN(32, -1)), (32, 32, 32, 64), F32, {}),
    "group_norm NHWC per group": (_grad_of(_GN(32, -1)), (4, 16, 16, 320), F32,
                                  {"gpu_nhwc_odd_groups": False}),
    "group_norm NHWC odd groups": (_grad_of(_GN(32, -1)), (4, 16, 16, 320), jnp.bfloat16,
                                   {"gpu_nhwc_odd_groups": True}),
}


def _explain_and_lower(fn, args, platform, tuning):
  """``jn.explain(fn, *args)`` for ``platform``, and the text of the module ``fn`` lowers to."""
  gpu = (cases.abstract_gpu() if platform == "cuda" and cases.TRITON_LOWERING_NEEDS_GPU_KIND
         else contextlib.nullcontext())
  with config.override(**tuning):
    with gpu:
      explained = jn.explain(fn, *args, platform=platform)
    return explained, _export_text(fn, args, platform)


def _told(explained, implementation):
  """The kernels ``explained`` names, each op's plan checked to be told."""
  told = set()
  for e in explained:
    if e.choice.implementation == "xla":
      assert e.plan is None, e
      continue
    assert e.choice.implementation == implementation, e
    assert e.plan.kernels and e.plan.detail and str(e.plan) in str(e), e
    told |= set(e.plan.kernels)
  return told


def _args(name, shape, dtype):
  c = shape[-1] if "NHWC" in name or "group" not in name else shape[1]
  return (_sds(shape, dtype), _sds((c,), F32), _sds((c,), F32))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(EXPLAIN_CASES))
def test_explain_names_the_kernels_of_the_lowered_module(name, platform):
  """``jn.explain`` on cuda and tpu names, for each op, the kernels and their plan; together
  they are the kernels of the module the function lowers to (no more, no fewer)."""
  fn, shape, dtype, tuning = EXPLAIN_CASES[name]
  explained, text = _explain_and_lower(fn, _args(name, shape, dtype), platform, tuning)
  told = _told(explained, {"cuda": "triton", "tpu": "mosaic_tpu"}[platform])
  assert told == set(re.findall(r"jax_normgrad_(?:norm|sum)_\w+", text)), str(explained)


def _value_and_grad_of(norm):
  """The loss and its gradients: every kernel's output is used (jax 0.12.1 drops a Mosaic GPU
  kernel whose outputs nothing reads, such as the forward's y pass under ``jax.grad``)."""
  return jax.value_and_grad(lambda x, w, b: jnp.sum(norm(x, w, b).astype(F32)), argnums=(0, 1, 2))


_MG = "mosaic_gpu"
MOSAIC_GPU_CASES = {  # name: (function of (x, w, b), x's shape and dtype, the kernels' variants)
    "layer_norm rows": (
        _value_and_grad_of(lambda x, w, b: jn.layer_norm(x, w, b, implementation=_MG)),
        (512, 1024), jnp.bfloat16, ("whole rows", "whole rows")),
    "layer_norm long rows in pieces": (
        _value_and_grad_of(lambda x, w, b: jn.layer_norm(x, w, b, implementation=_MG)),
        (64, 32768), F32,
        ("rows in 4 pieces", "rows in 6 pieces")),
    "rms_norm": (_value_and_grad_of(lambda x, w, b: jn.rms_norm(x, w, implementation=_MG)),
                 (256, 4096), jnp.bfloat16, ("whole rows", "whole rows")),
    "add_layer_norm": (
        _value_and_grad_of(
            lambda x, w, b: jn.add_layer_norm(x, x * 2, w, b, implementation=_MG)[0]),
        (256, 768), jnp.bfloat16, ("whole rows", "whole rows")),
    "group_norm NCHW segments whole, backward in two passes": (
        _value_and_grad_of(lambda x, w, b: jn.group_norm(x, 32, w, b, implementation=_MG)),
        (8, 320, 32, 32), F32,
        ("channels-first groups, segments whole", "channels-first groups, two passes over rows")),
    "group_norm NHWC": (
        _value_and_grad_of(
            lambda x, w, b: jn.group_norm(x, 32, w, b, channel_axis=-1, implementation=_MG)),
        (8, 32, 32, 320), jnp.bfloat16, ("channels-last groups, two passes over rows",) * 2),
}


@needs_mosaic_gpu
@pytest.mark.parametrize("name", list(MOSAIC_GPU_CASES))
def test_explain_names_the_mosaic_gpu_kernels_of_the_lowered_module(name):
  """The Mosaic GPU kernels as ``jn.explain`` names them (rows whole or in pieces, GroupNorm's
  segments whole or two passes) are exactly those of the lowered module, where each kernel is
  named in its location and, suffixed ``_mosaic_gpu``, in its Mosaic GPU module."""
  fn, shape, dtype, variants = MOSAIC_GPU_CASES[name]
  explained, text = _explain_and_lower(fn, _args(name, shape, dtype), "cuda", {})
  assert tuple(e.plan.variant for e in explained) == variants, str(explained)
  found = {re.sub("_mosaic_gpu$", "", k) for k in re.findall(r"jax_normgrad_norm_\w+", text)}
  assert _told(explained, "mosaic_gpu") == found, str(explained)
