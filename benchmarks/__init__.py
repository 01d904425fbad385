"""Reproducible benchmarks, run by `sao bench NAME`; results go to docs/RESULTS.md."""
