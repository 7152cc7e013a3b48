"""CUDA sources of the MoE glue kernels (installed as ``sglang_kdtree.kernels.moe``): alignment to Marlin blocks,
SiLU-and-mul and the top-k sum; launched by ``sglang_kdtree.moe.launch``."""
