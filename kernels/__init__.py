"""CUDA sources of sglang_kdtree's kernels (installed as ``sglang_kdtree._kernels``); one ``.cu`` per kernel."""
