"""Errors raised by ubep_torch. They name the phase, this rank and the ranks that did not deliver."""
from __future__ import annotations

import re
from typing import Sequence


class UBEPError(RuntimeError):
    """Base class of ubep_torch runtime errors (bad input raises ValueError/TypeError instead)."""


class UBEPMismatchError(UBEPError):
    """The ranks' calls differ: another operation, or the same one with arguments or rows of another layout
    (``num_experts``, hidden size, dtypes, top-k, sync mode, the handle of another dispatch). Breaks the Buffer
    on every rank; a peer that fails on it tells the others, whose ``UBEPPeerAbortedError`` says so
    (``mismatch``)."""


class UBEPTimeoutError(UBEPError, TimeoutError):
    """A poll passed its deadline. ``phase``, ``rank`` and ``missing_ranks`` say where and who."""

    def __init__(self, phase: str, rank: int, missing_ranks: Sequence[int], timeout_s: float,
                 consequence: str = "This Buffer is now unusable: destroy it and create a new one."):
        self.phase = phase
        self.rank = rank
        self.missing_ranks = list(missing_ranks)
        self.timeout_s = timeout_s
        super().__init__(
            f"ubep_torch: rank {rank} timed out after {timeout_s:.3g}s in phase '{phase}' waiting for "
            f"rank(s) {self.missing_ranks}; they did not deliver (stalled, crashed, or called a different "
            f"operation). Raise timeout_s or UBEP_TIMEOUT_S if they are only slow. {consequence}"
        )


class UBEPKernelWaitError(UBEPTimeoutError):
    """A bounded wait inside a kernel (the Triton engine's ``max_spins`` polls) ended before what it waited for
    had arrived. The Buffer's own waits run first with their deadline, so this means the data it had seen
    arrive was not all there, or the engine was given too few polls. ``timeout_s`` is None; ``polls`` says
    how many."""

    def __init__(self, phase: str, rank: int, missing_ranks: Sequence[int], polls: int,
                 consequence: str = "This Buffer is now unusable: destroy it and create a new one."):
        super().__init__(phase, rank, missing_ranks, 0.0, consequence)
        self.timeout_s, self.polls = None, polls
        who = f"rank {rank}" if rank >= 0 else "this rank"
        self.args = (f"ubep_torch: {who} in phase '{phase}': a wait inside the kernel gave up after {polls} polls "
                     f"(the engine's max_spins) waiting for rank(s) {self.missing_ranks}. {consequence}",)


class UBEPPeerLostError(UBEPError):
    """A peer's process exited (or the peer destroyed its Buffer) while this rank was waiting for it."""

    def __init__(self, phase: str, rank: int, missing_ranks: Sequence[int], dead_ranks: Sequence[int],
                 consequence: str = "This Buffer is now unusable.", cause: str = "exited"):
        self.phase = phase
        self.rank = rank
        self.missing_ranks = list(missing_ranks)
        self.dead_ranks = list(dead_ranks)
        self.cause = cause
        super().__init__(
            f"ubep_torch: rank {rank} in phase '{phase}': peer rank(s) {self.dead_ranks} {cause} while "
            f"rank(s) {self.missing_ranks} had not delivered. {consequence}"
        )


class UBEPPeerAbortedError(UBEPError):
    """A peer failed in a collective call (or gave up waiting in it) and told the group so, instead of going
    silent. ``when`` says which call: ``"this call"``, or another one by its number (an earlier call; or, seen
    from a recv hook, a later one). A rank too slow for its peers' deadline may still find all its data there;
    it learns of the abort when its part is done, at its next call or in a wait of that call. ``refused``: the
    peers left this call with an error before reaching the others (bad input on those ranks only, above all:
    they raised ValueError or TypeError). ``mismatch``: the peers found that the ranks' calls differ
    (``UBEPMismatchError`` on those ranks). ``cancelled``: that call is cancelled on every rank and this Buffer
    stays usable (every rank goes on with its next call)."""

    def __init__(self, phase: str, rank: int, missing_ranks: Sequence[int], aborted_ranks: Sequence[int],
                 when: str = "this call", refused: bool = False, mismatch: bool = False):
        self.phase = phase
        self.rank = rank
        self.missing_ranks = list(missing_ranks)
        self.aborted_ranks = list(aborted_ranks)
        self.when = when
        self.refused = refused
        self.mismatch = mismatch and not refused
        self._failed = "found that the ranks' calls differ in" if self.mismatch else "failed or gave up in"
        missing = f"; rank(s) {self.missing_ranks} had not delivered" if self.missing_ranks else ""
        what = (f"refused {when} (an error before they reached the others, as for invalid input: see their "
                f"error)" if refused else
                f"{self._failed} {when} and aborted it (see their error" +
                (": another operation, or other arguments, than this rank's)" if self.mismatch else ")"))
        self.cancelled = False
        super().__init__(
            f"ubep_torch: rank {rank} in phase '{phase}': peer rank(s) {self.aborted_ranks} {what}{missing}. "
            f"This Buffer is now unusable."
        )

    def name_call(self, when: str) -> None:
        """Name the call the aborted ranks left (``when``, as in the constructor) in place of "this call"."""
        if when != self.when and not self.refused:
            self.args = (self.args[0].replace(f"{self._failed} {self.when} and", f"{self._failed} {when} and", 1),)
            self.when = when

    def cancel(self) -> None:
        """The refused call was cancelled on every rank, and this rank's Buffer stays usable."""
        self.cancelled = True
        self.args = (self.args[0].replace("This Buffer is now unusable.", "The call is cancelled on every rank "
                                          "and this Buffer stays usable: every rank goes on with its next call."),)


class UBEPBrokenError(UBEPError):
    """The Buffer saw a timeout or a lost peer earlier and refuses further communication."""


class UBEPUsageError(UBEPError, RuntimeError):
    """A call this thread or process may not make on the Buffer now (another thread is inside a call, or the
    process is not the one that built it), refused before anything was touched: the Buffer and its peers
    are as they were, and no refusal is posted for them (it is not this rank's call that failed)."""


class CancelledCallError(ValueError):
    """The handle or recv hook of a call that was cancelled on every rank (a peer refused it): it received
    nothing. No peer makes a call with it, so none is told (no refusal is posted) and the Buffer stays
    usable."""


def refusal(e: BaseException) -> bool:
    """Whether an error raised before a call reached the peers makes this rank leave the call in a way its
    peers should learn of (``Buffer._refuse``): bad input above all, also a failed allocation, and an
    interrupt (``KeyboardInterrupt``; a loop that catches it goes on with its next call, which its peers
    must not take for this one). Protocol errors (``UBEPError``) are about the peers and leave nothing to
    tell, and a cancelled call's handle (``CancelledCallError``) is this rank's alone."""
    return not isinstance(e, (UBEPError, CancelledCallError))


_NAMES_A_RANK = re.compile(r"\branks? \[?\d|\brank\(s\) \[?\d")


def name_global_ranks(e: BaseException, global_ranks: Sequence[int], also: tuple = ()) -> None:
    """On a process group that is not the whole world, the ranks an error names (in its message and its
    attributes) are ranks of that group: add their global ranks to the message, once. ``also``: other
    exception types to annotate when their message names a rank ("rank 1", "rank(s) [0, 2]")."""
    if not (isinstance(e, UBEPError) or (isinstance(e, also) and _NAMES_A_RANK.search(str(e)))) \
            or getattr(e, "_global_ranks_named", False) or not e.args or not isinstance(e.args[0], str) \
            or list(global_ranks) == list(range(len(global_ranks))):
        return
    named = {getattr(e, "rank", None)}
    for attr in ("missing_ranks", "dead_ranks", "aborted_ranks"):
        named.update(getattr(e, attr, ()))
    named = sorted(r for r in named if isinstance(r, int) and 0 <= r < len(global_ranks))
    if len(named) < 2:        # (the message may name others only in its text: give them all)
        named = range(len(global_ranks))
    mapping = ", ".join(f"{r} is {global_ranks[r]}" for r in named)
    e.args = (f"{e.args[0]} (Ranks here are ranks of the Buffer's process group; as global ranks: {mapping})",) \
        + tuple(e.args[1:])
    e._global_ranks_named = True
