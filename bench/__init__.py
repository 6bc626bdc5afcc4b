"""Benchmarks and the one-call GPU check (``bench/gpu_check``); RESULTS.md records what was measured.

A package so that the check's tiers run as ``python -m bench.<module>`` from the repository
root and share ``layers`` (ResNet-18's layer shapes) and ``timing`` (median time per call); the FLOPs and
bytes of each op are in profiler/costs.py, which the profiler uses too.
"""
