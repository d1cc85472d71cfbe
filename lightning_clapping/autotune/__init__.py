"""Autotune: probe the links, price whole steps with a timing model, choose each boundary's codecs. No Lightning
imports."""
