"""Benchmarks behind ``kvrouter bench`` and ``make bench``: seeded, parameterised, JSON out."""
