"""The compatibility forms: the ops with the signatures of other frameworks' kernels.

For code ported from, or tested against, those kernels. Each computes what
the JAX-style layers compute (``jax_normgrad.layer_norm``, ``rms_norm``,
``group_norm``), on the same kernels, with the vendor's argument order,
statistics and output masks (docs/spec.md gives each one's contract):

* ATen / aclnn (PyTorch's native ops, Ascend's aclnn): ``layer_norm_fwd``
  (``native_layer_norm``), ``layer_norm_backward``, ``rms_norm_fwd``,
  ``rms_norm_backward``, ``group_norm_fwd`` (``native_group_norm``, with
  ``N, C, HxW, group``), ``group_norm_backward``;
* AscendC: ``layer_norm_grad`` (LayerNormGrad: the variance and epsilon
  instead of rstd, ``res_for_gamma``) and ``layer_norm_grad_beta``
  (LayerNormGradBeta);
* InfiniOp: ``layer_norm_backward_from_normalized`` (the backward from the
  normalized input and the standard deviation).

The same functions are also at the top level (``jax_normgrad.layer_norm_fwd``
and so on).
"""

from jax_normgrad.ops.group_norm import group_norm_backward, group_norm_fwd
from jax_normgrad.ops.layer_norm import layer_norm_backward, layer_norm_fwd
from jax_normgrad.ops.layer_norm_grad import (layer_norm_backward_from_normalized, layer_norm_grad,
                                              layer_norm_grad_beta)
from jax_normgrad.ops.rms_norm import rms_norm_backward, rms_norm_fwd

__all__ = [
    "group_norm_backward",
    "group_norm_fwd",
    "layer_norm_backward",
    "layer_norm_backward_from_normalized",
    "layer_norm_fwd",
    "layer_norm_grad",
    "layer_norm_grad_beta",
    "rms_norm_backward",
    "rms_norm_fwd",
]
