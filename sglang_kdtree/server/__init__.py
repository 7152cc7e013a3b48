"""KDTREE as SGLang's server sees it around the round: the server-argument checks and capability flags
(``spec.py``), the startup rehearsal (``prewarm.py``) and the opt-in diagnostics of the scheduler loop
(``host_times.py``, ``sync_debug.py``)."""
