"""The tools a user runs: ``python -m sglang_kdtree doctor`` (``doctor*.py``: what can break a deployment) and
``python -m sglang_kdtree bench`` (``bench*.py``: the tree machinery timed in isolation). Nothing in the serving
path imports them."""
