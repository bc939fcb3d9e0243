"""Pallas kernels of the primitives: Triton and Mosaic GPU on GPUs, Mosaic on TPU, interpreted on CPU.

The modules in layers, each importing only those below it:

* ``layer_norm``, ``group_norm``: the lowering functions registered with the
  primitives, and the problem each hands the kernels (which
  ``jax_normgrad._dispatch`` reads to choose a backend);
* ``kernels``: the forward and backward that hand a problem (``problem``)
  to the kernels of the chosen backend; ``gpu_target``: the GPU a lowering
  targets, and whether Pallas Triton and Mosaic GPU run on it;
  ``triton_warning``: jax's Pallas Triton deprecation warning, ignored
  around the package's GPU lowerings;
* ``gpu`` (Triton), ``mosaic_gpu`` (Mosaic GPU, sm_90+) and ``tpu``: the
  kernels, written once for every op over the segment view of ``common``;
  imported on first lowering only. ``mosaic_gpu`` routes to
  ``mosaic_gpu_rows``, ``mosaic_gpu_pieces`` and ``mosaic_gpu_group_norm``,
  which stand on ``mosaic_gpu_pipeline`` (TMA, SMEM, barriers);
* ``common``: the segment description, the per-tile math and the
  fixed-order sums of the kernels' partials in XLA; ``config``: the tile
  plans, over ``backend_config`` (one frozen configuration per backend),
  ``device`` (the device's figures) and ``overrides`` (how a caller changes
  either for what it traces).
"""
