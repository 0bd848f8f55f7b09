"""Load and fault scenarios of ubep_torch, with one summary table.

    python benchmarks/stress.py                    # >= 10,000 randomized calls + every fault class
    python benchmarks/stress.py --calls 2000 --quick

Load: randomized back-to-back calls (normal and low-latency, two Buffers on two process groups, random
shapes/dtypes/-1 masks/hot experts/zero-token ranks, two low-latency calls in flight) with random
per-rank delays before the protocol waits, every output compared bit for bit with a local reference
(tests/stress_rank_fns.py). Faults: a rank SIGKILLed or stalled past the deadline at every protocol wait
of every region (and the SyncAll phases of sync="sw"), a rank killed during the shared-memory set-up,
a killed rank nobody reaps (tests/fault_rank_fns.py). Every scenario has its own shared-memory directory;
"leaked" counts what is left there after all its processes exited (for the set-up crash: after the
next start's sweep).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]

import fault_rank_fns as FR  # noqa: E402
import stress_rank_fns as S  # noqa: E402

from ubep_torch import ugas  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402
from ubep_torch.utils import deadline_seconds, int_at_least  # noqa: E402


def load(world, syncs, calls, seed, base):
    d = tempfile.mkdtemp(dir=base)
    env = {"PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "UBEP_SHM_DIR": d}
    done, wrong, delays, t0 = 0, 0, 0, time.monotonic()
    with RankPool(world, env=env, timeout_s=900) as pool:
        step = 0
        while done < calls:
            steps = max(1, min(200, (calls - done + 3) // 4))     # a step makes one to four calls
            res = pool.run(S.stress, seed * 1000 + step, steps, syncs, 0.2, 0.002, 20.0)
            step += 1
            done += res[0]["calls"]
            wrong += sum(r["n_failures"] for r in res)
            delays += sum(r["delays"] for r in res)
            for r in res:
                for f in r["failures"][:3]:
                    print(f"  rank {r['rank']}: {f[:400]}", file=sys.stderr)
            if any(r["error"] for r in res):
                break
    leaked = len([n for n in os.listdir(d) if n.startswith("ubep-")])
    return {"scenario": f"load {world} ranks sync={'/'.join(syncs)}", "calls": done, "ranks": world,
            "faults": f"{delays} delays", "detected": "-", "wrong": wrong, "leaked": leaked,
            "seconds": time.monotonic() - t0}


def faults(world, scenarios, label, base, parallel):
    d = tempfile.mkdtemp(dir=base)
    t0 = time.monotonic()
    outs = FR.run_many(world, scenarios, d, parallel=parallel)
    detected, leaked, bad = 0, 0, []
    calls = 0
    for o in outs:
        sc = o.scenario
        left = list(o.leftover)
        if sc.fault == "setup_kill":
            ugas.sweep_stale_segments(os.path.join(d, f"scenario-{outs.index(o)}"))
            left = [n for n in os.listdir(os.path.join(d, f"scenario-{outs.index(o)}")) if n.startswith("ubep-")]
            o.leftover = []
        probs = o.check(1.5)
        if not probs:
            detected += 1
        else:
            bad.append((sc.op, sc.sync, sc.phase, probs))
        leaked += len(left)
        calls += sc.fault_call * 4
    for b in bad:
        print(f"  NOT DETECTED: {b}", file=sys.stderr)
    delays = [v for o in outs for v in o.detection_delays().values()]
    worst = f" (worst {max(delays):.2f}s)" if delays else ""
    return {"scenario": label, "calls": calls, "ranks": world, "faults": len(scenarios),
            "detected": f"{detected}/{len(scenarios)}{worst}", "wrong": 0, "leaked": leaked,
            "seconds": time.monotonic() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int_at_least(1), default=10000,
                    help="randomized calls in the load scenarios (total; the last batch may pass it by a few)")
    ap.add_argument("--seed", type=int_at_least(0, 2 ** 40), default=1)
    ap.add_argument("--timeout", type=deadline_seconds, default=1.5, help="timeout_s of the fault scenarios")
    ap.add_argument("--parallel", type=int_at_least(1, 64), default=4, help="fault scenarios run at once")
    ap.add_argument("--quick", action="store_true", help="kill and stall faults only at the TokenCnt phases")
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ubep-stress-")
    try:
        return _run(a, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run(a, base) -> int:
    rows = []
    print(_header(), flush=True)     # each row as its scenario ends
    share = [("2", ("tff", "sp"), 0.5), ("2", ("dc", "sw"), 0.3), ("3", ("sp", "tff"), 0.2)]
    for world, syncs, frac in share:
        rows.append(load(int(world), syncs, int(a.calls * frac), a.seed, base))
        print(_fmt(rows[-1]), flush=True)
    kill = FR.all_phase_scenarios("kill", a.timeout)
    stall = FR.all_phase_scenarios("stall", a.timeout)
    where = "every phase"
    if a.quick:
        kill = [s for s in kill if "TokenCnt" in s.phase]
        stall = [s for s in stall if "TokenCnt" in s.phase]
        where = "every TokenCnt phase"
    for s in stall:
        s.stall_extra_s = 0.5
    fault_sets = [
        (2, kill, f"SIGKILL at {where}"),
        (2, stall, f"stall past timeout at {where}"),
        (3, [FR.Scenario("normal", "tff", "kill", "dispatch: Token-Reordering", victim=0, timeout_s=a.timeout),
             FR.Scenario("ll", "sp", "kill", "low_latency_combine: waiting for expert outputs", victim=2,
                         timeout_s=a.timeout),
             FR.Scenario("normal", "sw", "stall", "combine: SyncAll after Token-Sending", victim=1,
                         timeout_s=a.timeout, stall_extra_s=0.5)], "3 ranks: kill rank 0 / 2, stall"),
        (2, [FR.Scenario("ll", "tff", "kill", "low_latency_dispatch: TokenCnt", timeout_s=a.timeout, reap=False)],
         "SIGKILL, victim never reaped"),
        (2, [FR.Scenario("normal", "tff", "setup_kill", "setup", timeout_s=a.timeout)],
         "SIGKILL during shm set-up"),
    ]
    for world, scs, label in fault_sets:
        rows.append(faults(world, scs, label, base, a.parallel))
        print(_fmt(rows[-1]), flush=True)
    tot_calls = sum(r["calls"] for r in rows if r["scenario"].startswith("load"))
    wrong = sum(r["wrong"] for r in rows)
    leaked = sum(r["leaked"] for r in rows)
    print(f"\nload calls: {tot_calls}   wrong results: {wrong}   leaked segments: {leaked}")
    return 1 if wrong or leaked else 0


def _header():
    return (f"{'scenario':<44} {'calls':>7} {'ranks':>5} {'injected faults':>16} {'detected in timeout':>24} "
            f"{'wrong':>5} {'leaked':>6} {'s':>6}")


def _fmt(r):
    return (f"{r['scenario']:<44} {r['calls']:>7} {r['ranks']:>5} {str(r['faults']):>16} {str(r['detected']):>24} "
            f"{r['wrong']:>5} {r['leaked']:>6} {r['seconds']:>6.1f}")


if __name__ == "__main__":
    sys.exit(main())
