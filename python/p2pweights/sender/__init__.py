"""The sender side: ``WeightSender`` (connect / update / push / finish / report), the slot pipeline
(stage → transform → fill a slot → write; update.py, transforms.py, fillers.py, pipeline.py) and
the native writer's binding."""
from __future__ import annotations

from .buffers import TransferBuffers, slot_size
from .fillers import GpuSlotFiller, HostSlotFiller, SlotFiller, StagedHostSlotFiller
from .pipeline import SlotPipeline
from .report import EngineRankReport, UpdateReport
from .transforms import GroupLoad, GroupTransform
from .update import Update
from .weight_sender import WeightSender
from .writer import PipelinedWriter, WriteReport

__all__ = ["EngineRankReport", "GpuSlotFiller", "GroupLoad", "GroupTransform", "HostSlotFiller", "PipelinedWriter",
           "SlotFiller", "SlotPipeline", "StagedHostSlotFiller", "TransferBuffers", "Update", "UpdateReport",
           "WeightSender", "WriteReport", "slot_size"]
