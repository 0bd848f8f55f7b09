"""Hierarchical token-level mapper kernels (paper section 3.3, Algorithm 6).

The pure-torch reference is ``ubep_torch.mapper``; every kernel here reproduces it exactly (the tests
compare them element for element):

* ``remap_experts_kernel``: the destination list grouped by hop class (farthest first), so the base
  sequence of copies (destination position, token, slot) holds each hop class in one range.
* ``first_copy``: the logical matrix transposition. The base sequence fills a matrix with one column
  per AIV row-major and is read column-major: AIV ``j`` sends base copies ``j, j + n, ...``, i.e.
  ``floor`` or ``ceil(V_h / n)`` copies of every hop class ``h``. ``mapping=False``: contiguous
  slices ``[j*V//n, (j+1)*V//n)``.
* ``quaternary_search``: three equidistant pivots per step, compared with one vector operation (the
  paper's VectorCount), keeping the quadrant that contains the target. ``quaternary_search_kernel``
  runs it for a vector of targets; ``kernels.dispatch.send_phase_kernel`` calls the scalar form
  ``quaternary_search_one`` so each AIV finds the destination of its first copy.
* ``aiv_slices_kernel``: each AIV's load and first copy (destination position, offset inside it,
  search steps).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ubep_torch.topology import NUM_HOP_CLASSES as _NUM_HOP_CLASSES

from . import data_as_flag as daf

NUM_HOP_CLASSES: tl.constexpr = tl.constexpr(_NUM_HOP_CLASSES)
#: upper bound on search iterations (the window shrinks about fourfold per step; 2**62 entries need 31)
MAX_SEARCH_STEPS: tl.constexpr = tl.constexpr(40)


@triton.jit
def _quaternary_step(cum_ptr, t, lo, hi):
    """One iteration for a vector of targets: returns the new ``(lo, hi)`` window.

    Pivots ``q_i = lo + i*(hi-lo)//4`` (i = 1, 2, 3) form a ``[M, 4]`` tile whose column 0 is masked;
    ``below`` counts the pivots with ``cum[q] <= t`` in one reduction (VectorCount).
    """
    i = tl.arange(0, 4)[None, :]
    span = hi - lo
    q = lo[:, None] + (i * span[:, None]) // 4
    use = (i >= 1) & (i <= 3)
    cq = tl.load(cum_ptr + q, mask=use, other=0)
    below = daf.vsum(tl.where(use & (cq <= t[:, None]), 1, 0), axis=1).to(tl.int64)
    new_lo = tl.where(below == 0, lo, lo + (below * span) // 4 + 1)
    new_hi = tl.where(below == 3, hi, lo + ((below + 1) * span) // 4)
    return new_lo, new_hi


@triton.jit
def quaternary_search(cum_ptr, n, t, valid):
    """Smallest ``e`` with ``cum[e] > t`` for every target of the vector ``t`` (int64).

    ``cum_ptr`` holds ``n`` nondecreasing inclusive prefix sums. Returns ``(idx, steps)``; targets that
    are not ``valid`` return ``n`` and take 0 steps, as in ``ubep_torch.mapper.quaternary_search``.
    """
    lo = tl.full(t.shape, 0, t.dtype)
    hi = tl.full(t.shape, 0, t.dtype) + (n - 1)
    steps = tl.full(t.shape, 0, t.dtype)
    active = valid & (lo < hi)
    it = 0
    while (daf.vsum(active.to(tl.int32), 0) > 0) & (it < MAX_SEARCH_STEPS):
        new_lo, new_hi = _quaternary_step(cum_ptr, t, lo, hi)
        lo = tl.where(active, new_lo, lo)
        hi = tl.where(active, new_hi, hi)
        steps += active.to(tl.int64)
        active = active & (lo < hi)
        it += 1
    return tl.where(valid, lo, tl.full(lo.shape, 0, lo.dtype) + n), steps


@triton.jit
def quaternary_search_one(cum_ptr, n, target):
    """Scalar form: the destination position whose cumulative range covers ``target`` (needs n >= 1)."""
    t = tl.full([2], 0, tl.int64) + target
    idx, _ = quaternary_search(cum_ptr, n, t, t >= 0)
    return daf.vmax(idx, axis=0)


@triton.jit
def quaternary_search_kernel(cum_ptr, targets_ptr, idx_ptr, steps_ptr, n, m, BLOCK_M: tl.constexpr):
    """``idx[i], steps[i]`` for targets ``[pid*BLOCK_M, (pid+1)*BLOCK_M)`` (``n`` >= 1 prefix sums)."""
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs < m
    t = tl.load(targets_ptr + offs, mask=m_ok, other=-1)
    total = tl.load(cum_ptr + n - 1)
    idx, steps = quaternary_search(cum_ptr, n, t, m_ok & (t >= 0) & (t < total))
    tl.store(idx_ptr + offs, idx, mask=m_ok)
    tl.store(steps_ptr + offs, steps, mask=m_ok)


@triton.jit
def remap_experts_kernel(hop_ptr, order_ptr, n_exp, HAS_HOP: tl.constexpr, MAPPING: tl.constexpr,
                         BLOCK_E: tl.constexpr):
    """``order[p]`` = destination at list position ``p`` (one program, ``n_exp <= BLOCK_E``).

    The list groups destinations by hop class, farthest first, ids ascending inside a class: the
    position of expert ``e`` is the number of experts of farther classes plus those of its own class
    with a smaller id (a stable counting sort, one vector scan per class).
    """
    e = tl.arange(0, BLOCK_E)
    ok = e < n_exp
    i = e.to(tl.int64)
    if MAPPING and HAS_HOP:
        hop = tl.load(hop_ptr + e, mask=ok, other=-1).to(tl.int64)
        farther = tl.full([], 0, tl.int64)
        for k in tl.static_range(NUM_HOP_CLASSES):
            mine = ok & (hop == NUM_HOP_CLASSES - 1 - k)
            rank_in_class = daf.vcumsum(mine.to(tl.int64), 0) - 1
            i = tl.where(mine, farther + rank_in_class, i)
            farther += daf.vsum(mine.to(tl.int64), 0)
    tl.store(order_ptr + i, e.to(tl.int64), mask=ok)


@triton.jit
def first_copy(j, n_copies, n_aivs, MAPPING: tl.constexpr):
    """Base-sequence index of AIV ``j``'s first copy, its load, and the stride between its copies.

    With the logical matrix transposition (``MAPPING``) the base sequence fills a matrix of ``n_aivs``
    columns row-major and AIV ``j`` reads column ``j``: copies ``j, j + n, j + 2n, ...``. Without it
    AIV ``j`` takes the contiguous slice ``[j*V//n, (j+1)*V//n)``. Either way loads differ by <= 1.
    """
    jj = j.to(tl.int64)
    if MAPPING:
        first = jj
        load = tl.maximum((n_copies - jj + n_aivs - 1) // n_aivs, 0)
        stride = n_aivs
    else:
        first = (jj * n_copies) // n_aivs
        load = ((jj + 1) * n_copies) // n_aivs - first
        stride = 1
    return first, load, stride


@triton.jit
def aiv_slices_kernel(cum_ptr, n, total, start_pos_ptr, start_off_ptr, steps_ptr, loads_ptr, n_aivs,
                      MAPPING: tl.constexpr):
    """Program ``j`` = AIV ``j``: where its copies start (one quaternary search) and how many it has."""
    j = tl.program_id(0)
    first, load, _ = first_copy(j, total, n_aivs, MAPPING)
    t = tl.full([2], 0, tl.int64) + first
    idx, steps = quaternary_search(cum_ptr, n, t, (t >= 0) & (t < total))
    pos = daf.vmax(idx, 0)
    prev = tl.load(cum_ptr + pos - 1, mask=pos > 0, other=0)
    tl.store(start_pos_ptr + j, pos)
    tl.store(start_off_ptr + j, first - prev)
    tl.store(steps_ptr + j, daf.vmax(steps, 0))
    tl.store(loads_ptr + j, load)
