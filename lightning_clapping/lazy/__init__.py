"""Lazy sampling: reuse a mini-batch for a random window, identically on every stage, resumable exactly. No
Lightning imports."""
