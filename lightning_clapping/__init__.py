"""lightning-clapping: pipeline-parallel Lightning training with compressed inter-stage messages.

``import lightning_clapping`` registers the strategy name, so ``Trainer(strategy="clapping")`` works afterwards.
"""

from lightning_clapping.bottleneck_fitting import FitBottlenecks
from lightning_clapping.codec_scheduler import CodecScheduler
from lightning_clapping.codecs import Codec, available_codecs, get_codec, register_codec
from lightning_clapping.data import BatchInfo, LazySamplingDataModule, LazySamplingLoader
from lightning_clapping.ft import FaultTolerance
from lightning_clapping.codecs.feedback import VARIANTS
from lightning_clapping.pipeline.bottleneck import Bottleneck, BottleneckAfter, fit_bottlenecks
from lightning_clapping.pipeline.materialize import MaterializeError, building_on_meta, materialize_module
from lightning_clapping.pipeline.partition import Partition, PartitionError, build_partition
from lightning_clapping.pipeline.stage import SplitError
from lightning_clapping.rank_scheduler import RankScheduler
from lightning_clapping.strategy import ClappingStrategy
from lightning_clapping.sync import LAG, DiLoCo

from lightning_clapping import _namespaces

# strategy="clapping" for lightning.pytorch and, when installed, pytorch_lightning (its twin: ._namespaces)
_namespaces.register()

__version__ = "0.1.0"
__all__ = [
    "Bottleneck",
    "BottleneckAfter",
    "VARIANTS",
    "BatchInfo",
    "ClappingStrategy",
    "Codec",
    "CodecScheduler",
    "DiLoCo",
    "FaultTolerance",
    "FitBottlenecks",
    "LAG",
    "LazySamplingDataModule",
    "LazySamplingLoader",
    "MaterializeError",
    "Partition",
    "PartitionError",
    "RankScheduler",
    "SplitError",
    "available_codecs",
    "building_on_meta",
    "build_partition",
    "fit_bottlenecks",
    "get_codec",
    "materialize_module",
    "register_codec",
]
