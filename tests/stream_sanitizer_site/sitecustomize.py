"""Turns the stream-order sanitizer on at start-up in the child processes of a ``pytest --stream-sanitizer`` run.

``tests/stream_sanitizer_plugin.py`` puts this folder first on ``PYTHONPATH`` and sets
``UBATCH_STREAM_SANITIZER=1``, so launched ranks and CLI runs are sanitised as the test process is. Python
imports ``sitecustomize`` at start-up by itself; ``import ubatch`` installs nothing.
"""
import os

if os.environ.get("UBATCH_STREAM_SANITIZER", "0") not in ("", "0"):
    from ubatch.testing import stream_sanitizer

    stream_sanitizer.enable()
