"""The benchmarks of sglang-kdtree: a package of the source checkout, not of the installed distribution.

Being a package lets the Kimi round model's modules (``kimi_round``, ``kimi_model``, ``kimi_measure``, the plot
scripts) import each other and lets ``python -m sglang_kdtree bench --kimi-round`` import ``kimi_round``; run
those from the checkout's root as ``python -m benchmarks.<name>``. The other benchmarks still run by path
(``python benchmarks/<name>.py``).
"""
