"""Mechanistic CM384 cost model of one dispatch or combine: UBEP against CANN EP (BSP).

The model replays, per AIV, the schedule the code produces for the actual routing. It is a small set
of closed-form timelines evaluated with numpy over every (rank, AIV) at once, not an event queue.

Token sending (both schedules)
    An AIV sends its token copies one after another. A copy of ``nb`` DataBlocks to hop class ``h``
    costs ``overhead + nb*512 B / aiv_issue + lat_h / store_depth``: per-copy bookkeeping (scalar in
    CANN EP, vectorised in UBEP), the store stream out of the UBuf, and the share of the hop latency
    that ``store_depth`` stores in flight cannot hide. The AIV's data is visible at the destination one
    more flight later. When the die's AIVs together need a link (UB 137/135 GB/s, cross-die 270 GB/s)
    for longer than the slowest AIV needs on its own, the link sets the pace and all are slowed in
    proportion; a receiving die cannot take data in faster than its own link either.

CANN EP (paper section 2.3, Figure 2): all AIVs run the same phases with a SyncAll between them
    Init (routing) -> Token-Sending (token ``i`` owned by AIV ``i mod 48``, which sends all of its
    copies: balanced by token count only, blind to copies per token and to hop classes; combine:
    contiguous slices of the receive buffer) -> SendFlag & Verification (stop-and-wait: the flags go
    out only after the data has landed and a SyncAll, one per destination expert, or per home rank
    for combine; receivers poll until the last flag of the slowest peer is in) -> CalCumSum (every
    AIV computes the full prefix sum) -> Token-Reordering (combine: the weighted sum of the K rows).

UBEP (sections 3.2-3.4)
    ``n_count`` AIVs form the count group: VectorCount per expert, count blocks to every peer, then,
    once every peer's counts have landed, CalCumSum; they publish the offsets. The other AIVs form the
    token group: mapped slices (section 3.3, :mod:`ubep_torch.mapper`) sent with Data-as-Flag: ``tff``
    carries 480 B per block, ``sp`` and ``dc`` 512 B; ``sp`` re-arms each consumed block; ``dc`` adds a
    checksum store per (AIV, destination) stream and lets the receiver consume a stream only once it
    is complete; ``sw`` (stop-and-wait flags) also stalls the sender for a flight per stream.
    Token-Reordering starts on each AIV as soon as it is free and the offsets are known, consuming
    blocks as they arrive (TFF/SP) or stream by stream (DC/SW). No SyncAll. Combine has no count group.

Per-phase numbers are durations on the critical path of the slowest rank and add up to the total;
UBEP's count group runs in parallel with Token-Sending, so only what it adds beyond Token-Sending
appears (as ``cal_cumsum``; its own span is in ``Report.overlapped_us``). Every constant comes from
:data:`ubep_torch.topology.CM384`.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from .mapper import default_count_aivs, remap_experts
from .protocol import SYNC_MODES
from .topology import (
    CM384,
    INTRA_NPU,
    MAX_AIVS,
    NUM_HOP_CLASSES,
    ONE_HOP,
    SAME_DIE,
    TWO_HOP,
    CM384Params,
    Topology,
)
from .utils import check_count

KINDS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_combine")
SCHEDULES = ("cann_ep", "ubep")
CANN_SENDING = ("tokens", "slices", "experts", "expert_blocks")   # CANN EP's AIV of each dispatch copy (see
#                                                                   ``simulate``)


@dataclass
class Report:
    """Modelled cost of one call on one schedule.

    Attributes:
        total_us: latency of the call (slowest rank), µs.
        phases_us: critical-path duration of each phase, µs; the values add up to ``total_us``.
        aiv_send_us: token-sending latency of each sending AIV of the slowest rank, µs.
        worst_aiv_us: the largest token-sending latency of any AIV of any rank, µs.
        bytes: payload bytes the slowest rank sends (token copies x bytes per token).
        effective_gbs: ``bytes / total_us`` in GB/s.
        schedule, kind, sync, mapping, n_count: the configuration that was modelled.
        overlapped_us: work that ran in parallel with the critical path (UBEP's count group), µs.
    """

    total_us: float
    phases_us: dict[str, float]
    aiv_send_us: list[float]
    worst_aiv_us: float
    bytes: int
    effective_gbs: float
    schedule: str
    kind: str
    sync: str
    mapping: bool
    n_count: int
    overlapped_us: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- helpers
def _blocks(nbytes: int, sync: str, p: CM384Params) -> int:
    payload = p.tff_payload_bytes if sync == "tff" else p.block_bytes
    return max(1, -(-int(nbytes) // payload))


def _lat_vec(p: CM384Params) -> np.ndarray:
    return np.array([p.hop_latency_us[h] for h in range(NUM_HOP_CLASSES)], dtype=np.float64)


def _waterfill(free: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Finish time ``T`` per row with ``sum_j max(0, T - free[r, j]) = work[r]`` (parallel AIVs).

    Args:
        free: ``[R, n]`` times at which each AIV can start on the shared work.
        work: ``[R]`` AIV-µs of work.
    """
    f = np.sort(free, axis=1)
    n = f.shape[1]
    k = np.arange(1, n + 1, dtype=np.float64)
    t = (work[:, None] + np.cumsum(f, axis=1)) / k[None, :]
    nxt = np.concatenate([f[:, 1:], np.full((f.shape[0], 1), np.inf)], axis=1)
    ok = (t >= f - 1e-12) & (t <= nxt + 1e-12)
    first = np.argmax(ok, axis=1)
    return t[np.arange(f.shape[0]), first]


@dataclass
class _Copies:
    """Flattened token copies as seen by the *sending* dies of one call."""

    sender: np.ndarray      # [C] index into sender_ranks
    dst: np.ndarray         # [C] destination die
    key: np.ndarray         # [C] destination id used for AIV assignment (expert or home rank)
    num_keys: int
    key_die: np.ndarray     # [num_keys] die hosting each key
    sender_ranks: np.ndarray  # [S]
    full: bool              # True: every rank is a sender (receivers see real loads)
    tok: np.ndarray         # [C] token index at the sender (dispatch) / row index (combine)


def _copies(kind: str, topk: np.ndarray, src_ranks: np.ndarray, world: int, num_experts: int,
            full: bool) -> _Copies:
    S, B, K = topk.shape
    per_rank = max(1, num_experts // world)
    flat = topk.reshape(S, B * K)
    valid = (flat >= 0) & (flat < num_experts)
    src = np.broadcast_to(src_ranks[:, None], flat.shape)[valid]
    tok = np.broadcast_to((np.arange(B * K) // K)[None, :], flat.shape)[valid]
    exp = flat[valid]
    edie = np.minimum(exp // per_rank, world - 1)
    if kind in ("dispatch", "low_latency_dispatch"):
        sidx = np.broadcast_to(np.arange(S)[:, None], flat.shape)[valid]
        key_die = np.minimum(np.arange(num_experts) // per_rank, world - 1)
        return _Copies(sidx, edie, exp, num_experts, key_die, src_ranks, full, tok)
    # combine: the expert host sends each row back to the token's home rank
    if full:
        order = np.lexsort((src, exp))          # receive-buffer order: expert-major, then source
        return _Copies(edie[order], src[order], src[order], world, np.arange(world), np.arange(world), True,
                       np.arange(order.size))
    # one rank's routing only: by symmetry it sends back as many rows as it dispatched, with the same
    # hop mix, so its own copies stand in for the rows it will return
    sidx = np.broadcast_to(np.arange(S)[:, None], flat.shape)[valid]
    return _Copies(sidx, edie, edie, world, np.arange(world), src_ranks, False, tok)


def _unique_rows(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    u, inv = torch.unique(x, dim=0, return_inverse=True)
    return u, inv.numpy()


def _assign(c: _Copies, n: int, policy: str, topo: Topology) -> np.ndarray:
    """AIV of every copy. Policies: ``mapped``/``unmapped`` (UBEP mapper), ``tokens`` (token ``i`` of
    a die is owned by AIV ``i mod n``, which sends all its copies: DeepEP-style token-count balancing),
    ``slices`` (contiguous count slices of the copies in their given order), ``experts`` (every copy to
    destination key ``e`` goes to AIV ``e mod n``) and ``expert_blocks`` (the keys cut into ``n``
    contiguous blocks, one per AIV)."""
    if policy == "tokens":
        return c.tok % n
    if policy == "experts":
        return c.key % n
    if policy == "expert_blocks":
        return c.key * n // c.num_keys
    S = len(c.sender_ranks)
    if policy == "mapped":
        # the mapper of every sending die (hop classes differ per die; the transposition does not)
        hop_keys = torch.from_numpy(topo.hop_class(c.sender_ranks[:, None], c.key_die[None, :]))  # [S, D]
        uniq, inv = _unique_rows(hop_keys)
        order = np.stack([remap_experts(c.num_keys, n, h, True).numpy() for h in uniq])[inv]
        pos_of = np.empty_like(order)
        np.put_along_axis(pos_of, order, np.arange(c.num_keys)[None, :].repeat(S, 0), axis=1)
        pos = pos_of[c.sender, c.key]
    elif policy == "unmapped":
        pos = c.key
    elif policy == "slices":
        pos = np.zeros_like(c.key)
    else:
        raise ValueError(f"unknown assignment policy {policy!r}")
    comb = c.sender * (c.num_keys + 1) + pos
    perm = np.argsort(comb, kind="stable")
    counts = np.bincount(c.sender, minlength=S)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    seq = np.empty_like(perm)
    seq[perm] = np.arange(perm.size)
    seq = seq - starts[c.sender]
    if policy == "mapped":
        return seq % n          # the transposition: AIV j takes base copies j, j+n, ...
    V = counts[c.sender]
    return ((seq + 1) * n - 1) // np.maximum(V, 1)


@dataclass
class _SendResult:
    t_aiv: np.ndarray       # [S, n] token-sending latency of each AIV (incl. last flight)
    bytes_s: np.ndarray     # [S] payload bytes per sender
    blocks_recv: np.ndarray  # [R] blocks received per die
    recv_bytes: np.ndarray  # [R] payload bytes received per die
    ingress_us: np.ndarray  # [R] lower bound from the receiving die's link
    stream_bytes: np.ndarray  # [R] mean bytes of one (AIV, destination) stream into a die
    streams_aiv: np.ndarray  # [S, n] distinct destination dies per AIV


def _send(c: _Copies, aiv: np.ndarray, n: int, world: int, bytes_per_token: int, sync: str,
          topo: Topology, p: CM384Params) -> _SendResult:
    S = len(c.sender_ranks)
    nb = _blocks(bytes_per_token, sync, p)
    wire = nb * p.block_bytes
    lat = _lat_vec(p)
    src_die = c.sender_ranks[c.sender]
    hop = topo.hop_class(src_die, c.dst)
    cnt = np.bincount((c.sender * n + aiv) * NUM_HOP_CLASSES + hop,
                      minlength=S * n * NUM_HOP_CLASSES).reshape(S, n, NUM_HOP_CLASSES).astype(np.float64)
    # CANN EP walks each token's destinations with scalar code; UBEP masks and locates them with
    # vector instructions (CompareScalar / FindFirstValue, paper section 4)
    overhead = p.token_overhead_us if sync == "bsp" else p.vector_token_overhead_us
    per_copy = overhead + wire / (p.aiv_issue_gbs * 1e3) + lat / p.store_depth
    body = cnt @ per_copy                                                     # [S, n]
    # streams: distinct (AIV, destination die) pairs; DC sends a checksum per stream, SW a flag
    skey = np.sort((c.sender * n + aiv) * world + c.dst)
    skey = skey[np.concatenate([[True], skey[1:] != skey[:-1]])] if skey.size else skey
    s_aiv = skey // world
    s_hop = topo.hop_class(c.sender_ranks[s_aiv // n], skey % world)
    streams_aiv = np.bincount(s_aiv, minlength=S * n).reshape(S, n).astype(np.float64)
    if sync == "dc":
        body = body + streams_aiv * p.flag_issue_us + (cnt.sum(2) * nb) * p.block_check_us
    elif sync == "sw":
        stall = np.bincount(s_aiv, weights=p.flag_issue_us + lat[s_hop], minlength=S * n).reshape(S, n)
        body = body + stall
    # link sharing: when the die's AIVs together need longer on a link than the slowest AIV needs on
    # its own, the link sets the pace and every AIV is slowed in proportion
    ub = (cnt[..., ONE_HOP] + cnt[..., TWO_HOP]) * wire
    xd = cnt[..., INTRA_NPU] * wire
    link_us = np.maximum(ub.sum(1) / (p.ub_link_gbs[ONE_HOP] * 1e3), xd.sum(1) / (p.ub_link_gbs[INTRA_NPU] * 1e3))
    stretch = np.maximum(1.0, link_us / np.maximum(body.max(1), 1e-9))
    far = np.where(cnt > 0, lat[None, None, :], 0.0).max(2)
    t_aiv = body * stretch[:, None] + far * (1.0 - 1.0 / p.store_depth)
    # receivers
    copies_to = np.bincount(c.dst, minlength=world).astype(np.float64)
    ub_to = np.bincount(c.dst, weights=(hop >= ONE_HOP).astype(np.float64), minlength=world) * wire
    if not c.full:   # one sender known: peers assumed to send it the same load (symmetry)
        own = c.sender_ranks
        copies_to = np.zeros(world)
        copies_to[own] = cnt.sum((1, 2))
        ub_to = np.zeros(world)
        ub_to[own] = ub.sum(1)
    bytes_s = cnt.sum((1, 2)) * bytes_per_token
    n_streams_to = np.bincount(skey % world, minlength=world).astype(np.float64)
    if not c.full:
        n_streams_to = np.zeros(world)
        n_streams_to[c.sender_ranks] = streams_aiv.sum(1)
    stream_bytes = copies_to * bytes_per_token / np.maximum(n_streams_to, 1.0)
    return _SendResult(t_aiv, bytes_s, copies_to * nb, copies_to * bytes_per_token,
                       ub_to / (p.ub_link_gbs[TWO_HOP] * 1e3), stream_bytes, streams_aiv)


def _arrival(finish_s: np.ndarray, c: _Copies, world: int, topo: Topology, p: CM384Params,
             include_flight: bool) -> np.ndarray:
    """``[R]`` time the last piece from any sender lands at each die (``finish_s`` per sender)."""
    out = np.zeros(world)
    if c.full:
        if include_flight:
            lat = _lat_vec(p)[topo.hop_matrix(world)]
            out = (finish_s[:, None] + lat).max(0)
        else:
            out[:] = finish_s.max()
        return out
    far = p.hop_latency_us[int(topo.hop_matrix(world)[c.sender_ranks[0]].max())] if include_flight else 0.0
    out[c.sender_ranks] = finish_s + far
    return out


# ----------------------------------------------------------------------------- schedules
def _cann(kind: str, c: _Copies, B: int, K: int, world: int, num_experts: int, bytes_per_token: int,
          topo: Topology, p: CM384Params, n: int, sending: str = "tokens"
          ) -> tuple[np.ndarray, dict[str, np.ndarray], _SendResult]:
    dispatch = "dispatch" in kind
    policy = sending if dispatch else "slices"
    aiv = _assign(c, n, policy, topo)
    # raw 512 B blocks; BSP's stop-and-wait happens once per phase (SyncAll, then flags), not per stream
    sr = _send(c, aiv, n, world, bytes_per_token, "bsp", topo, p)
    R = world
    rows = B * K
    init = p.launch_us + p.route_us_per_copy * -(-rows // n)
    ranks = c.sender_ranks if not c.full else np.arange(R)
    send = sr.t_aiv.max(1)
    send = np.maximum(send, sr.ingress_us[ranks])
    t_send_done = init + p.syncall_us + send
    # SendFlag: stop-and-wait means the flags go out only once the data is known to have landed (the
    # sender's last flight is in token_sending, the SyncAll follows); dispatch then writes one
    # flag+count per destination expert, combine one flag per home rank, spread over the AIVs
    lat = _lat_vec(p)
    n_flags = num_experts if dispatch else R
    far = lat[topo.hop_matrix(R)[ranks].max(1)]
    t_flag_start = t_send_done + p.syncall_us
    t_flag_done = t_flag_start + p.flag_issue_us * -(-n_flags // n) + far
    if c.full:
        landed = np.full(R, t_flag_done.max())
    else:
        landed = t_flag_done
    verify_done = landed + p.poll_us * -(-n_flags // n)
    phases = {
        "init": np.full(len(ranks), init),
        "token_sending": send,
        "send_flag_verification": verify_done - t_flag_start,   # incl. waiting for the slowest peer
    }
    n_sync = 2
    if kind == "dispatch":
        phases["cal_cumsum"] = np.full(len(ranks), p.cumsum_us_per_entry * num_experts)
        phases["token_reordering"] = sr.recv_bytes[ranks] / (n * p.aiv_copy_gbs * 1e3)
        n_sync = 4
    elif not dispatch:
        # weighted sum of the K returned rows of every token: HBM-read bound (K reads + 1 write per token)
        phases["token_reordering"] = B * (K + 1) * bytes_per_token / (p.hbm_gbs * 1e3) + np.zeros(len(ranks))
        n_sync = 3
    phases["sync_all"] = np.full(len(ranks), n_sync * p.syncall_us)
    total = sum(phases.values())
    return total, phases, sr


def _ubep(kind: str, c: _Copies, B: int, K: int, world: int, num_experts: int, bytes_per_token: int,
          topo: Topology, p: CM384Params, n: int, sync: str, mapping: bool, n_count: int
          ) -> tuple[np.ndarray, dict[str, np.ndarray], _SendResult, dict[str, np.ndarray]]:
    dispatch = "dispatch" in kind
    n_cnt = n_count if dispatch else 0
    n_tok = n - n_cnt
    aiv = _assign(c, n_tok, "mapped" if mapping else "unmapped", topo)
    sr = _send(c, aiv, n_tok, world, bytes_per_token, sync, topo, p)
    R = world
    ranks = c.sender_ranks if not c.full else np.arange(R)
    rows = B * K
    steps = int(np.ceil(np.log(max(c.num_keys, 2)) / np.log(4.0)))
    t0 = p.launch_us + p.route_us_per_copy * -(-rows // n_tok) + steps * p.qs_step_us
    tok_done = t0 + sr.t_aiv                                                      # [S, n_tok]
    finish = np.maximum(tok_done.max(1), p.launch_us + sr.ingress_us[ranks])
    arrive = _arrival(finish, c, R, topo, p, include_flight=False)[ranks]
    phases: dict[str, np.ndarray] = {"init": np.full(len(ranks), t0), "token_sending": finish - t0}
    overlapped: dict[str, np.ndarray] = {}
    free = tok_done
    t_off = np.full(len(ranks), 0.0)
    if dispatch:
        lat = _lat_vec(p)
        far = lat[topo.hop_matrix(R)[ranks].max(1)]
        t_cnt = (p.launch_us + p.count_us_per_expert * -(-num_experts // n_cnt)
                 + p.flag_issue_us * -(-R // n_cnt))
        counts_in = (np.full(len(ranks), t_cnt) + far) if not c.full else np.full(len(ranks), t_cnt + far.max())
        # one count block per source rank to poll, one prefix-sum entry per (source, local expert)
        t_off = counts_in + p.poll_us * -(-R // n_cnt) + p.cumsum_us_per_entry * -(-num_experts // n_cnt) \
            + p.hop_latency_us[SAME_DIE]
        overlapped["count_group"] = t_off - p.launch_us
        free = np.concatenate([tok_done, np.repeat(t_off[:, None], n_cnt, 1)], axis=1)
    nb = _blocks(bytes_per_token, sync, p)
    check = p.block_check_us * (1.0 + p.sp_rearm_share if sync == "sp" else 1.0)   # (SP re-arms the block)
    if kind == "low_latency_dispatch":
        work = sr.blocks_recv[ranks] * check
    elif dispatch:
        work = sr.recv_bytes[ranks] / (p.aiv_copy_gbs * 1e3) + sr.blocks_recv[ranks] * check
    else:
        work = (n * B * (K + 1) * bytes_per_token / (p.hbm_gbs * 1e3) + B * K * nb * check) + np.zeros(len(ranks))
    start = np.maximum(free, t_off[:, None])
    if sync in ("dc", "sw"):
        # a stream is consumed only once it is complete (DC: after its checksum landed)
        # (its last flag or checksum comes from the farthest source: two hops only beyond one node)
        far_src = _lat_vec(p)[topo.hop_matrix(R)[ranks].max(1)]
        tail = p.flag_issue_us + far_src + sr.stream_bytes[ranks] / (p.aiv_copy_gbs * 1e3)
        end = np.maximum(_waterfill(start, work), arrive + tail)
    else:
        tail = bytes_per_token / (p.aiv_copy_gbs * 1e3) + nb * check
        end = np.maximum(_waterfill(start, work), arrive + tail)
    crit = np.maximum(finish, t_off)
    phases["cal_cumsum"] = crit - finish
    phases["token_reordering"] = end - crit
    total = end
    return total, phases, sr, overlapped


# ----------------------------------------------------------------------------- public API
def count_cost_ratio(params: CM384Params, bytes_per_token: int, world_size: int, num_experts: int,
                     sync: str = "tff", topology: Topology | None = None) -> float:
    """Appendix 9's ``beta / alpha`` on these parameters.

    ``beta``: count-group time per expert (VectorCount, a share of the per-source count-block polls,
    CalCumSum entry); ``alpha``: token-group time per token copy to the farthest die of the group (two hops
    away beyond one node; ``topology``: ``Topology.for_ranks(world_size)`` unless given).
    """
    _check_params(params)
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    bytes_per_token = _count_in("bytes_per_token", bytes_per_token, 1, MAX_BYTES_PER_TOKEN)
    world_size = _count_in("world_size", world_size, 1, MAX_WORLD_SIZE)
    num_experts = _count_in("num_experts", num_experts, 1, MAX_NUM_EXPERTS)
    p = params
    beta = p.count_us_per_expert + p.cumsum_us_per_entry + (p.poll_us + p.flag_issue_us) * world_size / num_experts
    wire = _blocks(bytes_per_token, sync, p) * p.block_bytes
    topo = topology or Topology.for_ranks(world_size)
    far = int(topo.hop_matrix(world_size).max()) if world_size > 1 else TWO_HOP
    alpha = p.vector_token_overhead_us + wire / (p.aiv_issue_gbs * 1e3) + p.hop_latency_us[far] / p.store_depth
    return beta / alpha


#: bounds of what the model replays (a CloudMatrix384 has 768 dies of 48 AIVs; beyond 768 dies the topology
#: adds nodes of the same kind)
MAX_WORLD_SIZE = 4096
MAX_NUM_EXPERTS = 65536
MAX_BYTES_PER_TOKEN = 1 << 30    # (1 GiB per token copy; a bf16 row of the simulator's largest hidden is 2 MiB)


def _count_in(name: str, value, lowest: int, highest: int) -> int:
    """``value`` as an int in [lowest, highest] (``check_count``, then the model's bound ``highest``)."""
    return _at_most(name, check_count(name, value, lowest), highest)


def _at_most(name: str, value: int, highest: int) -> int:
    if value > highest:
        shown = value if value < 1 << 64 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise ValueError(f"{name}={shown}: the model covers at most {highest}")
    return value


def _check_params(params) -> None:
    if not isinstance(params, CM384Params):
        raise TypeError(f"params must be a ubep_torch.topology.CM384Params, got {type(params).__name__}")


def _routing_array(topk_idx) -> np.ndarray:
    """``topk_idx`` (a tensor on any device but meta, or an array-like) as a numpy array."""
    if isinstance(topk_idx, torch.Tensor):
        if topk_idx.is_meta:
            raise ValueError("topk_idx is a meta tensor (it has no values to model)")
        return topk_idx.detach().cpu().resolve_neg().numpy()
    arr = np.asarray(topk_idx)
    return arr.astype(np.int64) if arr.size == 0 else arr      # (an empty list holds no ids of any type)


def simulate(
    kind: str,
    schedule: str,
    topk_idx: torch.Tensor | np.ndarray,
    num_experts: int,
    bytes_per_token: int,
    world_size: int | None = None,
    src_ranks: Sequence[int] | None = None,
    topology: Topology | None = None,
    params: CM384Params = CM384,
    sync: str = "tff",
    mapping: bool = True,
    n_count: int | None = None,
    n_aivs: int | None = None,
    cann_sending: str = "tokens",
) -> Report:
    """Model one call of ``kind`` under ``schedule`` from the routing of some or all ranks.

    Args:
        kind: ``"dispatch"``, ``"combine"``, ``"low_latency_dispatch"`` (received tokens are read in
            place: no CalCumSum/Token-Reordering) or ``"low_latency_combine"`` (modelled as combine).
        schedule: ``"cann_ep"`` (BSP baseline, always stop-and-wait flags) or ``"ubep"``.
        topk_idx: ``[R, B, K]`` int64 routing of every rank (``-1`` = no expert) or ``[S, B, K]`` of
            the ranks in ``src_ranks`` only; with only some ranks known, each unknown peer is assumed to
            send as much as the known ranks and as late (symmetric load).
        num_experts: ``E``; expert ``e`` lives on die ``e // (E // world_size)``.
        bytes_per_token: payload bytes of one token copy (dispatch) or expert output (combine).
        world_size: ranks (dies); defaults to ``topk_idx.shape[0]``.
        src_ranks: the ranks whose routing ``topk_idx`` holds; defaults to all.
        topology: defaults to 16 dies per node (CM384).
        params: the constants; :data:`ubep_torch.topology.CM384` by default.
        sync, mapping, n_count: UBEP's Data-as-Flag variant, topology-aware mapping and count-group
            size (``None``: :func:`ubep_torch.mapper.default_count_aivs` of the copies the busiest rank
            sends, its slots in use). Ignored for CANN EP.
        n_aivs: AIVs per die (default ``params.aivs_per_die``).
        cann_sending: which AIV sends each dispatch copy in CANN EP (ignored for UBEP): ``"tokens"``
            (the calibrated default: token ``i`` of a die and all its copies go to AIV ``i mod n``) or
            ``"slices"`` (the die's B*K copies in token order, cut into contiguous equal slices, one per
            AIV, as the public ``MoeDistributeDispatch`` kernel of CANN splits them), ``"experts"``
            (every copy to expert ``e`` from AIV ``e mod n``) or ``"expert_blocks"`` (the experts cut into
            contiguous blocks, one per AIV): rules the calibration was not redone for (see
            docs/reproducing.md).
    Returns:
        :class:`Report` of the slowest rank.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    if not isinstance(mapping, (bool, np.bool_)):
        raise TypeError(f"mapping must be True or False, got {mapping!r}")
    if cann_sending not in CANN_SENDING:
        raise ValueError(f"cann_sending must be one of {CANN_SENDING}, got {cann_sending!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a ubep_torch.topology.Topology, got {type(topology).__name__}")
    _check_params(params)
    tk = _routing_array(topk_idx)
    if tk.dtype.kind not in "iu":
        raise TypeError(f"topk_idx must hold integer expert ids, got {tk.dtype}")
    if tk.ndim not in (2, 3):
        raise ValueError(f"topk_idx must be [ranks, batch, topk] (or [batch, topk]), got shape {tk.shape}")
    if tk.dtype.kind == "u" and tk.size and int(tk.max()) > np.iinfo(np.int64).max:
        # (the cast below would wrap it to a negative id, read as an empty slot)
        raise ValueError(f"topk_idx holds expert id {int(tk.max())}, past any num_experts")
    tk = tk.astype(np.int64, copy=False)
    if tk.ndim == 2:
        tk = tk[None]
    S, B, K = tk.shape
    if S == 0:
        raise ValueError("topk_idx holds the routing of no rank ([0, batch, topk]): give at least one rank's")
    R = _count_in("world_size", world_size if world_size is not None else S, 1, MAX_WORLD_SIZE)
    E = _count_in("num_experts", num_experts, 1, MAX_NUM_EXPERTS)
    bytes_per_token = _count_in("bytes_per_token", bytes_per_token, 1, MAX_BYTES_PER_TOKEN)
    if E % R:
        raise ValueError(f"num_experts={E} must be a multiple of world_size={R}")
    if tk.size and (int(tk.min()) < -1 or int(tk.max()) >= E):
        raise ValueError(f"topk_idx values must be in [-1, {E}); got min {int(tk.min())}, max {int(tk.max())}")
    try:
        given = None if src_ranks is None else np.asarray(src_ranks)
        # (integers only: 0.5 was truncated to rank 0)
        if given is not None and given.size and given.dtype.kind not in "iu":
            raise TypeError
        src = np.arange(S, dtype=np.int64) if given is None else given.astype(np.int64)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"src_ranks must be integer ranks, got {src_ranks!r}") from None
    if src.shape != (S,) or (S and (int(src.min()) < 0 or int(src.max()) >= R)) or len(set(src.tolist())) != S:
        raise ValueError(f"src_ranks must name {S} distinct ranks in [0, {R}) (one per row of topk_idx), got "
                         f"{src.tolist()}")
    full = S == R and bool(np.array_equal(src, np.arange(R)))
    topo = topology or Topology.for_ranks(R)
    if topo.num_dies < R:
        raise ValueError(f"the topology has {topo.num_dies} dies, fewer than world_size={R}")
    n = params.aivs_per_die if n_aivs is None else _count_in("n_aivs", n_aivs, 2, MAX_AIVS)
    c = _copies(kind, tk, src, R, E, full)
    if schedule == "cann_ep":
        total, phases, sr = _cann(kind, c, B, K, R, E, bytes_per_token, topo, params, n, cann_sending)
        overlapped: dict[str, np.ndarray] = {}
        sync_used, mapping_used, nc = "sw", False, 0
    else:
        nc = 0
        if "dispatch" in kind:
            # (Appendix 9's K * B is the copies a rank's token group sends: the slots in use, -1 slots
            # send nothing; the busiest rank's, whose sending the count group must not outlast)
            copies = int((tk >= 0).sum(axis=(1, 2)).max()) if tk.size else 0
            nc = check_count("n_count", n_count, 1) if n_count is not None else default_count_aivs(
                E, 1, max(1, copies), n, count_cost_ratio(params, bytes_per_token, R, E, sync, topo))
            if not 1 <= nc < n:
                raise ValueError(f"n_count must be in [1, {n - 1}], got {nc}")
        total, phases, sr, overlapped = _ubep(kind, c, B, K, R, E, bytes_per_token, topo, params, n,
                                              sync, mapping, nc)
        sync_used, mapping_used = sync, bool(mapping)
    crit = int(np.argmax(total))
    tot = float(total[crit])
    nbytes = int(sr.bytes_s[min(crit, len(sr.bytes_s) - 1)])
    return Report(
        total_us=tot,
        phases_us={k: float(v[crit]) for k, v in phases.items()},
        aiv_send_us=[float(x) for x in sr.t_aiv[crit]],
        worst_aiv_us=float(sr.t_aiv.max()),
        bytes=nbytes,
        effective_gbs=nbytes / tot / 1e3 if tot > 0 else 0.0,
        schedule=schedule, kind=kind, sync=sync_used, mapping=mapping_used, n_count=nc,
        overlapped_us={k: float(v[crit]) for k, v in overlapped.items()},
    )


def compare(kind: str, topk_idx, num_experts: int, bytes_per_token: int, **kw) -> dict:
    """``{"cann_ep": Report, "ubep": Report, "reduction": 1 - ubep/cann_ep}`` for the same routing.

    Keyword arguments are those of :func:`simulate`; ``sync``, ``mapping`` and ``n_count`` apply to
    the UBEP side only, ``cann_sending`` to the CANN EP side only.
    """
    ub_kw = {k: kw.pop(k) for k in ("sync", "mapping", "n_count") if k in kw}
    cann_kw = {k: kw.pop(k) for k in ("cann_sending",) if k in kw}
    cann = simulate(kind, "cann_ep", topk_idx, num_experts, bytes_per_token, **kw, **cann_kw)
    ubep = simulate(kind, "ubep", topk_idx, num_experts, bytes_per_token, **kw, **ub_kw)
    # (parameters with every cost 0 model a call that moves nothing in no time: nothing to reduce)
    reduction = 1.0 - ubep.total_us / cann.total_us if cann.total_us > 0 else 0.0
    return {"cann_ep": cann, "ubep": ubep, "reduction": reduction}


def dispatch_bytes_per_token(hidden: int, dtype: str = "int8") -> int:
    """Payload of one dispatched token: ``hidden`` values plus one fp32 scale per 128 for int8/fp8, two bytes
    per value for bf16/fp16."""
    hidden = check_count("hidden", hidden, 1)
    if dtype in ("int8", "fp8"):
        return hidden + 4 * (-(-hidden // 128))
    if dtype in ("bf16", "fp16"):
        return 2 * hidden
    raise ValueError(f"dtype must be 'int8', 'fp8', 'bf16' or 'fp16', got {dtype!r}")


class CostModel:
    """Per-call CM384 cost reports for ``Buffer(..., cost_model=CostModel())``.

    Args:
        ranks_per_node: dies per node of the modelled superpod (CM384: 16).
        params: the constants (default :data:`ubep_torch.topology.CM384`).
        sync, mapping, n_count: UBEP configuration used when a call does not say otherwise.
        callback: optional ``f(kind, report_dict)`` called with every report.
    """

    def __init__(self, ranks_per_node: int = 16, params: CM384Params = CM384, sync: str = "tff",
                 mapping: bool = True, n_count: int | None = None,
                 callback: Callable[[str, dict], None] | None = None) -> None:
        # (checked here, not at the first report: inside a Buffer a bad setting would warn on every call)
        _check_params(params)
        self.ranks_per_node = check_count("ranks_per_node", ranks_per_node, 1)
        Topology.for_ranks(self.ranks_per_node, self.ranks_per_node)     # (dies of whole NPUs, else ValueError)
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if not isinstance(mapping, (bool, np.bool_)):
            raise TypeError(f"mapping must be True or False, got {mapping!r}")
        if n_count is not None and not 1 <= check_count("n_count", n_count, 1) < params.aivs_per_die:
            raise ValueError(f"n_count must be in [1, {params.aivs_per_die - 1}] (AIVs per die: "
                             f"{params.aivs_per_die}), got {n_count}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self.params = params
        self.sync = sync
        self.mapping = bool(mapping)
        self.n_count = n_count
        self.callback = callback
        self.last_report: dict | None = None

    def report(self, kind: str, rank: int, world_size: int, topk_idx: torch.Tensor, num_experts: int,
               hidden: int, bytes_per_token: int | None = None, sync: str | None = None,
               mapping: bool | None = None, n_count: int | None = None) -> dict:
        """Model the call this rank just made, UBEP against CANN EP on the same routing.

        Only this rank's routing is known to the hook: this rank's sending is modelled from its real
        ``topk_idx``; every peer is assumed to send it a similar load at the same time (symmetric
        load), so receive-side costs mirror this rank's send side.

        Args:
            kind: ``"dispatch"``, ``"combine"``, ``"low_latency_dispatch"`` or ``"low_latency_combine"``.
            rank, world_size: this die and the number of dies.
            topk_idx: ``[T, K]`` int64 this rank's routing, ``-1`` = no expert.
            num_experts: global expert count.
            hidden: hidden size (used when ``bytes_per_token`` is ``None``: bf16 rows).
            bytes_per_token: payload bytes per token copy.
            sync, mapping, n_count: UBEP configuration overrides.
        Returns:
            ``{"ubep": Report, "cann_ep": Report, "reduction": float, "kind": str, "rank": int}``.
        """
        world_size = check_count("world_size", world_size, 1)
        rank = check_count("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        nbytes = check_count("bytes_per_token", bytes_per_token, 1) if bytes_per_token is not None else \
            2 * check_count("hidden", hidden, 1)
        _at_most("bytes_per_token" if bytes_per_token is not None else "2 x hidden", nbytes, MAX_BYTES_PER_TOKEN)
        if n_count is not None:      # (checked for every kind: a combine, which has no count group, took "x")
            check_count("n_count", n_count, 1)
        tk = _routing_array(topk_idx)
        if tk.ndim != 2:
            raise ValueError(f"topk_idx must be this rank's [T, K] routing, got shape {tk.shape}")
        topo = Topology.for_ranks(world_size, min(self.ranks_per_node, max(2, world_size + world_size % 2)))
        out = compare(kind, tk[None], num_experts, nbytes, world_size=world_size, src_ranks=[rank],
                      topology=topo, params=self.params, sync=self.sync if sync is None else sync,
                      mapping=self.mapping if mapping is None else mapping,
                      n_count=self.n_count if n_count is None else n_count)
        out["kind"] = kind
        out["rank"] = int(rank)
        self.last_report = out
        if self.callback is not None:
            self.callback(kind, out)
        return out


def format_report(rep: dict) -> str:
    """One readable paragraph for a ``{"ubep", "cann_ep", "reduction"}`` report."""
    if not (isinstance(rep, dict) and isinstance(rep.get("ubep"), Report) and isinstance(rep.get("cann_ep"), Report)
            and isinstance(rep.get("reduction"), numbers.Real)):
        raise TypeError("format_report takes a report as compare(), run_case() or CostModel.report() return it: "
                        "{'ubep': Report, 'cann_ep': Report, 'reduction': float, ...}")
    u, c = rep["ubep"], rep["cann_ep"]

    def ph(r: Report) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in r.phases_us.items() if v > 0.05)

    head = f"{rep.get('kind', u.kind)}"
    if "rank" in rep:
        head += f" (rank {rep['rank']})"
    cfg = f"{u.sync}, mapping {'on' if u.mapping else 'off'}" + (f", n_count {u.n_count}" if u.n_count else "")
    return (f"{head} on CM384: UBEP {u.total_us:.1f} us ({cfg}; {ph(u)}) vs CANN EP {c.total_us:.1f} us ({ph(c)}): "
            f"{100 * rep['reduction']:.1f}% lower; worst AIV {u.worst_aiv_us:.1f} vs {c.worst_aiv_us:.1f} us; "
            f"{u.bytes / 1e6:.2f} MB at {u.effective_gbs:.1f} vs {c.effective_gbs:.1f} GB/s.")
