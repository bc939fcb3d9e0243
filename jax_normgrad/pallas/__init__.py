"""Pallas kernels of the primitives: Triton on CUDA/ROCm, Mosaic on TPU, interpreted on CPU.

``layer_norm`` and ``group_norm`` hold the lowering functions registered with
the primitives (``pallas=``); ``gpu`` (Triton) and ``tpu`` the kernels,
written once for every op over the segment view of ``common``;
``mosaic_gpu`` the Mosaic GPU kernels (sm_90+, LayerNorm / RMSNorm rows, by
choice: ``_implementation``); ``config`` the tile heuristics. The kernel
modules are imported on first lowering only.
"""
