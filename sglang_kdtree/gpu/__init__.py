"""CuPy launchers of the CUDA kernels in ``kernels/``; each has the signature of its twin in
``sglang_kdtree.reference`` but takes and returns torch CUDA tensors (zero-copy through DLPack)."""
