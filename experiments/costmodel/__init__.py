"""The cost model of a prefill: `python -m experiments.costmodel` (see cli.py)."""
