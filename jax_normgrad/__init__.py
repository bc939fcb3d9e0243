"""jax_normgrad: fast, exact LayerNorm / GroupNorm / RMSNorm backward passes for JAX.

Each op is a JAX primitive whose default lowering is a compiled kernel (the
C++ XLA FFI custom call on CPU); ``implementation="xla"`` selects the
pure-JAX reference. The primitives differentiate to any order (their JVPs
are the reference's), so ``grad(grad)``, ``jax.hessian`` and ``jvp(grad)``
work through the layers. See README.md for the API table.
"""

import pkgutil

# Run from a source checkout after `pip install .`, this directory shadows the
# installed package, which alone holds the compiled extension: let submodule
# imports also look in the installed copy (the same sources plus the .so).
__path__ = pkgutil.extend_path(__path__, __name__)

from jax_normgrad import _ffi  # noqa: E402,F401  (registers the CPU FFI targets)
from jax_normgrad._ffi import export_safety_checks  # noqa: E402
from jax_normgrad._implementation import (  # noqa: E402
    LAYER_FORWARD_DEFAULT, FallbackWarning, default_implementations)
from jax_normgrad._malloc import keep_freed_memory  # noqa: E402
from jax_normgrad._sharding import ShardingWarning  # noqa: E402
from jax_normgrad._validation import IMPLEMENTATIONS, SUPPORTED_DTYPES
from jax_normgrad.ops.add_norm import add_layer_norm, add_rms_norm
from jax_normgrad.ops.group_norm import group_norm, group_norm_backward, group_norm_fwd
from jax_normgrad.ops.layer_norm import layer_norm, layer_norm_backward, layer_norm_fwd
from jax_normgrad.ops.layer_norm_grad import (layer_norm_backward_from_normalized, layer_norm_grad,
                                              layer_norm_grad_beta)
from jax_normgrad.ops.rms_norm import rms_norm, rms_norm_backward, rms_norm_fwd
from jax_normgrad._rewrite import RewriteReport, explain_rewrite, rewrite  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "FallbackWarning",
    "IMPLEMENTATIONS",
    "LAYER_FORWARD_DEFAULT",
    "RewriteReport",
    "SUPPORTED_DTYPES",
    "ShardingWarning",
    "add_layer_norm",
    "add_rms_norm",
    "default_implementations",
    "explain_rewrite",
    "export_safety_checks",
    "group_norm",
    "group_norm_backward",
    "group_norm_fwd",
    "keep_freed_memory",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_from_normalized",
    "layer_norm_fwd",
    "layer_norm_grad",
    "layer_norm_grad_beta",
    "rewrite",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_fwd",
]
