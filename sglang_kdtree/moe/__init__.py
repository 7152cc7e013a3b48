"""Routed experts of a compressed-tensors W4A16 MoE (Kimi K2.6: INT4, symmetric, group 32) on SGLang's JIT
Marlin GEMM, with the glue in CuPy kernels (``sglang_kdtree/kernels/moe/``): no ``sgl_kernel`` binary op anywhere on
the path.

* ``weights``: the INT4 format, its quantiser, ``PackedMoEWeights`` / ``MarlinMoEWeights`` and the one-time
  repack into Marlin's layout through SGLang's own functions.
* ``routing``: Marlin's block heights, the block-table layout (``MoEAlignment``) and the route error bit.
* ``reference``: torch twins of every glue kernel and the float twin of the forward.
* ``launch``: the CuPy launchers of the glue kernels.
* ``forward``: ``fused_moe_marlin``, the forward (alignment, two Marlin GEMMs, SiLU-and-mul, top-k sum).
* ``jit``: building, exporting and seeding SGLang's JIT Marlin modules; ``python -m sglang_kdtree.moe``
  (``__main__``) is its command line.

``sglang_kdtree/patches/marlin_moe.py`` routes SGLang's ``CompressedTensorsWNA16MoE.apply_weights`` here under
``SGLANG_KDTREE_MOE=marlin``.
"""
