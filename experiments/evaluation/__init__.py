"""Evaluation of a trained model on held-out text: perplexity, agreement, recall, probes."""
