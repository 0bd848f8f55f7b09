"""Wall time of one modelled dispatch and combine (CANN EP + UBEP) from 16 to 384 ranks.

Run: ``python benchmarks/sim_speed.py``. The routing is generated once per size, outside the timing.
"""
from __future__ import annotations

import argparse
import time

from ubep_torch.cost_model import compare, dispatch_bytes_per_token
from ubep_torch.sim import make_routing
from ubep_torch.topology import Topology


def main() -> None:
    argparse.ArgumentParser(description="Wall time of one modelled dispatch and combine from 16 to 384 ranks "
                                        "(no options).").parse_args()
    print(f"{'ranks':>6s} {'copies':>8s} {'dispatch ms':>12s} {'combine ms':>11s} {'reduction':>10s}")
    for ranks in (16, 32, 64, 128, 256, 384):
        experts = max(256, ranks)
        experts -= experts % ranks
        tk = make_routing(ranks, 128, 8, experts, seed=0)
        topo = Topology.for_ranks(ranks)
        compare("dispatch", tk, experts, dispatch_bytes_per_token(7168), topology=topo)  # warm-up
        t0 = time.perf_counter()
        d = compare("dispatch", tk, experts, dispatch_bytes_per_token(7168), topology=topo)
        t1 = time.perf_counter()
        compare("combine", tk, experts, 2 * 7168, topology=topo)
        t2 = time.perf_counter()
        print(f"{ranks:6d} {tk.numel():8d} {1e3 * (t1 - t0):12.1f} {1e3 * (t2 - t1):11.1f} "
              f"{100 * d['reduction']:9.1f}%")


if __name__ == "__main__":
    main()
