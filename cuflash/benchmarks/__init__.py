"""Benchmarks: `python3 -m cuflash.benchmarks --help`."""
