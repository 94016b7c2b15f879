"""Benchmarks: programs that measure, print a table, and write JSON and PNG plots.

Each compares alternatives in ONE run, as ratios (speculative vs plain, measured vs theory, ours vs
Hugging Face). Nothing here is imported by the services; tests never assert on what it measures.
"""
