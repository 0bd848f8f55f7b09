"""CM384 topology and the one set of hardware constants the cost model uses.

Ranks are NPU *dies*. Two dies make an NPU, ``npus_per_node`` NPUs share a node's level-1 UB switch
tier, and nodes are joined by the level-2 tier. Every (source, destination) pair of dies falls in one
hop class (paper section 2.3, "Terminology"):

* ``SAME_DIE``  : source == destination (local HBM; the paper does not model it separately),
* ``INTRA_NPU`` : the other die of the same NPU (cross-die link),
* ``ONE_HOP``   : another NPU of the same node (through the L1 tier),
* ``TWO_HOP``   : an NPU of another node (through L1 and L2).

The same function applies to the small worlds of the real ``Buffer`` (rank ``r`` is die ``r``).

Every number below cites the line of ``docs/cm384-calibration.md`` (``CAL``) or the
paper section it comes from. Numbers marked *calibrated* are not published: they are physical
quantities (a per-core bandwidth, a barrier cost) whose value was chosen once so that the model
reproduces the public calibration points listed in ``docs/reproducing.md``; nothing in the model is
specific to one figure.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

import numpy as np
import torch

from .protocol import BLOCK_BYTES, FLAG_BYTES, TFF_PAYLOAD_BYTES
from .utils import check_count, check_real

SAME_DIE = 0
INTRA_NPU = 1
ONE_HOP = 2
TWO_HOP = 3
NUM_HOP_CLASSES = 4
HOP_NAMES = {SAME_DIE: "same_die", INTRA_NPU: "intra_npu", ONE_HOP: "one_hop", TWO_HOP: "two_hop"}

ArrayLike = Union[np.ndarray, torch.Tensor, int]

#: the most AIVs per die the cost model replays (a CloudMatrix384 die has 48)
MAX_AIVS = 1024


@dataclass(frozen=True)
class Topology:
    """Dies, NPUs and nodes of a (possibly partial) CloudMatrix-style superpod.

    Args:
        dies_per_npu: compute dies per NPU (CAL line 7: "each NPU has 2 compute dies").
        npus_per_node: NPUs behind one level-1 switch tier (CAL line 7: "48 nodes of 8 NPUs").
        nodes: nodes joined by the level-2 tier (CAL lines 7-8).
    """

    dies_per_npu: int = 2
    npus_per_node: int = 8
    nodes: int = 48

    def __post_init__(self) -> None:
        for name in ("dies_per_npu", "npus_per_node", "nodes"):
            check_count(name, getattr(self, name), 1)

    @property
    def dies_per_node(self) -> int:
        return self.dies_per_npu * self.npus_per_node

    @property
    def num_dies(self) -> int:
        return self.dies_per_node * self.nodes

    @classmethod
    def for_ranks(cls, world_size: int, ranks_per_node: int = 16, dies_per_npu: int = 2) -> Topology:
        """The smallest topology holding ``world_size`` dies with ``ranks_per_node`` dies per node."""
        world_size = check_count("world_size", world_size, 1)
        ranks_per_node = check_count("ranks_per_node", ranks_per_node, 1)
        dies_per_npu = check_count("dies_per_npu", dies_per_npu, 1)
        if ranks_per_node % dies_per_npu:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be a multiple of dies_per_npu={dies_per_npu}")
        nodes = max(1, -(-int(world_size) // int(ranks_per_node)))
        return cls(dies_per_npu=dies_per_npu, npus_per_node=ranks_per_node // dies_per_npu, nodes=nodes)

    def hop_class(self, src: ArrayLike, dst: ArrayLike) -> ArrayLike:
        """Hop class of every (src, dst) die pair; broadcasts like ``src == dst``.

        Args:
            src, dst: int ranks (die ids); python ints, numpy arrays or torch tensors of any
                (broadcastable) shape.
        Returns:
            Codes ``SAME_DIE``/``INTRA_NPU``/``ONE_HOP``/``TWO_HOP`` with the broadcast shape, as the
            same array type as the inputs (int64 for tensors and arrays).
        """
        s, d = self._dies("src", src), self._dies("dst", dst)
        tensor = next((t for t in (src, dst) if isinstance(t, torch.Tensor)), None)
        if tensor is not None:
            torch.broadcast_shapes(s.shape, d.shape)     # (torch's error for shapes that do not broadcast)
        out = np.where(s // self.dies_per_node == d // self.dies_per_node, ONE_HOP, TWO_HOP)
        out = np.where(s // self.dies_per_npu == d // self.dies_per_npu, INTRA_NPU, out)
        out = np.where(s == d, SAME_DIE, out).astype(np.int64)
        if tensor is not None:
            return torch.from_numpy(out).to(tensor.device)
        return int(out) if out.ndim == 0 and isinstance(src, int) and isinstance(dst, int) else out

    def _dies(self, name: str, ids) -> np.ndarray:
        """``ids`` as an int64 numpy array of die ids of this topology; TypeError for other than integers,
        ValueError for an id outside [0, num_dies)."""
        if isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"Topology.hop_class: {name} must be integer die ids, got a {ids.dtype} tensor")
            if ids.is_meta:
                raise ValueError(f"Topology.hop_class: {name} is a meta tensor (it has no ids)")
            a = ids.detach().cpu().resolve_neg().numpy()
        elif isinstance(ids, int) and not isinstance(ids, bool) and not -(1 << 63) <= ids < 1 << 64:   # (past numpy)
            raise ValueError(f"Topology.hop_class: {name} names die {ids}; this topology has dies "
                             f"0..{self.num_dies - 1}")
        else:
            a = np.asarray(ids)
        if a.size and a.dtype.kind not in "iu":     # (no ids at all: of any type, as an empty list is float)
            raise TypeError(f"Topology.hop_class: {name} must be integer die ids, got {ids!r}"[:200])
        if a.size:
            lo, hi = int(a.min()), int(a.max())       # (before any cast: a uint64 past int64 stays what it is)
            if lo < 0 or hi >= self.num_dies:
                raise ValueError(f"Topology.hop_class: {name} names die {lo if lo < 0 else hi}; this topology has "
                                 f"dies 0..{self.num_dies - 1}")
        return a.astype(np.int64)

    def hop_matrix(self, world_size: int) -> np.ndarray:
        """``[world_size, world_size]`` int64 hop classes of all die pairs."""
        world_size = check_count("world_size", world_size, 1)
        if world_size > self.num_dies:
            raise ValueError(f"world_size={world_size} exceeds this topology's {self.num_dies} dies")
        r = np.arange(world_size, dtype=np.int64)
        return self.hop_class(r[:, None], r[None, :])


CM384_TOPOLOGY = Topology(dies_per_npu=2, npus_per_node=8, nodes=48)  # CAL line 7: 384 NPUs, 768 dies


@dataclass(frozen=True)
class CM384Params:
    """Every latency, bandwidth and overhead of the cost model, in µs and GB/s (1 GB/s = 1e3 B/µs).

    Published hardware facts
        ``hop_latency_us``: Table 2 of the UBEP paper (CAL lines 25-26: intra-NPU 218 ns, one-hop 929 ns,
        two-hop 2500 ns). Same-die access is given the intra-NPU value: the paper does not model it
        separately (paper section 2.3, "Terminology").
        ``ub_link_gbs``: measured NPU->NPU write bandwidth per die at 512 B (CAL line 13: 137 GB/s intra
        node, 135 GB/s inter node); cross-die link: CAL lines 11-12 (270 GB/s); ``hbm_gbs``: CAL line 10.
        ``aivs_per_die``: CAL line 10. Block sizes come from ``ubep_torch.protocol`` (CAL line 29).

    Calibrated physical parameters (see ``docs/reproducing.md`` for the points they were set on)
        ``aiv_issue_gbs``: how fast one AIV streams stores out of its UBuf.
        ``store_depth``: token stores an AIV keeps in flight; a token copy exposes ``latency / depth``.
        ``token_overhead_us``: CANN EP's scalar work per token copy (destination lookup, UBuf staging).
        ``vector_token_overhead_us``: the same work in UBEP, done with vector instructions (section 4).
        ``syncall_us``: one SyncAll of all AIVs of a die (the "synchronization tax", CAL line 27).
        ``launch_us``: kernel launch and argument load.
        ``route_us_per_copy``: reading one top-k entry and bucketing it (Init phase), per AIV.
        ``flag_issue_us``: issuing one flag/count/checksum store (its flight time is the hop latency).
        ``poll_us``: one poll of a flag entry in local HBM.
        ``count_us_per_expert``: VectorCount of one expert over the batch (TokenCnt).
        ``cumsum_us_per_entry``: CalCumSum work per (source rank, local expert) count entry.
        ``qs_step_us``: one quaternary-search step of the mapper (paper: 4-5 steps, < 1 µs).
        ``block_check_us``: receiver-side verification of one DataBlock (flag compare / DC marker sum /
        sentinel compare), folded into the reorder read.
        ``sp_rearm_share``: what Sentinel Polling adds to that per block, as a share of it: the receiver
        also stores the sentinel back into every block it consumed (paper section 3.4: SP "necessitates
        active resetting of the receive buffer"), a store beside the check's load. Set, not fitted.
    """

    hop_latency_us: dict[int, float] = field(default_factory=lambda: {
        SAME_DIE: 0.218,     # CAL lines 25-26 (intra-NPU value; same-die not modelled separately, paper 2.3)
        INTRA_NPU: 0.218,    # CAL lines 25-26
        ONE_HOP: 0.929,      # CAL lines 25-26
        TWO_HOP: 2.500,      # CAL lines 25-26
    })
    ub_link_gbs: dict[int, float] = field(default_factory=lambda: {
        SAME_DIE: 1600.0,    # CAL line 10: HBM 1.6 TB/s (no fabric link involved)
        INTRA_NPU: 270.0,    # CAL lines 11-12: cross-die link 270 GB/s per direction
        ONE_HOP: 137.0,      # CAL line 13: measured write, intra node, 512 B
        TWO_HOP: 135.0,      # CAL line 13: measured write, inter node, 512 B
    })
    hbm_gbs: float = 1600.0            # CAL line 10
    aivs_per_die: int = 48             # CAL line 10
    block_bytes: int = BLOCK_BYTES     # CAL line 29 (512 B atomic DataBlock)
    flag_bytes: int = FLAG_BYTES       # CAL line 29 (32 B flag)
    tff_payload_bytes: int = TFF_PAYLOAD_BYTES  # CAL line 29 (480 B payload)
    # --- calibrated once, jointly, on the public points of docs/reproducing.md ("What is calibrated")
    aiv_issue_gbs: float = 9.1         # store stream of one AIV out of its UBuf
    store_depth: float = 1.21          # stores in flight per AIV; sets the hop-latency share of a copy
    token_overhead_us: float = 0.91    # CANN EP scalar per-copy bookkeeping
    vector_token_overhead_us: float = 0.38  # UBEP's vectorised per-copy bookkeeping (paper section 4)
    syncall_us: float = 5.0            # one SyncAll; ~13% of CANN EP dispatch at EP 64 (CAL line 27: ~15%)
    launch_us: float = 12.0            # kernel launch + argument load
    route_us_per_copy: float = 0.04    # Init: read and bucket one top-k entry, per AIV
    flag_issue_us: float = 0.06        # issue one flag / count / checksum store
    poll_us: float = 0.2               # one poll of a remotely written GM entry (cf. 218 ns, CAL line 25)
    count_us_per_expert: float = 0.7   # TokenCnt of one expert: VectorCount + count-block staging
    cumsum_us_per_entry: float = 0.04  # CalCumSum per (source, local expert) entry
    qs_step_us: float = 0.15           # CAL lines 30-31: 4-5 quaternary-search steps in under 1 us
    block_check_us: float = 0.004      # receiver check of one DataBlock (flag / marker / sentinel)
    sp_rearm_share: float = 0.5        # SP's re-arm store of a consumed block, as a share of block_check_us

    def __post_init__(self) -> None:
        """Every field a finite number that the model can divide by where it does (bandwidths, sizes, AIVs:
        positive; latencies and costs: zero or more), and a latency and a bandwidth for every hop class."""
        for name in ("hop_latency_us", "ub_link_gbs"):
            table = getattr(self, name)
            if not isinstance(table, dict) or sorted(table) != list(range(NUM_HOP_CLASSES)):
                raise ValueError(f"CM384Params.{name} must map every hop class 0..{NUM_HOP_CLASSES - 1} to a number, "
                                 f"got {table!r}")
            for v in table.values():
                _check_param(f"{name} entry", v, positive=name == "ub_link_gbs")
        for name in ("block_bytes", "flag_bytes", "tff_payload_bytes"):
            check_count(f"CM384Params.{name}", getattr(self, name), 1)
        check_count("CM384Params.aivs_per_die", self.aivs_per_die, 2)    # (UBEP: a count and a token group)
        if self.aivs_per_die > MAX_AIVS:
            raise ValueError(f"CM384Params.aivs_per_die={self.aivs_per_die}: the model covers at most {MAX_AIVS}")
        if self.flag_bytes + self.tff_payload_bytes > self.block_bytes:
            raise ValueError("CM384Params: flag_bytes + tff_payload_bytes exceed block_bytes")
        for name in ("hbm_gbs", "aiv_issue_gbs", "store_depth"):
            _check_param(name, getattr(self, name), positive=True)
        for name in ("token_overhead_us", "vector_token_overhead_us", "syncall_us", "launch_us", "route_us_per_copy",
                     "flag_issue_us", "poll_us", "count_us_per_expert", "cumsum_us_per_entry", "qs_step_us",
                     "block_check_us", "sp_rearm_share"):
            _check_param(name, getattr(self, name), positive=False)

    def with_(self, **kw) -> CM384Params:
        """A copy with some fields replaced (for sweeps and what-if studies)."""
        return replace(self, **kw)

    @property
    def aiv_copy_gbs(self) -> float:
        """Local HBM->HBM copy rate of one AIV when all AIVs copy at once (read + write share HBM)."""
        return self.hbm_gbs / (2.0 * self.aivs_per_die)


def _check_param(name: str, value, positive: bool) -> None:
    check_real(f"CM384Params.{name}", value, minimum=0, positive=positive)


CM384 = CM384Params()
