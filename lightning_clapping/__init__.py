"""lightning-clapping: pipeline-parallel Lightning training with compressed inter-stage messages.

``import lightning_clapping`` registers the strategy name, so ``Trainer(strategy="clapping")`` works afterwards.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_clapping.partition import Partition, PartitionError, build_partition
from lightning_clapping.stage import SplitError
from lightning_clapping.strategy import ClappingStrategy

if "clapping" not in StrategyRegistry:
    ClappingStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["ClappingStrategy", "Partition", "PartitionError", "SplitError", "build_partition"]
