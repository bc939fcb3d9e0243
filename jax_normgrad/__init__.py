"""jax_normgrad: fast, exact LayerNorm / GroupNorm / RMSNorm for JAX, forward and backward.

Each op is a JAX primitive lowered to a compiled kernel: the C++ XLA FFI
custom call on CPU, Pallas on GPUs and TPUs; ``implementation="xla"`` selects
the pure-JAX reference, and ``explain(f, *args)`` says which runs where, and
why (docs/dispatch.md). The layers (``layer_norm``, ``rms_norm``,
``group_norm``, ``add_layer_norm``, ``add_rms_norm``) are ``custom_vjp``
functions whose backward is the backward kernel; they differentiate to any
order (the primitives' JVPs are the reference's), so ``grad(grad)``,
``jax.hessian`` and ``jvp(grad)`` work through them. ``jax_normgrad.vendor``
holds the forms with other frameworks' kernel signatures; ``rewrite(f)``
puts every norm a function computes on these ops (docs/rewrite.md). See
README.md and docs/api.md.
"""

import pkgutil

# Run from a source checkout after `pip install .`, this directory shadows the
# installed package, which alone holds the compiled extension: let submodule
# imports also look in the installed copy (the same sources plus the .so).
__path__ = pkgutil.extend_path(__path__, __name__)

from jax_normgrad import _ffi  # noqa: E402,F401  (registers the CPU FFI targets)

# The layers, JAX-style: differentiable functions whose backward (and forward) are the kernels.
from jax_normgrad.ops.add_norm import add_layer_norm, add_rms_norm  # noqa: E402
from jax_normgrad.ops.group_norm import group_norm  # noqa: E402
from jax_normgrad.ops.layer_norm import layer_norm  # noqa: E402
from jax_normgrad.ops.rms_norm import rms_norm  # noqa: E402

# Which kernel runs, and why; the package's warnings and settings.
from jax_normgrad._explain import default_implementations, explain  # noqa: E402
from jax_normgrad._fallback import FallbackWarning  # noqa: E402
from jax_normgrad._ffi import export_safety_checks  # noqa: E402
from jax_normgrad._malloc import keep_freed_memory  # noqa: E402
from jax_normgrad._settings import LAYER_FORWARD_DEFAULT, SettingsChangedError  # noqa: E402
from jax_normgrad._sharding import ShardingWarning  # noqa: E402
from jax_normgrad._validation import IMPLEMENTATIONS, SUPPORTED_DTYPES  # noqa: E402

# Every norm of any JAX function on the kernels: a jaxpr rewrite (docs/rewrite.md).
from jax_normgrad._rewrite import RewriteReport, explain_rewrite, rewrite  # noqa: E402

# The compatibility forms (other frameworks' kernel signatures), also as jax_normgrad.vendor.*.
from jax_normgrad import vendor  # noqa: E402
from jax_normgrad.vendor import (group_norm_backward, group_norm_fwd,  # noqa: E402
                                 layer_norm_backward, layer_norm_backward_from_normalized,
                                 layer_norm_fwd, layer_norm_grad, layer_norm_grad_beta,
                                 rms_norm_backward, rms_norm_fwd)

__version__ = "0.1.0"

__all__ = [
    # The layers.
    "add_layer_norm",
    "add_rms_norm",
    "group_norm",
    "layer_norm",
    "rms_norm",
    # Which kernel runs; warnings and settings.
    "FallbackWarning",
    "IMPLEMENTATIONS",
    "LAYER_FORWARD_DEFAULT",
    "SUPPORTED_DTYPES",
    "SettingsChangedError",
    "ShardingWarning",
    "default_implementations",
    "explain",
    "export_safety_checks",
    "keep_freed_memory",
    # Every norm of any function on the kernels.
    "RewriteReport",
    "explain_rewrite",
    "rewrite",
    # The compatibility forms (jax_normgrad.vendor).
    "vendor",
    *vendor.__all__,
]
