"""ubep_torch: UBEP expert-parallel dispatch/combine for PyTorch over a simulated unified global address
space, with DeepEP's ``Buffer`` API.

Where things live: ``ugas`` (shared-memory heap and peer views), ``protocol`` (DataBlocks, flags, epochs,
slot layout), ``engine`` (the torch data path), ``buffer`` (the public ``Buffer``), ``kernels`` (Triton).
"""
from . import functional, nn
from .buffer import Buffer, DispatchHandle, LowLatencyHandle
from .errors import (
                     UBEPBrokenError,
                     UBEPError,
                     UBEPPeerAbortedError,
                     UBEPPeerLostError,
                     UBEPTimeoutError,
                     UBEPUsageError,
)
from .utils import Config, EventOverlap

__version__ = "0.1.0"

__all__ = [
    "Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle",
    "UBEPError", "UBEPTimeoutError", "UBEPPeerLostError", "UBEPPeerAbortedError", "UBEPBrokenError", "UBEPUsageError",
    "functional", "nn",
]
