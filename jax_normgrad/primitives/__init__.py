"""The JAX primitives of jax_normgrad: one module per op family.

Each primitive module holds, side by side: the primitive, its abstract eval,
its lowerings (the C++ FFI call on CPU, the jnp reference, Pallas where built)
and its batching rule. The public functions in ``jax_normgrad/ops`` validate
arguments, reshape to the canonical layout and ``bind``.
"""
