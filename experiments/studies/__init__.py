"""One-off studies whose findings are recorded in docs/."""
