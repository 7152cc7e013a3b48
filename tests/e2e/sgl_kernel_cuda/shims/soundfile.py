"""Import stand-in for ``soundfile`` (test-only, CUDA servers on the H200).

What it replaces and why: SGLang's OpenAI audio routes (``sglang/srt/entrypoints/openai/audio_chunking.py``,
``streaming_asr.py``, ``realtime/session.py``) ``import soundfile`` at module level, so the HTTP server
does not start without it; the test machine has neither the package nor libsndfile, and the tests send
no audio. Any use raises, by name. ``sitecustomize.py`` registers it only when the real package is
missing.
"""


def available_formats() -> dict:
    """No audio formats: there is no libsndfile behind this stand-in (``mistral_common``'s audio module
    builds an enum from this at import time)."""
    return {}


def available_subtypes(format=None) -> dict:
    """No subtypes either, for the same reason."""
    return {}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(
        f"soundfile.{name}: soundfile is not installed; this is the sglang-kdtree test stand-in "
        "(tests/e2e/sgl_kernel_cuda/shims), enough for SGLang's audio routes to import, not to decode audio"
    )
