"""Error-feedback rules: what crosses a boundary in compressed form, and the buffers both ends keep in step.

One :class:`MessageRule` serves one boundary and direction on one side (the sender's ``encode`` and the receiver's
``decode`` are the same class with the same settings). Each tensor of a message is sent in one of four wire forms,
named by the part's codec id (the ids and the byte layout are :mod:`lightning_clapping.comm.wire`'s):

``RAW``    the tensor's own bytes (a bool tensor's one bit per value), no state (uncompressed runs; masks and other
           tensors that carry no gradient)
``FULL``   the tensor's own bytes, and both ends reset their buffer to it (a fresh batch under Clapping-FU, the first
           message of a slot, the first visit of a sample under AQ-SGD)
``CODEC``  a codec payload: of the difference to the buffer (feedback variants: both ends add the decoded
           difference to their buffer and use the buffer) or of the value itself (``direct``; and clapping-fu's
           fresh steps under a ``fresh_codec``, where both ends reset their buffer to the decoded value)
``SKIP``   nothing: both ends keep the buffer (lazy messages)

Both ends apply the *decoded* payload, so their buffers stay bit-identical. The variants (``variant=`` of the
strategy) are:

================  ==================================================  ================================================
variant           forward (activations)                                backward (gradients)
================  ==================================================  ================================================
uncompressed      RAW                                                  RAW
direct            C_f(a)                                               C_b(g)
ef21              C_f(a - A), one buffer per micro-batch slot          C_b(g - G)
clapping-fc       as ef21 (made to work by lazy sampling)              as ef21
clapping-fu       fresh batch: FULL; reused batch: as clapping-fc      fresh: FULL; reused: as clapping-fc
aqsgd             first visit of every sample: FULL; later            C_b(g)
                  C_f(a - m(sample)), one buffer per training sample
================  ==================================================  ================================================

AQ-SGD sends a micro-batch FULL when one of its samples is visited for the first time, else compressed. A sample
counts as visited when it has a buffer row or appears in an earlier micro-batch of the same step (sampling with
replacement repeats ids): the receiver decides every slot's form when the step starts, before the earlier slots'
messages have stored their rows, and this rule gives it the sender's answer. A repeat is compressed against the row
its earlier occurrence left; a sample repeated within one micro-batch keeps the row of its last occurrence.

AQ-SGD's rows live off the accelerator by default (``store_device="cpu"``: a row per training sample outgrows a
GPU's memory long before the host's), and there are at most ``store_max_samples`` of them per tensor of the
message (default :data:`STORE_MAX_SAMPLES`; ``None``: no bound). When a micro-batch's rows take the store past the
bound, the least recently stored rows go first, except those of samples in any micro-batch of the current step
(both ends know them, and a row the receiver counted on when the step began must still be there when its slot's
message is encoded); an evicted sample's next visit is a first visit again, sent FULL. Both ends store and evict
alike, so their stores stay identical. A step with more distinct samples than the bound cannot keep them all and
raises, saying so. The order of the rows is part of :meth:`MessageRule.state`, so a resumed run evicts as an
uninterrupted one.

``ef21`` and ``clapping-fc`` share one rule; the baseline is the rule run without lazy sampling (every batch
fresh).

A separate codec for fresh steps (``fresh_codec``, off by default) applies to the feedback variants (ef21,
clapping-fc, clapping-fu): on a fresh step clapping-fu sends ``fresh_codec(a)`` instead of ``a`` in full precision
(still a reset: both ends set the buffer to the decoded value), and ef21 / clapping-fc compress the difference with
``fresh_codec`` instead of ``codec``; reuse steps keep ``codec``. Such a message is a ``CODEC`` part: the receiver
knows which codec and which rule apply from the fresh flag, which both ends share, and :meth:`MessageRule.mode`
names it ``"fresh"`` so that both ends predict its size. direct and aqsgd have no fresh-step form and ignore it.

The first message of each slot (and any change of shape, e.g. a smaller last batch) is sent FULL when
``warm_start`` is on, since an empty buffer makes the first difference as large as the activation (under
clapping-fu with a fresh codec, step 0 is a fresh step like any other: its reset is sent by the fresh codec).

Lazy messages (off by default) skip a reuse-step message while the last difference sent on that slot was small
relative to the buffer (``lazy_threshold``), at most ``max_skips`` times in a row. The trigger uses only what both
ends already know (the last decoded difference and the buffer), so the receiver knows in advance that nothing will
come and the wire stays predictable; the skipped change is not lost, it is part of the next difference.

Where the code is, and why: one class per variant (:mod:`.rules`: ``UncompressedRule``, ``DirectRule``,
``EF21Rule``, ``ClappingFCRule``, ``ClappingFURule``, ``AQSGDRule``) over a memory both ends keep identical
(:mod:`.rules.memory`: the slot buffers with their lazy trigger, AQ-SGD's rows), in the manner of GRACE's split of a
compressor from its memory. ``MessageRule(variant, ...)`` builds the variant's class from a table keyed by the name
(:func:`~.rules.base.rule_class`), so a new variant is one class and one entry, where a ``kind`` string used to be
tested in every method. Each rule checks what arrives for it (:meth:`MessageRule.check_part`), so the wire
(:mod:`lightning_clapping.comm.wire`) knows the framing only. This module keeps the names the package imports.
"""

from lightning_clapping.codecs.rules import (
    STORE_MAX_SAMPLES, VARIANTS, AQSGDRule, ClappingFCRule, ClappingFURule, DirectRule, EF21Rule, MessageRule,
    RuleStats, StepContext, UncompressedRule, check_variant, register_rule, rule_class,
)

__all__ = [
    "AQSGDRule", "ClappingFCRule", "ClappingFURule", "DirectRule", "EF21Rule", "MessageRule", "RuleStats",
    "STORE_MAX_SAMPLES", "StepContext", "UncompressedRule", "VARIANTS", "check_variant", "register_rule",
    "rule_class",
]
