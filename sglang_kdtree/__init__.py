"""sglang-kdtree: DDTree speculative decoding for SGLang (``--speculative-algorithm kdtree``).

The DDTree semantics live in ``sglang_kdtree.reference`` (numpy); the GPU kernels in ``sglang_kdtree/kernels/*.cu`` with
their launchers in ``sglang_kdtree.gpu``; SGLang registration in ``sglang_kdtree.plugin``.
"""

__version__ = "0.1.0"
