"""Cross-checks of a loaded pretrained model against implementations that share no code
with dosa's: a plain-numpy Llama forward and llama.cpp (`python -m experiments.crosscheck`)."""
