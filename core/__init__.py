"""Records, config, ports and pure tree math of the speculative cycle."""

from .config import SamplingParams, SpecConfig
from .ports import (
    BlockDraft,
    DraftModel,
    ForwardBatch,
    KVPool,
    KVPoolExhausted,
    LookupDraft,
    ModelOutput,
    Ports,
    RecurrentStatePool,
    TargetModel,
)
from .records import (
    Accepted,
    Admitted,
    Compacted,
    Drafted,
    DraftTree,
    ExtendRows,
    Ready,
    Request,
    RowOutputs,
    Verified,
)

__all__ = [
    "SpecConfig",
    "SamplingParams",
    "ForwardBatch",
    "ModelOutput",
    "TargetModel",
    "DraftModel",
    "LookupDraft",
    "BlockDraft",
    "KVPool",
    "KVPoolExhausted",
    "RecurrentStatePool",
    "Ports",
    "Admitted",
    "Compacted",
    "Ready",
    "Drafted",
    "Verified",
    "Accepted",
    "DraftTree",
    "ExtendRows",
    "Request",
    "RowOutputs",
]
