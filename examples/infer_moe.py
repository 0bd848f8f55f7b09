"""Greedy decoding of the MoE language model of ``train_moe.py`` with low-latency expert parallelism.

    torchrun --nproc-per-node 2 examples/infer_moe.py                  # random weights
    torchrun --nproc-per-node 2 examples/train_moe.py --save /tmp/moe.pt
    torchrun --nproc-per-node 2 examples/infer_moe.py --ckpt /tmp/moe.pt
    python examples/infer_moe.py --single                               # dense, one process

Every rank decodes its own batch of sequences, one token per sequence and step. Each MoE layer exchanges
tokens with ``Buffer.low_latency_dispatch``/``low_latency_combine`` (bf16, as in DeepEP) and overlaps the
exchange with compute using the recv hook and two micro-batches:

    attention(mb0) -> send(mb0) -> attention(mb1) -> send(mb1)      (mb0's tokens travel meanwhile)
    hook(mb0) -> experts(mb0) -> send back(mb0) -> hook(mb1) -> experts(mb1) -> send back(mb1)
    hook back(mb0), hook back(mb1)

It prints the measured time per output token on this machine and, when ``ubep_torch.cost_model`` is
available, the modeled CM384 latency of the step's MoE exchange, UBEP against CANN EP. ``--check``
also runs the dense model (all experts, float32) on the same inputs and reports the largest logit
difference and the agreement of the greedy tokens.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_moe as T

from ubep_torch.utils import deadline_seconds, int_at_least, memory_errors_as_usage_errors, require_torchrun

try:
    from ubep_torch.cost_model import CostModel, format_report
except ImportError:  # the cost model is optional
    CostModel = None
    format_report = None


class StepReports:
    """Collects the Buffer's per-call cost reports of one decode step."""

    def __init__(self):
        self.calls: list = []

    def __call__(self, kind: str, rep: dict) -> None:
        self.calls.append(rep)

    def take(self) -> tuple[float, float, list]:
        calls, self.calls = self.calls, []
        return (sum(c["ubep"].total_us for c in calls), sum(c["cann_ep"].total_us for c in calls), calls)


def moe_block_decode(block, xs: list, caches: list, buffer, n_max: int) -> list:
    """One transformer block for two (or more) micro-batches ``xs[i] [b_i, 1, D]``, overlapping the
    low-latency exchange of one micro-batch with the attention or expert compute of the other."""
    moe = block.moe
    sent = []
    for x, cache in zip(xs, caches):
        x = x + block.attn(block.ln1(x), cache)
        h = block.ln2(x).reshape(-1, x.shape[-1])
        topk_idx, topk_weights, _ = moe.router(h)
        recv_x, _count, handle, _, hook = buffer.low_latency_dispatch(
            h.to(torch.bfloat16), topk_idx, n_max, moe.num_experts, use_fp8=False, return_recv_hook=True)
        sent.append((x, h, topk_idx, topk_weights, recv_x, handle, hook))
    returned = []
    for x, h, topk_idx, topk_weights, recv_x, handle, hook in sent:
        hook()  # this micro-batch's tokens are here; the next one's are still in flight
        y = moe.experts.forward_padded(recv_x.to(h.dtype)).to(torch.bfloat16)
        combined, _, back_hook = buffer.low_latency_combine(y, topk_idx, topk_weights.float(), handle,
                                                            return_recv_hook=True)
        returned.append((x, h, combined, back_hook))
    outs = []
    for x, h, combined, back_hook in returned:
        back_hook()
        out = combined.to(h.dtype)
        if moe.shared_expert is not None:
            out = out + moe.shared_expert(h)
        outs.append(x + out.view_as(x))
    return outs


def decode_step(model, tokens: list, caches: list, pos: int, buffer, n_max: int) -> list:
    """Logits ``[b_i, V]`` of the next token of each micro-batch (``tokens[i] [b_i, 1]``)."""
    xs = [model.tok(t) + model.pos(torch.tensor([pos]))[None] for t in tokens]
    for li, block in enumerate(model.blocks):
        layer_caches = [c[li] for c in caches]
        if buffer is None:
            xs = [block(x, c) for x, c in zip(xs, layer_caches)]
        else:
            xs = moe_block_decode(block, xs, layer_caches, buffer, n_max)
    return [(model.ln_f(x) @ model.tok.weight.t())[:, -1] for x in xs]


def dense_logits(dense, seqs: torch.Tensor) -> torch.Tensor:
    """Reference: the dense model over whole sequences (no cache), logits of the last position."""
    with torch.no_grad():
        return dense(seqs)[:, -1]


def run(args) -> dict:
    distributed = not args.single
    if distributed:
        require_torchrun("examples/infer_moe.py", "python examples/infer_moe.py --single (dense, one process)")
        # (the waits outside the Buffer, gloo's all-reduces and barriers, get the same deadline as its calls)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    torch.set_num_threads(max(1, args.threads))
    data = T.CharData()
    if args.ckpt:
        try:
            ck = torch.load(args.ckpt, weights_only=False)
            shape = {k: ck["args"][k] for k in ("dim", "heads", "layers", "experts", "top_k", "ffn", "shared",
                                                 "router", "seq")}
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
            raise SystemExit(f"infer_moe.py: --ckpt {args.ckpt} is not a checkpoint of train_moe.py --save "
                             f"({type(e).__name__}: {e})") from None
        for k, v in shape.items():
            setattr(args, k, v)
    if distributed:
        T.check_experts_per_rank("examples/infer_moe.py", args.experts, world)
    targs = argparse.Namespace(**vars(args))
    # positions fed: the prompt's and every generated token's but the last, 0 .. len(prompt) + tokens - 2
    need = len(args.prompt) + args.tokens - 1
    if args.ckpt and need > args.seq:               # (the checkpoint's position table has its training length)
        fit = args.seq - len(args.prompt) + 1
        raise SystemExit(f"infer_moe.py: the prompt ({len(args.prompt)} characters) and --tokens {args.tokens} need "
                         f"{need} positions, but --ckpt {args.ckpt} was trained with --seq {args.seq}: "
                         + (f"use at most --tokens {fit}" if fit >= 1 else
                            f"use a prompt of at most {args.seq} characters"))
    targs.seq = args.seq if args.ckpt else max(args.seq, need + 2)
    n_max = (args.batch + 1) // 2          # tokens per micro-batch and rank
    reports = StepReports()
    buffer = None
    if distributed and world > 1:
        from ubep_torch.buffer import Buffer
        kw = {}
        if CostModel is not None and not args.no_cost_model:
            kw = {"cost_model": CostModel(), "on_report": reports}
        buffer = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, low_latency_mode=True,
                        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(n_max, args.dim, world, args.experts),
                        timeout_s=args.timeout, **kw)
    torch.manual_seed(args.seed)
    dense = T.MoETransformerLM(data.vocab_size, dim=args.dim, heads=args.heads, layers=args.layers,
                               max_seq=targs.seq, num_experts=args.experts, top_k=args.top_k, ffn_hidden=args.ffn,
                               shared_expert_hidden=args.shared or None, router=args.router)
    if args.ckpt:
        try:
            dense.load_state_dict(ck["state"])
        except (KeyError, RuntimeError, TypeError, AttributeError) as e:
            raise SystemExit(f"infer_moe.py: --ckpt {args.ckpt}: its weights do not fit the model its arguments "
                             f"describe ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    model = dense
    if buffer is not None:
        model = T.MoETransformerLM(data.vocab_size, dim=args.dim, heads=args.heads, layers=args.layers,
                                   max_seq=targs.seq, num_experts=args.experts, top_k=args.top_k,
                                   ffn_hidden=args.ffn, shared_expert_hidden=args.shared or None,
                                   router=args.router, buffer=buffer)
        model.load_dense_state_dict(dense.state_dict())
    model.eval()

    # Each rank starts its sequences from the prompt shifted by a rank- and row-dependent character.
    prompt = data.encode(args.prompt)
    seqs = torch.stack([torch.roll(prompt, -((rank * args.batch + b) % 3)) for b in range(args.batch)])
    half = (args.batch + 1) // 2
    split = [slice(0, half), slice(half, args.batch)]
    caches = [[{} for _ in model.blocks] for _ in split]
    step_times, modeled, max_diff, agree, total = [], [], 0.0, 0, 0
    with torch.no_grad():
        # The prompt is fed one position per step through the same low-latency path (prefill by decoding).
        for pos in range(prompt.numel() + args.tokens - 1):
            tokens = [seqs[s, pos:pos + 1] for s in split]
            t0 = time.perf_counter()
            logits = decode_step(model, tokens, caches, pos, buffer, n_max)
            dt = time.perf_counter() - t0
            if buffer is not None and CostModel is not None and not args.no_cost_model:
                modeled.append(reports.take())
            nxt = torch.cat([lg.argmax(-1) for lg in logits])
            if pos >= prompt.numel() - 1:
                step_times.append(dt)
                if args.check:
                    ref = dense_logits(dense, seqs[:, :pos + 1])
                    got = torch.cat(logits)
                    max_diff = max(max_diff, float((got - ref).abs().max()))
                    agree += int((ref.argmax(-1) == nxt).sum())
                    total += nxt.numel()
                seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    if args.check and distributed:      # every rank's comparison, not rank 0's alone
        sums = torch.tensor([agree, total], dtype=torch.int64)
        worst = torch.tensor([max_diff], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        (agree, total), max_diff = sums.tolist(), float(worst)
    measured = step_times[1:] or step_times        # the first step pays one-time allocation
    tpot_ms = 1e3 * sum(measured) / len(measured)
    result = {"tpot_ms": tpot_ms, "max_logit_diff": max_diff, "agree": agree, "total": total,
              "text": data.decode(seqs[0])}
    if rank == 0:
        mode = "dense, one process" if buffer is None else f"low-latency expert parallel over {world} ranks"
        print(f"decoded {args.tokens} tokens x {args.batch} sequences per rank ({mode}, 2 micro-batches)")
        print(f"sample: {result['text']!r}")
        print(f"time per output token (measured on this machine): {tpot_ms:.2f} ms "
              f"({args.batch * world / (tpot_ms / 1e3):.0f} tokens/s over all ranks)")
        if modeled:
            ub = sum(m[0] for m in modeled) / len(modeled)
            cann = sum(m[1] for m in modeled) / len(modeled)
            calls = len(modeled[-1][2])
            result.update(modeled_ubep_us=ub, modeled_cann_us=cann)
            print(f"modeled CM384 MoE exchange per step ({calls} low-latency calls: {args.layers} layers x "
                  f"2 micro-batches x dispatch+combine): UBEP {ub:.1f} us vs CANN EP {cann:.1f} us "
                  f"({100 * (1 - ub / cann) if cann else 0:.1f}% lower)")
            if args.verbose and modeled[-1][2]:
                print("last call:", format_report(modeled[-1][2][-1]))
        elif buffer is not None and not args.no_cost_model:
            print("modeled CM384 latency: ubep_torch.cost_model not available")
        if args.check:
            over = f" (all {world} ranks)" if world > 1 else ""
            print(f"check against the dense float32 model{over}: max |logit diff| {max_diff:.4f}, greedy tokens "
                  f"agree {agree}/{total}")
    if buffer is not None:
        buffer.destroy()
    if distributed:
        dist.barrier()   # every rank is done with the group (rank 0 may still be saving) before any tears it down
        dist.destroy_process_group()
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_at_least(1), default=32, help="tokens to generate per sequence")
    p.add_argument("--batch", type=int_at_least(1, 1 << 24), default=8,
                   help="sequences per rank (split in 2 micro-batches)")
    p.add_argument("--prompt", default="the cat sees")
    p.add_argument("--ckpt", default="", help="dense checkpoint written by train_moe.py --save (the model's "
                                              "shape options then come from it)")
    T.add_model_args(p)
    p.add_argument("--timeout", type=deadline_seconds, default=60.0, help="seconds every wait may take")
    p.add_argument("--single", action="store_true", help="dense model in one process (no Buffer)")
    p.add_argument("--check", action="store_true", help="compare every step with the dense model")
    p.add_argument("--no-cost-model", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    args = p.parse_args(argv)
    if args.tiny:   # smaller defaults; options given on the command line still win
        p.set_defaults(tokens=min(p.get_default("tokens"), 6), batch=4, dim=32, ffn=32, shared=16,
                       experts=max(4, p.get_default("experts") // 2))
        args = p.parse_args(argv)
    T.check_model_args(p, args)
    if not args.prompt:
        p.error("--prompt must not be empty")
    try:
        T.CharData().encode(args.prompt)
    except ValueError as e:
        p.error(f"--prompt: {e}")
    if args.ckpt and not os.path.isfile(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such file")
    return args


if __name__ == "__main__":
    with memory_errors_as_usage_errors("examples/infer_moe.py"):
        run(parse_args())
