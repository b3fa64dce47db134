"""Rollout and training engines behind one interface (``base``): simulated now, real ones alongside."""
