"""Benchmarks: each prints a table and writes JSON. Run one as `python benchmarks/NAME.py` or
`python -m benchmarks.NAME` (anyrec installed); tests import them as `benchmarks.NAME`."""
