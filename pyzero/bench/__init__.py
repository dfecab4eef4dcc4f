"""Benchmarks behind the ``pyzero-bench`` command (``python -m pyzero.bench``)."""
