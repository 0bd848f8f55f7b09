"""A Mixture-of-Experts layer that runs expert-parallel over a :class:`ubep_torch.Buffer`.

The layer composes communication and compute (communication knows nothing about experts):

    router -> functional.dispatch(layout="expert_major") -> grouped SwiGLU per local expert
           -> scale each row by its routing weight -> functional.combine -> (+ shared expert)

Rank ``r`` of a group of ``R`` owns experts ``[r * E_local, (r + 1) * E_local)``; everything else (router,
shared expert) is replicated and trained data-parallel (see :func:`data_parallel_sync`). Without a
Buffer, or with a group of one rank, the same layer runs a dense local path that sorts tokens into the
same expert-major order, so a dense model and an expert-parallel model with the same parameters give the
same outputs and gradients.

Shapes: ``T`` tokens, ``H`` hidden, ``F`` expert FFN hidden, ``E`` experts, ``K`` top-k.
"""
from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as tF
from torch import nn

from . import functional as F
from .errors import refusal
from .utils import check_count, check_flag, check_real, physical_memory

__all__ = ["GroupedSwiGLU", "MoE", "Router", "SwiGLU", "data_parallel_sync", "is_expert_parameter"]

ROUTERS = ("softmax", "sigmoid")


def is_expert_parameter(p: torch.Tensor) -> bool:
    """True for parameters tagged ``expert_parallel = True``: they live on one rank only (sharded experts)
    and are not all-reduced. (:func:`data_parallel_sync` also finds the experts of :class:`MoE` layers by
    their place in the module, where a tag may have been lost: see there.)"""
    return bool(getattr(p, "expert_parallel", False))


def _expert_parameters(module: nn.Module) -> set:
    """Ids of the parameters of ``module`` that live on one rank only: the experts of every expert-parallel
    :class:`MoE` inside it, found by their place (idioms such as ``load_state_dict(..., assign=True)``,
    building on the meta device then ``to_empty()``, or ``copy.deepcopy`` put new Parameter objects there,
    without the tag), else those tagged (:func:`is_expert_parameter`). The experts of a dense MoE (no
    Buffer) are replicated like any other parameter."""
    placed, dense = set(), set()
    for m in module.modules():
        if isinstance(m, MoE):
            (placed if m.expert_parallel else dense).update(id(p) for p in m.experts.parameters())
    return placed | {id(p) for p in module.parameters() if is_expert_parameter(p) and id(p) not in dense}


_MAY_BE_ZERO = {"shared_expert_hidden"}      # (0: no shared expert)


def _check_sizes(where: str, elements: Callable[..., int], **sizes) -> tuple:
    """The sizes (positive ints, as Python ints) of a block whose float32 parameters hold ``elements(*sizes)``
    values: refused before anything is allocated when they exceed the machine's memory, instead of torch's
    overflow or allocation error."""
    ints = tuple(check_count(f"ubep_torch.nn.{where}: {name}", value, 0 if name in _MAY_BE_ZERO else 1)
                 for name, value in sizes.items())
    if 4 * elements(*ints) > physical_memory():
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"ubep_torch.nn.{where}: {shown} make {4 * elements(*ints)} bytes of parameters, more than "
                         f"this machine's memory ({physical_memory()} bytes)"[:400])
    return ints


class Router(nn.Module):
    """Top-k router with the Switch/GShard load-balancing loss.

    Args:
        hidden: ``H``.
        num_experts: ``E``.
        top_k: ``K``.
        kind: ``"softmax"`` (probabilities over experts, Mixtral/Switch) or ``"sigmoid"`` (independent
            scores, DeepSeek-V3 style; the chosen scores are always normalized to sum to 1).
        normalize_topk: renormalize the chosen softmax probabilities to sum to 1.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, kind: str = "softmax",
                 normalize_topk: bool = True):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"ubep_torch.nn.Router: kind must be one of {ROUTERS}, got {kind!r}")
        hidden, num_experts, top_k = _check_sizes("Router", lambda h, e, k: e * h, hidden=hidden,
                                                  num_experts=num_experts, top_k=top_k)
        check_flag("ubep_torch.nn.Router: normalize_topk", normalize_topk)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"ubep_torch.nn.Router: need 0 < top_k <= num_experts, got {top_k}, {num_experts}")
        self.num_experts, self.top_k, self.kind, self.normalize_topk = num_experts, top_k, kind, normalize_topk
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x [T, H]``.

        Returns:
            ``(topk_idx [T, K] int64, topk_weights [T, K], balance_loss [])``. Weights and loss are float32
            for half-precision inputs (routing is precision-sensitive) and in ``x``'s dtype otherwise.
            ``balance_loss = E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``T*K`` assignments that
            chose expert ``e`` and ``P_e`` the mean routing probability of ``e``; it is 1 when balanced.
        """
        logits = tF.linear(x, self.weight.to(x.dtype))
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if self.kind == "softmax":
            probs = logits.softmax(dim=-1)
            weights, topk_idx = probs.topk(self.top_k, dim=-1)
            if self.normalize_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            scores = logits.sigmoid()
            weights, topk_idx = scores.topk(self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        t = x.shape[0]
        counts = torch.zeros(self.num_experts, dtype=probs.dtype, device=x.device)
        counts.index_add_(0, topk_idx.reshape(-1), torch.ones(topk_idx.numel(), dtype=probs.dtype,
                                                              device=x.device))
        frac = counts / max(t * self.top_k, 1)
        balance = self.num_experts * (frac * probs.mean(dim=0)).sum() if t else probs.sum() * 0
        return topk_idx, weights, balance


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``[.., H] -> [.., H]`` with FFN width ``F``."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        hidden, ffn_hidden = _check_sizes("SwiGLU", lambda h, f: 3 * h * f, hidden=hidden, ffn_hidden=ffn_hidden)
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 master weights, computed in the input's dtype (as the router and the experts do)
        d = x.dtype
        h = tF.silu(tF.linear(x, self.gate.weight.to(d))) * tF.linear(x, self.up.weight.to(d))
        return tF.linear(h, self.down.weight.to(d))


class GroupedSwiGLU(nn.Module):
    """``E_local`` SwiGLU experts stored as stacked weights.

    Parameters: ``w_gate [E_local, H, F]``, ``w_up [E_local, H, F]``, ``w_down [E_local, F, H]``, each
    tagged ``expert_parallel = True``.
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        num_experts, hidden, ffn_hidden = _check_sizes("GroupedSwiGLU", lambda e, h, f: 3 * e * h * f,
                                                       num_experts=num_experts, hidden=hidden, ffn_hidden=ffn_hidden)
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.randn(num_experts, hidden, ffn_hidden) / math.sqrt(hidden))
        self.w_up = nn.Parameter(torch.randn(num_experts, hidden, ffn_hidden) / math.sqrt(hidden))
        self.w_down = nn.Parameter(torch.randn(num_experts, ffn_hidden, hidden) / math.sqrt(ffn_hidden))
        for p in self.parameters():
            p.expert_parallel = True

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Expert-major rows ``x [rows, H]`` with ``counts[e]`` consecutive rows for expert ``e`` -> ``[rows, H]``."""
        if len(counts) != self.num_experts:
            raise ValueError(f"ubep_torch.nn.GroupedSwiGLU: {len(counts)} counts for {self.num_experts} experts")
        counts = [check_count("ubep_torch.nn.GroupedSwiGLU: counts", c) for c in counts]
        if sum(counts) != x.shape[0]:
            raise ValueError(f"ubep_torch.nn.GroupedSwiGLU: counts sum to {sum(counts)} but x has "
                             f"{x.shape[0]} rows")
        outs = []
        for e, part in enumerate(torch.split(x, list(counts), dim=0)):
            if part.shape[0] == 0:
                # Keep every expert weight in the graph so gradients are defined (zeros) on every rank.
                unused = (self.w_gate[e][:, :0] + self.w_up[e][:, :0]).to(x.dtype)
                outs.append(part @ unused @ self.w_down[e][:0].to(x.dtype))
                continue
            outs.append(self._expert(part, e))
        return torch.cat(outs, dim=0) if outs else x.new_zeros(0, x.shape[1])

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Low-latency layout ``x [E_local, M, H] -> [E_local, M, H]`` (rows past each count are computed too)."""
        d = x.dtype
        h = tF.silu(torch.bmm(x, self.w_gate.to(d))) * torch.bmm(x, self.w_up.to(d))
        return torch.bmm(h, self.w_down.to(d))

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        d = x.dtype
        return (tF.silu(x @ self.w_gate[e].to(d)) * (x @ self.w_up[e].to(d))) @ self.w_down[e].to(d)


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer, expert-parallel over ``buffer`` or dense without one.

    Args:
        hidden: ``H``.
        ffn_hidden: ``F``, each expert's SwiGLU width.
        num_experts: ``E`` in total (divisible by the group size).
        top_k: ``K``.
        router: ``"softmax"`` or ``"sigmoid"`` (see :class:`Router`).
        shared_expert_hidden: width of an always-on shared SwiGLU expert, or None for none.
        aux_loss_coef: scale of the load-balancing loss stored in :attr:`aux_loss` after each forward.
        buffer: a :class:`ubep_torch.Buffer`; None (or a group of one rank) selects the dense local path.
        layout: ``"expert_major"`` (the Buffer sorts rows per local expert) or ``"rank_major"`` (DeepEP's
            layout; the layer sorts locally). Only used in expert-parallel mode.
        expert_alignment: passed to dispatch (rows per expert padded to a multiple of it).
        normalize_topk: see :class:`Router`.

    Attributes:
        aux_loss: ``aux_loss_coef * balance_loss`` of the last forward (a 0-dim tensor in the graph).
        expert_offset, num_local_experts: this rank's experts are ``[expert_offset, expert_offset + E_local)``.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, *, router: str = "softmax",
                 shared_expert_hidden: int | None = None, aux_loss_coef: float = 0.01, buffer=None,
                 layout: str = "expert_major", expert_alignment: int = 1, normalize_topk: bool = True):
        super().__init__()
        if layout not in F.LAYOUTS:
            raise ValueError(f"ubep_torch.nn.MoE: layout must be one of {F.LAYOUTS}, got {layout!r}")
        for name, value, least in (("hidden", hidden, 1), ("ffn_hidden", ffn_hidden, 1),
                                   ("num_experts", num_experts, 1), ("top_k", top_k, 1),
                                   ("expert_alignment", expert_alignment, 1)):
            check_count(f"ubep_torch.nn.MoE: {name}", value, least)
        if shared_expert_hidden is not None:
            check_count("ubep_torch.nn.MoE: shared_expert_hidden", shared_expert_hidden)   # (0: none)
        check_flag("ubep_torch.nn.MoE: normalize_topk", normalize_topk)     # (as Buffer's flags)
        check_real("ubep_torch.nn.MoE: aux_loss_coef", aux_loss_coef)
        if buffer is not None:
            F.check_buffer(buffer, "ubep_torch.nn.MoE")
        world = 1 if buffer is None else int(buffer.group_size)
        if num_experts % world:
            raise ValueError(f"ubep_torch.nn.MoE: num_experts={num_experts} is not divisible by the "
                             f"{world} ranks of the Buffer's group")
        # the parameters: router, this rank's experts, shared expert
        hidden, ffn_hidden, num_experts, _ = _check_sizes(
            "MoE", lambda h, f, e, s: e * h + 3 * h * f * (e // world) + 3 * h * s, hidden=hidden,
            ffn_hidden=ffn_hidden, num_experts=num_experts, shared_expert_hidden=shared_expert_hidden or 0)
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.buffer = buffer if world > 1 else None
        self.layout, self.expert_alignment, self.aux_loss_coef = layout, expert_alignment, float(aux_loss_coef)
        self.num_local_experts = num_experts // world
        self.expert_offset = 0 if self.buffer is None else int(buffer.rank) * self.num_local_experts
        self.router = Router(hidden, num_experts, top_k, router, normalize_topk)
        self.experts = GroupedSwiGLU(self.num_local_experts, hidden, ffn_hidden)
        self.shared_expert = SwiGLU(hidden, shared_expert_hidden) if shared_expert_hidden else None
        self.aux_loss = torch.zeros(())

    @property
    def expert_parallel(self) -> bool:
        """Whether the layer runs its experts across ranks through a ``Buffer`` (else densely, locally)."""
        return self.buffer is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H] -> [..., H]``; also sets :attr:`aux_loss`. Collective in expert-parallel mode: an
        error before the dispatch (a bad ``x``, say) refuses the dispatch the peers make, as bad input to
        :mod:`ubep_torch.functional` does, so every rank leaves that step."""
        try:
            if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype.itemsize < 2:
                raise TypeError(f"ubep_torch.nn.MoE: x must be a float tensor (16 bits or more), got "
                                f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
            if x.layout != torch.strided or x.is_nested:
                raise TypeError(f"ubep_torch.nn.MoE: x must be a dense tensor, got "
                                f"{'a nested tensor' if x.is_nested else x.layout}")
            if x.device.type == "meta":
                raise ValueError("ubep_torch.nn.MoE: x is a meta tensor (it has no values)")
            if x.dim() < 1 or x.shape[-1] != self.hidden:
                raise ValueError(f"ubep_torch.nn.MoE: x must be [..., {self.hidden}], got {tuple(x.shape)}")
            shape = x.shape
            x2 = x.reshape(-1, self.hidden)
            topk_idx, topk_weights, balance = self.router(x2)
        except BaseException as e:
            refuse = getattr(self.buffer, "_refuse", None)
            if refuse is not None and refusal(e):
                refuse("dispatch")
            raise
        self.aux_loss = self.aux_loss_coef * balance
        if self.buffer is None:
            out = self._dense(x2, topk_idx, topk_weights)
        elif self.layout == "expert_major":
            out = self._expert_major(x2, topk_idx, topk_weights)
        else:
            out = self._rank_major(x2, topk_idx, topk_weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        return out.reshape(shape)

    # ------------------------------------------------------------------ paths
    def _sorted_rows(self, local_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Expert-major order of the (row, slot) pairs of ``local_idx [n, K]`` (``-1`` slots skipped)."""
        flat = local_idx.reshape(-1)
        keep = torch.nonzero(flat >= 0).squeeze(1)
        order = keep[torch.argsort(flat[keep], stable=True)]
        counts = torch.bincount(flat[order], minlength=self.num_local_experts)
        return order // local_idx.shape[1], order, counts.tolist()

    def _dense(self, x, topk_idx, topk_weights):
        rows, order, counts = self._sorted_rows(topk_idx)
        w = topk_weights.reshape(-1)[order].to(x.dtype)
        y = self.experts(x[rows], counts) * w[:, None]
        return torch.zeros_like(x).index_add(0, rows, y)

    def _expert_major(self, x, topk_idx, topk_weights):
        recv_x, _recv_eid, recv_w, handle = F.dispatch(self.buffer, x, topk_idx, topk_weights, self.num_experts,
                                                      layout="expert_major",
                                                      expert_alignment=self.expert_alignment)
        y = self.experts(recv_x, handle.num_recv_tokens_per_expert) * recv_w.to(recv_x.dtype)[:, None]
        return F.combine(self.buffer, y, handle)

    def _rank_major(self, x, topk_idx, topk_weights):
        recv_x, recv_idx, recv_w, handle = F.dispatch(self.buffer, x, topk_idx, topk_weights, self.num_experts,
                                                      layout="rank_major",
                                                      expert_alignment=self.expert_alignment)
        rows, order, counts = self._sorted_rows(recv_idx)
        w = recv_w.reshape(-1)[order].to(recv_x.dtype)
        y = self.experts(recv_x[rows], counts) * w[:, None]
        return F.combine(self.buffer, torch.zeros_like(recv_x).index_add(0, rows, y), handle)

    def __deepcopy__(self, memo) -> "MoE":
        """A copy with copies of the parameters, sharing the Buffer (EMA or evaluation copies, made between
        steps too): :attr:`aux_loss` of the last forward, a tensor of that step's graph, which torch cannot
        deep-copy, is copied detached."""
        state = dict(self.__dict__, aux_loss=self.aux_loss.detach())
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    # ------------------------------------------------------------------ parameters
    def load_dense_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the state of a dense :class:`MoE` with all ``E`` experts, keeping this rank's experts."""
        if not isinstance(state, Mapping):
            raise TypeError(f"ubep_torch.nn.MoE.load_dense_state_dict: state must be a state dict (a mapping of "
                            f"names to tensors), got {type(state).__name__}")
        lo, hi = self.expert_offset, self.expert_offset + self.num_local_experts
        own = {}
        for name, value in state.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise TypeError(f"ubep_torch.nn.MoE.load_dense_state_dict: state must map names to tensors, got "
                                f"{type(name).__name__} -> {type(value).__name__}")
            if name.startswith("experts.") and value.dim() == 0:
                raise ValueError(f"ubep_torch.nn.MoE.load_dense_state_dict: {name} is a 0-dim tensor; a dense "
                                 f"MoE's expert tensors have one row per expert")
            # (checked whole, not only this rank's slice of it: a shard of another world size must be refused
            # on every rank alike, not loaded on the ranks whose slice happens to fit)
            if name.startswith("experts.") and value.shape[0] != self.num_experts:
                raise ValueError(f"ubep_torch.nn.MoE.load_dense_state_dict: the state is not a dense MoE of this "
                                 f"layer's sizes: {name} has {value.shape[0]} rows, where a dense MoE of this layer "
                                 f"has one per expert ({self.num_experts}) (the state_dict of an expert-parallel "
                                 f"rank holds only that rank's experts)")
            own[name] = value[lo:hi] if name.startswith("experts.") else value
        try:
            self.load_state_dict(own)
        except RuntimeError as e:      # (missing or unexpected keys, other shapes: another model's state)
            raise ValueError(f"ubep_torch.nn.MoE.load_dense_state_dict: the state is not a dense MoE of this "
                             f"layer's sizes (hidden={self.hidden}, num_experts={self.num_experts}): "
                             f"{str(e)[:600]}") from None


def data_parallel_sync(module: nn.Module, group=None, dp_group=None) -> None:
    """Make gradients those of the mean loss over the ranks of ``group`` (call after ``backward``).

    Replicated parameters are all-reduced and divided by the group size. Expert parameters (those of
    expert-parallel :class:`MoE` layers, and others tagged ``expert_parallel = True``) are not reduced:
    every rank's loss already sent its gradient to the owning rank through combine's backward, so they hold
    the sum over ranks and are only divided by the group size.

    ``dp_group``: expert parallelism inside data parallelism, where ``group`` is this rank's
    expert-parallel group (its MoE layers' Buffer group) and every such group is a replica of the model:
    ``dp_group`` holds the ranks with this rank's place in the other replicas (the same experts). Every
    gradient is then averaged over ``dp_group`` as well, so they are those of the mean loss over all the
    ranks of both. (Ranks ``g * E + i`` with EP groups of E consecutive ranks: ``dp_group`` of rank r is
    ``[r % E, r % E + E, ...]``.) Every rank of a group passes a ``dp_group`` or none: the ranks of a group
    that disagree raise a ``ValueError``, while the ranks of other groups wait in their ``dp_group``'s
    agreement for the process group's timeout.

    Before any gradient is sent the ranks agree, over ``group``, then ``dp_group``, then ``group`` again,
    on the parameters' number, shapes and dtypes and on no sparse gradient; a rank given a bad ``module``
    raises its own error there and every other rank a ``ValueError`` naming it by its global rank.
    """
    for name, g in (("group", group), ("dp_group", dp_group)):
        # (no group to tell the others through: a rank given another group cannot reach theirs)
        if g is not None and not isinstance(g, dist.ProcessGroup):
            outside = " (torch's NON_GROUP_MEMBER: this rank is not in that group)" \
                if isinstance(g, int) and g == dist.GroupMember.NON_GROUP_MEMBER else ""
            raise TypeError(f"ubep_torch.nn.data_parallel_sync: {name} must be None or a process group, got "
                            f"{type(g).__name__}{outside}")
    # A bad module on one rank is told to every other rank in the agreements below (over ``group``, then over
    # ``dp_group``, which reaches the other replicas), all made before any gradient is sent, so every rank
    # raises instead of waiting in an all-reduce that rank never joins.
    bad: Optional[Exception] = None
    if not isinstance(module, nn.Module):
        bad = TypeError(f"ubep_torch.nn.data_parallel_sync: module must be a torch.nn.Module, got "
                        f"{type(module).__name__}")
    else:
        off = next((n for n, p in module.named_parameters() if p.device.type != "cpu"
                    or (p.grad is not None and p.grad.device.type != "cpu")), None)
        if off is not None:
            bad = ValueError(f"ubep_torch.nn.data_parallel_sync: parameter {off!r} (or its gradient) is not in host "
                             f"memory; the gloo all-reduce averages CPU tensors")
        elif dist.is_initialized():
            bad = _buffer_group_mismatch(module, group)
    if bad is not None and not dist.is_initialized():
        raise bad
    world = dist.get_world_size(group)
    replicas = 1 if dp_group is None else dist.get_world_size(dp_group)
    experts = set() if bad is not None else _expert_parameters(module)
    replicated = [] if bad is not None else [p for p in module.parameters() if id(p) not in experts]
    everything = [] if bad is not None else list(module.parameters())
    err = bad
    if bad is not None:
        bad.culprits = [dist.get_rank()]
    # (``replicas`` is agreed too: ranks of one group that disagree on having a dp_group would make a different
    # number of agreements)
    if world > 1:
        err = _agree(replicated, group, err, "group", replicas)
        if getattr(err, "dp_mismatch", False):    # (the ranks would make different numbers of agreements next)
            raise err
    if replicas > 1:
        err = _agree(everything, dp_group, err, "dp_group", replicas)
        if world > 1:     # (what only the dp_group agreement found, back to the ranks of this group)
            err = _agree(replicated, group, err, "group", replicas)
    if err is not None:
        raise err
    if world > 1:
        _average(_used_grads(replicated, group), group, world)
        for p in module.parameters():
            if p.grad is not None and id(p) in experts:
                p.grad /= world
    if replicas > 1:
        _average(_used_grads(everything, dp_group), dp_group, replicas)


def _buffer_group_mismatch(module: nn.Module, group) -> Optional[Exception]:
    """A ValueError when an expert-parallel :class:`MoE` of ``module`` exchanges over other ranks than
    ``group``: its experts' gradients hold the sum over its Buffer's ranks, so dividing by another group's size
    (or averaging the rest over it) gives wrong gradients without any error."""
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    for name, m in module.named_modules():
        ranks = getattr(m.buffer, "_global_ranks", None) if isinstance(m, MoE) and m.expert_parallel else None
        if ranks and list(ranks) != list(members):
            return ValueError(f"ubep_torch.nn.data_parallel_sync: the MoE layer {name or 'module'!r} exchanges "
                              f"tokens over ranks {list(ranks)} (its Buffer's group) but group has ranks {members}; "
                              f"pass its Buffer's group as group (and the other replicas' ranks as dp_group)")
    return None


def _agree(params: list, group, err: Optional[Exception], name: str, replicas: int) -> Optional[Exception]:
    """One agreement of ``group`` before any gradient is sent: the parameters' number, shapes and dtypes, no
    sparse gradient (a flat all-reduce of tensors of other sizes aborts the process inside gloo), and whether
    a rank has an error already (``err``: its own bad argument, or one an earlier agreement found; its
    ``culprits`` are the global ranks it blames), and the size of the ranks' ``dp_group`` (``replicas``).
    Returns ``err``, else the error this agreement finds (the same on every rank of the group), else None."""
    shapes = zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())
    sparse = int(any(p.grad is not None and p.grad.layout != torch.strided for p in params))
    world = dist.get_world_size()
    blamed = [0] * world                   # (global ranks: the culprits of errors found before)
    for r in getattr(err, "culprits", [dist.get_rank()] if err is not None else []):
        blamed[r] = 1
    agree = torch.tensor([len(params), -len(params), shapes, -shapes, sparse, int(err is not None)] + blamed
                         + [replicas, -replicas], dtype=torch.int64)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=group)
    if err is not None:
        return err
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    found = None
    if agree[5]:
        ranks = [r for r in range(world) if agree[6 + r]]
        found = ValueError(f"ubep_torch.nn.data_parallel_sync: rank(s) {ranks} were given a bad argument or hold "
                           f"a model that differs from the other ranks' (they raised it); nothing was averaged")
        found.culprits = ranks
    elif agree[-2] != -agree[-1]:
        found = ValueError(f"ubep_torch.nn.data_parallel_sync: the ranks of the {name} {members} pass dp_groups of "
                           f"different sizes ({-int(agree[-1])} to {int(agree[-2])}; 1 for none); every rank of a "
                           f"group must pass one, or none")
        found.dp_mismatch = True
    elif agree[0] != -agree[1]:
        found = ValueError(f"ubep_torch.nn.data_parallel_sync: the modules of the ranks of the {name} {members} "
                           f"have different numbers of parameters to average ({-int(agree[1])} to "
                           f"{int(agree[0])}); every rank must hold the same model")
    elif agree[2] != -agree[3]:
        found = ValueError(f"ubep_torch.nn.data_parallel_sync: the parameters to average of the ranks of the {name} "
                           f"{members} differ in shape or dtype; every rank must hold the same model")
    elif agree[4]:
        found = TypeError(f"ubep_torch.nn.data_parallel_sync: sparse gradients (nn.Embedding(sparse=True), say) on "
                          f"a rank of the {name} {members} are not averaged here; use dense ones")
    if found is not None and not hasattr(found, "culprits"):
        found.culprits = members
    return found


def _used_grads(params: list, group) -> list:
    """The gradients of those of ``params`` that a rank of ``group`` has one for, the same list on every rank
    (the ranks agreed on ``params`` first, see ``_agree``): a rank that did not use a parameter this step (a
    branch its batch did not take) gets zeros for it, so the all-reduce adds the same tensors everywhere.
    Parameters no rank has a gradient for keep none."""
    if not params:
        return []
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(used, group=group)
    grads = []
    for p, n in zip(params, used.tolist()):
        if n:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
            # (a parameter frozen here takes part with zeros and keeps no gradient: no optimizer step moves it)
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
    return grads


def _average(grads: list, group, size: int) -> None:
    """All-reduce ``grads`` over ``group`` in one flat message and divide them by ``size``."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
