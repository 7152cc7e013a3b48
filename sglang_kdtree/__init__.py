"""sglang-kdtree: DDTree speculative decoding for SGLang (``--speculative-algorithm kdtree``).

The DDTree semantics live in ``sglang_kdtree.reference`` (numpy); the GPU kernels in ``sglang_kdtree/kernels/*.cu`` with
their launchers in ``sglang_kdtree.gpu``; SGLang registration in ``sglang_kdtree.plugin``.

Names: DDTree is the published algorithm (a draft tree from a block drafter's per-depth distributions, verified
in one target forward); ``kdtree`` is this plugin's name and the value of ``--speculative-algorithm``; ``KDTREE``
is how SGLang's ``SpeculativeAlgorithm`` enum (and our log lines) show it. Sizes: the node ``budget`` B, the
verify ``width`` B + 1 (rows verified, the root included) and ``K``, the top-K taken per draft depth.
"""

__version__ = "0.1.0"
