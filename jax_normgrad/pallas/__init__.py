"""Pallas kernels of the primitives: Triton and Mosaic GPU on GPUs, Mosaic on TPU, interpreted on CPU.

The modules in layers, each importing only those below it:

* ``layer_norm``, ``group_norm``: the lowering functions registered with the
  primitives, and the problem each hands the kernels (which
  ``jax_normgrad._dispatch`` reads to choose a backend);
* ``kernels``: the forward and backward that hand a problem to the kernels
  of the chosen backend; ``gpu_target``: the GPU a lowering targets, and
  whether Pallas Triton and Mosaic GPU run on it;
* ``gpu`` (Triton), ``mosaic_gpu`` (Mosaic GPU, sm_90+) and ``tpu``: the
  kernels, written once for every op over the segment view of ``common``;
  imported on first lowering only. ``mosaic_gpu`` routes to
  ``mosaic_gpu_rows``, ``mosaic_gpu_pieces`` and ``mosaic_gpu_group_norm``,
  which stand on ``mosaic_gpu_pipeline`` (TMA, SMEM, barriers);
* ``common``: the segment description, the per-tile math and the
  fixed-order sums of the kernels' partials in XLA; ``config``: the tile
  heuristics.
"""
