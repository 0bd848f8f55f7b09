"""DeepEP-compatible helper types: ``Config`` and ``EventOverlap``."""
from __future__ import annotations

from typing import Any, Optional, Tuple


class EventOverlap:
    """A handle on work that may still be in flight, as in DeepEP.

    On the CPU data path every call has completed when it returns, so ``current_stream_wait`` has nothing
    to wait for; the type exists so that overlap code written for DeepEP runs unchanged. Usable as a
    context manager (``with event: ...``), which waits on exit.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[Any, ...]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None and hasattr(self.event, "synchronize"):
            self.event.synchronize()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class Config:
    """Performance knobs of a normal-mode call, with DeepEP's constructor signature.

    Args:
        num_sms: vector cores (AIVs) one rank uses; the UBEP token/count split is taken from these.
        num_max_nvl_chunked_send_tokens: tokens written per batch before the flags (TFF granularity).
        num_max_nvl_chunked_recv_tokens: rows of receive capacity per source that the size hints assume.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: accepted for compatibility.
        num_count_aivs: AIVs of the count group (None = the Appendix-9 model).
    """

    def __init__(self, num_sms: int = 24, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 4096, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256, num_count_aivs: Optional[int] = None):
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)
        self.num_count_aivs = num_count_aivs

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_nvl_bytes`` for normal mode with ``hidden_bytes`` per token (x plus scales)."""
        from .buffer import normal_buffer_bytes
        return normal_buffer_bytes(self.num_max_nvl_chunked_recv_tokens, hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Normal mode needs no RDMA buffer on a single host: always 0."""
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens="
                f"{self.num_max_nvl_chunked_send_tokens}, num_max_nvl_chunked_recv_tokens="
                f"{self.num_max_nvl_chunked_recv_tokens})")
