"""Lazy sampling's Lightning-free engine: reuse a mini-batch for a random window, alike on every stage, resumable."""
