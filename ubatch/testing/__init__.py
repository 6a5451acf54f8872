"""Test and example tooling: the stream-order sanitizer and ranks run as threads of one process.

Nothing in the product (``ubatch``, ``cudagraph``, ``runner``) imports this package; tests, benchmarks and
examples do. ``tests/test_imports.py`` checks both.
"""
