"""Benchmarks: speed ratios measured side by side in one run."""
