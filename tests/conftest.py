"""Shared by tests/py and tests/e2e: one parse of each GGUF file per test session.

The `gguf` package's reader decodes every metadata array element by element in Python: Gemma 3's
262k-entry vocabulary takes 15-35 s per parse, SmolLM2's 5-10 s, and the oracles (numpy
forwards, tokenizers) each open the file themselves. Readers are read-only views of a
memory-mapped file, so one per (path, mode) serves them all. The oracles' code is unchanged; run
on their own (tests/reference/*.py) they parse as before.
"""
from __future__ import annotations

import os

try:
    import gguf
except ImportError:  # the e2e tests that need no oracle run without the package
    gguf = None

if gguf is not None and not getattr(gguf.GGUFReader, "_kv_session_cache", False):
    _Reader = gguf.GGUFReader

    class _SessionReader(_Reader):
        """gguf.GGUFReader that hands out one instance per file (still an instance of the class)."""

        _kv_session_cache = True
        _readers: dict = {}

        def __new__(cls, path, mode="r"):
            key = (os.path.realpath(os.fspath(path)), mode)
            st = os.stat(key[0])
            cached = cls._readers.get(key)
            if cached is not None and cached[0] == (st.st_mtime_ns, st.st_size):
                return cached[1]
            r = super().__new__(cls)
            _Reader.__init__(r, path, mode)
            cls._readers[key] = ((st.st_mtime_ns, st.st_size), r)
            return r

        def __init__(self, path, mode="r"):  # done in __new__
            pass

    gguf.GGUFReader = _SessionReader
    try:  # transformers' GGUF loader took its own reference at import
        import gguf.gguf_reader as _gr
        _gr.GGUFReader = _SessionReader
    except ImportError:
        pass
