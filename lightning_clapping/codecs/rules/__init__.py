"""The message rules, one class per variant, and their memory; :mod:`lightning_clapping.codecs.feedback` documents
the variants and is where the rest of the package imports them from.

:mod:`.context` (the step both ends know, the stats), :mod:`.memory` (the buffers and AQ-SGD's rows), :mod:`.base`
(:class:`MessageRule` and the factory keyed by the variant's name), then one module per family: :mod:`.simple`
(uncompressed, direct), :mod:`.ef21` (EF21, Clapping-FC, Clapping-FU) and :mod:`.aqsgd`. Importing this package
registers every variant, so ``MessageRule(variant, ...)`` finds each one's class.
"""

from lightning_clapping.codecs.rules.aqsgd import AQSGDRule
from lightning_clapping.codecs.rules.base import STORE_MAX_SAMPLES, MessageRule, register_rule, rule_class
from lightning_clapping.codecs.rules.context import VARIANTS, RuleStats, StepContext, check_variant
from lightning_clapping.codecs.rules.ef21 import ClappingFCRule, ClappingFURule, EF21Rule
from lightning_clapping.codecs.rules.memory import SampleRows, SlotBuffers
from lightning_clapping.codecs.rules.simple import DirectRule, UncompressedRule

__all__ = [
    "AQSGDRule", "ClappingFCRule", "ClappingFURule", "DirectRule", "EF21Rule", "MessageRule", "RuleStats",
    "STORE_MAX_SAMPLES", "SampleRows", "SlotBuffers", "StepContext", "UncompressedRule", "VARIANTS",
    "check_variant", "register_rule", "rule_class",
]
