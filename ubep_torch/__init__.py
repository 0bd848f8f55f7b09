"""ubep_torch: UBEP expert-parallel dispatch/combine for PyTorch over a simulated unified global address
space, with DeepEP's ``Buffer`` API.

Where things live: ``ugas`` (shared-memory heap and peer views), ``protocol`` (DataBlocks, flags, epochs,
slot layout), ``engine`` (the torch data path), ``buffer`` (the public ``Buffer``), ``kernels`` (Triton),
``fp8`` (the fp8 row format dispatch takes and returns, and DeepEP's ``calc_diff``).
"""
import torch

from . import functional, nn
from .buffer import Buffer, DispatchHandle, LowLatencyHandle
from .errors import (
                     CancelledCallError,
                     UBEPBrokenError,
                     UBEPError,
                     UBEPKernelWaitError,
                     UBEPMismatchError,
                     UBEPPeerAbortedError,
                     UBEPPeerLostError,
                     UBEPTimeoutError,
                     UBEPUsageError,
)
from .fp8 import calc_diff, per_token_cast_back, per_token_cast_to_fp8
from .utils import Config, EventHandle, EventOverlap

__version__ = "0.1.0"

#: the dtype of ``topk_idx`` (DeepEP's ``deep_ep.topk_idx_t``: its tests and frameworks cast routings to it)
topk_idx_t = torch.int64

__all__ = [
    "Buffer", "Config", "EventHandle", "EventOverlap", "DispatchHandle", "LowLatencyHandle",
    "UBEPError", "UBEPTimeoutError", "UBEPPeerLostError", "UBEPPeerAbortedError", "UBEPBrokenError", "UBEPUsageError",
    "UBEPKernelWaitError", "UBEPMismatchError", "CancelledCallError",
    "functional", "nn", "per_token_cast_to_fp8", "per_token_cast_back", "calc_diff", "topk_idx_t",
]
