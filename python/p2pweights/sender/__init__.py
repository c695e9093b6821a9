"""The sender side: ``WeightSender`` (connect / update / push / finish / report), the slot pipeline
that stages HF tensors, transforms them and fills transfer slots, and the native writer's binding."""
from __future__ import annotations

from .buffers import TransferBuffers, slot_size
from .weight_sender import EngineRankReport, Update, UpdateReport, WeightSender, stage_hf_names
from .writer import PipelinedWriter, WriteReport

__all__ = ["EngineRankReport", "PipelinedWriter", "TransferBuffers", "Update", "UpdateReport", "WeightSender",
           "WriteReport", "slot_size", "stage_hf_names"]
