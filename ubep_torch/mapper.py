"""Hierarchical Token-level mapper (UBEP paper section 3.3), pure-torch reference.

The mapper decides which AIV of a sending die sends which token copy (the die's copies to one
destination, expert for dispatch or home rank for combine, form that destination's bucket).

1. **Expert remapping.** Destinations are listed grouped by hop class, farthest class first and by
   id inside a class (:func:`remap_experts`). The die's copies, ordered by (position of their
   destination in that list, token, slot), form the *base sequence* of ``V`` copies, so the copies of
   each hop class ``h`` occupy one contiguous range of ``V_h`` entries.
2. **Logical matrix transposition.** The base sequence is written row-major into a virtual matrix
   with one column per AIV (rows hold ``n`` consecutive copies) and read back column-major. The
   transposed sequence is cut into equal contiguous slices, one per AIV, which is the same as AIV
   ``j`` taking the base copies ``j, j + n, j + 2n, ...``. Loads therefore differ by at most one
   copy, and since each hop class is a contiguous range of the base sequence, AIV ``j`` gets
   ``floor(V_h / n)`` or ``ceil(V_h / n)`` copies of class ``h``: the paper's per-hop capacity bound
   ``v_{j,h} <= ceil(V_h / n)`` holds by construction, and a hot expert is spread over all AIVs.
3. **Locating copies.** For its ``k``-th copy AIV ``j`` needs the destination whose cumulative
   range covers base index ``j + k*n`` and the offset inside it: :func:`quaternary_search` over the
   prefix sums of the per-destination counts (in list order).

``mapping=False`` (the paper's "UBEP w/o mapping") keeps the id order and no transposition: AIV ``j``
takes the contiguous copies ``[j*V//n, (j+1)*V//n)``, balanced in count but, since consecutive
experts live on the same die and node, often all one-hop or all two-hop.

``kernels/mapper.py`` must reproduce these functions exactly; every tensor here is int64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .topology import NUM_HOP_CLASSES
from .utils import check_count, check_real

__all__ = [
    "DEFAULT_COUNT_COST_RATIO",
    "AivAssignment",
    "default_count_aivs",
    "map_tokens_to_aivs",
    "quaternary_search",
    "remap_experts",
    "token_slices",
]


def remap_experts(
    num_experts: int,
    n_aivs: int,
    dst_hop_class_per_expert: torch.Tensor | None = None,
    mapping: bool = True,
) -> torch.Tensor:
    """The destination list of the base sequence.

    Args:
        num_experts: ``E``, number of destinations.
        n_aivs: ``n`` (kept for the kernel's signature; the list does not depend on it).
        dst_hop_class_per_expert: ``[E]`` int64 hop class of each destination seen from this die, or
            ``None`` (one class: the id order).
        mapping: ``False`` returns ``arange(E)``.
    Returns:
        ``order``: ``[E]`` int64 permutation, ``order[p]`` = destination at list position ``p``:
        ``stable_sort(arange(E), key=-hop)`` (farthest class first, ids ascending inside a class).
    """
    E = int(num_experts)
    ids = torch.arange(E, dtype=torch.int64)
    if not mapping or E == 0 or dst_hop_class_per_expert is None:
        return ids
    hop = torch.as_tensor(dst_hop_class_per_expert, dtype=torch.int64).reshape(E)
    return torch.sort(-hop, stable=True).indices


def token_slices(total: int, n_aivs: int) -> torch.Tensor:
    """``[n+1]`` int64 slice bounds ``starts[j] = j*total//n``; AIV ``j`` owns ``[starts[j], starts[j+1])``."""
    j = torch.arange(int(n_aivs) + 1, dtype=torch.int64)
    return (j * int(total)) // int(n_aivs)


def quaternary_search(cum_counts: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Find, for each target copy index, the destination whose cumulative range covers it.

    Args:
        cum_counts: ``[E]`` int64 inclusive prefix sums (``cum[e] = sum(count[:e+1])``), nondecreasing.
        targets: ``[M]`` int64 copy indices with ``0 <= t < cum[-1]``.
    Returns:
        ``(idx, steps)``: ``idx[m]`` is the smallest ``e`` with ``cum[e] > t`` (equal to
        ``torch.searchsorted(cum, t, right=True)``); ``steps[m]`` is the number of iterations that
        target needed. Out-of-range targets return ``E`` (no destination covers them).

    Each iteration evaluates three equidistant pivots ``q_i = L + i*(R-L)//4`` (i = 1, 2, 3) of the
    window ``[L, R]``, counts how many satisfy ``cum[q] <= t`` (the paper's single VectorCount) and
    keeps the quadrant that contains the answer: ``[L, q1]``, ``[q1+1, q2]``, ``[q2+1, q3]`` or
    ``[q3+1, R]``. The window shrinks about fourfold per step: 5 steps cover 1024 destinations.
    """
    cum = torch.as_tensor(cum_counts, dtype=torch.int64).reshape(-1)
    t = torch.as_tensor(targets, dtype=torch.int64).reshape(-1)
    E = cum.numel()
    steps = torch.zeros_like(t)
    if E == 0:
        return torch.zeros_like(t), steps
    valid = (t >= 0) & (t < cum[-1])
    lo = torch.zeros_like(t)
    hi = torch.full_like(t, E - 1)
    active = valid & (lo < hi)
    while bool(active.any()):
        span = hi - lo
        q = torch.stack([lo + (i * span) // 4 for i in (1, 2, 3)])       # [3, M]
        below = (cum[q] <= t).sum(0)                                     # VectorCount
        q_ext = torch.cat([lo[None] - 1, q, hi[None]], 0)                # [5, M]
        new_lo = q_ext.gather(0, below[None]).squeeze(0) + 1
        new_hi = torch.where(below == 3, hi, q_ext.gather(0, (below + 1)[None]).squeeze(0))
        lo = torch.where(active, new_lo, lo)
        hi = torch.where(active, new_hi, hi)
        steps = steps + active.long()
        active = active & (lo < hi)
    return torch.where(valid, lo, torch.full_like(lo, E)), steps


@dataclass
class AivAssignment:
    """Result of :func:`map_tokens_to_aivs` for one sending die.

    Attributes:
        aiv_of_copy: ``[T, K]`` int64, the AIV that sends each copy; ``-1`` where ``topk_idx < 0``.
        order: ``[E]`` int64 remapped destination sequence (see :func:`remap_experts`).
        counts: ``[E]`` int64 copies per destination (by destination id).
        slice_bounds: ``[n+1]`` int64 bounds of the AIV slices in the (transposed, if mapping) sequence.
        slice_start_pos: ``[n]`` int64 list position of the destination of each AIV's first copy
            (``E`` if the AIV has none).
        slice_start_offset: ``[n]`` int64 offset of that first copy inside its destination's bucket.
        loads: ``[n]`` int64 copies per AIV (differ by at most one).
        hop_counts: ``[n, 4]`` int64 copies per (AIV, hop class), or ``None`` without hop classes.
        search_steps: ``[n]`` int64 quaternary-search iterations per AIV.
    """

    aiv_of_copy: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    slice_bounds: torch.Tensor
    slice_start_pos: torch.Tensor
    slice_start_offset: torch.Tensor
    loads: torch.Tensor
    hop_counts: torch.Tensor | None
    search_steps: torch.Tensor


def map_tokens_to_aivs(
    topk_idx: torch.Tensor,
    num_experts: int,
    n_aivs: int,
    dst_hop_class_per_expert: torch.Tensor | None = None,
    mapping: bool = True,
) -> AivAssignment:
    """Assign every token copy of one sending die to one of ``n_aivs`` AIVs.

    Args:
        topk_idx: ``[T, K]`` int64 destination of each (token, slot); ``-1`` = no destination.
        num_experts: ``E``; valid entries are in ``[0, E)``.
        n_aivs: ``n``, AIVs of the token group.
        dst_hop_class_per_expert: ``[E]`` int64 hop class of each destination from this die.
        mapping: topology-aware remapping on (UBEP) or off (UBEP w/o mapping).
    Returns:
        :class:`AivAssignment`. The base sequence is ordered by (list position of the destination,
        token index, slot); with ``mapping`` AIV ``j`` sends base copies ``j, j+n, j+2n, ...``,
        without it the copies ``[j*V//n, (j+1)*V//n)``.
    """
    idx = torch.as_tensor(topk_idx, dtype=torch.int64)
    if idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {tuple(idx.shape)}")
    E, n = int(num_experts), int(n_aivs)
    if n < 1:
        raise ValueError(f"n_aivs must be >= 1, got {n}")
    hop = None if dst_hop_class_per_expert is None else torch.as_tensor(dst_hop_class_per_expert, dtype=torch.int64)
    order = remap_experts(E, n, hop, mapping)
    pos_of = torch.empty(E, dtype=torch.int64)
    pos_of[order] = torch.arange(E, dtype=torch.int64)

    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid], minlength=E)
    cum = torch.cumsum(counts[order], 0)
    total = int(cum[-1]) if E else 0
    bounds = token_slices(total, n)

    # Sequence index of each copy: copies before its destination's position + rank among equal ones.
    key = torch.where(valid, pos_of[flat.clamp(0, E - 1)], torch.full_like(flat, E)) if E else torch.zeros_like(flat)
    _sorted_key, perm = torch.sort(key, stable=True)
    seq = torch.empty_like(perm)
    seq[perm] = torch.arange(perm.numel(), dtype=torch.int64)
    if mapping:
        aiv = seq % n                                   # column j of the transposed matrix
        first = torch.arange(n, dtype=torch.int64)      # AIV j's first copy is base copy j
        loads = torch.clamp((total - first + n - 1) // n, min=0)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(loads, 0)])
    else:
        aiv = torch.searchsorted(bounds[1:], seq, right=True)
        first = bounds[:-1]
        loads = bounds[1:] - bounds[:-1]
    aiv = torch.where(valid, aiv, torch.full_like(aiv, -1))

    start_pos, steps = quaternary_search(cum, first)
    prev = torch.cat([torch.zeros(1, dtype=torch.int64), cum])
    start_off = first - prev[start_pos.clamp(max=E)]
    hop_counts = None
    if hop is not None:
        hv = hop[flat[valid]]
        hop_counts = torch.bincount(aiv[valid] * NUM_HOP_CLASSES + hv, minlength=n * NUM_HOP_CLASSES)
        hop_counts = hop_counts.view(n, NUM_HOP_CLASSES)
    return AivAssignment(
        aiv_of_copy=aiv.view_as(idx), order=order, counts=counts, slice_bounds=bounds,
        slice_start_pos=start_pos, slice_start_offset=start_off, loads=loads,
        hop_counts=hop_counts, search_steps=steps,
    )


#: beta/alpha of Appendix 9 on CM384: count-path cost per expert over sending cost per token copy,
#: ``cost_model.count_cost_ratio(CM384, 7392, 64, 256)`` (DeepSeek dispatch, EP 64, 256 experts).
DEFAULT_COUNT_COST_RATIO = 0.24


def default_count_aivs(
    num_experts: int,
    topk: int,
    batch: int,
    n_aivs: int = 48,
    beta_over_alpha: float = DEFAULT_COUNT_COST_RATIO,
) -> int:
    """AIVs for the count group, ``n_count ~ (beta/alpha) * n * N_exp / (K_top * B_sz)`` (Appendix 9).

    Args:
        num_experts: ``N_exp``, experts whose counts must be produced and summed.
        topk: ``K_top``.
        batch: ``B_sz``, tokens per rank.
        n_aivs: ``n``, all AIVs of a die.
        beta_over_alpha: ratio of the per-expert count cost to the per-copy sending cost.
    Returns:
        the integer next to the estimate, below or above it, that better meets the appendix's objective
        ``min max(T_count, T_token)`` with its linear costs (``T_count ~ beta * N_exp / n_count``,
        ``T_token ~ alpha * K_top * B_sz / (n - n_count)``), clamped to ``[1, n // 2]``. (Rounding the
        estimate to nearest can starve the count group: 1.4 rounds to 1, whose count work then takes 1.4x
        the sending, where 2 AIVs take 0.7x of it and slow the sending by 1/n.)
    """
    num_experts, topk = check_count("num_experts", num_experts, 1), check_count("topk", topk)
    batch, n_aivs = check_count("batch", batch), check_count("n_aivs", n_aivs, 2)
    beta_over_alpha = check_real("beta_over_alpha", beta_over_alpha, minimum=0)
    if max(num_experts, topk, batch, n_aivs) >= 1 << 62:
        raise ValueError("default_count_aivs: counts must be below 2**62")
    load = max(1, topk * batch)
    n = n_aivs
    est = min(beta_over_alpha * n * num_experts / load, float(n))     # (past n // 2 it is clamped anyway)
    top = max(1, n // 2)

    def worst(nc: int) -> float:     # max(T_count, T_token) / alpha
        return max(beta_over_alpha * int(num_experts) / nc, load / max(n - nc, 1))
    lo = int(min(max(1, math.floor(est)), top))
    hi = int(min(max(1, math.ceil(est)), top))
    return lo if worst(lo) <= worst(hi) else hi
