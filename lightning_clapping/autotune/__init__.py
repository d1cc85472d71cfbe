"""Autotune: probe the links, price whole steps with a timing model, choose each boundary's codecs. No Lightning
imports.

One room per job: :mod:`.probe` measures (timed probe messages for each link's delay and bandwidth, and the codecs'
work on the real messages), :mod:`.messages` says what a message costs on the wire under a setting, :mod:`.ladders`
what may be chosen (each boundary's ladder, ending at the user's codec, and what fresh steps send), :mod:`.frontier`
the published quality of settings (package data) and the frontier rule, :mod:`.choose` decides (the step rule played
with :mod:`lightning_clapping.pipeline.timing`, the per-message rule, and what is logged), and :mod:`.tune` runs it
all on every rank (:func:`~.tune.tune_pipeline`, the strategy's one entry point)."""
