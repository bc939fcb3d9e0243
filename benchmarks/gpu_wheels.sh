#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) the wheels the lent GPU machine lacks, for
# benchmarks/gpu_session.sh's `wheels` stage: that machine reaches no package registry, so a
# device call carries them (`carry: [".whl"]`). From the repository root, on a machine with pip
# and a registry:
#
#     bash benchmarks/gpu_wheels.sh
#
# The machine runs Python 3.12 on x86-64 with jax 0.11.2, torch, triton, flax, optax, absl,
# jaxtyping, pyyaml, rich and tqdm installed. Fetched, each pinned and without its dependencies:
#   Liger-Kernel               bench_gpu.py's Liger columns (needs torch and triton: there)
#   tokamax                    bench_gpu.py's tokamax column (Python >= 3.12, jax >= 0.11.1)
#   jax-triton                 tokamax's Triton kernels (an optional dependency of tokamax).
#                              Neither release runs them on the machine's Triton 3.6: 0.4.1
#                              needs a newer Triton (its calls fail on stand-ins for the missing
#                              API), and 0.3.1, the one for Triton 3.6, lacks the triton_call
#                              arguments tokamax 0.0.17 passes; bench_gpu.py then reports the
#                              error in the tokamax column (H200, 2026-11-28)
#   einshape, immutabledict, pydantic (+ pydantic-core, annotated-types, typing-inspection),
#   qwix, xprof (+ fire, termcolor)
#                              what `import tokamax` imports that the machine lacks (xprof, a
#                              profiler plugin of about 32 MB, is imported by its benchmarking
#                              module, which every op imports)
# About 37 MB in all. Checked by installing them with the device command's
# `pip install --no-deps --target` into a Python 3.12 environment holding jax 0.11.2 and only
# the machine's other packages: `import tokamax` then lists its "triton" implementation.
set -eu
wheels=(
  liger-kernel==0.8.5
  tokamax==0.0.17 jax-triton==0.3.1
  einshape==1.0 immutabledict==4.3.1 qwix==0.1.8
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  xprof==2.24.2 fire==0.7.1 termcolor==3.3.0
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
ls -l .whl
du -sh .whl
