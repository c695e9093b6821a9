"""p2pweights: one-sided RDMA weight updates from RL trainer ranks into running rollout engines."""
from __future__ import annotations

from . import _native
from .errors import (
    Busy,
    Closed,
    EngineError,
    EnginesFailed,
    EngineUnreachable,
    InvalidRequest,
    InvalidWrite,
    LayoutMismatch,
    LayoutSpecError,
    MissingTensors,
    NotFound,
    OutOfRegion,
    P2PWeightsError,
    PlanError,
    RemoteDisconnected,
    TransferTimeout,
    TransportError,
    Unauthorized,
    UnknownModel,
    UnknownParameter,
    UnsupportedLayout,
    UpdateFailed,
    WrongTransport,
)
from .sender.buffers import TransferBuffers
from .sender.weight_sender import WeightSender
from .sender.writer import PipelinedWriter, WriteReport
from .settings import SettingError, Settings

__version__ = _native.__version__

__all__ = [
    "Busy",
    "Closed",
    "EngineError",
    "EngineUnreachable",
    "EnginesFailed",
    "InvalidRequest",
    "InvalidWrite",
    "LayoutMismatch",
    "LayoutSpecError",
    "MissingTensors",
    "NotFound",
    "OutOfRegion",
    "P2PWeightsError",
    "PlanError",
    "PipelinedWriter",
    "RemoteDisconnected",
    "SettingError",
    "Settings",
    "TransferBuffers",
    "TransferTimeout",
    "TransportError",
    "Unauthorized",
    "UnknownModel",
    "UnknownParameter",
    "UnsupportedLayout",
    "UpdateFailed",
    "WeightSender",
    "WriteReport",
    "WrongTransport",
]
