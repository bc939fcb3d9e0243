"""The JAX primitives of jax_normgrad: one module per op family.

Each primitive module holds, side by side: the primitive, its abstract eval,
its lowerings' entry points (the C++ FFI call on CPU and the jnp reference
here; the Pallas lowering in ``jax_normgrad/pallas/<op>.py``) and its
partitioning roles. What every primitive shares, the batch-folding vmap rule
and the JVP rule, is in ``_common.py``; which lowering runs, in
``jax_normgrad/_dispatch.py``. The public functions in ``jax_normgrad/ops``
validate arguments, reshape to the canonical layout and ``bind``.
"""
