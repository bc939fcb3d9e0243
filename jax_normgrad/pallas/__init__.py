"""Pallas kernels of the primitives: Triton on CUDA/ROCm, Mosaic on TPU, interpreted on CPU.

The modules in layers, each importing only those below it:

* ``layer_norm``, ``group_norm``: the lowering functions registered with the
  primitives (``pallas=``);
* ``dispatch``: which kernels run a problem (the GPU backend a lowering
  gets, chosen at lowering time: ``_implementation`` imports the choice from
  here) and the forward and backward that hand it to them;
  ``gpu_target``: whether Pallas Triton lowers for the targeted GPU;
* ``gpu`` (Triton), ``mosaic_gpu`` (Mosaic GPU, sm_90+) and ``tpu``: the
  kernels, written once for every op over the segment view of ``common``;
  imported on first lowering only. ``mosaic_gpu`` routes to
  ``mosaic_gpu_rows``, ``mosaic_gpu_pieces`` and ``mosaic_gpu_group_norm``,
  which stand on ``mosaic_gpu_pipeline`` (TMA, SMEM, barriers);
* ``common``: the segment description, the per-tile math and the
  fixed-order sums of the kernels' partials in XLA; ``config``: the tile
  heuristics.
"""
