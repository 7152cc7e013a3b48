"""CUDA sources of sglang_kdtree's kernels (installed as ``sglang_kdtree.kernels``); one ``.cu`` per kernel."""
