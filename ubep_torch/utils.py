"""DeepEP-compatible helper types: ``Config`` and ``EventOverlap``, and argument checks."""
from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import re
import sys
from typing import Any, Optional, Tuple

import numpy as np
import torch


def check_host(what: str, t) -> None:
    """``t``, when a tensor, lives in host memory, where the UGAS and the C loops read it by address; else a
    ValueError naming ``what`` (the call and the argument)."""
    if isinstance(t, torch.Tensor) and not t.is_cpu:
        raise ValueError(f"ubep_torch: {what} is a {t.device.type} tensor; the shared-memory UGAS moves host "
                         f"memory, so pass CPU tensors")


def check_flag(name: str, value) -> None:
    """``value`` is a bool (or a numpy bool or an int, as DeepEP's binding converts flags): a string or None would
    be taken as True or False by its truth value; TypeError naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_, numbers.Integral)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_real(name: str, value, minimum: Optional[float] = None, positive: bool = False) -> float:
    """``value`` as a float: a real number (a Python or numpy one, not a bool), finite, at least ``minimum``
    (above 0 with ``positive``); TypeError or ValueError naming ``name`` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}"[:200])
    floor = 0 if positive else minimum
    if floor is not None and value < floor:     # (before the conversion: a huge negative int gets this message)
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} {floor:g}, got {value!r}"[:200])
    try:
        v = float(value)
    except OverflowError:       # (an int or fraction past any float)
        raise ValueError(f"{name} must be finite, got a number past any float") from None
    if not math.isfinite(v) or (positive and v == 0):
        bound = " > 0" if positive else f" >= {floor:g}" if floor is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


def out_of_memory(e: BaseException) -> Optional[str]:
    """What failed, in a line, where ``e`` is a failed allocation (MemoryError, or torch's error for one, also
    as a rank's traceback in a ``RankPool`` error); else None."""
    if isinstance(e, MemoryError):
        return f"MemoryError {str(e)[:100]}".strip()
    text = str(e)
    if isinstance(e, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text):
        m = re.search(r"tried to allocate (\d+) bytes", text)
        return f"an allocation of {m.group(1)} bytes failed" if m else "an allocation failed"
    # (sizes whose product, or which alone, pass what torch's size arithmetic holds)
    if isinstance(e, (RuntimeError, TypeError)) and ("Storage size calculation overflowed" in text
                                                     or "Overflow when unpacking long" in text):
        return "a tensor size overflowed"
    if isinstance(e, ValueError) and "more than this machine's memory" in text:    # (a check before allocating)
        return " ".join(text.split())
    return None


@contextlib.contextmanager
def memory_errors_as_usage_errors(script: str):
    """Inside it, a failed allocation (sizes past the machine's memory) ends the script with one line
    naming it instead of the allocator's traceback."""
    try:
        yield
    except (MemoryError, RuntimeError, TypeError, ValueError) as e:
        what = out_of_memory(e)
        if what is None:
            raise
        raise SystemExit(f"{script}: {what}: the sizes given need more memory than this machine has "
                         f"({physical_memory()} bytes); use smaller ones") from None


def physical_memory() -> int:
    """Bytes of this machine's memory (no limit where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def share_memory(a: torch.Tensor, b: torch.Tensor, elementwise: bool = False) -> bool:
    """Whether two tensors share a byte of memory, compared by address (two storages can map the same
    memory: numpy views turned into tensors). By default a conservative test, their byte spans from first to
    last element; with ``elementwise`` (1-d tensors of a few hundred elements), byte by byte, so interleaved
    columns of one table do not count."""
    if not a.numel() or not b.numel():
        return False

    def span(t):
        last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    if not (a0 < b1 and b0 < a1) or not elementwise:
        return a0 < b1 and b0 < a1

    def element_bytes(t):
        return {t.data_ptr() + i * t.stride(0) * t.element_size() + j
                for i in range(t.numel()) for j in range(t.element_size())}
    return not element_bytes(a).isdisjoint(element_bytes(b))


def env_flag(name: str, default: bool) -> bool:
    """Environment variable ``name`` as a switch: 1/true/yes/on or 0/false/no/off (any case), ``default``
    when unset or empty; ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {os.environ[name]!r}")


def check_count(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int (a Python or numpy integer, or a one-element integer tensor) of at least
    ``minimum``; TypeError or ValueError naming ``name`` otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {v}")
    return v


def require_torchrun(script: str, instead: str = "") -> None:
    """Exit with a one-line message when this process was not started by torchrun (no ``RANK`` and
    ``WORLD_SIZE`` in the environment), where ``init_process_group("gloo")`` would fail with a bare
    rendezvous error. ``instead`` names a way to run the script without it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        hint = f", or {instead}" if instead else ""
        raise SystemExit(f"{script}: start it with torchrun, e.g. torchrun --standalone --nproc-per-node 2 "
                         f"{script}{hint}")


def int_at_least(minimum: int, maximum: Optional[int] = None):
    """An ``argparse`` type: an integer of at least ``minimum`` (and at most ``maximum``; a one-line usage
    error otherwise)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        shown = text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {shown}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {shown}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_number(text: str, zero: bool = False) -> float:
    """An ``argparse`` type: a finite number > 0 (a one-line usage error otherwise); with ``zero``, >= 0
    (see :func:`non_negative_number`)."""
    import argparse
    import math
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if zero else '>'} 0, got {text}")
    return value


def deadline_seconds(text: str) -> float:
    """An ``argparse`` type: a deadline in seconds, > 0 and at most ``protocol.MAX_TIMEOUT_S`` (about 116
    days: a timedelta or a clock past it overflows)."""
    import argparse

    from .protocol import MAX_TIMEOUT_S
    value = positive_number(text)
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:g} seconds, got {text}")
    return value


def non_negative_number(text: str) -> float:
    """An ``argparse`` type: a finite number >= 0 (a learning rate)."""
    return positive_number(text, zero=True)


class EventHandle:
    """DeepEP's handle on a recorded device event, here with nothing to record: every call has completed when
    it returns. It exists so that DeepEP code such as ``EventOverlap(EventHandle())`` (how some frameworks
    make the ``previous_event`` of their first call) runs unchanged."""

    def current_stream_wait(self) -> None:
        """Wait for the event (nothing to wait for)."""


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
        """Wait for the work behind the event (none on the CPU data path: calls have completed): the event's
        own ``current_stream_wait`` (an ``EventHandle``), or its ``synchronize`` (a ``torch`` event)."""
        wait = getattr(self.event, "current_stream_wait", None) or getattr(self.event, "synchronize", None)
        if wait is not None:
            wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class Config:
    """Performance knobs of a normal-mode call, with DeepEP's constructor signature.

    Args:
        num_sms, num_max_nvl_chunked_send_tokens: DeepEP's SM count and send chunk, checked and kept for
            code that reads them back; no call uses them (there are no SMs here, a call's rows are written in
            whole exchanges, and the Triton engine's AIVs come from ``UBEP_TRITON_AIVS``).
        num_max_nvl_chunked_recv_tokens: rows of receive capacity per source that the size hints assume.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: accepted for compatibility.
        num_count_aivs: AIVs of the count group (None = the Appendix-9 model): the one knob a call reads.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 4096, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256, num_count_aivs: Optional[int] = None):
        self.num_sms = check_count("num_sms", num_sms, 1)
        self.num_max_nvl_chunked_send_tokens = check_count("num_max_nvl_chunked_send_tokens",
                                                           num_max_nvl_chunked_send_tokens, 1)
        self.num_max_nvl_chunked_recv_tokens = check_count("num_max_nvl_chunked_recv_tokens",
                                                           num_max_nvl_chunked_recv_tokens, 1)
        self.num_max_rdma_chunked_send_tokens = check_count("num_max_rdma_chunked_send_tokens",
                                                            num_max_rdma_chunked_send_tokens, 1)
        self.num_max_rdma_chunked_recv_tokens = check_count("num_max_rdma_chunked_recv_tokens",
                                                            num_max_rdma_chunked_recv_tokens, 1)
        self.num_count_aivs = None if num_count_aivs is None else check_count("num_count_aivs", num_count_aivs, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_nvl_bytes`` for normal mode with ``hidden_bytes`` per token (x plus scales)."""
        from .buffer import normal_buffer_bytes
        return normal_buffer_bytes(self.num_max_nvl_chunked_recv_tokens, hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Normal mode needs no RDMA buffer on a single host: always 0."""
        return 0

    def __repr__(self) -> str:
        # (every constructor argument: evaluating the repr rebuilds a Config with the same arguments)
        names = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens", "num_count_aivs")
        return "Config(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


def version_of(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter, or None for an inference tensor (those have none): caches keyed by
    versions must then treat the tensor as changed."""
    return None if t.is_inference() else t._version


class TensorCache:
    """Reuses output tensors that their users have dropped.

    A fresh multi-MB tensor is faulted in page by page on first touch, which costs several times the copy
    that fills it. The cache keeps the flat tensors it handed out; one is reused only when nothing outside
    the cache refers to it any more: no Python reference to the tensor object and no other tensor (view,
    detach, numpy array) on its storage. That is exact under CPython reference counting, so a result the
    caller still holds is never overwritten, and any number of results can be alive at once. (A Python
    ``untyped_storage()`` object or a raw ``data_ptr()`` alone does not count as a reference.) A result
    sent to another process is not reused at all: torch moves its memory to shared memory to send it, and
    the other process's hold on it shows in no count here.

    Tensors of fewer than ``min_bytes`` bytes are plain ``torch.empty`` ones: the allocator serves them from
    memory it keeps mapped, so there is nothing to gain, and the checks cost more than the allocation. (On
    two ranks, round trips whose largest output takes 64 KiB to 1 MiB took 8-10% longer through the cache;
    low-latency ones whose recv_x takes 3.7 MiB or 29 MiB took 17% longer and twice as long without it.)
    """

    def __init__(self, max_entries: int = 6, min_bytes: int = 1 << 20):
        self.max_entries = max_entries
        self.min_bytes = min_bytes
        self._entries: dict = {}   # dtype -> list of flat tensors
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        probe = [torch.empty(1)]
        self._base_refs = self._refs(probe, 0)          # the list entry alone, as this interpreter counts it
        self._base_uses = self._uses(probe, 0)          # the tensor alone on its storage

    @staticmethod
    def _refs(pool: list, i: int) -> int:
        return sys.getrefcount(pool[i])

    def _uses(self, pool: list, i: int) -> int:
        return self._use_count(pool[i].untyped_storage()._cdata)

    @staticmethod
    def _shared(pool: list, i: int) -> bool:
        """The entry's memory was moved to shared memory, as torch does to a tensor it sends to another process
        (``torch.multiprocessing``, or a ``RankPool`` rank's result): that process may hold it, and no count
        in this one says so. Such an entry is never handed out again (only dropped to make room)."""
        return pool[i].untyped_storage().is_shared()

    def _free(self, pool: list, i: int) -> bool:
        return self._refs(pool, i) <= self._base_refs and self._uses(pool, i) <= self._base_uses

    def empty(self, shape, dtype: "torch.dtype") -> "torch.Tensor":
        shape = tuple(map(int, shape))
        if len(shape) == 2:
            n, strides = shape[0] * shape[1], [shape[1], 1]
        else:
            n, strides = 1, []
            for d in reversed(shape):
                strides.insert(0, n)
                n *= d
        if n == 0 or self._use_count is None or n * dtype.itemsize < self.min_bytes:
            return torch.empty(*shape, dtype=dtype)
        pool = self._entries.get(dtype)
        if pool is None:
            pool = self._entries[dtype] = []            # kept in ascending size: the first free fit is the best
        for i in range(len(pool)):
            if pool[i].numel() >= n and self._free(pool, i) and not self._shared(pool, i):
                return self._on(pool[i], shape, strides)
        if len(pool) >= self.max_entries:
            victims = [i for i in range(len(pool)) if self._free(pool, i)]
            if not victims:
                return torch.empty(*shape, dtype=dtype)
            pool.pop(victims[0])                        # the smallest free one
        with torch.inference_mode(False):   # reused in any mode later: a plain tensor
            fresh = torch.empty(n + n // 4, dtype=dtype)
        i = 0
        while i < len(pool) and pool[i].numel() <= fresh.numel():
            i += 1
        pool.insert(i, fresh)
        return self._on(fresh, shape, strides)

    @staticmethod
    def _on(flat: "torch.Tensor", shape: tuple, strides: list) -> "torch.Tensor":
        """A tensor of ``shape`` at the start of ``flat``'s storage that is not a view of it: it shares the
        memory, but autograd treats it as a tensor of its own, so results returned from a custom
        ``autograd.Function`` (``ubep_torch.functional``) can be modified in place like any other."""
        return torch.empty(0, dtype=flat.dtype).set_(flat.untyped_storage(), 0, shape, strides)

    def zeros(self, shape, dtype: "torch.dtype") -> "torch.Tensor":
        return self.empty(shape, dtype).zero_()
