"""``python -m ubep_torch.sim``: what a dispatch or combine would cost on a CloudMatrix384.

Sub-commands::

    dispatch --ranks R --batch B --hidden H --topk K --experts E [--ranks-per-node N] [--hot-experts N]
             [--sync tff|dc|sp|sw] [--no-mapping] [--count-aivs N] [--seed S] [--json]
    combine  (same options)
    sweep    [calibration|batch|ranks|experts|granularity|sync|ncount|topk|aivs|fig10|all]
             [--plot FILE.png] [--json]

``--sync``, ``--no-mapping`` and ``--count-aivs`` configure the UBEP side; CANN EP is always BSP with
stop-and-wait flags. ``--model NAME`` fills ``--hidden/--experts/--topk`` from a preset.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys

from ..cost_model import MAX_BYTES_PER_TOKEN, dispatch_bytes_per_token
from ..utils import int_at_least
from . import (
    PRESETS,
    calibration_points,
    fig10_case,
    run_case,
    sweep_aivs,
    sweep_batch,
    sweep_count_aivs,
    sweep_experts,
    sweep_granularity,
    sweep_ranks,
    sweep_sync,
    sweep_topk,
)


def _report_json(r) -> dict:
    return {"total_us": r.total_us, "phases_us": dict(r.phases_us), "aiv_send_us": list(r.aiv_send_us),
            "worst_aiv_us": r.worst_aiv_us, "effective_gbs": r.effective_gbs, "bytes": r.bytes,
            "sync": r.sync, "mapping": r.mapping, "n_count": r.n_count}


def _exponent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {text}")
    return v


#: what ``--plot`` may write: the Agg backend's formats (a name without an extension gets ".png", as
#: matplotlib adds it; pgf needs a TeX installation and is left out)
_PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "webp", "eps", "ps", "raw", "rgba")


def _add_case_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), required=True, help="EP ranks (NPU dies)")
    p.add_argument("--batch", type=int_at_least(1), required=True, help="tokens per rank")
    p.add_argument("--hidden", type=int_at_least(1), default=None, help="hidden size H")
    p.add_argument("--topk", type=int_at_least(1), default=None, help="experts per token K")
    p.add_argument("--experts", type=int_at_least(1), default=None, help="routed experts E (multiple of ranks)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None, help="fill H/E/K from a model preset")
    p.add_argument("--ranks-per-node", type=int_at_least(1), default=16, help="dies per node (CM384: 16)")
    p.add_argument("--hot-experts", type=int_at_least(0), default=0, help="number of hot experts (0: uniform routing)")
    p.add_argument("--zipf", type=_exponent, default=None, help="Zipf exponent of expert popularity")
    p.add_argument("--sync", choices=("tff", "dc", "sp", "sw"), default="tff", help="UBEP Data-as-Flag variant")
    p.add_argument("--no-mapping", action="store_true", help="UBEP without topology-aware mapping")
    p.add_argument("--count-aivs", type=int_at_least(1), default=None,
                   help="UBEP count-group AIVs (default: Appendix 9)")
    p.add_argument("--bytes-per-token", type=int_at_least(1, MAX_BYTES_PER_TOKEN), default=None,
                   help="payload per token copy (default: int8+scales for dispatch, bf16 for combine)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _fill(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.model:
        pre = PRESETS[args.model]
        args.hidden = args.hidden or pre.hidden
        args.experts = args.experts or pre.experts
        args.topk = args.topk or pre.topk
    missing = [n for n in ("hidden", "topk", "experts") if getattr(args, n) is None]
    if missing:
        parser.error(f"missing --{' --'.join(missing)} (or give --model)")
    if args.hot_experts and args.zipf is not None:
        parser.error("--hot-experts and --zipf are two routings: give one of them")
    if args.cmd == "combine" and args.count_aivs is not None:
        parser.error("--count-aivs sizes dispatch's count group; combine has none")


def _print_case(kind: str, args: argparse.Namespace, res: dict) -> None:
    u, c = res["ubep"], res["cann_ep"]
    copy = args.bytes_per_token or (dispatch_bytes_per_token(args.hidden) if kind == "dispatch" else 2 * args.hidden)
    print(f"{kind}: {args.ranks} ranks ({args.ranks_per_node} per node), batch {args.batch}, H {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, {copy} B per copy")
    for name, r in (("CANN EP", c), ("UBEP", u)):
        extra = ""
        if name == "UBEP":
            extra = f"  [{r.sync}, mapping {'on' if r.mapping else 'off'}, n_count {r.n_count}]"
        print(f"  {name:8s} {r.total_us:8.1f} us  {r.effective_gbs:6.1f} GB/s  "
              f"worst AIV {r.worst_aiv_us:6.1f} us{extra}")
        print("           " + "  ".join(f"{k} {v:.1f}" for k, v in r.phases_us.items()))
    print(f"  reduction {100 * res['reduction']:.1f}%")


def _table(rows: list[dict], cols: list[str], title: str) -> None:
    print(title)
    widths = [max(14, len(c) + 2) for c in cols]     # (a long name never runs into the previous column)
    print("  " + "".join(f"{c:>{w}s}" for c, w in zip(cols, widths)))
    for r in rows:
        cells = []
        for c, w in zip(cols, widths):
            v = r.get(c, "")
            if isinstance(v, bool):
                cells.append(f"{'*' if v else '':>{w}s}")
            elif isinstance(v, float):
                cells.append(f"{100 * v:{w - 1}.1f}%" if "reduction" in c else f"{v:{w}.1f}")
            else:
                cells.append(f"{v!s:>{w}s}")
        print("  " + "".join(cells))
    print()


def _plot(path: str, batch_rows: list[dict], fig10: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install -e \".[plot]\" in the checkout (or pip install matplotlib)")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    phases = ["init", "token_sending", "send_flag_verification", "cal_cumsum", "token_reordering", "sync_all"]
    colors = dict(zip(phases, ["#bbbbbb", "#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52"]))
    x = 0.0
    ticks, labels, seen = [], [], set()
    for row in batch_rows:
        ax1.text(x + 0.5, row["cann_ep"].total_us + 2, f"-{100 * row['reduction']:.0f}%", ha="center", fontsize=8)
        for name, rep in (("CANN EP", row["cann_ep"]), ("UBEP", row["ubep"])):
            bottom = 0.0
            for ph in phases:
                v = rep.phases_us.get(ph, 0.0)
                if v <= 0:
                    continue
                ax1.bar(x, v, 0.8, bottom=bottom, color=colors[ph], label=None if ph in seen else ph)
                seen.add(ph)
                bottom += v
            ticks.append(x)
            labels.append(f"{name}\nBS {row['batch']}")
            x += 1.0
        x += 0.6
    ax1.set_xticks(ticks)
    ax1.set_xticklabels(labels, fontsize=7)
    ax1.set_ylabel("dispatch latency (us)")
    ax1.set_title("Dispatch latency breakdown, EP 64, one expert per die (Fig. 9 setting)")
    ax1.legend(fontsize=7)
    width = 0.27
    for i, (name, key) in enumerate((("CANN EP", "cann_ep"), ("UBEP w/o mapping", "ubep_no_mapping"),
                                     ("UBEP", "ubep"))):
        vals = fig10[key].aiv_send_us
        ax2.bar([j + (i - 1) * width for j in range(len(vals))], vals, width,
                label=f"{name} (this die max {max(vals):.1f} us, any die {fig10[key].worst_aiv_us:.1f} us)")
    ax2.set_xlabel("AIV")
    ax2.set_ylabel("token-sending latency (us)")
    ax2.set_title("Per-AIV sending latency, 4x16 dies, 256 experts, 8 hot (Fig. 10 setting)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    if not os.path.splitext(path)[1]:
        path += ".png"
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError, RuntimeError) as e:
        sys.exit(f"--plot {path}: {e}")
    print(f"wrote {path}")


def _sweep(args: argparse.Namespace) -> None:
    """The sweeps as tables, or with ``--json`` as one JSON object and nothing else."""
    if not args.json:
        _sweep_tables(args)
        return
    with contextlib.redirect_stdout(io.StringIO()):
        out = _sweep_tables(args)
    print(json.dumps(out))


def _sweep_tables(args: argparse.Namespace) -> dict:
    """Print the tables of ``args.what``; returns them as JSON-ready data."""
    what = args.what
    kw = {"seed": args.seed}
    out = {}
    if what in ("calibration", "all"):
        rows = calibration_points(seed=args.seed)
        out["calibration"] = rows
        print("Calibration points: model against the published numbers")
        print(f"  {'point':42s} {'paper':>12s} {'model':>10s} {'error':>8s}")
        for r in rows:
            model = r["model"]
            m = f"{100 * model:9.1f}%" if isinstance(r["paper"], str) else f"{model:10.1f}"
            paper = r["paper"] if isinstance(r["paper"], str) else f"{r['paper']:.1f}"
            # (a range's error is the distance outside it, in percentage points)
            unit = "pt" if isinstance(r["paper"], str) and "-" in r["paper"] else "%"
            print(f"  {r['point']:42s} {paper:>12s} {m:>10s} {100 * r['error']:+7.1f}{unit}")
        print()
        if what == "calibration" and not args.plot:
            return out
    if what in ("batch", "all") or args.plot:
        rows = sweep_batch(ranks=64, **kw)
        out["batch"] = rows
        _table(rows, ["batch", "n_count", "cann_ep_us", "ubep_us", "reduction"],
               "Batch sweep: dispatch, EP 64, one expert per die, DeepSeek H 7168 top-8 (Fig. 9)")
        rows128 = sweep_batch(ranks=128, **kw)
        out["batch_128"] = rows128
        _table(rows128, ["batch", "n_count", "cann_ep_us", "ubep_us", "reduction"],
               "Batch sweep: dispatch, 128 ranks, one expert per die (Fig. 8a)")
    if what in ("ranks", "all"):
        rows = sweep_ranks(**kw)
        out["ranks"] = rows
        _table(rows, ["ranks", "n_count", "cann_ep_us", "ubep_us", "reduction"],
               "Rank sweep: dispatch, batch 64, one expert per die (Fig. 8b)")
    if what in ("experts", "all"):
        rows = sweep_experts(**kw)
        out["experts"] = rows
        _table(rows, ["experts", "n_count", "cann_ep_us", "ubep_us", "reduction"],
               "Expert sweep: dispatch, 128 ranks, batch 64 (Fig. 8c)")
    if what in ("granularity", "all"):
        rows = sweep_granularity(**kw)
        out["granularity"] = rows
        _table(rows, ["bytes", "cann_ep_us", "tff_us", "dc_us", "sp_us", "tff_reduction", "sp_reduction"],
               "Sync-granularity sweep: bytes per synchronised row, combine path, EP 64, batch 64 (Fig. 11)")
    if what in ("sync", "all"):
        rows = sweep_sync(**kw)
        out["sync"] = rows
        _table(rows, ["ranks", "cann_ep_us", "tff_us", "dc_us", "sp_us"],
               "Data-as-Flag variants over rank counts, 2 KB rows, batch 16, combine path (Fig. 11)")
    if what in ("ncount", "all"):
        for r in (64, 128, 256):
            for b in (16, 64, 128):
                rows = sweep_count_aivs(ranks=r, batch=b, **kw)
                out[f"ncount_{r}_{b}"] = rows
                _table(rows[:-1], ["n_count", "ubep_us", "extra_us", "best"],
                       f"n_count sweep: {r} ranks, batch {b} (Fig. 15; Appendix 9 suggests {rows[-1]['n_count']})")
    if what in ("topk", "all"):
        rows = sweep_topk(**kw)
        out["topk"] = rows
        _table(rows, ["topk", "n_count", "cann_ep_us", "ubep_us", "reduction"], "Top-k sweep (Fig. 14)")
    if what in ("aivs", "all"):
        rows = sweep_aivs(seed=args.seed)
        out["aivs"] = rows
        _table(rows, ["aivs", "token_sending_us", "total_us", "effective_gbs"],
               "CANN EP dispatch with fewer AIVs, EP 64, batch 128 (Fig. 3b)")
    f10 = fig10_case(seed=args.seed)
    if what in ("fig10", "all") or args.plot:
        print("Fig. 10: worst AIV token-sending latency (us): " + ", ".join(
            f"{k} {v.worst_aiv_us:.1f}" for k, v in f10.items()) + "  (paper 62.2 / 48.1 / 43.5)")
    if args.plot:
        _plot(args.plot, out["batch"], f10)

    def clean(rows):
        return [{k: v for k, v in r.items() if k not in ("cann_ep", "ubep")} for r in rows]
    data = {k: clean(v) for k, v in out.items()}
    if what in ("fig10", "all"):
        data["fig10"] = {k: _report_json(v) for k, v in f10.items()}
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubep_torch.sim", description=(__doc__ or "").split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for kind in ("dispatch", "combine"):
        _add_case_args(sub.add_parser(kind, help=f"model one {kind} call: CANN EP against UBEP"))
    sw = sub.add_parser("sweep", help="paper-style sweeps as tables (and a plot)")
    sw.add_argument("what", nargs="?", default="all",
                    choices=("all", "calibration", "batch", "ranks", "experts", "granularity", "sync",
                             "ncount", "topk", "aivs", "fig10"))
    sw.add_argument("--plot", default=None, metavar="FILE.png", help="draw the latency breakdown and per-AIV bars")
    sw.add_argument("--seed", type=_seed, default=0)
    sw.add_argument("--json", action="store_true", help="print one JSON object (no tables)")
    args = parser.parse_args(argv)
    if args.cmd == "sweep":
        if args.plot is not None and not args.plot.strip():
            sw.error("--plot needs a file name (e.g. --plot breakdown.png)")
        if args.plot:
            if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
                sw.error(f"--plot {args.plot}: no such directory")
            ext = os.path.splitext(args.plot)[1].lower().lstrip(".")
            if ext and ext not in _PLOT_FORMATS:
                sw.error(f"--plot {args.plot}: name a file ending in one of "
                         f"{', '.join('.' + f for f in _PLOT_FORMATS)}")
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                sw.error("--plot needs matplotlib: pip install -e \".[plot]\" in the checkout (or pip install "
                         "matplotlib)")
        _sweep(args)
        return 0
    _fill(args, sub.choices[args.cmd])
    try:
        res = run_case(args.cmd, args.ranks, args.batch, args.hidden, args.topk, args.experts,
                       ranks_per_node=args.ranks_per_node, hot_experts=args.hot_experts, zipf=args.zipf,
                       sync=args.sync, mapping=not args.no_mapping, count_aivs=args.count_aivs,
                       seed=args.seed, bytes_per_token=args.bytes_per_token)
    except ValueError as e:
        sub.choices[args.cmd].error(str(e))
    if args.json:
        print(json.dumps({"cann_ep": _report_json(res["cann_ep"]), "ubep": _report_json(res["ubep"]),
                          "reduction": res["reduction"]}))
    else:
        _print_case(args.cmd, args, res)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:     # (the output piped into a reader that stopped early, such as head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
