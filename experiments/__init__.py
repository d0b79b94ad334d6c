"""Experiments: the main job, benchmarks, training and evaluation."""
