"""Training: the YAML-configured trainer, its typed config, losses and train steps."""
