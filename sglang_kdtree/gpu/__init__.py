"""CuPy launchers of the CUDA kernels in ``sglang_kdtree/kernels/``; each has the signature of its twin in
``sglang_kdtree.reference`` but takes and returns torch CUDA tensors (zero-copy through DLPack)."""
