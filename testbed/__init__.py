"""A trained target + DFlash drafter pair for measuring DDTree acceptance.

``python -m testbed.build_pair --out DIR`` builds it: corpus -> tokenizer -> target -> the target's greedy
continuations -> drafter -> ``metadata.json``. ``README.md`` beside this file says what the pair is.
"""
