"""Train a small MoE transformer language model, expert-parallel over CPU ranks.

    torchrun --nproc-per-node 2 examples/train_moe.py            # expert parallel on 2 ranks (or 4)
    python examples/train_moe.py --single --world 2                # the same model and data, one process

Experts are sharded (rank ``r`` owns experts ``[r * E / R, (r + 1) * E / R)``) and the tokens of every
MoE layer travel through ``ubep_torch.Buffer`` with the differentiable ``ubep_torch.functional`` pair;
everything else is data-parallel (gradients all-reduced over gloo). The text is generated: sentences of a
tiny grammar, so there is structure to learn and nothing to download.

``--single`` runs the global batch of all ``--world`` ranks in one process on the dense path, one rank's
slice at a time with gradient accumulation (the data-parallel objective is the mean of the per-rank
losses, each with its own load-balancing term), so the two loss curves agree up to float rounding.
``--loss-file`` writes the curve as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as tF
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ubep_torch import nn as unn
from ubep_torch import protocol as P
from ubep_torch.utils import (
    deadline_seconds,
    int_at_least,
    memory_errors_as_usage_errors,
    non_negative_number,
    require_torchrun,
)

# ----------------------------------------------------------------------------- data
_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the teacher"]
_VERBS = ["sees", "likes", "finds", "follows", "draws", "helps", "hears"]
_OBJECTS = ["the ball", "a red box", "the river", "an apple", "the moon", "a small boat", "the garden"]
_ENDINGS = [".", " today.", " at night.", " again.", " in the rain."]


def generate_text(num_sentences: int = 4000, seed: int = 1234) -> str:
    """Sentences of a tiny grammar (deterministic for a seed)."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
                    for _ in range(num_sentences))


class CharData:
    """Character-level tokens of :func:`generate_text`; ``batch(step, n, seq)`` is the same on every rank."""

    def __init__(self, seed: int = 1234):
        text = generate_text(seed=seed)
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        unknown = sorted(set(s) - set(self.stoi))
        if unknown:
            raise ValueError(f"characters {''.join(unknown)!r} are not in the vocabulary {''.join(self.chars)!r}")
        return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, step: int, n: int, seq: int) -> torch.Tensor:
        """``[n, seq + 1]`` windows (inputs and shifted targets) chosen by ``step``."""
        g = torch.Generator().manual_seed(10_000 + step)
        starts = torch.randint(0, self.data.numel() - seq - 1, (n,), generator=g)
        return torch.stack([self.data[s:s + seq + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal multi-head self-attention with an optional key/value cache for decoding."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        causal = cache is None or s > 1
        y = tF.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe_kwargs: dict):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = unn.MoE(dim, **moe_kwargs)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.moe(self.ln2(x))


class MoETransformerLM(nn.Module):
    """Token + position embeddings, ``layers`` blocks of (attention, MoE), a final norm and a tied head.

    ``forward(idx [B, S]) -> logits [B, S, V]``; :meth:`aux_loss` sums the MoE load-balancing terms of the
    last forward.
    """

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2, max_seq: int = 256,
                 num_experts: int = 8, top_k: int = 2, ffn_hidden: int = 96, shared_expert_hidden: int | None = 64,
                 router: str = "softmax", buffer=None):
        super().__init__()
        self.max_seq = max_seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        moe_kwargs = {"ffn_hidden": ffn_hidden, "num_experts": num_experts, "top_k": top_k, "router": router,
                          "shared_expert_hidden": shared_expert_hidden, "buffer": buffer}
        self.blocks = nn.ModuleList(Block(dim, heads, moe_kwargs) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor, caches: list | None = None, start: int = 0) -> torch.Tensor:
        pos = torch.arange(start, start + idx.shape[1])
        x = self.tok(idx) + self.pos(pos)[None]
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.ln_f(x) @ self.tok.weight.t()

    def aux_loss(self) -> torch.Tensor:
        return sum(b.moe.aux_loss for b in self.blocks)

    def moe_layers(self) -> list:
        return [b.moe for b in self.blocks]

    def load_dense_state_dict(self, state: dict) -> None:
        """Load a dense model's state; every MoE layer keeps only this rank's experts."""
        for i, moe in enumerate(self.moe_layers()):
            prefix = f"blocks.{i}.moe."
            moe.load_dense_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        rest = {k: v for k, v in state.items() if ".moe." not in k}
        missing, unexpected = self.load_state_dict(rest, strict=False)
        assert not unexpected and all(".moe." in k for k in missing), (missing, unexpected)


def build_model(args, vocab: int, buffer=None) -> MoETransformerLM:
    """The dense model for ``args.seed``; with a Buffer, its expert-parallel shard (same parameters)."""
    kw = {"dim": args.dim, "heads": args.heads, "layers": args.layers, "max_seq": args.seq, "num_experts": args.experts,
              "top_k": args.top_k, "ffn_hidden": args.ffn, "shared_expert_hidden": args.shared or None,
              "router": args.router}
    torch.manual_seed(args.seed)
    dense = MoETransformerLM(vocab, **kw)
    if buffer is None or buffer.group_size == 1:
        return dense
    model = MoETransformerLM(vocab, **kw, buffer=buffer)
    model.load_dense_state_dict(dense.state_dict())
    return model


def make_buffer(group, args):
    from ubep_torch.buffer import Buffer
    tokens = args.batch * args.seq
    return Buffer(group, num_max_tokens_per_rank=tokens * args.top_k, hidden=max(args.dim, args.experts) * 2,
                  timeout_s=args.timeout)


# ----------------------------------------------------------------------------- training
def lm_loss(model: MoETransformerLM, batch: torch.Tensor, aux_weight: float = 1.0) -> tuple:
    logits = model(batch[:, :-1])
    ce = tF.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return ce + aux_weight * model.aux_loss(), ce


def train(args) -> list:
    distributed = not args.single
    if distributed:
        require_torchrun("examples/train_moe.py", "python examples/train_moe.py --single --world 2 (one process)")
        # torch._dynamo before the process group exists: the optimizer below would import it after, and then
        # it keeps references to the group that destroy_process_group cannot drop, so gloo's threads are left
        # to the interpreter's exit and may abort the finished run (README, "Exiting under torchrun")
        importlib.import_module("torch._dynamo")   # (a plain import would make torch a local name here)
        # (the waits outside the Buffer, gloo's all-reduces and barriers, get the same deadline as its calls)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        rank, world = dist.get_rank(), dist.get_world_size()
        check_experts_per_rank("examples/train_moe.py", args.experts, world)
    else:
        rank, world = 0, args.world
    torch.set_num_threads(max(1, args.threads))
    data = CharData()
    buffer = make_buffer(dist.group.WORLD, args) if distributed and world > 1 else None
    model = build_model(args, data.vocab_size, buffer)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        mode = "single process" if not distributed else f"expert parallel over {world} ranks"
        print(f"MoE LM: {args.layers} layers, dim {args.dim}, {args.experts} experts top-{args.top_k}, "
              f"{n_params} parameters on rank 0, {mode}", flush=True)
    curve = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = data.batch(step, world * args.batch, args.seq)
        opt.zero_grad(set_to_none=True)
        if distributed:
            mine = batch[rank * args.batch:(rank + 1) * args.batch]
            loss, ce = lm_loss(model, mine)
            loss.backward()
            if world > 1:
                unn.data_parallel_sync(model)
            stats = torch.stack([loss.detach(), ce.detach()])
            if world > 1:
                dist.all_reduce(stats)
                stats /= world
        else:
            stats = torch.zeros(2)
            for r in range(world):
                loss, ce = lm_loss(model, batch[r * args.batch:(r + 1) * args.batch])
                (loss / world).backward()
                stats += torch.stack([loss.detach(), ce.detach()]) / world
        opt.step()
        curve.append(float(stats[0]))
        if rank == 0:
            print(f"step {step:4d}  loss {stats[0]:.4f}  (cross-entropy {stats[1]:.4f}, "
                  f"{math.exp(float(stats[1])):.2f} ppl)", flush=True)
    if rank == 0:
        dt = time.perf_counter() - t0
        print(f"loss {curve[0]:.4f} -> {curve[-1]:.4f} in {args.steps} steps, {dt / max(args.steps, 1):.3f} s/step",
              flush=True)
        if args.loss_file:
            with open(args.loss_file, "w") as f:
                json.dump({"world": world, "single": args.single, "loss": curve}, f)
    if args.save:
        state = model.state_dict()
        if distributed and world > 1:
            # Reassemble the dense checkpoint: every rank contributes its experts.
            gathered = [None] * world
            dist.all_gather_object(gathered, {k: v for k, v in state.items() if ".moe.experts." in k})
            for k in state:
                if ".moe.experts." in k:
                    state[k] = torch.cat([g[k] for g in gathered], dim=0)
        if rank == 0:
            torch.save({"args": vars(args), "state": state}, args.save)
            print(f"saved {args.save}", flush=True)
    if buffer is not None:
        buffer.destroy()
    if distributed:
        dist.barrier()   # every rank is done with the group (rank 0 may still be saving) before any tears it down
        dist.destroy_process_group()
    return curve


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape options (shared with infer_moe.py)."""
    p.add_argument("--dim", type=int_at_least(1), default=64)
    p.add_argument("--heads", type=int_at_least(1), default=4)
    p.add_argument("--layers", type=int_at_least(1), default=2)
    p.add_argument("--experts", type=int_at_least(1), default=8)
    p.add_argument("--top-k", type=int_at_least(1), default=2)
    p.add_argument("--ffn", type=int_at_least(1), default=96)
    p.add_argument("--shared", type=int_at_least(0), default=64, help="shared expert width (0 = none)")
    p.add_argument("--router", choices=unn.ROUTERS, default="softmax")
    p.add_argument("--seq", type=int_at_least(2), default=64)
    p.add_argument("--seed", type=int_at_least(-(2 ** 63), 2 ** 64 - 1), default=0)   # (torch.manual_seed's range)
    p.add_argument("--threads", type=int_at_least(1), default=1)


def check_experts_per_rank(script: str, experts: int, world: int) -> None:
    """Under torchrun, once the group size is known: a one-line error (on every rank) instead of a traceback
    when ``--experts`` does not split over the ranks, or gives a rank more experts than one control message
    of a normal-mode call counts."""
    most = P.MAX_CTRL_COUNTS - world - 1
    if experts % world:
        raise SystemExit(f"{script}: --experts {experts} must be a multiple of the {world} ranks")
    if experts // world > most:
        raise SystemExit(f"{script}: --experts {experts} gives {experts // world} experts per rank; at most "
                         f"{most} with {world} ranks")


def check_model_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.seq >= len(generate_text()) - 1:
        p.error(f"--seq {args.seq} is not shorter than the {len(generate_text())}-character corpus")
    for opt in ("save", "loss_file"):
        path = getattr(args, opt, "")
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"--{opt.replace('_', '-')} {path}: no such directory")
        if path and os.path.isdir(path):
            p.error(f"--{opt.replace('_', '-')} {path} is a directory; give a file name")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int_at_least(1), default=40)
    p.add_argument("--batch", type=int_at_least(1, 1 << 24), default=8, help="sequences per rank and step")
    add_model_args(p)
    p.add_argument("--lr", type=non_negative_number, default=3e-3)
    p.add_argument("--timeout", type=deadline_seconds, default=60.0, help="seconds every wait may take")
    p.add_argument("--single", action="store_true", help="run the same model and global batch in one process")
    p.add_argument("--world", type=int_at_least(1), default=2, help="with --single: how many ranks to reproduce")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    p.add_argument("--loss-file", default="")
    p.add_argument("--save", default="", help="write a dense checkpoint (for infer_moe.py --ckpt)")
    args = p.parse_args(argv)
    if args.tiny:   # smaller defaults; options given on the command line still win
        p.set_defaults(steps=min(p.get_default("steps"), 8), batch=2, seq=24, dim=32, ffn=32, shared=16,
                       experts=max(4, p.get_default("experts") // 2))
        args = p.parse_args(argv)
    check_model_args(p, args)
    if args.single and args.experts % args.world:
        p.error(f"--experts {args.experts} is not divisible by --world {args.world} (the expert-parallel run "
                f"it reproduces needs that)")
    return args


if __name__ == "__main__":
    with memory_errors_as_usage_errors("examples/train_moe.py"):
        train(parse_args())
