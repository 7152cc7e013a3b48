"""The DDTree decode round. ``worker.py`` holds SGLang's worker class and composes the round; each step has its
module: ``begin.py`` (the round's values and width), ``draft.py`` (steps 1 and 7, the drafter), ``tree_step.py``
(2-3, top-K and tree), ``verify.py`` (4), ``accept.py`` (5-6, accept and commit) and ``result.py`` (8). What the
steps lean on: ``pipeline.py`` (the CPU or GPU backend), ``verify_input.py`` and ``verify_tiers.py`` (the
target's verify at each width), ``widths.py`` and ``width_choice.py`` (which width), ``faults.py``, ``log.py``,
``seeded.py`` and ``spec_logprobs.py``."""
