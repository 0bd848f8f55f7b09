"""Fault scenarios: fresh gloo rank processes per scenario, one victim killed or stalled at a chosen phase.

``run_scenario(world, Scenario(...), shm_dir)`` spawns ``world`` processes (multiprocessing spawn, gloo
over a free TCP port, ``UBEP_SHM_DIR`` = ``shm_dir``), runs a loop of calls on every rank and makes the
victim SIGKILL itself (``fault="kill"``) or sleep past the deadline (``fault="stall"``) from inside
``Buffer.delay_hook`` the first time the hook sees a phase containing ``phase`` at or after call
``fault_call``. ``fault="setup_kill"`` kills the victim inside the Buffer's shared-memory set-up, after it
created its segment and before the segment is unlinked (``"setup_stall_kill"``: there, once the others
gave up waiting for it, as a launcher kills it then); ``fault="gone_before_setup"`` makes it exit right
after joining the process group, and the others build their Buffers a second later.

The parent polls the processes (so a killed victim is reaped at once, as a launcher would) unless
``reap=False``, collects one report per rank and returns an :class:`Outcome`: what every survivor raised
and when, the processes that had to be killed because they did not exit (must be none) and the entries
left in ``shm_dir``.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ubep_torch.testing import join_group, rendezvous_store

OPS = ("normal", "ll", "ll_hook")


@dataclass
class Scenario:
    op: str = "normal"            #: "normal" (dispatch + combine), "ll" (low-latency), "ll_hook" (recv hooks)
    sync: str = "tff"
    fault: str = "kill"           #: "kill", "stall", "setup_kill", "setup_stall_kill", "gone_before_setup", "none"
    phase: str = "dispatch: TokenCnt"   #: substring of the phase at which the victim faults
    victim: int = 1
    fault_call: int = 2           #: index of the call (0-based) in which the fault happens
    calls: int = 6                #: calls every rank attempts
    timeout_s: float = 1.5
    reap: bool = True
    stall_extra_s: float = 1.0    #: a stalled victim sleeps timeout_s + this
    steady: bool = False          #: every call routes as the first (new x), and only the victim has a delay
    #: hook: the others' calls take the one-step exchanges of a repeated routing (Buffer._steady_dispatch)


@dataclass
class Outcome:
    scenario: Scenario
    world: int
    fault_time: Optional[float] = None
    fault_phase: Optional[str] = None
    reports: Dict[int, dict] = field(default_factory=dict)
    exitcodes: Dict[int, Optional[int]] = field(default_factory=dict)
    spinning: List[int] = field(default_factory=list)
    leftover: List[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def survivors(self) -> List[int]:
        if self.scenario.fault in ("kill", "setup_kill", "setup_stall_kill", "gone_before_setup"):
            return [r for r in range(self.world) if r != self.scenario.victim]
        return list(range(self.world))

    def detection_delays(self) -> Dict[int, float]:
        """Seconds from the fault to each survivor's error (survivors that raised only)."""
        out = {}
        for r in self.survivors:
            if r == self.scenario.victim:
                continue
            rep = self.reports.get(r)
            if rep and rep.get("kind") == "error" and self.fault_time is not None:
                out[r] = rep["time"] - self.fault_time
        return out

    def check(self, slack_s: float = 1.5) -> List[str]:
        """Every violated guarantee, as text (empty = all held)."""
        sc = self.scenario
        problems = []
        if self.spinning:
            problems.append(f"ranks {self.spinning} did not exit and were killed")
        if self.leftover:
            problems.append(f"segments left in the shm dir: {self.leftover}")
        if sc.fault == "none":
            for r in range(self.world):
                rep = self.reports.get(r)
                if not rep or rep.get("kind") != "ok":
                    problems.append(f"rank {r}: {rep}")
            return problems
        if self.fault_time is None:
            problems.append(f"the victim never reached a phase containing {sc.phase!r}")
            return problems
        must_raise = [r for r in range(self.world) if r != sc.victim]
        for r in must_raise:
            rep = self.reports.get(r)
            if not rep:
                problems.append(f"rank {r} sent no report (exit code {self.exitcodes.get(r)})")
                continue
            if rep["kind"] != "error":
                problems.append(f"rank {r} did not raise a ubep error: {rep}")
                continue
            if sc.fault in ("setup_kill", "setup_stall_kill"):
                continue  # the bootstrap (gloo) reports it; checked by the caller
            if sc.victim not in rep["missing"]:
                problems.append(f"rank {r} raised without naming rank {sc.victim}: {rep['message']}")
            if not rep["phase"]:
                problems.append(f"rank {r} raised without a phase: {rep['message']}")
            delay = rep["time"] - self.fault_time
            if delay > sc.timeout_s + slack_s:
                problems.append(f"rank {r} raised {delay:.2f}s after the fault (timeout_s={sc.timeout_s})")
        if sc.fault == "stall":
            rep = self.reports.get(sc.victim)
            if not rep or rep.get("kind") not in ("error", "ok"):
                problems.append(f"stalled victim {sc.victim} ended badly: {rep}")
        return problems


def _make_inputs(rank: int, call: int, E: int, T: int, H: int, K: int):
    import torch

    g = torch.Generator().manual_seed(call * 131 + rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand(T, K, generator=g)
    return x, topk, w


def _one_call(buf, sc: Scenario, rank: int, call: int, E: int, N: int, H: int) -> None:
    x, topk, w = _make_inputs(rank, call, E, T=6, H=H, K=2)
    if sc.steady:
        _, topk, w = _make_inputs(rank, 0, E, T=6, H=H, K=2)
    if sc.op == "normal":
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E)
        if sc.steady:       # (unweighted, as the one-step combine takes it)
            buf.combine(recv_x, handle)
        else:
            buf.combine(recv_x, handle, topk_weights=recv_w)
        return
    hook = sc.op == "ll_hook"
    recv_x, _, handle, _, hk = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=hook)
    if hook:
        hk()
    _, _, hk2 = buf.low_latency_combine(recv_x, topk, w, handle, return_recv_hook=hook)
    if hook:
        hk2()


def _rank_main(rank: int, world: int, port: int, shm_dir: str, sc: Scenario, q) -> None:
    os.environ["UBEP_SHM_DIR"] = shm_dir
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("UBEP_TIMEOUT_S", None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ubep_torch import Buffer, ugas
    from ubep_torch.errors import UBEPError, UBEPPeerLostError, UBEPTimeoutError

    def report(**kw):
        kw.setdefault("time", time.time())
        q.put((rank, kw))

    join_group(port, rank, world, timeout=datetime.timedelta(seconds=20))
    E, N, H = 2 * world, 8, 128
    victim = rank == sc.victim
    if sc.fault in ("setup_kill", "setup_stall_kill") and victim:
        real = ugas._all_gather
        calls = {"n": 0}

        def gather_then_die(obj, group, world_size, *args):
            calls["n"] += 1
            if calls["n"] == 2:  # every segment exists (by name: not unlinked yet)
                q.put((rank, {"kind": "fault", "phase": "setup", "time": time.time() + 0.2}))
                time.sleep(0.2)  # let the queue's feeder thread flush
                if sc.fault == "setup_stall_kill":   # stalled until the others gave up, then killed
                    time.sleep(sc.timeout_s + sc.stall_extra_s)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(obj, group, world_size, *args)
        ugas._all_gather = gather_then_die
    if sc.fault == "gone_before_setup":
        if victim:
            report(kind="fault", phase="setup")
            q.close()
            q.join_thread()
            os._exit(0)     # (gloo's connections close with the process)
        time.sleep(1.0)
    low_latency = sc.op != "normal"
    buf = None
    state = {"call": -1, "fired": False}
    try:
        rdma = Buffer.get_low_latency_rdma_size_hint(N, H, world, E) if low_latency else 0
        buf = Buffer(dist.group.WORLD, 4 << 20, rdma, low_latency_mode=low_latency, sync=sc.sync,
                     timeout_s=sc.timeout_s)

        def hook(phase: str) -> None:
            if not victim or state["fired"] or state["call"] < sc.fault_call or sc.phase not in phase:
                return
            state["fired"] = True
            if sc.fault == "kill":
                report(kind="fault", phase=phase, time=time.time() + 0.2)
                time.sleep(0.2)  # let the queue's feeder thread flush the report
                os.kill(os.getpid(), signal.SIGKILL)
            elif sc.fault == "stall":
                report(kind="fault", phase=phase)
                time.sleep(sc.timeout_s + sc.stall_extra_s)

        if victim or not sc.steady:
            buf.delay_hook = hook
        for call in range(sc.calls):
            state["call"] = call
            _one_call(buf, sc, rank, call, E, N, H)
        report(kind="ok", calls=sc.calls)
    except UBEPError as e:
        # UBEPTimeoutError / UBEPPeerLostError (and UBEPPeerAbortedError where the library has it) carry
        # the phase and the ranks that did not deliver; anything else is not a deadline error.
        known = isinstance(e, (UBEPTimeoutError, UBEPPeerLostError)) or type(e).__name__ == "UBEPPeerAbortedError"
        own = sorted(n for n in os.listdir(shm_dir) if n.startswith(f"ubep-{os.getpid()}-")) if buf is None else None
        report(kind="error" if known else "other_ubep", type=type(e).__name__, phase=getattr(e, "phase", ""),
               missing=list(getattr(e, "missing_ranks", [])), dead=list(getattr(e, "dead_ranks", [])),
               aborted=list(getattr(e, "aborted_ranks", [])), message=str(e), own_segments_after_error=own,
               call=state["call"])
    except Exception as e:  # noqa: BLE001 - the bootstrap (gloo) fails for set-up faults
        own = sorted(n for n in os.listdir(shm_dir) if n.startswith(f"ubep-{os.getpid()}-"))
        setup_fault = sc.fault in ("setup_kill", "setup_stall_kill")
        report(kind="error" if setup_fault else "crash", type=type(e).__name__, phase="setup", missing=[],
               own_segments_after_error=own, message=f"{e}\n{traceback.format_exc()}")
    finally:
        if buf is not None:
            buf.destroy()
    q.put((rank, {"kind": "exit", "time": time.time()}))
    q.close()
    q.join_thread()
    atexit._run_exitfuncs()  # what a normal interpreter exit runs (ubep's pending-segment cleanup) ...
    os._exit(0)              # ... without gloo's teardown, whose peers may be gone


def run_scenario(world: int, sc: Scenario, shm_dir: str, exit_timeout_s: Optional[float] = None) -> Outcome:
    """Run one scenario in fresh processes and report what happened (see the module docstring)."""
    ctx = _context(sc.reap)
    q = ctx.Queue()
    store = rendezvous_store()      # (held until the scenario's processes are done)
    port = store.port
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, shm_dir, sc, q), daemon=True)
             for r in range(world)]
    out = Outcome(sc, world)
    t0 = time.monotonic()
    for p in procs:
        p.start()
    limit = exit_timeout_s if exit_timeout_s is not None else 60.0 + 4 * sc.timeout_s
    deadline = time.monotonic() + limit

    def drain(block: float) -> None:
        try:
            rank, msg = q.get(timeout=block)
        except queue.Empty:
            return
        kind = msg["kind"]
        if kind == "fault":
            out.fault_time, out.fault_phase = msg["time"], msg["phase"]
        elif kind != "exit":
            out.reports[rank] = msg

    while time.monotonic() < deadline:
        if sc.reap:
            alive = [p.is_alive() for p in procs]   # is_alive() reaps exited children
        else:
            alive = [_running(p.pid) for p in procs]   # a zombie stays unreaped, as under a slow launcher
        if not any(alive):
            break
        drain(0.01)
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) + 2.0)
        if p.is_alive():
            out.spinning.append(r)
            p.kill()
            p.join(timeout=10)
        out.exitcodes[r] = p.exitcode
    while True:
        try:
            rank, msg = q.get(timeout=0.2)
        except queue.Empty:
            break
        if msg["kind"] == "fault":
            out.fault_time, out.fault_phase = msg["time"], msg["phase"]
        elif msg["kind"] != "exit":
            out.reports.setdefault(rank, msg)
    q.close()
    out.wall_s = time.monotonic() - t0
    out.leftover = sorted(n for n in os.listdir(shm_dir) if n.startswith("ubep-"))
    return out


_FORKSERVER = None


def _context(reap: bool):
    """A forkserver that has imported torch and ubep_torch once (rank start-up costs ~no CPU), or plain
    spawn when the victim must stay an unreaped zombie (the forkserver reaps its children at once)."""
    global _FORKSERVER
    if not reap:
        return mp.get_context("spawn")
    if _FORKSERVER is None:
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "ubep_torch", __name__])
    return _FORKSERVER


def _running(pid: int) -> bool:
    """True while ``pid`` has not exited (a zombie counts as exited), without reaping it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


#: (op, sync, phase substring) for every wait a rank can be killed or stalled at.
PHASES = {
    "normal": ["dispatch: waiting for peers to consume", "dispatch: TokenCnt", "dispatch: Token-Reordering",
               "combine: waiting for peers to consume", "combine: TokenCnt", "combine: Token-Reordering"],
    "ll": ["low_latency_dispatch: waiting for peers to consume", "low_latency_dispatch: TokenCnt",
           "low_latency_dispatch: Token-Reordering", "low_latency_combine: waiting for peers to consume",
           "low_latency_combine: waiting for the count messages", "low_latency_combine: waiting for expert outputs"],
    "sw": ["dispatch: SyncAll after Token-Sending", "dispatch: SyncAll after flag verification",
           "combine: SyncAll after Token-Sending", "combine: SyncAll after flag verification"],
    "ll_sw": ["low_latency_dispatch: SyncAll after Token-Sending",
              "low_latency_dispatch: SyncAll after flag verification",
              "low_latency_combine: SyncAll after Token-Sending",
              "low_latency_combine: SyncAll after flag verification"],
}


def all_phase_scenarios(fault: str, timeout_s: float = 1.5) -> List[Scenario]:
    """One scenario per phase (every region, the SyncAll phases of sync="sw", recv hooks)."""
    out = []
    for ph in PHASES["normal"]:
        out.append(Scenario("normal", "tff", fault, ph, timeout_s=timeout_s))
    for ph in PHASES["ll"]:
        out.append(Scenario("ll", "tff", fault, ph, timeout_s=timeout_s))
    for ph in PHASES["sw"]:
        out.append(Scenario("normal", "sw", fault, ph, timeout_s=timeout_s))
    for ph in PHASES["ll_sw"]:
        out.append(Scenario("ll", "sw", fault, ph, timeout_s=timeout_s))
    out.append(Scenario("ll_hook", "sp", fault, "low_latency_dispatch: Token-Reordering", timeout_s=timeout_s))
    out.append(Scenario("normal", "dc", fault, "combine: Token-Reordering", timeout_s=timeout_s))
    return out


def run_many(world: int, scenarios: List[Scenario], base_dir: str, parallel: int = 4) -> List[Outcome]:
    """Run scenarios concurrently (``parallel`` process groups at a time), each with its own shm dir."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i_sc):
        i, sc = i_sc
        d = os.path.join(base_dir, f"scenario-{i}")
        os.makedirs(d, exist_ok=True)
        return run_scenario(world, sc, d)

    with ThreadPoolExecutor(max_workers=parallel) as ex:
        return list(ex.map(one, enumerate(scenarios)))


def skip_buffer(ctx, timeout_s):
    """Rank 1 never builds its Buffer: rank 0's set-up must end at its deadline, naming rank 1."""
    import time

    import torch.distributed as dist

    from ubep_torch import Buffer
    from ubep_torch.errors import UBEPTimeoutError
    if ctx.rank == 1:
        time.sleep(timeout_s + 2)
        return None
    t0 = time.monotonic()
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=timeout_s)
    except UBEPTimeoutError as e:
        return time.monotonic() - t0, e.missing_ranks, e.phase
    return "built"



def failure_while_destroying(ctx):
    """A call that fails because ``destroy()`` runs meanwhile in another thread may record its failure between
    the destroy's first step (the Buffer marked destroyed) and its word to the peers. Rank 0 recreates that
    order: marked destroyed, the failure, then the rest of ``destroy()``. Rank 1 returns the cause rank 0's
    word gives it, which must be the destroy."""
    import torch.distributed as dist

    import ubep_torch.buffer as B
    from ubep_torch import Buffer
    from ubep_torch import protocol as P
    from ubep_torch.errors import UBEPBrokenError

    buf = Buffer(dist.group.WORLD, 1 << 20, timeout_s=20.0)
    dist.barrier()
    if ctx.rank == 0:
        buf._destroyed = True           # (destroy()'s first step)
        buf._fail(UBEPBrokenError("ubep_torch: rank 0: this Buffer was destroyed while waiting"))
        buf._destroyed = False
        buf.destroy()
    dist.barrier()
    how = P.abort_how(int(buf._aux_words[B._ABORT_ROW * ctx.world_size + 0])) if ctx.rank == 1 else None
    buf.destroy()
    return None if how is None else P.GONE_CAUSES.get(how, f"abort {how}")


def stalled_in(ctx, where, timeout_s=1.0):
    """Rank 1 leaves out what rank 0 then waits in: the recv hook of a low-latency dispatch (``"hook"``) or the
    backward of ``functional.combine`` (``"backward"``). Rank 0's wait ends at its deadline; returns the
    error's type, phase and missing ranks there (rank 1 destroys its Buffer once rank 0 has given up)."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer, functional
    from ubep_torch.errors import UBEPError

    T, H, K, E, N = 8, 64, 2, 4, 8
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(T, H, generator=g)
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    if where == "hook":
        buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, 2, E), low_latency_mode=True,
                     timeout_s=timeout_s)
    else:
        buf = Buffer(dist.group.WORLD, 1 << 20, timeout_s=timeout_s)
    try:
        if where == "hook":
            if ctx.rank == 1:
                time.sleep(timeout_s + 1.5)
                return None
            hook = buf.low_latency_dispatch(x.bfloat16(), topk, N, E, use_fp8=False, return_recv_hook=True)[-1]
            wait = hook
        else:
            x.requires_grad_(True)
            recv_x, _, _, handle = functional.dispatch(buf, x, topk, torch.rand(T, K, generator=g), E)
            out = functional.combine(buf, recv_x * 2.0, handle)
            if ctx.rank == 1:
                time.sleep(timeout_s + 1.5)
                return None
            wait = out.sum().backward
        try:
            wait()
        except UBEPError as e:
            return type(e).__name__, e.phase, list(e.missing_ranks)
        return "completed"
    finally:
        buf.destroy()


def late_rank(ctx, case):
    """Rank 1 gives up waiting for rank 0, which is 2.5 s late. ``"hook"``: both ranks issue two low-latency
    dispatches with recv hooks, then run the first hook; rank 0 starts late and rank 1 times out in that
    hook (call 1). ``"clean"``: one low-latency round trip, then ``clean_low_latency_buffer`` (call 3),
    which rank 0 enters late. Returns what each step raised on this rank (None: it returned), in order."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    E, N, H = 4, 4, 128
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, 2, E), low_latency_mode=True,
                 timeout_s=1.0)
    x = torch.randn(N, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    w = torch.rand(N, 2)

    def late():
        if ctx.rank == 0:
            time.sleep(2.5)
    if case == "hook":
        held = []
        steps = [late,
                 lambda: held.append(buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)),
                 lambda: held.append(buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)),
                 lambda: held[0][-1]()]
    else:
        def round_trip():
            d = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
            buf.low_latency_combine(d[0], topk, w, d[2])
        steps = [round_trip, late, lambda: buf.clean_low_latency_buffer(N, H, E)]
    out = []
    for step in steps:
        try:
            step()
            out.append(None)
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, getattr(e, "phase", ""), str(e)))
            break
    dist.barrier()       # (the peer has read the abort word before this Buffer goes)
    buf.destroy()
    return out


def refused_call(ctx, case):
    """Rank 1's first dispatch has an expert id out of range (refused with ValueError before it reaches
    rank 0); rank 0's is valid. ``"late"``: rank 1 calls again only after 2.5 s; rank 0, waiting in the
    call rank 1 refused, raises at once (its deadline is 20 s): the call is cancelled on both ranks, and
    both go on with a round trip that completes (rank 0's waits for rank 1's). ``"prompt"``: rank 1 calls
    again at once: that is its next call, not the cancelled one (former bug: rank 0's cancelled call took
    it), and rank 0 makes it too after its error. ``"both"``: both ranks' first calls are refused (no call
    happens), rank 1 calls again after 2.5 s, and rank 0's call again waits for it. ``"layout"``: as
    ``"late"``, with rank 1's error raised by ``get_dispatch_layout``. ``"destroy"``: rank 1 destroys its
    Buffer right after the refusal (as a ``with`` block ended by the error does). Returns what each step
    raised or returned (the seconds it took and, for an error, its type, whether it says refused, the ranks
    it names)."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    E, T, H = 2 * ctx.world_size, 6, 64     # (the results checked in "prompt" and "both": two ranks)
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    x = torch.randn(T, H).bfloat16()
    good = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    bad = good.clone()
    bad[0, 0] = E

    def dispatch(topk):
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
        ranks = torch.tensor([2, 2, 2, 2, 1, 1]).unsqueeze(1)      # ranks each token of good reaches
        return float((buf.combine(recv_x, handle)[0].float() - ranks * x.float()).abs().max())

    first = bad if ctx.rank == 1 or case == "both" else good
    steps = [lambda: dispatch(first)]
    if case == "layout" and ctx.rank == 1:     # the error comes from get_dispatch_layout, before dispatch
        steps = [lambda: buf.get_dispatch_layout(bad, E)]
    if ctx.rank == 1 and case == "destroy":
        steps.append(buf.destroy)
    elif ctx.rank == 1 or case in ("both", "late", "layout", "prompt"):
        if ctx.rank == 1 and case != "prompt":
            steps.append(lambda: time.sleep(2.5))
        steps.append(lambda: dispatch(good))
    out = []
    for step in steps:
        t0 = time.monotonic()
        try:
            result = step()
            out.append(("ok", time.monotonic() - t0, result))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, time.monotonic() - t0, getattr(e, "refused", None),
                        getattr(e, "aborted_ranks", None), str(e)))
    dist.barrier()       # (the peer has read the abort word before this Buffer goes)
    buf.destroy()
    return out


def refused_with_hooks(ctx, case):
    """Refusals around low-latency recv hooks (2 ranks, 20 s deadline). ``"later"``: rank 0 refuses a
    low-latency dispatch and makes its next call, a normal round trip, 1.5 s later; rank 1 issued the
    refused call with a recv hook and waits in the round trip: it completes with rank 0's, and the hook,
    run last, raises ``CancelledCallError`` (its call was cancelled while rank 1 waited in a later one).
    ``"twice"``: both ranks refuse a low-latency dispatch (no call); rank 0 makes it again at once with a
    recv hook, refuses a round trip alone, makes it again at once, then runs the hook; rank 1 makes the
    low-latency dispatch after 1.5 s, then the round trip (cancelled: rank 0 refused it) and the round trip
    again: everything completes. Returns (step, outcome, seconds) per step."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    E, N, H = 4, 4, 128
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, 2, E),
                 low_latency_mode=True, timeout_s=20.0)
    x = torch.randn(N, H).bfloat16()
    good = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    bad = good.clone()
    bad[0, 0] = E
    held = []

    def ll(topk, hook=False):
        held.append(buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=hook))

    def normal(topk):
        d = buf.dispatch(x, topk_idx=topk, num_experts=E)
        buf.combine(d[0], d[4])
    if case == "later":
        steps = [("ll", lambda: ll(bad)), ("sleep", lambda: time.sleep(1.5)), ("normal", lambda: normal(good))] \
            if ctx.rank == 0 else [("ll", lambda: ll(good, hook=True)), ("normal", lambda: normal(good)),
                                   ("hook", lambda: held[-1][-1]())]
    elif ctx.rank == 0:
        steps = [("ll", lambda: ll(bad)), ("ll", lambda: ll(good, hook=True)), ("normal", lambda: normal(bad)),
                 ("normal", lambda: normal(good)), ("hook", lambda: held[-1][-1]())]
    else:
        steps = [("ll", lambda: ll(bad)), ("sleep", lambda: time.sleep(1.5)), ("ll", lambda: ll(good)),
                 ("normal", lambda: normal(good)), ("normal", lambda: normal(good))]
    out = []
    for name, step in steps:
        t0 = time.monotonic()
        try:
            step()
            out.append((name, "ok", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001
            out.append((name, type(e).__name__, time.monotonic() - t0, getattr(e, "refused", None)))
    dist.barrier()       # (the peer has read the abort word before this Buffer goes)
    buf.destroy()
    return out


def destroy_under_views(ctx):
    """A tensor from ``get_local_buffer_tensor`` used after ``destroy()``, and ``destroy()`` from another
    thread while this rank waits in a call that its peer never makes: neither may crash the process (the
    mapping stays while a view lives); the wait raises. Returns (the kept view's sum after writing it,
    the waiting rank's error type and seconds to it)."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    kept = buf.get_local_buffer_tensor()
    buf.destroy()
    kept[:16] = 3
    total = int(kept[:16].sum())
    del kept
    dist.barrier()
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    waited = None
    if ctx.rank == 0:
        threading.Timer(0.5, buf.destroy).start()
        t0 = time.monotonic()
        try:
            buf.dispatch(torch.ones(2, 64).bfloat16(), topk_idx=torch.tensor([[0], [1]]), num_experts=2)
        except Exception as e:  # noqa: BLE001
            waited = (type(e).__name__, time.monotonic() - t0, str(e))
    else:
        time.sleep(1.5)
        buf.destroy()
    dist.barrier()
    return total, waited


def destroy_during_one_step_calls(ctx, delays):
    """``destroy()`` from another thread while rank 0 makes normal round trips that take the one-step C
    exchanges (a repeated routing): rank 1 makes the same calls 3 ms apart, so rank 0 spends most of its
    time in the C calls' short wait for rank 1's messages and rows, then in the general wait after it. One
    trial per delay (seconds before the destroy), each with a fresh Buffer. Returns per trial (rank 0's
    error type, seconds from the destroy to it, round trips completed before it) on rank 0, (rank 1's error
    type, its message) on rank 1."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    T, H, K, E = 32, 256, 2, 4
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    topk = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    out = []
    for delay in delays:
        buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)

        def rt(buf=buf, ntpr=ntpr, itr=itr, ntpe=ntpe):
            d = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                             topk_idx=topk)
            return buf.combine(d[0], d[4])
        for _ in range(3):      # (a routing sent before: the calls below take the one-step exchanges)
            rt()
        dist.barrier()
        done, when = 0, {}
        try:
            if ctx.rank == 0:
                timer = threading.Timer(delay, lambda b=buf, w=when: (w.setdefault("t", time.monotonic()), b.destroy()))
                timer.start()
            while True:
                rt()
                done += 1
                if ctx.rank == 1:
                    time.sleep(0.003)
        except Exception as e:  # noqa: BLE001
            if ctx.rank == 0:
                timer.join()
                out.append((type(e).__name__, time.monotonic() - when["t"], done))
            else:
                out.append((type(e).__name__, str(e)[:200]))
        buf.destroy()
        dist.barrier()
    return out


def build_on_full_tmpfs(ctx, which):
    """Buffer construction when reserving the segment's pages fails with ENOSPC (as ``posix_fallocate`` does
    on a full tmpfs) on every rank (``which="all"``) or on rank 1 only (``"one"``: the others learn it in
    the set-up exchange, well before their 20 s deadline). Returns (error type, message, seconds)."""
    import errno
    import time

    import torch.distributed as dist

    from ubep_torch import Buffer

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    real = os.posix_fallocate
    if which == "all" or ctx.rank == 1:
        os.posix_fallocate = full
    t0 = time.monotonic()
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=20.0)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        os.posix_fallocate = real
    return None, "built", time.monotonic() - t0


def stuck_while_reserving(ctx, marks: str):
    """Every rank's set-up stops where it reserves its segment's memory (``posix_fallocate`` writes a file
    ``<marks>/<rank>`` and sleeps): the test then SIGKILLs every rank at once, as a launcher or a job
    scheduler does."""
    import time

    import torch.distributed as dist

    from ubep_torch import Buffer

    def stuck(fd, offset, length):
        with open(os.path.join(marks, str(ctx.rank)), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    os.posix_fallocate = stuck          # (this worker process is killed in it)
    Buffer(dist.group.WORLD, 1 << 20, timeout_s=90)
    return "built"


def die_before_own_unlink(ctx):
    """Rank 0 SIGKILLs itself when it is about to unlink its own segment (after every rank mapped every
    segment); rank 1 goes on with the set-up (its last step, in which every rank reserves its memory, fails
    naming rank 0)."""
    import torch.distributed as dist

    from ubep_torch import Buffer
    if ctx.rank == 0:
        real_unlink = os.unlink

        def unlink(path, *a, **k):
            if os.path.basename(path).startswith(f"ubep-{os.getpid()}-"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_unlink(path, *a, **k)
        os.unlink = unlink      # this worker process dies here anyway
    buf = Buffer(dist.group.WORLD, 1 << 20, timeout_s=10)
    buf.destroy()
    return "built"


def second_thread_and_fork(ctx):
    """Calls a Buffer must refuse before touching anything, and what follows them. Thread: rank 0's main
    thread waits in a dispatch (rank 1 comes 1 s late) while a second thread calls dispatch on the same
    Buffer; the second thread gets UBEPUsageError at once, the first call completes correctly. Fork: rank 0
    forks, and the child's calls (a dispatch, get_dispatch_layout, a recv hook, ubep_torch.functional's
    dispatch) are refused and post nothing to the peers, nor does its ``destroy()``. Then a round trip on
    both ranks (rank 1 waits 1.5 s for rank 0 in it: a refusal posted by the child would end that wait),
    and a call rank 1 alone refuses:
    rank 0 must learn of it in about 1 s (the call counts still agree). Returns (what the second thread and
    the child raised, the errors of the round trips)."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer, UBEPUsageError, functional
    R, E, T, H, N = ctx.world_size, 2 * ctx.world_size, 6, 64, 8
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                 low_latency_mode=True, timeout_s=20.0)
    x = torch.randn(T, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    ranks = torch.tensor([2, 2, 2, 2, 1, 1]).unsqueeze(1)      # ranks each token reaches

    def round_trip():
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
        return float((buf.combine(recv_x, handle)[0].float() - ranks * x.float()).abs().max())

    refused, errors = {}, []
    _, _, _, _, hook = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)
    if ctx.rank == 0:
        def second():
            time.sleep(0.3)
            try:
                buf.dispatch(x, topk_idx=topk, num_experts=E)
            except UBEPUsageError as e:
                refused["thread"] = str(e)
        t = threading.Thread(target=second)
        t.start()
        errors.append(round_trip())
        t.join()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:    # the child: every call refused, nothing written into the peers' memory
            said = []
            for call in (lambda: buf.dispatch(x, topk_idx=topk, num_experts=E),
                         lambda: buf.get_dispatch_layout(topk, E), hook,
                         lambda: functional.dispatch(buf, x, topk, torch.ones(T, 2), E)):
                try:
                    call()
                    said.append("accepted")
                except UBEPUsageError as e:
                    said.append(str(e))
            buf.destroy()       # (a clean-up in the child: releases its mappings, tells the peers nothing)
            os.write(w, repr(said).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            refused["fork"] = f.read()
    else:
        time.sleep(1.0)
        errors.append(round_trip())
    hook()
    if ctx.rank == 0:
        time.sleep(1.5)
    errors.append(round_trip())
    bad = topk.clone()
    bad[0, 0] = E
    t0 = time.monotonic()
    try:
        buf.dispatch(x, topk_idx=bad if ctx.rank == 1 else topk, num_experts=E)
    except Exception as e:  # noqa: BLE001
        refused["peer"] = (type(e).__name__, round(time.monotonic() - t0, 1))
    dist.barrier()       # (the refusing rank's Buffer stays until rank 0 has seen the refusal)
    buf.destroy()
    return refused, errors


def swapped_combines(ctx, mode, how="object"):
    """Two dispatches of the same shapes and row counts, combined in call order on rank 0 and in the other
    order on rank 1 (``mode`` "normal" or "ll"): the combines must fail naming the mismatch, not sum the
    wrong rows. ``how``: the handle passed as the object, as a plain tuple of its own tensors ("tuple"), or
    (normal mode, "cached") to a cached dispatch instead of a combine (the two normal dispatches route
    tokens 4 and 5 to other ranks, with the same counts: swapped layouts would place the wrong tokens' rows).
    Returns what each rank's first combine (or cached dispatch) raised (type and message), or how far its
    result was off."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, E, T, H, N = ctx.world_size, 2 * ctx.world_size, 6, 64, 8
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                 low_latency_mode=True, timeout_s=10.0)
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    xs = [torch.randn(T, H).bfloat16() for _ in range(2)]
    if mode == "normal":
        topks = [topk, topk[[0, 1, 2, 3, 5, 4]]]
        calls = [buf.dispatch(x, topk_idx=t, num_experts=E) for x, t in zip(xs, topks)]
        ranks = torch.tensor([2, 2, 2, 2, 1, 1]).unsqueeze(1)

        def combine(i):
            handle = tuple(calls[i][4]) if how == "tuple" else calls[i][4]
            if how == "cached":     # (xs[i] again: the rows dispatch i received)
                return float((buf.dispatch(xs[i], handle=handle)[0].float() - calls[i][0].float()).abs().max())
            return float((buf.combine(calls[i][0], handle)[0].float() - ranks * xs[i].float()).abs().max())
    else:
        calls = [buf.low_latency_dispatch(x, topk, N, E, use_fp8=False) for x in xs]
        w = torch.rand(T, 2)

        def combine(i):
            handle = tuple(calls[i][2]) if how == "tuple" else calls[i][2]
            out = buf.low_latency_combine(calls[i][0], topk, w, handle)[0]
            return float((out.float() - xs[i].float() * w.sum(1, keepdim=True)).abs().max())
    first = 0 if ctx.rank == 0 else 1
    try:
        result = ("ok", combine(first))
    except Exception as e:  # noqa: BLE001
        result = (type(e).__name__, str(e))
    buf.destroy()
    return result


def edited_handles(ctx):
    """Handles changed after their call. Normal mode, rows in several exchanges (a small buffer): a handle
    object whose recv_src_idx and is_token_in_rank entries the caller rewrote in place still combines by its
    dispatch's layout (former bug: the several-exchange path read the rewritten entry, and every rank raised
    and broke the Buffer). Low-latency mode: a cloned plain-tuple copy of the latest handle, on a rank that
    received nothing in that call and the one before (equal handles), is told apart by the combine's
    topk_idx (former bug: refused as ambiguous); a cloned copy with a rewritten src_info is refused naming
    what may be wrong. Returns {case: result}."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, me = ctx.world_size, ctx.rank
    out = {}
    T, H, K, E = 64, 1024, 2, 2 * R
    buf = Buffer(dist.group.WORLD, 262144, timeout_s=20.0)
    g = torch.Generator().manual_seed(me)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    x = torch.randint(-8, 9, (T, H), generator=g).float()
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
    want = x * h[4].sum(1, keepdim=True)
    h[3].add_(1000 * (me + 1))
    h[4][:, me] = ~h[4][:, me]
    out["normal edited in place"] = bool(torch.equal(buf.combine(recv_x, h)[0], want))
    again = buf.dispatch(x, topk_idx=topk, num_experts=E)
    out["normal next call"] = bool(torch.equal(buf.combine(again[0], again[4])[0], want))
    buf.destroy()

    # an expert-major handle's row_index entry, and the cost model's reports of a combine (is_token_in_rank)
    class Recorder:
        def __init__(self):
            self.seen = []

        def report(self, kind, rank, world, topk_idx, num_experts, hidden, bytes_per_token, **kw):
            self.seen.append((kind, int((topk_idx >= 0).sum())))

    rec = Recorder()
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0, cost_model=rec)
    rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E, layout="expert_major")
    want_em, want_rx = buf.combine(rx, h)[0], rx.clone()
    h[6].fill_(-1)
    out["expert-major edited in place"] = bool(torch.equal(buf.combine(rx, h)[0], want_em)
                                               and torch.equal(buf.dispatch(x, handle=h)[0], want_rx))
    itr = torch.ones(T, R, dtype=torch.bool)
    rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=itr.sum(0).int(), is_token_in_rank=itr, num_experts=E)
    h[4].zero_()
    itr.zero_()     # (the caller's own tensor, reused)
    del rec.seen[:]
    buf.combine(rx, h)
    out["reports of an edited handle"] = rec.seen
    buf.destroy()

    N, H = 8, 128
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                 timeout_s=20.0)
    x = torch.full((4, H), float(me + 1), dtype=torch.bfloat16)
    w = torch.ones(4, 1)
    ta, tb = torch.tensor([[0], [1], [0], [1]]), torch.tensor([[1], [0], [1], [0]])   # (rank 0's experts only)
    rxa, _, ha, _, _ = buf.low_latency_dispatch(x, ta, N, E, use_fp8=False)
    buf.low_latency_combine(rxa, ta, w, ha)
    rxb, _, hb, _, _ = buf.low_latency_dispatch(x, tb, N, E, use_fp8=False)
    copy = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in hb)
    out["ll clone of equal handles"] = bool(torch.equal(buf.low_latency_combine(rxb, tb, w, copy)[0], x))
    rxc, _, hc, _, _ = buf.low_latency_dispatch(x, ta, N, E, use_fp8=False)
    edited = (hc[0].clone() + 1,) + tuple(hc[1:])
    try:
        buf.low_latency_combine(rxc, ta, w, edited)
        out["ll edited clone"] = "no error"
    except TypeError as e:
        out["ll edited clone"] = str(e)
    out["ll next call"] = bool(torch.equal(buf.low_latency_combine(rxc, ta, w, hc)[0], x))
    buf.destroy()
    return out


def interrupted_setup_then_retry(ctx, retry=True):
    """Rank 0's Buffer set-up is interrupted by Ctrl-C (a SIGINT 0.5 s in) while it waits for rank 1, which
    comes 1.5 s late; then (``retry``) both ranks build a Buffer again on the same group. Rank 0's receives
    of the interrupted set-up are still posted and would take rank 1's messages: rank 0 must refuse at once
    saying so, instead of waiting for its deadline and naming rank 1, which delivered (former bug). Without
    ``retry`` rank 1 builds nothing, and rank 0's wait on its message is still running when the call returns.
    Returns [(what the first set-up raised, if anything), (what the retry raised, its message, seconds)]."""
    import signal
    import threading

    import torch.distributed as dist

    from ubep_torch import Buffer
    out = []
    if ctx.rank == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            Buffer(dist.group.WORLD, 1 << 20, timeout_s=20.0).destroy()
            out.append(None)
        except KeyboardInterrupt:
            out.append("KeyboardInterrupt")
    else:
        time.sleep(1.5)
        out.append(None)
    if not retry:
        return out
    t0 = time.monotonic()
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=3.0).destroy()
        out.append(("built", "", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001
        out.append((type(e).__name__, str(e), time.monotonic() - t0))
    return out


def build_in(ctx, directory, nbytes=1 << 20):
    """Every rank builds a Buffer of ``nbytes`` in the shared-memory directory ``directory`` and makes a
    dispatch and combine with it: "ok" where the sums are right, else the error's type and message."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    try:
        with Buffer(dist.group.WORLD, nbytes, timeout_s=20.0, shm_dir=directory) as buf:
            x = torch.randn(8, 64)
            topk = torch.stack([torch.randperm(4)[:2] for _ in range(8)])
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=4)
            out = buf.combine(recv_x, handle)[0]
        want = x * (topk // 2 == 0).any(1, keepdim=True) + x * (topk // 2 == 1).any(1, keepdim=True)
        return "ok" if torch.allclose(out, want) else "wrong sums"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def fill_shm_then_build(ctx, directory):
    """Rank 0 fills the shared-memory directory just before it creates its segment (as another job could
    between the set-up's free-space check and that step), then every rank builds a Buffer there. Returns
    (exception type, message) per rank, or "ok"."""
    import torch.distributed as dist

    import ubep_torch.ugas as U
    from ubep_torch import Buffer
    if ctx.rank == 0:
        create = U.SymmetricHeap._create_segment

        def fill_then_create(self, *args, **kwargs):
            fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"x" * 65536)
            except OSError:
                pass
            finally:
                os.close(fd)
            return create(self, *args, **kwargs)
        U.SymmetricHeap._create_segment = fill_then_create
    try:
        Buffer(dist.group.WORLD, 512 << 10, timeout_s=10.0, shm_dir=directory).destroy()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    finally:
        if ctx.rank == 0:
            U.SymmetricHeap._create_segment = create


def proc_refused_setup(ctx, directory):
    """Rank 0 cannot open its peer's segment through /proc (``_ProcRefused``, as a hardened kernel refuses):
    every rank builds a Buffer in ``directory`` and makes a round trip (``build_in``). Returns (its result,
    the peer segments this rank tried to map by descriptor, those it mapped by name)."""
    import errno

    import ubep_torch.ugas as U
    real_open, real_map = U._open_by_descriptor, U.SymmetricHeap._map_peer
    tries = {"descriptor": 0, "name": 0}

    def refused(pid, where, r):
        raise U._ProcRefused(errno.EACCES, "Permission denied (simulated)")

    def counted(self, r, path, nbytes, token, where=None):
        tries["name" if where is None else "descriptor"] += 1
        return real_map(self, r, path, nbytes, token, where)
    if ctx.rank == 0:
        U._open_by_descriptor = refused
    U.SymmetricHeap._map_peer = counted
    try:
        return build_in(ctx, directory), tries["descriptor"], tries["name"]
    finally:
        U._open_by_descriptor, U.SymmetricHeap._map_peer = real_open, real_map


def proc_refused_while_a_peer_stalls(ctx):
    """Rank 0 cannot open its peer's segment through /proc while the last rank stalls in the mapping step (3 s,
    past the set-up's 1.5 s deadline). Returns what each rank's set-up raised (type, message)."""
    import errno

    import torch.distributed as dist

    import ubep_torch.ugas as U
    from ubep_torch import Buffer
    real_open, real_map = U._open_by_descriptor, U.SymmetricHeap._map_peer

    def refused(pid, where, r):
        raise U._ProcRefused(errno.EACCES, "Permission denied (simulated)")

    def stalled(self, *args):
        time.sleep(3.0)
        return real_map(self, *args)
    if ctx.rank == 0:
        U._open_by_descriptor = refused
    elif ctx.rank == ctx.world_size - 1:
        U.SymmetricHeap._map_peer = stalled
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=1.5).destroy()
        return "built", ""
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    finally:
        U._open_by_descriptor, U.SymmetricHeap._map_peer = real_open, real_map


def map_failure(ctx):
    """Rank 0 fails to map a peer's segment (an OSError, as an mmap failing with ENOMEM raises) in set-up step 3
    and stays alive: every rank must raise at once, the peers naming rank 0 and its error (former bug: they
    waited for their deadline and named rank 0 as stalled). Returns (type, message, seconds) per rank."""
    import errno

    import torch.distributed as dist

    import ubep_torch.ugas as U
    from ubep_torch import Buffer
    real = U.SymmetricHeap._map_peer

    def fail(self, *args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory (simulated)")
    if ctx.rank == 0:
        U.SymmetricHeap._map_peer = fail
    t0 = time.monotonic()
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=20.0).destroy()
        return "built", "", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        U.SymmetricHeap._map_peer = real


def interrupted_last_setup_step(ctx, late_rank=None):
    """Rank 0's set-up is interrupted by Ctrl-C while it waits in the last step (the others reserve their
    memory late); the others, which then have every message, complete their set-up and make a dispatch: each
    must fail at once naming rank 0 (former bug: its Buffer waited for rank 0 until its deadline), rank
    ``late_rank`` 3 s after the others (which gave up by then). Returns what each rank's set-up and dispatch
    raised (type, message, seconds)."""
    import signal
    import threading

    import torch
    import torch.distributed as dist

    import ubep_torch.ugas as U
    from ubep_torch import Buffer
    settle, reserve = U.SymmetricHeap._settle_step, U.SymmetricHeap._reserve
    if ctx.rank == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def interrupted(self, group, phase, *args, **kwargs):
            if "reserve" in phase:
                threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            return settle(self, group, phase, *args, **kwargs)
        U.SymmetricHeap._settle_step = interrupted
    else:
        def late(self, fd):
            time.sleep(2.0)
            return reserve(self, fd)
        U.SymmetricHeap._reserve = late
    out = {}
    try:
        buf = Buffer(dist.group.WORLD, 1 << 20, timeout_s=30.0)
        out["set-up"] = "built"
    except KeyboardInterrupt:
        out["set-up"], buf = "KeyboardInterrupt", None
    finally:
        U.SymmetricHeap._settle_step, U.SymmetricHeap._reserve = settle, reserve
    if buf is not None:
        if ctx.rank == late_rank:
            time.sleep(3.0)
        t0 = time.monotonic()
        try:
            buf.dispatch(torch.randn(8, 64), topk_idx=torch.randint(0, 2 * ctx.world_size, (8, 2)),
                         num_experts=2 * ctx.world_size)
            out["dispatch"] = ("returned", "", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            out["dispatch"] = (type(e).__name__, str(e), time.monotonic() - t0)
        buf.destroy()
    return out


def handles_of_another_buffer(ctx, mode, case):
    """Two Buffers A and B of one group, each with one dispatch of the same routing (call 1 of each) and
    other tokens. ``case`` "mixed": rank 0 combines A's handle on B, the others B's own: the combines must
    fail naming the mismatch, not sum the wrong rows. ``case`` "same": every rank combines A's handle on B
    (a handle is the layout, as in DeepEP): that works. Returns what the combine raised (type and message)
    or ("ok", how far its result was off from the dispatched tokens' sum)."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, E, T, H, N = ctx.world_size, 2 * ctx.world_size, 6, 64, 8
    bufs = [Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                   low_latency_mode=True, timeout_s=10.0) for _ in range(2)]
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    xs = [torch.randn(T, H).bfloat16() for _ in range(2)]
    use = 0 if case == "same" or ctx.rank == 0 else 1     # whose handle (and rows) this rank combines on B
    try:
        if mode == "normal":
            calls = [b.dispatch(x, topk_idx=topk, num_experts=E) for b, x in zip(bufs, xs)]
            ranks = torch.tensor([2, 2, 2, 2, 1, 1]).unsqueeze(1)
            out = bufs[1].combine(calls[use][0], calls[use][4])[0]
            result = ("ok", float((out.float() - ranks * xs[use].float()).abs().max()))
        else:
            calls = [b.low_latency_dispatch(x, topk, N, E, use_fp8=False) for b, x in zip(bufs, xs)]
            w = torch.rand(T, 2)
            out = bufs[1].low_latency_combine(calls[use][0], topk, w, calls[use][2])[0]
            result = ("ok", float((out.float() - xs[use].float() * w.sum(1, keepdim=True)).abs().max()))
    except Exception as e:  # noqa: BLE001
        result = (type(e).__name__, str(e))
    for b in bufs:
        b.destroy()
    return result


def dropped_buffers_release_memory(ctx):
    """With the cycle collector off: a Buffer dropped without ``destroy()`` is freed by reference counting
    alone, its segments unmapped; ``destroy()`` releases the shared memory even while views of it live
    (a kept ``get_local_buffer_tensor``, the frames of a kept exception), and such a view stays writable.
    Returns (segment mappings while a Buffer lives, after dropping it, whether it was freed, after destroy()
    with the views kept, the kept view's sum after writing it, the kept error's type)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer

    def segments():     # mappings of segment files, and descriptors open on them
        with open("/proc/self/maps") as f:
            n = sum("/ubep-" in line for line in f)
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += "/ubep-" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return n

    T, H, E = 4, 128, 4
    x, topk = torch.ones(T, H).bfloat16(), torch.tensor([[0, 3]] * T)
    gc.disable()
    try:
        base = segments()
        buf = Buffer(dist.group.WORLD, 1 << 22, 1 << 22, low_latency_mode=True, timeout_s=20.0)
        out = buf.dispatch(x, topk_idx=topk, num_experts=E)
        buf.combine(out[0], out[4])
        buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, return_recv_hook=True)[-1]()
        alive = segments() - base
        ref = weakref.ref(buf)
        del buf, out
        dropped, freed = segments() - base, ref() is None
        dist.barrier()
        buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
        kept, error = buf.get_local_buffer_tensor(), None
        if ctx.rank == 0:
            try:
                buf.dispatch(x, topk_idx=topk, num_experts=E)     # rank 1 destroys its Buffer instead
            except Exception as e:  # noqa: BLE001
                error = e
        buf.destroy()
        after = segments() - base
        kept[:8] = 2
        total = int(kept[:8].sum())
        dist.barrier()
        return alive, dropped, freed, after, total, type(error).__name__
    finally:
        gc.enable()


def refusal_on_a_sub_group(ctx):
    """Global ranks 1 and 2 of three build a Buffer on their own group; rank 2 refuses a dispatch (bad
    input), then destroys its Buffer, and rank 1 waits for it in that call; rank 1's next dispatch finds
    rank 2 gone, and a call after that finds its own Buffer broken. Returns rank 1's first error (type,
    group ranks it names, text), the last one's text, and the error of Buffers built with sizes that
    differ."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    sub = dist.new_group([1, 2])
    if ctx.rank == 0:
        return None
    buf = Buffer(sub, 1 << 22, timeout_s=20.0)
    topk = torch.tensor([[0, 2], [1, 3]])
    if ctx.rank == 2:
        topk[0, 0] = 9
    try:
        buf.dispatch(torch.ones(2, 64).bfloat16(), topk_idx=topk, num_experts=4)
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, getattr(e, "aborted_ranks", None), str(e))
    later = mismatch = None
    if ctx.rank == 2:
        buf.destroy()
    else:                   # a call of the Buffer broken by the lost peer names the same ranks
        try:
            buf.dispatch(torch.ones(2, 64).bfloat16(), topk_idx=topk, num_experts=4)
        except Exception:  # noqa: BLE001
            pass
        try:
            buf.get_dispatch_layout(topk, 4)
        except Exception as e:  # noqa: BLE001
            later = f"{type(e).__name__}: {e}"
    dist.barrier(sub)       # (rank 1 has seen the refusal before rank 2's Buffer goes)
    buf.destroy()
    try:                    # arguments that differ between the ranks: named at set-up
        Buffer(sub, (1 << 20) * ctx.rank, timeout_s=20.0)
    except ValueError as e:
        mismatch = str(e)
    return out + (later, mismatch)


def peer_leaves_before_mapping(ctx):
    """Rank 1 fails in set-up right after every rank created its segment (before mapping any), so its own
    segment name is gone; rank 0 maps the peers' segments a second later. Returns what each raised (type,
    phase, missing ranks, text)."""
    import time

    import torch.distributed as dist

    from ubep_torch import Buffer, ugas
    real = ugas.SymmetricHeap._map_peer

    def leave(self, *args):
        raise RuntimeError("injected: this rank leaves the set-up")

    def late(self, *args):
        time.sleep(1.0)
        return real(self, *args)
    ugas.SymmetricHeap._map_peer = leave if ctx.rank == 1 else late
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=10.0)
        out = None
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, getattr(e, "phase", None), getattr(e, "missing_ranks", None), str(e))
    finally:
        ugas.SymmetricHeap._map_peer = real
    return out


def exit_on_rank(ctx, rank: int, code: int, others_after: float = 0.0) -> int:
    """The process of ``rank`` exits at once with ``code`` (a crash from the pool's point of view); the
    others answer after ``others_after`` seconds."""
    if ctx.rank == rank:
        os._exit(code)
    time.sleep(others_after)
    return ctx.rank


def pid_after(ctx, seconds: float) -> int:
    """This rank's process id, after ``seconds`` of sleep."""
    time.sleep(seconds)
    return os.getpid()


def environment_of(ctx, names):
    """This rank's values of the environment variables ``names`` (None where unset), and its process's
    parent's pid."""
    return {n: os.environ.get(n) for n in names}, os.getppid()


def unpicklable_result(ctx):
    """A result the pool cannot send back (a lambda)."""
    return lambda: ctx.rank


def refused_then_retried(ctx, sync, cases, late=None):
    """Rank 1 refuses a call (an expert id out of range), then makes it again with valid input after a
    delay; every other rank makes the call with valid input, and makes it again if it raised (the call was
    cancelled on every rank). Each case is ``(kind, delay)``, kind ``"normal"`` (dispatch and combine),
    ``"ll"`` (low-latency dispatch and combine, no recv hook), ``"ll_hook"`` (low-latency dispatch with a
    recv hook run at once; the ranks that wait, wait in the hook) or ``"clean"``
    (``clean_low_latency_buffer``, refused for a wrong ``num_experts``, then a low-latency round trip);
    ``delay`` may also be ``{rank: delay}``: every rank named refuses, each retrying after its delay.
    Every case's inputs differ (tokens, routing, values), so rows left from a cancelled attempt would
    show. Returns per case: each attempt's outcome (``"ok"`` or the error's type, and for an error whether
    it was cancelled) and the largest error of the results against plain torch, then the same for two
    round trips of each kind after all cases. ``late``: {rank: seconds} a rank waits before its first
    attempt of every case."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, H, N = ctx.world_size, 128, 8
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                 low_latency_mode=True, timeout_s=20.0, sync=sync)
    gen = torch.Generator().manual_seed(100 + ctx.rank)

    def inputs(i):
        T = 3 + (i + ctx.rank) % 5
        x = (torch.randn(T, H, generator=gen) + i).bfloat16()
        topk = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
        w = torch.rand(T, 2, generator=gen)
        return x, topk, w

    def run(kind, x, topk, w, bad=False):
        if kind == "clean":
            buf.clean_low_latency_buffer(N, H, E + 1 if bad else E)
            kind = "ll"
        if kind == "ll_hook":
            recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False,
                                                                  return_recv_hook=True)
            hook()
            out = buf.low_latency_combine(recv_x, topk, w, handle)[0]
            return float((out.float() - x.float() * w.sum(1, keepdim=True)).abs().max() / (x.abs().max() + 1))
        if kind == "normal":
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
            out = buf.combine(recv_x, handle)[0]
            reached = torch.zeros(x.shape[0], R, dtype=torch.bool)
            reached.scatter_(1, topk // (E // R), True)
            ref = x.float() * reached.sum(1, keepdim=True)
        else:
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
            out = buf.low_latency_combine(recv_x, topk, w, handle)[0]
            ref = x.float() * w.sum(1, keepdim=True)
        return float((out.float() - ref).abs().max() / (ref.abs().max() + 1))

    results = []
    for i, (kind, delay) in enumerate(cases):
        x, topk, w = inputs(i)
        attempts, err = [], None
        refusers = delay if isinstance(delay, dict) else {1: delay}
        if ctx.rank in refusers:
            bad = topk.clone()
            bad[0, 0] = E
            try:
                run(kind, x, bad, w, bad=True)
            except ValueError:
                attempts.append(("ValueError", False))
            time.sleep(refusers[ctx.rank])
        time.sleep((late or {}).get(ctx.rank, 0.0))
        while err is None and len(attempts) < 3:
            try:
                err = run(kind, x, topk, w)
                attempts.append(("ok", False))
            except Exception as e:  # noqa: BLE001
                attempts.append((type(e).__name__, getattr(e, "cancelled", None)))
                if not getattr(e, "cancelled", False):
                    break
        results.append((attempts, err))
    after = []
    for i, kind in enumerate(["normal", "ll", "normal", "ll"]):
        after.append(run(kind, *inputs(len(cases) + i)))
    dist.barrier()
    buf.destroy()
    return results, after


def sp_cancel_rearms(ctx):
    """``sync="sp"``: rank 1 refuses a dispatch that rank 0 makes; once rank 0's call is cancelled, the
    slots rank 0 wrote into rank 1's memory hold the sentinel again (else the first words of rows never
    read would look arrived when the slots are next used). Returns rank 0's error type and whether it was
    cancelled, and on rank 1 the number of rank 0's slot blocks in its memory whose first word is not the
    sentinel."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    from ubep_torch import protocol as P
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0, sync="sp")
    x = torch.randn(6, 128).bfloat16() + 3
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    out = None
    if ctx.rank == 1:
        topk[0, 0] = 4
    try:
        buf.dispatch(x, topk_idx=topk, num_experts=4)
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, getattr(e, "cancelled", None))
    dist.barrier()
    if ctx.rank == 1:
        region = buf._regions[P.REGION_DISPATCH]
        first = region.rows_base          # (half 0, part 0: the slots of rank 0's rows)
        heads = buf._heap.local[first:first + 64 * P.BLOCK_BYTES].view(torch.int64).view(64, -1)[:, 0]
        out = (out, int((heads != P.SP_SENTINEL).sum()))
    dist.barrier()
    buf.destroy()
    return out


def bad_constructor_argument(ctx, case, tmp):
    """Rank 1 builds its Buffer with a bad argument (``"sync"``: an unknown sync mode, ``"size"``: a string
    for num_nvl_bytes) or another shared-memory directory (``"shm_dir"``: ``tmp``); rank 0 builds it
    correctly (20 s deadline). Returns each rank's (error type, seconds, text), then whether both could
    build a Buffer afterwards and make a round trip."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    kwargs = {"timeout_s": 20.0}
    nvl = 1 << 22
    if ctx.rank == 1:
        if case == "sync":
            kwargs["sync"] = "bogus"
        elif case == "size":
            nvl = "2M"
        elif case == "huge":
            nvl = 2 ** 63
        elif case == "engine":        # an error of another kind before the set-up (here: its engine)
            import ubep_torch.buffer as B

            def no_engine(*args):
                raise OSError("bogus engine failure")
            B.make_engine, saved_make_engine = no_engine, B.make_engine
        else:
            kwargs["shm_dir"] = tmp
    t0 = time.monotonic()
    try:
        Buffer(dist.group.WORLD, nvl, **kwargs).destroy()
        out = ("ok", time.monotonic() - t0, "")
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, time.monotonic() - t0, str(e))
    if ctx.rank == 1 and case == "engine":
        B.make_engine = saved_make_engine
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    x = torch.randn(4, 64).bfloat16()
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=torch.tensor([[0, 2]] * 4), num_experts=4)
    ok = torch.equal(buf.combine(recv_x, handle)[0], (x.float() * 2).bfloat16())
    buf.destroy()
    return out, ok


def dropped_buffer(ctx):
    """Rank 1 drops its Buffer without destroy() (and stays alive); rank 0, waiting for it in a dispatch
    (20 s deadline), learns that it is gone at once. Returns rank 0's (error type, seconds, text)."""
    import gc
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    dist.barrier()
    if ctx.rank == 1:
        del buf
        gc.collect()
        dist.barrier()
        time.sleep(3.0)
        return None
    dist.barrier()
    t0 = time.monotonic()
    try:
        buf.dispatch(torch.randn(2, 64).bfloat16(), topk_idx=torch.tensor([[0, 2], [1, 3]]), num_experts=4)
        out = ("ok", time.monotonic() - t0, "")
    except Exception as e:  # noqa: BLE001
        out = (type(e).__name__, time.monotonic() - t0, str(e))
    buf.destroy()
    return out


def refused_then_another_kind(ctx):
    """Rank 1 refuses a low-latency dispatch, then (after rank 0 gave up on it) refuses a normal dispatch,
    then makes the low-latency dispatch; rank 0 makes the low-latency dispatch until its third attempt. The
    second call is a low-latency dispatch on rank 0 and a normal one on rank 1: the ranks' calls differ,
    which both learn at once (no control message of a cancelled call is read as a later call's). Returns
    each step's (error type or "ok", seconds, text)."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, H, N = ctx.world_size, 64, 8
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                 low_latency_mode=True, timeout_s=20.0)
    x = torch.randn(4, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    bad = topk.clone()
    bad[0, 0] = E
    ll = lambda t: buf.low_latency_dispatch(x, t, N, E, use_fp8=False)  # noqa: E731
    pause = lambda: time.sleep(1.5)  # noqa: E731
    steps = [lambda: ll(topk)] * 3 if ctx.rank == 0 else \
        [lambda: ll(bad), pause, lambda: buf.dispatch(x, topk_idx=bad, num_experts=E), pause, lambda: ll(topk)]
    out = []
    for step in steps:
        t0 = time.monotonic()
        try:
            step()
            out.append(("ok", time.monotonic() - t0, ""))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, time.monotonic() - t0, str(e)))
    dist.barrier()
    buf.destroy()
    return out


def _step_log():
    """A list of step outcomes, (error type or "ok", text), and a function that runs a step into it."""
    out = []

    def step(fn):
        try:
            fn()
            out.append(("ok", ""))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    return out, step


def refused_while_peers_combine(ctx, mode):
    """Two low-latency dispatches with their recv hooks deferred on both ranks; rank 1 then makes a third
    dispatch, refused on it (two hooks pending), while rank 0 runs its hooks and goes on to the combine of
    the first (``mode="in_call"``; with ``"hook"`` that combine defers its own recv hook, and rank 0 makes a
    further dispatch). Rank 1 refused that call as a dispatch where rank 0 was in a combine: every rank raises
    the operation mismatch (former bug: rank 0 was told its combine was cancelled and the Buffer usable, and
    found it broken at its next call; with three or more ranks, those that came late were told of an abort).
    Returns each step's (error type or "ok", text)."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, H, N = ctx.world_size, 64, 8
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                 timeout_s=20.0)
    x = torch.randn(4, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    w = torch.rand(4, 2)
    ll = lambda: buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)  # noqa: E731
    first, second = ll(), ll()
    out, step = _step_log()
    if ctx.rank == 1:
        step(ll)                       # refused: two hooks pending
        time.sleep(1.5)
        step(ll)                       # its next call settles the refusal
    else:
        if ctx.rank == 3:              # (on four ranks: one comes 1.5 s late, when the others have failed)
            time.sleep(1.5)
        first[-1]()
        second[-1]()
        if mode == "in_call":
            step(lambda: buf.low_latency_combine(first[0], topk, w, first[2]))
        else:
            step(lambda: buf.low_latency_combine(first[0], topk, w, first[2], return_recv_hook=True))
            time.sleep(1.5)
            step(ll)
    dist.barrier()
    buf.destroy()
    return out


def late_rank_after_a_refusal(ctx, case, sync):
    """Three ranks after a low-latency dispatch (hook run): rank 1 refuses the second call as a dispatch (bad
    topk_idx); rank 0 makes that dispatch too (``case="late_combine"``: cancelled, then a further dispatch) or
    a combine (``"late_dispatch"``); rank 2 comes 1.5 s late with a combine, or with the dispatch. Every rank
    that meets the mismatch names it (former bugs: the refusing rank, or the late one, was told of an abort).
    Returns each step's (error type or "ok", text)."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, H, N = ctx.world_size, 64, 8
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                 timeout_s=8.0, sync=sync)
    x = torch.randn(4, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 4], [5, 1]])
    bad = topk.clone()
    bad[0, 0] = E
    w = torch.rand(4, 2)
    first = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)
    first[-1]()
    out, step = _step_log()
    ll = lambda t=topk: buf.low_latency_dispatch(x, t, N, E, use_fp8=False)  # noqa: E731
    llc = lambda: buf.low_latency_combine(first[0], topk, w, first[2])  # noqa: E731
    if ctx.rank == 1:
        step(lambda: ll(bad))
        time.sleep(0.5)
        step(ll)
    elif ctx.rank == 0:
        step(ll if case == "late_combine" else llc)
        step(ll)
    else:
        time.sleep(1.5)
        step(llc if case == "late_combine" else ll)
    dist.barrier()
    buf.destroy()
    return out


def refused_with_a_hook_between(ctx, sync):
    """A low-latency dispatch with its recv hook deferred (call 1); rank 1 then refuses a normal dispatch
    (call 2) that rank 0 makes; each rank runs hook 1 (rank 0 after its call was cancelled, rank 1 at once),
    then makes the dispatch again (rank 1 after 1.5 s). Returns each step's (name, outcome, cancelled) and
    the error of the final combine against plain torch."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, H, N = ctx.world_size, 128, 8
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                 low_latency_mode=True, timeout_s=20.0, sync=sync)
    x = torch.randn(6, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    bad = topk.clone()
    bad[0, 0] = E
    held = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)
    log, err = [], None

    def step(name, f):
        try:
            f()
            log.append((name, "ok", None))
        except Exception as e:  # noqa: BLE001
            log.append((name, type(e).__name__, getattr(e, "cancelled", None)))

    def normal(t):
        nonlocal err
        d = buf.dispatch(x, topk_idx=t, num_experts=E)
        out = buf.combine(d[0], d[4])[0]
        reached = torch.zeros(6, R).scatter_(1, t.clamp(min=0) // (E // R), 1.0).sum(1, keepdim=True)
        err = float((out.float() - x.float() * reached).abs().max())
    if ctx.rank == 0:
        step("normal", lambda: normal(topk))
        step("hook", held[-1])
        if log[0][1] != "ok":
            step("retry", lambda: normal(topk))
    else:
        step("refuse", lambda: normal(bad))
        step("hook", held[-1])
        time.sleep(1.5)
        step("retry", lambda: normal(topk))
    dist.barrier()
    buf.destroy()
    return log, err


def refused_while_a_half_is_held(ctx, k):
    """``low_latency_buffers=k``: k - 1 low-latency dispatches wait for their recv hook; rank 1 refuses the
    next one, which rank 0 makes (and the peers cancel), then makes it again after 1.5 s: the half it needs
    is held, so it is refused like rank 0's next attempt, and after both run their hooks the call succeeds.
    Returns the attempts' outcomes."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, H, N = ctx.world_size, 128, 8
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E, num_buffers=k),
                 low_latency_mode=True, timeout_s=20.0, low_latency_buffers=k)
    x = torch.randn(4, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    bad = topk.clone()
    bad[0, 0] = E
    hooks = [buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)[-1] for _ in range(k - 1)]
    log = []
    if ctx.rank == 1:
        try:
            buf.low_latency_dispatch(x, bad, N, E, use_fp8=False)
        except ValueError:
            log.append("refused")
        time.sleep(1.5)
    for _ in range(4):
        try:
            buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
            log.append("ok")
            break
        except Exception as e:  # noqa: BLE001
            held = isinstance(e, ValueError) and "recv hook" in str(e)
            log.append("held" if held else (type(e).__name__, getattr(e, "cancelled", None)))
            if held:
                for h in hooks:
                    h()
                hooks = []
            elif not getattr(e, "cancelled", False):
                break
    dist.barrier()
    buf.destroy()
    return log


def after_a_cancel(ctx, case):
    """What a program may do after a call was cancelled (2 ranks, 20 s deadline; rank 1 refuses a
    low-latency dispatch its peer makes with a recv hook or without one). ``"hook twice"``: rank 0 runs
    the cancelled call's hook twice. ``"combine"``: rank 0 combines the cancelled dispatch's handle, waits
    1.5 s, then both make round trips. ``"held"``: a hook of call 1 pending, the refusing rank's retry
    finds its half held, runs the hook 2 s later and makes the call again, while rank 0 retries after any
    cancel. ``"sw late hook"`` (sync="sw"): a hook run 32 round trips (64 calls) after its call, rank 1
    stalled 0.3 s in call 65's last barrier. Returns each step's (name, outcome, seconds, cancelled) and
    the largest error of the round trips against plain torch."""
    import time

    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    N, H, E = 4, 128, 4
    sync = "sw" if case == "sw late hook" else "tff"
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, 2, E),
                 low_latency_mode=True, timeout_s=20.0, sync=sync)
    x = torch.randn(N, H).bfloat16()
    good = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    bad = good.clone()
    bad[0, 0] = E
    w = torch.rand(N, 2)
    log, errs = [], []

    def step(name, f, retry=False):
        for _ in range(3 if retry else 1):
            t0 = time.monotonic()
            try:
                f()
                log.append((name, "ok", time.monotonic() - t0, None))
                return
            except Exception as e:  # noqa: BLE001
                log.append((name, type(e).__name__, time.monotonic() - t0, getattr(e, "cancelled", None)))
                if not (retry and getattr(e, "cancelled", False)):
                    return

    def ll(t=good, hook=False):
        return buf.low_latency_dispatch(x, t, N, E, use_fp8=False, return_recv_hook=hook)

    def rt():
        recv_x, _, h, _, _ = ll()
        out, ref = buf.low_latency_combine(recv_x, good, w, h)[0].float(), x.float() * w.sum(1, keepdim=True)
        errs.append(float((out - ref).abs().max() / ref.abs().max()))      # (bf16 rounding: about 1e-2 at most)

    def normal_rt():
        recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=good, num_experts=E)
        errs.append(float((buf.combine(recv_x, h)[0].float() - 2 * x.float()).abs().max()))
    if case in ("hook twice", "combine"):
        if ctx.rank == 0:
            a = ll(hook=True)
            step("hook", a[-1])
            if case == "hook twice":
                step("hook again", a[-1])
            else:
                step("combine", lambda: buf.low_latency_combine(a[0], good, w, a[2]))
                time.sleep(1.5)
        else:
            step("refuse", lambda: ll(bad, hook=True))
            time.sleep(1.5)
        step("rt", rt)
        step("rt", rt)
    elif case == "held":
        first = ll(hook=True)
        if ctx.rank == 0:
            step("hook 1", first[-1])
            step("call", ll, retry=True)
        else:
            step("refuse", lambda: ll(bad))
            time.sleep(1.5)
            step("retry", ll)
            time.sleep(2.0)
            step("hook 1", first[-1])
            step("retry", ll, retry=True)
        step("rt", rt)
    else:
        first = ll(hook=True)
        if ctx.rank == 1:     # (a stall in call 65's last barrier, when its row is the hook's row too)
            buf.delay_hook = lambda phase: time.sleep(0.3) if buf._active_call == 65 and "flag" in phase else None
        step("64 calls", lambda: [normal_rt() for _ in range(32)])
        step("hook 1", first[-1])
        buf.delay_hook = None
        step("combine 1", lambda: buf.low_latency_combine(first[0], good, w, first[2]))
        step("rt", rt)
    dist.barrier()
    buf.destroy()
    return log, max(errs) if errs else None


def refused_then_next_step(ctx, steps=3, how="bad id"):
    """Every rank runs ``steps`` steps of a dispatch and its combine, each step's rows worth 10 * step + the
    rank; rank 1 passes an expert id out of range in step 1 (``how="interrupt"``: a KeyboardInterrupt
    arrives while its dispatch checks its input; ``"interrupt in layout"``: in get_dispatch_layout) and,
    like every rank, goes on to the next step after any error (the pattern of a training or serving loop).
    Returns per step: the error's type and whether it was cancelled, or the values received and the
    combine's largest error."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R, T, H, K = ctx.world_size, 4, 64, 2
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    out = []
    for step in range(1, steps + 1):
        x = torch.full((T, H), float(10 * step + ctx.rank)).bfloat16()
        topk = (torch.arange(T * K).view(T, K) + step) % E
        if step == 1 and ctx.rank == 1 and how == "bad id":
            topk[0, 0] = E
        if step == 1 and ctx.rank == 1 and how.startswith("interrupt"):
            def interrupted(*args):
                raise KeyboardInterrupt
            buf._check_num_experts = interrupted
        else:
            buf.__dict__.pop("_check_num_experts", None)
        try:
            if how == "interrupt in layout":     # (get_dispatch_layout, before the dispatch it prepares)
                buf.get_dispatch_layout(topk, E)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
            combined = buf.combine(recv_x, handle)[0]
            reached = torch.zeros(T, R, dtype=torch.bool)
            reached.scatter_(1, topk // 2, True)
            err = float((combined.float() - x.float() * reached.sum(1, keepdim=True)).abs().max())
            out.append(("ok", sorted(set(recv_x[:, 0].float().tolist())), err))
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            out.append((type(e).__name__, getattr(e, "cancelled", None)))
    dist.barrier()
    buf.destroy()
    return out


def _ll_refusal_setup(ctx, N=8, k=2, H=128):
    """A low-latency Buffer (``k`` buffers, 20 s deadline) and inputs for refusal scenarios: ``(buf, x,
    topk, bad, N, E)``, ``x`` 4 tokens for ``N`` in 4..8 (``N`` tokens below 4), ``bad`` the routing with an
    expert id out of range."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    R = ctx.world_size
    E = 2 * R
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E, num_buffers=k),
                 low_latency_mode=True, timeout_s=20.0, low_latency_buffers=k)
    T = min(4, N)
    x = torch.randn(T, H).bfloat16()
    topk = torch.stack([torch.arange(2) * R + t for t in range(T)]) % E
    bad = topk.clone()
    bad[0, 0] = E
    return buf, x, topk, bad, N, E


def _recorder(out):
    """``step(f, name=None)``: runs ``f`` and appends to ``out`` ``"ok"`` (or ``(name, "ok")``), else the
    error's type and whether it was cancelled (after ``name``); returns ``f``'s result."""
    def step(f, name=None):
        try:
            result = f()
            out.append((name, "ok") if name else "ok")
            return result
        except Exception as e:  # noqa: BLE001
            err = (type(e).__name__, getattr(e, "cancelled", None))
            out.append((name,) + err if name else err)
    return step


def refusals_behind_pending_hooks(ctx):
    """Two low-latency dispatches, then rank 0 issues four calls with recv hooks (two combines, two
    dispatches: every buffer half held) and refuses a normal dispatch; rank 1 comes 1 s later and refuses the
    first of those combines, then issues the other three with hooks, runs them and makes the normal dispatch
    (cancelled: rank 0 refused it) and a normal dispatch again; rank 0 runs its hooks (the first raises, its
    call refused) and makes the normal dispatch again. A rank runs that far ahead of a peer's decision
    without waiting for it (former bug: its later decisions overwrote earlier ones before the peer read
    them, and both ranks waited for their deadline). Returns (step, outcome) per step, then the call and
    attempt counts."""
    import time

    import torch
    import torch.distributed as dist

    buf, x, topk, bad, N, E = _ll_refusal_setup(ctx)
    w = torch.ones(4, 2)
    out = []
    step = _recorder(out)

    def ll(hook=False):
        return buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=hook)

    def comb(d, weights, hook=False):
        return buf.low_latency_combine(d[0], topk, weights, d[2], return_recv_hook=hook)

    def normal(t):
        return buf.dispatch(x, topk_idx=t, num_experts=E)
    d1, d2 = ll(), ll()
    if ctx.rank == 0:
        hooks = [comb(d1, w, True)[-1], comb(d2, w, True)[-1], ll(True)[-1], ll(True)[-1]]
        step(lambda: normal(bad), "normal bad")
        for i, h in enumerate(hooks):
            step(h, f"hook {i}")
        step(lambda: normal(topk), "normal")
    else:
        time.sleep(1.0)
        step(lambda: comb(d1, torch.ones(5, 2)), "combine bad")
        hooks = [comb(d2, w, True)[-1], ll(True)[-1], ll(True)[-1]]
        for i, h in enumerate(hooks, start=1):
            step(h, f"hook {i}")
        step(lambda: normal(topk), "normal")
        step(lambda: normal(topk), "normal")
    out.append((buf._calls, buf._seq, buf._broken))
    dist.barrier()
    buf.destroy()
    return out


def refused_call_holding_a_half(ctx):
    """Rank 0 issues two low-latency dispatches with recv hooks (both buffer halves held), then, 0.6 s later,
    a third; rank 1 refuses the first 0.2 s in, then makes the second (with a hook) and the third. The third
    needs the half of the first, whose call rank 1 refused: that hook holds nothing (former bug: the third
    was refused, its half held, unless rank 0 had already noticed the refusal elsewhere). Returns (step,
    outcome) per step."""
    import time

    import torch.distributed as dist

    buf, x, topk, bad, N, E = _ll_refusal_setup(ctx)
    out, hooks = [], []
    step = _recorder(out)

    def ll(t, hook=False):
        d = buf.low_latency_dispatch(x, t, N, E, use_fp8=False, return_recv_hook=hook)
        if hook:
            hooks.append(d[-1])
    if ctx.rank == 0:
        step(lambda: ll(topk, True), "ll 1")
        step(lambda: ll(topk, True), "ll 2")
        time.sleep(0.6)
        step(lambda: ll(topk), "ll 3")
    else:
        time.sleep(0.2)
        step(lambda: ll(bad), "ll 1")
        step(lambda: ll(topk, True), "ll 2")
        step(lambda: ll(topk), "ll 3")
    for i, h in enumerate(hooks):
        step(h, f"hook {i}")
    dist.barrier()
    buf.destroy()
    return out


def refusals_while_one_rank_lags(ctx):
    """5 ranks, ``low_latency_buffers=8``. Eight low-latency dispatches; then four
    ``clean_low_latency_buffer`` calls (they take no buffer half), each refused by another rank (ranks 1, 2,
    3, 4), rank 1 resting 2 s after its refusal; then eight low-latency combines and eight dispatches with
    recv hooks (every buffer half held); then a normal dispatch refused by rank 0; then every hook, and a
    normal dispatch. Rank 0 runs all of that before rank 1 has read its decision on the first refused call:
    as far ahead as a rank can get (former bug: rows too few for that, the decision was overwritten, and
    every rank waited for its deadline). Returns per step "ok" or the error's type and whether it was
    cancelled, then (calls, attempts, broken)."""
    import time

    import torch
    import torch.distributed as dist

    k = 8
    buf, x, topk, bad, N, E = _ll_refusal_setup(ctx, N=4, k=k)
    H = x.shape[1]
    w = torch.ones(N, 2)
    out, hooks = [], []
    step = _recorder(out)

    def normal(refuser):
        return buf.dispatch(x, topk_idx=bad if ctx.rank == refuser else topk, num_experts=E)
    handles = [buf.low_latency_dispatch(x, topk, N, E, use_fp8=False) for _ in range(k)]
    for refuser in (1, 2, 3, 4):
        step(lambda r=refuser: buf.clean_low_latency_buffer(N, H, E + 1 if ctx.rank == r else E))
        if refuser == 1 and ctx.rank == 1:
            time.sleep(2.0)
    for d in handles:
        hooks.append(step(lambda d=d: buf.low_latency_combine(d[0], topk, w, d[2], return_recv_hook=True)[-1]))
    for _ in range(k):
        hooks.append(step(lambda: buf.low_latency_dispatch(x, topk, N, E, use_fp8=False, return_recv_hook=True)[-1]))
    step(lambda: normal(0))
    for h in hooks:
        step(h)
    step(lambda: normal(None))
    out.append((buf._calls, buf._seq, buf._broken))
    dist.barrier()
    buf.destroy()
    return out


def _normal_refusal_setup(ctx, timeout_s: float):
    """A normal-mode Buffer (deadline ``timeout_s``) and inputs for refusal scenarios on two ranks: ``(buf, x,
    good, bad, E)``, ``bad`` the routing ``good`` with an expert id out of range."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    E, T, H = 2 * ctx.world_size, 6, 64
    buf = Buffer(dist.group.WORLD, 1 << 22, timeout_s=timeout_s)
    x = torch.randn(T, H).bfloat16()
    good = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    bad = good.clone()
    bad[0, 0] = E
    return buf, x, good, bad, E


def interrupted_refusal_handoff(ctx):
    """Rank 1 refuses a dispatch (an expert id out of range); rank 0 reaches that call only after 2 s, so
    rank 1's next call waits at its start for rank 0 to leave the refused one, and a Ctrl-C arrives in that
    wait (a KeyboardInterrupt raised by a timer 0.3 s in). Returns per rank what each step raised and how
    long it took."""
    import signal
    import time

    import torch.distributed as dist
    buf, x, good, bad, E = _normal_refusal_setup(ctx, 20.0)
    out = []

    def step(f):
        t0 = time.monotonic()
        try:
            f()
            out.append(("ok", round(time.monotonic() - t0, 2)))
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            out.append((type(e).__name__, round(time.monotonic() - t0, 2)))

    def interrupt(*args):
        raise KeyboardInterrupt
    if ctx.rank == 1:
        step(lambda: buf.dispatch(x, topk_idx=bad, num_experts=E))
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        step(lambda: buf.dispatch(x, topk_idx=good, num_experts=E))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    else:
        time.sleep(2.0)
        step(lambda: buf.dispatch(x, topk_idx=good, num_experts=E))
    step(lambda: buf.dispatch(x, topk_idx=good, num_experts=E))
    dist.barrier()
    buf.destroy()
    return out


def refusal_handoff_times_out(ctx):
    """Rank 1 refuses a dispatch and calls again at once; rank 0 reaches the refused call only after 2 s,
    past rank 1's 1 s deadline, which rank 1's next call spends waiting for rank 0 to leave the refused one.
    Returns per rank what each step raised (type, message)."""
    import time

    import torch.distributed as dist
    buf, x, good, bad, E = _normal_refusal_setup(ctx, 1.0)
    out = []
    steps = [bad, good] if ctx.rank == 1 else [None, good, good]
    for topk in steps:
        if topk is None:
            time.sleep(2.0)
            continue
        try:
            buf.dispatch(x, topk_idx=topk, num_experts=E)
            out.append(("ok", ""))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    dist.barrier()
    buf.destroy()
    return out


def abort_of_an_earlier_call_seen_in_a_wait(ctx, later: bool):
    """Every rank completes dispatch 1. Rank 1 then posts an abort naming call 1 (``later``: call 3) 0.5 s
    on, as a rank whose abort of a call comes after its peer finished that call, and does not come to call
    2 (nor does rank 2, on three ranks, for which rank 1 posts an abort of call 2 in rank 0's memory just
    before its own); rank 0 is waiting in call 2 by then (its deadline 20 s). Returns what rank 0's call 2
    raised."""
    import time

    import torch.distributed as dist

    from ubep_torch import protocol as P
    buf, x, good, bad, E = _normal_refusal_setup(ctx, 20.0)
    buf.dispatch(x, topk_idx=good, num_experts=E)
    dist.barrier()
    out = None
    if ctx.rank == 1:
        time.sleep(0.5)
        if ctx.world_size == 3:     # (rank 2's word too, in the same microsecond: rank 0 sees both at once)
            from ubep_torch.buffer import _ABORT_ROW
            buf._peer_words[0][_ABORT_ROW * 3 + 2] = P.abort_word(P.ABORT_GAVE_UP, 2)
        buf._signal_abort(P.ABORT_GAVE_UP, call=3 if later else 1)
    else:
        t0 = time.monotonic()
        try:
            buf.dispatch(x, topk_idx=good, num_experts=E)
            out = ("ok", "", 0.0)
        except Exception as e:  # noqa: BLE001
            out = (type(e).__name__, str(e), time.monotonic() - t0)
    dist.barrier()
    buf.destroy()
    return out


def ll_next_buffer_refused(ctx):
    """Rank 0 fetches the zero-copy combine buffer with a bad handle (an edited plain tuple), raising before
    its combine; rank 1 fetches it rightly and combines. Then both make a low-latency round trip. Returns
    per rank what each step did (error type and cancelled, or "ok") and the round trip's largest error."""
    import time

    import torch
    import torch.distributed as dist
    buf, x, topk, _, N, E = _ll_refusal_setup(ctx)
    w = torch.full(topk.shape, 0.5)
    out = []
    step = _recorder(out)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)

    def zero_copy_combine():
        if ctx.rank == 0:
            buf.get_next_low_latency_combine_buffer(tuple(handle)[:4] + (2 ** 40,))
        else:
            buf.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
        return buf.low_latency_combine(None, topk, w, handle, zero_copy=True)
    t0 = time.monotonic()
    step(zero_copy_combine)
    took = time.monotonic() - t0

    def round_trip():
        rx, _, h, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
        y = buf.low_latency_combine(rx, topk, w, h)[0]
        return float((y.float() - x.float() * w.sum(1, keepdim=True)).abs().max())
    err = step(round_trip)
    dist.barrier()
    buf.destroy()
    return out, took, err


def ll_zero_copy_combine_interrupted(ctx, steps=3):
    """Steps of a low-latency dispatch and a zero-copy combine; in step 0 a KeyboardInterrupt reaches rank 0
    while its combine fetches the zero-copy buffer, before the call reaches the peers. Every rank goes on
    with its next step after any error. Returns per rank each step's outcome and the largest error."""
    import torch
    import torch.distributed as dist
    buf, x, topk, _, N, E = _ll_refusal_setup(ctx)
    w = torch.full(topk.shape, 0.5)
    out = []
    step = _recorder(out)
    fetch = buf._next_combine_buffer
    fetches = []

    def interrupted(handle):      # (the caller's fetch passes; the combine's own is interrupted)
        fetches.append(handle)
        if len(fetches) == 1:
            return fetch(handle)
        buf._next_combine_buffer = fetch
        raise KeyboardInterrupt

    def round_trip():
        rx, _, h, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
        buf.get_next_low_latency_combine_buffer(h).copy_(rx)
        y = buf.low_latency_combine(None, topk, w, h, zero_copy=True)[0]
        return float((y.float() - x.float() * w.sum(1, keepdim=True)).abs().max())
    errs = []
    for i in range(steps):
        if i == 0 and ctx.rank == 0:
            buf._next_combine_buffer = interrupted
        try:
            errs.append(step(round_trip))
        except KeyboardInterrupt:
            out.append(("KeyboardInterrupt", None))
    dist.barrier()
    buf.destroy()
    return out, errs


def zero_copy_buffer_of_a_normal_buffer(ctx):
    """Rank 0 asks its normal-mode Buffer for the zero-copy combine buffer of a low-latency handle (of the
    program's other Buffer): a usage error on a Buffer that has no low-latency calls, which must not refuse
    anything; then both ranks make a normal round trip. Returns what each step did."""
    import torch
    import torch.distributed as dist

    from ubep_torch import Buffer
    llbuf, x, topk, _, N, E = _ll_refusal_setup(ctx)
    normal = Buffer(dist.group.WORLD, 1 << 22, timeout_s=20.0)
    out = []
    step = _recorder(out)
    _, _, handle, _, _ = llbuf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    if ctx.rank == 0:
        step(lambda: normal.get_next_low_latency_combine_buffer(handle))

    def round_trip():
        recv_x, _, _, _, h, _ = normal.dispatch(x, topk_idx=topk, num_experts=E)
        reached = torch.zeros(x.shape[0], ctx.world_size, dtype=torch.bool)
        reached.scatter_(1, topk // (E // ctx.world_size), True)
        return float((normal.combine(recv_x, h)[0].float() - x.float() * reached.sum(1, keepdim=True)).abs().max())
    err = step(round_trip)
    dist.barrier()
    normal.destroy()
    llbuf.destroy()
    return out, err
