"""The main job's study: TTFT of flat vs hierarchical selection, side by side (experiments.run)."""
