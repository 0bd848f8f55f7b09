"""Vanished and stalled peers: every survivor raises within ``timeout_s`` naming the phase and the missing
rank, every process exits, and no segment is left in the shared-memory directory.

Every scenario runs in fresh processes (``fault_rank_fns.run_scenario``), one victim per scenario, killed
(SIGKILL) or stalled past the deadline from inside ``Buffer.delay_hook`` at a chosen phase: each wait of
normal dispatch and combine, of the low-latency pair (plain and with recv hooks), and the SyncAll phases
of ``sync="sw"``. The stale-segment sweep is tested on planted files.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fault_rank_fns as FR  # noqa: E402

from ubep_torch import ugas  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402

TIMEOUT_S = 1.5
SLACK_S = 1.5


def _explain(outcomes):
    lines = []
    for o in outcomes:
        probs = o.check(SLACK_S)
        if probs:
            sc = o.scenario
            lines.append(f"{sc.op}/{sc.sync}/{sc.fault} at {sc.phase!r} (victim {sc.victim}): {probs}; "
                         f"reports {o.reports}")
    return "\n".join(lines)


def _phase_ids(scenarios):
    return [f"{s.op}-{s.sync}-{s.phase}" for s in scenarios]


def test_kill_at_every_phase(tmp_path):
    scenarios = FR.all_phase_scenarios("kill", timeout_s=TIMEOUT_S)
    outcomes = FR.run_many(2, scenarios, str(tmp_path), parallel=4)
    assert not _explain(outcomes), _explain(outcomes)
    for o in outcomes:
        rep = o.reports[0]
        # the launcher reaps the victim, so the loss is seen by liveness long before the deadline
        assert rep["type"] in ("UBEPPeerLostError", "UBEPPeerAbortedError"), rep
        assert o.detection_delays()[0] < TIMEOUT_S, (o.scenario, o.detection_delays())
        assert rep["phase"].split(":")[0] in ("dispatch", "combine", "low_latency_dispatch",
                                              "low_latency_combine"), rep["phase"]
        assert "rank 0" in rep["message"] and "[1]" in rep["message"]


def test_stall_at_every_phase(tmp_path):
    scenarios = FR.all_phase_scenarios("stall", timeout_s=1.0)
    for sc in scenarios:
        sc.stall_extra_s = 0.5
    outcomes = FR.run_many(2, scenarios, str(tmp_path), parallel=6)
    assert not _explain(outcomes), _explain(outcomes)
    for o in outcomes:
        assert o.reports[0]["type"] == "UBEPTimeoutError", o.reports[0]
        assert o.reports[0]["missing"] == [1]
        # the stalled rank wakes up and fails fast instead of spinning, and never completes a call its peer
        # gave up on (it may find all that call's data there): it fails in the same call, naming the peer
        rep = o.reports[1]
        assert rep["kind"] == "error" and 0 in rep["aborted"] + rep["dead"], rep
        assert rep["call"] == o.reports[0]["call"], (o.scenario.phase, o.reports)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_a_fault_while_peers_take_the_one_step_exchanges(tmp_path, fault):
    """Every call repeats the routing, so rank 0's calls take the C path's one-step exchanges; rank 1 is
    killed or stalled at each wait of dispatch and combine in call 3: rank 0, whose one-step call finds
    messages or rows missing, goes on the general way and raises as in the other scenarios."""
    scenarios = [FR.Scenario("normal", "tff", fault, ph, fault_call=3, timeout_s=1.0, stall_extra_s=0.5, steady=True)
                 for ph in FR.PHASES["normal"]]
    outcomes = FR.run_many(2, scenarios, str(tmp_path), parallel=6)
    assert not _explain(outcomes), _explain(outcomes)
    for o in outcomes:
        rep = o.reports[0]
        if fault == "kill":
            assert rep["type"] in ("UBEPPeerLostError", "UBEPPeerAbortedError") and rep["call"] in (3, 4), rep
        else:
            assert rep["type"] == "UBEPTimeoutError" and rep["missing"] == [1], rep
        assert rep["phase"].split(":")[0] in ("dispatch", "combine"), rep


@pytest.mark.parametrize("victim,phase,op", [
    (0, "dispatch: Token-Reordering", "normal"),         # rank 0 also hosts the bootstrap store
    (1, "combine: TokenCnt", "normal"),
    (2, "low_latency_combine: waiting for expert outputs", "ll"),
])
def test_kill_three_ranks(tmp_path, victim, phase, op):
    o = FR.run_scenario(3, FR.Scenario(op, "tff", "kill", phase, victim=victim, timeout_s=TIMEOUT_S), str(tmp_path))
    assert not o.check(SLACK_S), _explain([o])
    for r in o.survivors:
        assert victim in o.reports[r]["missing"] + o.reports[r].get("aborted", []), o.reports[r]


def test_stall_three_ranks_names_the_stalled_rank(tmp_path):
    o = FR.run_scenario(3, FR.Scenario("normal", "sp", "stall", "dispatch: TokenCnt", victim=2, timeout_s=1.0,
                                       stall_extra_s=0.5), str(tmp_path))
    assert not o.check(SLACK_S), _explain([o])
    timed_out = [r for r in (0, 1) if o.reports[r]["type"] == "UBEPTimeoutError"]
    assert timed_out, o.reports
    for r in timed_out:
        assert o.reports[r]["missing"] == [2], o.reports[r]


def test_unreaped_victim_is_still_detected_by_the_deadline(tmp_path):
    """A killed rank that nobody reaps stays a zombie; the survivor must still fail by its deadline."""
    o = FR.run_scenario(2, FR.Scenario("ll", "tff", "kill", "low_latency_combine: waiting for expert outputs",
                                       timeout_s=TIMEOUT_S, reap=False), str(tmp_path))
    assert not o.check(SLACK_S), _explain([o])
    assert o.reports[0]["type"] in ("UBEPTimeoutError", "UBEPPeerLostError")


def test_no_fault_baseline(tmp_path):
    outcomes = FR.run_many(2, [FR.Scenario(op, sync, "none", "-", timeout_s=5.0)
                               for op, sync in [("normal", "tff"), ("ll", "dc"), ("ll_hook", "sw")]],
                           str(tmp_path), parallel=3)
    assert not _explain(outcomes), _explain(outcomes)


@pytest.mark.parametrize("by_name", [False, True])
def test_crash_during_setup_leaves_nothing(tmp_path, monkeypatch, by_name):
    """The victim dies after creating its segment, before anyone unlinks it (by name: ``UBEP_SHM_BY_NAME``):
    the survivor raises an error naming the set-up step and the lost rank, unlinks its own segment, and
    unlinks the victim's too (its name was announced before it was created). Segments of a group that died
    entirely in that window are removed by the next start's sweep
    (``test_sweep_removes_only_dead_owners_segments``)."""
    monkeypatch.setenv("UBEP_SHM_BY_NAME", "1" if by_name else "0")
    o = FR.run_scenario(2, FR.Scenario("normal", "tff", "setup_kill", "setup", timeout_s=TIMEOUT_S), str(tmp_path))
    assert not o.spinning
    rep = o.reports[0]
    assert rep["kind"] == "error" and rep["type"] == "UBEPPeerLostError", o.reports
    assert "set-up" in rep["phase"] and rep["dead"] == [1], rep
    assert o.leftover == [], o.leftover


def test_a_peer_gone_before_setup_is_named_as_lost(tmp_path):
    """A rank that left the process group before building its Buffer (its gloo connections are closed):
    the others' set-up raises UBEPPeerLostError naming the set-up step and that rank at once, not a bare
    error about an earlier timed-out set-up."""
    o = FR.run_scenario(2, FR.Scenario("normal", "tff", "gone_before_setup", "setup", timeout_s=20.0), str(tmp_path))
    rep = o.reports[0]
    assert rep["kind"] == "error" and rep["type"] == "UBEPPeerLostError", o.reports
    assert "set-up" in rep["phase"] and rep["dead"] == [1] and rep["missing"] == [1], rep
    assert rep["time"] - o.fault_time < 10.0, rep          # (not at the 20 s deadline)
    assert o.leftover == [] and not o.spinning, (o.leftover, o.spinning)


def test_a_connection_closed_by_an_earlier_timeout_says_so():
    """gloo closes a connection whose wait timed out: a later set-up on that group is told to use a new
    process group, and names no rank as lost."""
    from ubep_torch import ugas
    from ubep_torch.errors import UBEPError, UBEPPeerLostError
    e = ugas._closed_connection(RuntimeError("Application timeout caused pair closure"), "Buffer set-up", 0, 1)
    assert type(e) is UBEPError and "new process group" in str(e) and "timed out" in str(e), e
    e = ugas._closed_connection(RuntimeError("Connection closed by peer [127.0.0.1]:1"), "Buffer set-up", 0, 1)
    assert isinstance(e, UBEPPeerLostError) and e.dead_ranks == [1] and e.phase == "Buffer set-up", e


_SETUP_RANK = """
import os, sys, time
import torch.distributed as dist
rank = int(sys.argv[1])
from ubep_torch.testing import join_group
join_group(int(sys.argv[2]), rank, 2)
from ubep_torch import Buffer
if rank == 1:
    time.sleep(8)
    sys.exit(0)
print("building", flush=True)
Buffer(dist.group.WORLD, 1 << 20, timeout_s=30)
"""


def test_ctrl_c_ends_a_setup_wait_at_once(tmp_path):
    """Ctrl-C while the set-up waits for a late peer raises KeyboardInterrupt at once (the wait used to be one
    uninterruptible gloo wait until the deadline) and leaves no segment."""
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), UBEP_SHM_DIR=str(tmp_path))
    from ubep_torch.testing import rendezvous_store
    store = rendezvous_store()     # (held until the ranks are done)
    port = str(store.port)
    # (Ctrl-C's default action restored in the ranks: a shell running this suite in the background ignores
    # SIGINT, the ranks would inherit that, and Python then installs no KeyboardInterrupt handler)
    ranks = [subprocess.Popen([sys.executable, "-c", _SETUP_RANK, str(r), port], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) for r in range(2)]
    try:
        assert ranks[0].stdout.readline().strip() == "building"
        time.sleep(2.0)     # (into the set-up's wait, on a loaded machine too: rank 1 comes after 8 s)
        t0 = time.monotonic()
        ranks[0].send_signal(signal.SIGINT)
        _, err = ranks[0].communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    assert "KeyboardInterrupt" in err and took < 5.0, (took, err[-1500:])
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")], os.listdir(tmp_path)


_INTERRUPTED_EXIT = """
import os, signal, sys, threading, time
import torch.distributed as dist
from ubep_torch import Buffer
dist.init_process_group("gloo")
me = dist.get_rank()
if me == 0:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        Buffer(dist.group.WORLD, 1 << 20, timeout_s=6.0)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
else:
    time.sleep(1.5)
dist.barrier()
print("done", flush=True)
"""


def test_a_process_exits_cleanly_after_an_interrupted_setup(tmp_path):
    """A program that catches Ctrl-C in a Buffer set-up and then ends normally exits with status 0: exit waits
    (the set-up's deadline at most, saying so) for the receive gloo cannot withdraw (former bug: the process
    aborted at exit, SIGABRT, "terminate called without an active exception")."""
    from ubep_torch.testing import run_torchrun
    script = tmp_path / "interrupted_exit.py"
    script.write_text(_INTERRUPTED_EXIT)
    env = {"PYTHONPATH": os.path.dirname(HERE)}
    proc = run_torchrun(str(script), nproc=2, timeout_s=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out[-3000:]
    assert proc.stdout.count("done") == 2 and "interrupted" in proc.stdout, out[-3000:]
    assert "exit waits" in proc.stderr, out[-3000:]


def test_shared_memory_that_fills_up_during_setup_is_an_error_not_sigbus(tmp_path):
    """Shared memory that another job fills between the set-up's free-space check and the creation of the
    segments: every rank raises the error that names the bytes (former bug: the header's store into the
    sparse mapping killed the rank with SIGBUS, and segments could be left). Needs a small tmpfs of its own
    (root)."""
    import subprocess
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
        with RankPool(2, env=env) as pool:
            out = pool.run(FR.fill_shm_then_build, str(small), timeout_s=60)
        for name, msg in out:
            assert name == "RuntimeError" and "bytes of shared memory" in msg, out
        assert sorted(os.listdir(small)) == ["filler"], os.listdir(small)
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_shared_memory_without_a_size_limit_builds_and_a_pseudo_file_system_is_refused(tmp_path):
    """A tmpfs mounted without a size limit (size=0: its file system reports no size) takes a Buffer (former
    bug: "needs N bytes of shared memory but only 0 are free"), and one larger than the machine's memory is
    refused naming the bytes; /proc, which root may write by access() but which takes no files, and an mqueue
    file system, whose files cannot be sized, are refused by name (they were reported as too little memory).
    The mounts need root."""
    import subprocess

    from ubep_torch.ugas import shm_dir
    with pytest.raises(ValueError, match="/proc.*(cannot hold a shared-memory segment|not writable)"):
        shm_dir("/proc")
    unlimited, mqueue = tmp_path / "unlimited", tmp_path / "mqueue"
    unlimited.mkdir()
    mqueue.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=0", "tmpfs", str(unlimited)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        with RankPool(2, env=env) as pool:
            assert pool.run(FR.build_in, str(unlimited), timeout_s=60) == ["ok", "ok"]
            assert os.listdir(unlimited) == [], os.listdir(unlimited)
            too_large = pool.run(FR.build_in, str(unlimited), available, timeout_s=60)   # (two ranks' worth)
        assert all(r.startswith("RuntimeError") and "bytes of shared memory" in r and "only" in r
                   for r in too_large), too_large
        assert os.listdir(unlimited) == [], os.listdir(unlimited)
        if not subprocess.run(["mount", "-t", "mqueue", "none", str(mqueue)], capture_output=True).returncode:
            try:
                with pytest.raises(ValueError, match="cannot hold a shared-memory segment"):
                    shm_dir(str(mqueue))
                assert os.listdir(mqueue) == [], os.listdir(mqueue)
            finally:
                subprocess.run(["umount", str(mqueue)], capture_output=True)
    finally:
        subprocess.run(["umount", str(unlimited)], capture_output=True)


def test_a_rank_that_cannot_map_a_segment_tells_its_peers():
    """A rank whose set-up fails while mapping the peers' segments (and that stays alive) makes every peer
    raise at once naming it and its error, as failures in the other set-up steps do."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (name0, msg0, took0), (name1, msg1, took1) = pool.run(FR.map_failure, timeout_s=90)
    assert name0 == "OSError" and "simulated" in msg0 and took0 < 10, (name0, msg0, took0)
    assert name1 == "RuntimeError" and "rank(s) [0]" in msg1 and "simulated" in msg1 and took1 < 10, \
        (name1, msg1, took1)


def test_a_peer_that_completed_its_setup_learns_of_an_interrupted_one():
    """Ctrl-C ends rank 0's set-up in its last step, after its message of that step went out: rank 1
    completes its own set-up, and its first call fails at once naming rank 0 and what it did instead of waiting
    for it until the deadline (then: saying that rank 0 "destroyed its Buffer", which it never had)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        out0, out1 = pool.run(FR.interrupted_last_setup_step, timeout_s=90)
    assert out0 == {"set-up": "KeyboardInterrupt"}, out0
    assert out1["set-up"] == "built", out1
    name, msg, took = out1["dispatch"]
    assert name == "UBEPPeerLostError" and "[0] left its Buffer set-up" in msg and took < 5, out1
    # three ranks, one of them 3 s late to its call: the others gave up by then, and it names rank 0 too
    # (it named rank 2, which had only given up)
    with RankPool(3, env=env) as pool:
        out = pool.run(FR.interrupted_last_setup_step, 1, timeout_s=90)
    assert out[0] == {"set-up": "KeyboardInterrupt"}, out
    for late in out[1:]:
        name, msg, took = late["dispatch"]
        assert name == "UBEPPeerLostError" and "[0] left its Buffer set-up" in msg and took < 5, out


def test_a_setup_again_after_an_interrupted_one_refuses_at_once():
    """After Ctrl-C ended a set-up's wait, a set-up on the same group refuses at once, saying why (former bug:
    it waited for its deadline and named a peer that had delivered: the interrupted set-up's receives took
    its messages), the peer fails naming the rank that did not deliver, and the pool's ranks exit cleanly
    (former bug: the rank with the interrupted wait aborted with SIGABRT at exit)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (first0, (name0, msg0, took0)), (_, (name1, msg1, took1)) = pool.run(FR.interrupted_setup_then_retry,
                                                                             timeout_s=90)
        procs = pool._procs
    assert first0 == "KeyboardInterrupt", first0
    assert name0 == "UBEPError" and "interrupted" in msg0 and "new process group" in msg0 and took0 < 1.0, \
        (name0, msg0, took0)
    assert name1 in ("UBEPTimeoutError", "UBEPPeerLostError") and "[0]" in msg1 and took1 < 30, (name1, msg1)
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
    # the pool closes while rank 0's interrupted wait still runs (rank 1 sends nothing)
    with RankPool(2, env=env) as pool:
        assert pool.run(FR.interrupted_setup_then_retry, False, timeout_s=60) == [["KeyboardInterrupt"], [None]]
        procs = pool._procs
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]


@pytest.mark.parametrize("by_name", [False, True])
def test_a_rank_stalled_in_setup_and_killed_later_leaves_nothing(tmp_path, monkeypatch, by_name):
    """The victim stalls in set-up after creating its segment; the survivor times out and exits, then the
    victim is killed (as a launcher does once a rank failed): its segment is gone too (by name, the
    survivor's failed set-up unlinked it, though the victim was alive then)."""
    monkeypatch.setenv("UBEP_SHM_BY_NAME", "1" if by_name else "0")
    o = FR.run_scenario(2, FR.Scenario("normal", "tff", "setup_stall_kill", "setup", timeout_s=TIMEOUT_S),
                        str(tmp_path))
    rep = o.reports[0]
    assert rep["kind"] == "error" and rep["type"] == "UBEPTimeoutError" and "set-up" in rep["phase"], o.reports
    assert rep["missing"] == [1] and o.exitcodes[1] == -9, (rep, o.exitcodes)
    assert o.leftover == [] and not o.spinning, (o.leftover, o.spinning)


def test_a_peer_that_left_the_setup_is_named_by_those_mapping_its_segment(tmp_path):
    """A rank whose set-up fails while mapping tells the peers that map after it which rank failed and why
    (former bugs: a bare FileNotFoundError naming a segment path, neither the rank nor the step; then a
    UBEPPeerLostError that said the rank had left, without its error)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": str(tmp_path)}
    with RankPool(2, env=env) as pool:
        mapping, leaving = pool.run(FR.peer_leaves_before_mapping, timeout_s=60)
    assert leaving[0] == "RuntimeError" and "injected" in leaving[3], leaving
    assert mapping[0] == "RuntimeError" and "map every segment" in mapping[3] and "rank(s) [1]" in mapping[3] \
        and "injected" in mapping[3], mapping
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")], os.listdir(tmp_path)


_LEAVES_WHILE_MAPPING = r"""
import json, os, sys, time
import torch.distributed as dist
from ubep_torch import Buffer, ugas
rank, real = int(os.environ["RANK"]), ugas.SymmetricHeap._map_peer
def mapping(self, *args, **kwargs):
    if rank == 1:
        sys.exit(3)             # leaves the set-up (its failed set-up closes its segment) and exits
    time.sleep(1.5 if rank == 2 else 0.3)   # (rank 2 comes to the peers' segments after the others)
    return real(self, *args, **kwargs)
ugas.SymmetricHeap._map_peer = mapping
dist.init_process_group("gloo")
try:
    Buffer(dist.group.WORLD, 1 << 20, timeout_s=30)
    out = ["built", ""]
except Exception as e:
    out = [type(e).__name__, str(e)]
with open(os.path.join(os.environ["OUT"], f"{rank}.json"), "w") as f:
    json.dump(out, f)
"""


@pytest.mark.parametrize("by_name", [False, True])
def test_a_rank_that_leaves_the_setup_while_the_others_map_is_named_by_each_of_them(tmp_path, by_name):
    """Four ranks; rank 1 leaves the set-up and exits while the others map the segments, and rank 2 comes to
    them last: every other rank names rank 1 (former defect: ranks 0 and 3 raised at once and exited, and rank
    2 then found their segments gone and named them; by name, rank 1's failed set-up removed the peers' names
    and they named each other)."""
    import socket
    import time
    shm = tmp_path / "shm"
    shm.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="4", UBEP_SHM_DIR=str(shm),
               OUT=str(tmp_path), UBEP_SHM_BY_NAME="1" if by_name else "0")
    procs = [subprocess.Popen([sys.executable, "-c", _LEAVES_WHILE_MAPPING], env=dict(env, RANK=str(r)),
                              cwd=tmp_path) for r in range(4)]
    start = time.monotonic()
    for p in procs:
        p.wait(90)
    assert [p.returncode for p in procs] == [0, 3, 0, 0], [p.returncode for p in procs]
    for r in (0, 2, 3):
        with open(tmp_path / f"{r}.json") as f:
            name, msg = json.load(f)
        assert name == "UBEPPeerLostError" and "set-up" in msg and "peer rank(s) [1]" in msg, (r, name, msg)
    assert time.monotonic() - start < 60
    assert [n for n in os.listdir(shm) if n.startswith("ubep-")] == []


_STALLED_IN_SETUP = r"""
import os, time
import torch.distributed as dist
from ubep_torch import Buffer, ugas
if os.environ["RANK"] == "1":
    def stalled(self, *args, **kwargs):       # slow between creating its segment and mapping the peers'
        open(os.environ["STALLED"], "w").close()
        time.sleep(120)
    ugas.SymmetricHeap._map_peer = stalled
dist.init_process_group("gloo")
Buffer(dist.group.WORLD, 1 << 20, timeout_s=120)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_group_killed_whole_in_its_setup_leaves_no_segment(tmp_path, sig):
    """Every rank is killed (SIGKILL, or the SIGTERM a launcher sends when a job is cancelled: neither runs
    atexit) while rank 1 is slow in the set-up, after every segment was created and before it mapped its
    peers': nothing is left in the shared-memory directory (former defect: the names lived until every rank
    had mapped every segment, so they stayed until a later set-up on the host swept them)."""
    import signal
    import socket
    import time
    shm, flag = tmp_path / "shm", tmp_path / "stalled"
    shm.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", UBEP_SHM_DIR=str(shm),
               STALLED=str(flag))
    procs = [subprocess.Popen([sys.executable, "-c", _STALLED_IN_SETUP], env=dict(env, RANK=str(r)), cwd=tmp_path)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no rank reached the stall"
            time.sleep(0.05)
        time.sleep(0.3)     # (rank 0 waits for rank 1 in the mapping step by now)
    finally:
        for p in procs:
            p.send_signal(getattr(signal, sig))
        for p in procs:
            p.wait(30)
    assert [n for n in os.listdir(shm) if n.startswith("ubep-")] == []


def test_setup_shares_segments_by_name_where_proc_refuses_their_descriptors(tmp_path):
    """Where /proc refuses a rank access to a peer's descriptors (a hardened kernel, a non-dumpable peer), the
    set-up shares the segments by name instead, on every rank, and the Buffer works; nothing is left."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        out = pool.run(FR.proc_refused_setup, str(tmp_path), timeout_s=60)
    assert out == [("ok", 1, 1), ("ok", 1, 1)], out      # (result; maps by descriptor, then by name)
    assert os.listdir(tmp_path) == []


def test_a_rank_refused_by_proc_names_a_peer_that_stalls_in_the_setup(tmp_path):
    """Rank 0 cannot open the segments through /proc while rank 1 stalls in the same step: rank 0 raises the
    timeout naming the set-up step and rank 1, not the internal error that would have made the group share
    by name (former bug: ``_ProcRefused``, "[Errno 13] ...")."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": str(tmp_path)}
    with RankPool(2, env=env) as pool:
        (kind, msg), _ = pool.run(FR.proc_refused_while_a_peer_stalls, timeout_s=60)
    assert kind == "UBEPTimeoutError" and "set-up" in msg and "rank(s) [1]" in msg, (kind, msg)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")], os.listdir(tmp_path)


@pytest.mark.parametrize("by_name", [False, True])
def test_setup_failure_unlinks_own_segment_before_raising(tmp_path, monkeypatch, by_name):
    monkeypatch.setenv("UBEP_SHM_BY_NAME", "1" if by_name else "0")
    o = FR.run_scenario(2, FR.Scenario("normal", "tff", "setup_kill", "setup", timeout_s=TIMEOUT_S), str(tmp_path))
    assert o.reports[0].get("own_segments_after_error") == [], o.reports[0]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_sweep_removes_only_dead_owners_segments(tmp_path):
    """Only this user's segments whose creator is gone, and only those created in this PID namespace (a
    pid of another namespace, e.g. a container sharing /dev/shm, says nothing here: former bug, such a
    job's live segments were removed)."""
    d = str(tmp_path)
    ns = ugas._pid_namespace()
    dead = os.path.join(d, f"ubep-{_dead_pid()}-{ns}-{'ab' * 16}")
    live = os.path.join(d, f"ubep-{os.getpid()}-{ns}-{'cd' * 16}")
    elsewhere = os.path.join(d, f"ubep-{_dead_pid()}-{ns + 1}-{'12' * 16}")   # another PID namespace
    other = os.path.join(d, f"ubep-{_dead_pid()}-{ns}-short")     # not our naming scheme
    unrelated = os.path.join(d, "something-else")
    for p in (dead, live, elsewhere, other, unrelated):
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
        os.chmod(p, 0o600)
    foreign = None
    if os.getuid() == 0:
        foreign = os.path.join(d, f"ubep-{_dead_pid()}-{ns}-{'ef' * 16}")
        with open(foreign, "wb") as f:
            f.write(b"\0")
        os.chown(foreign, 12345, 12345)                           # another user's file: never touched
    removed = ugas.sweep_stale_segments(d)
    assert removed == [dead]
    left = set(os.listdir(d))
    assert {os.path.basename(p) for p in (live, elsewhere, other, unrelated)} <= left
    if foreign:
        assert os.path.basename(foreign) in left
    assert ugas.sweep_stale_segments(os.path.join(d, "missing-dir")) == []


@pytest.mark.parametrize("where,context", [
    ("hook", "in its recv hook"),
    ("backward", "in the backward of ubep_torch.functional.combine"),
])
def test_a_wait_names_the_hook_or_backward_it_is_in(where, context):
    """A wait in a recv hook, or in the backward of a differentiable call, belongs to a call the user made
    earlier or did not make by that name: its error says where it is after the phase."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        res, _ = pool.run(FR.stalled_in, where)
    kind, phase, missing = res
    assert kind == "UBEPTimeoutError" and missing == [1], res
    assert phase.endswith(", " + context), phase
    assert phase.startswith("low_latency_dispatch: " if where == "hook" else "dispatch: "), phase


def test_setup_has_a_deadline(tmp_path):
    """Buffer construction waits for the peers under timeout_s, not under gloo's 30-minute default."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": str(tmp_path)}
    with RankPool(2, env=env) as pool:
        (elapsed, missing, phase), _ = pool.run(FR.skip_buffer, 2.0, timeout_s=60)
    assert missing == [1] and "set-up" in phase
    assert 1.9 < elapsed < 10, elapsed
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")]


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "abc", 1e14])
def test_timeout_must_be_a_finite_positive_number(monkeypatch, value):
    from ubep_torch import protocol as P
    monkeypatch.delenv("UBEP_TIMEOUT_S", raising=False)
    error = TypeError if isinstance(value, str) else ValueError     # (a string is not a number of seconds)
    with pytest.raises(error, match="timeout_s"):
        P.default_timeout(value)
    monkeypatch.setenv("UBEP_TIMEOUT_S", str(value))
    with pytest.raises(ValueError, match="UBEP_TIMEOUT_S"):
        P.default_timeout(5.0)
    monkeypatch.setenv("UBEP_TIMEOUT_S", "2.5")
    with pytest.raises(error, match="timeout_s"):      # checked even when the variable overrides it
        P.default_timeout(value)
    assert P.default_timeout(7.0) == 2.5


def test_rank_killed_before_unlinking_its_segment_leaves_nothing(tmp_path):
    """Segments shared by name (``UBEP_SHM_BY_NAME``): every rank has mapped every segment, then rank 0 dies
    right before unlinking its own file: rank 1 unlinks every announced name too, so nothing is left while
    one rank of the group lives. (Rank 1's set-up then fails in its last step, which needs every rank: the
    pool may report that too.)"""
    from ubep_torch.testing import RankFailure
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": str(tmp_path),
           "UBEP_SHM_BY_NAME": "1"}
    with RankPool(2, env=env) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(FR.die_before_own_unlink, timeout_s=8)
    assert "exited (code -9)" in info.value.failures[0], str(info.value)
    assert 1 not in info.value.failures or "UBEPPeerLostError" in info.value.failures[1] or \
        "stopped with the pool" in info.value.failures[1], str(info.value)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")], os.listdir(tmp_path)


def test_group_killed_while_reserving_memory_leaves_nothing(tmp_path):
    """Every rank SIGKILLed at once while it reserves its segment's memory (``posix_fallocate``, about 0.25 s
    per GiB: most of a large Buffer's set-up) leaves no file (former bug: the memory was reserved while the
    names existed, and a whole group killed then left its segments until the next start's sweep)."""
    import signal
    import threading
    import time

    from ubep_torch.testing import RankFailure
    shm, marks = tmp_path / "shm", tmp_path / "marks"
    shm.mkdir()
    marks.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": str(shm)}
    with RankPool(2, env=env) as pool:
        failed = []

        def run():
            try:
                pool.run(FR.stuck_while_reserving, str(marks), timeout_s=60)
            except RankFailure as e:
                failed.append(e)
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(marks)) == 2, "the ranks never reached the reservation"
        for name in os.listdir(marks):
            os.kill(int((marks / name).read_text()), signal.SIGKILL)
        t.join(60)
    assert failed, "the pool did not report its killed ranks"
    assert not [n for n in os.listdir(shm) if n.startswith("ubep-")], os.listdir(shm)


def test_late_rank_learns_which_call_was_aborted():
    """An abort names the call it happened in, also from a recv hook that runs after later calls were
    issued and from clean_low_latency_buffer: the late rank fails in that very call and says so, and
    completes the calls its peer completed."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        late, gave_up = pool.run(FR.late_rank, "hook", timeout_s=60)
        assert gave_up[:3] == [None, None, None] and gave_up[3][0] == "UBEPTimeoutError", gave_up
        # rank 1 gave up in call 1 (its first hook) after issuing call 2: rank 0 fails as call 1 starts
        assert len(late) == 2 and late[1][0] == "UBEPPeerAbortedError", late
        assert "low_latency_dispatch: start of the call" in late[1][1] and "in this call" in late[1][2], late
        late, gave_up = pool.run(FR.late_rank, "clean", timeout_s=60)
        assert gave_up[:2] == [None, None] and "clean_low_latency_buffer" in gave_up[2][1], gave_up
        assert late[:2] == [None, None], late           # the round trip completed on both ranks
        assert late[2][0] == "UBEPPeerAbortedError" and "in this call" in late[2][2], late


def test_a_call_refused_on_one_rank_fails_its_peers_fast():
    """Bad input on one rank only: the rank that waits for it in that call raises at once (not at its 20 s
    deadline), naming that rank and saying it refused the call, which is then cancelled on every rank,
    every Buffer usable; a call the refusing rank makes at once is its next call, never the cancelled one
    (former bug: the peer's cancelled call took it, and the ranks were a call out of step from then on),
    and a call refused on every rank is no call at all."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        waiting, refusing = pool.run(FR.refused_call, "late", timeout_s=60)
        name, took, refused, aborted = waiting[0][:4]
        assert name == "UBEPPeerAbortedError" and refused and aborted == [1], waiting
        assert took < 1.0, waiting
        assert "refused this call" in waiting[0][4] and "invalid" in waiting[0][4], waiting
        assert "cancelled on every rank" in waiting[0][4] and "stays usable" in waiting[0][4], waiting
        # the call is cancelled on both ranks: both go on with the next one, which completes
        assert waiting[1][0] == "ok" and waiting[1][2] == 0.0, waiting
        assert [step[0] for step in refusing] == ["ValueError", "ok", "ok"] and refusing[2][2] == 0.0, refusing
        waiting, refusing = pool.run(FR.refused_call, "layout", timeout_s=60)
        assert waiting[0][0] == "UBEPPeerAbortedError" and waiting[0][2] and waiting[0][1] < 3.0, waiting
        assert [step[0] for step in waiting[1:]] == ["ok"] and waiting[1][2] == 0.0, waiting
        assert [step[0] for step in refusing] == ["ValueError", "ok", "ok"] and refusing[2][2] == 0.0, refusing
        # refused, then destroyed (a with block ended by the error): the refusal is named at once, not the
        # destroyed Buffer, and without the second a retry would take
        waiting, refusing = pool.run(FR.refused_call, "destroy", timeout_s=60)
        assert waiting[0][0] == "UBEPPeerAbortedError" and waiting[0][2] and waiting[0][3] == [1], waiting
        assert waiting[0][1] < 0.9 and "refused this call" in waiting[0][4], waiting
        assert [step[0] for step in refusing] == ["ValueError", "ok"], refusing
        waiting, refusing = pool.run(FR.refused_call, "prompt", timeout_s=60)
        assert waiting[0][0] == "UBEPPeerAbortedError" and waiting[0][2] and waiting[0][1] < 1.0, waiting
        assert "cancelled on every rank" in waiting[0][4], waiting
        assert waiting[1][0] == "ok" and waiting[1][2] == 0.0, waiting
        assert [step[0] for step in refusing] == ["ValueError", "ok"] and refusing[1][2] == 0.0, refusing
        waiting, refusing = pool.run(FR.refused_call, "both", timeout_s=60)
        assert [step[0] for step in waiting] == ["ValueError", "ok"] and waiting[1][2] == 0.0, waiting
        assert waiting[1][1] > 2.0, waiting            # (it waited for rank 1's retry)
        assert [step[0] for step in refusing] == ["ValueError", "ok", "ok"] and refusing[2][2] == 0.0, refusing


def test_refusals_around_recv_hooks():
    """A rank waiting in a later call, its recv hook for the refused one pending, cancels that hook's call
    and goes on with the later call (former bug: it failed; the refusing rank's next call now waits until
    its peers left the refused one); refusals on every rank, then on one, around a pending hook."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        refusing, waiting = pool.run(FR.refused_with_hooks, "later", timeout_s=60)
        assert [o[1] for o in refusing] == ["ValueError", "ok", "ok"], refusing
        assert [o[1] for o in waiting] == ["ok", "ok", "CancelledCallError"], waiting
        assert 1.0 < waiting[1][2] < 10.0, waiting          # (the round trip waited for rank 0's)
        r0, r1 = pool.run(FR.refused_with_hooks, "twice", timeout_s=60)
        assert [o[1] for o in r0] == ["ValueError", "ok", "ValueError", "ok", "ok"], r0
        assert [o[1] for o in r1] == ["ValueError", "ok", "ok", "UBEPPeerAbortedError", "ok"] and r1[3][3], r1


def test_a_call_refused_on_one_of_three_ranks_is_named_by_both_others():
    """The two ranks that wait for the refusing one both name it (not the other waiting rank, which gave up
    on it too)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(3, env=env) as pool:
        first, refusing, third = pool.run(FR.refused_call, "late", timeout_s=60)
    for waiting in (first, third):
        name, took, refused, aborted = waiting[0][:4]
        assert name == "UBEPPeerAbortedError" and refused and aborted == [1] and took < 3.0, waiting
    assert refusing[0][0] == "ValueError", refusing


def test_errors_on_a_sub_group_name_global_ranks_too():
    """Ranks in errors are ranks of the Buffer's group: on a sub-group the message also gives their global
    ranks (global rank 1 is group rank 0 here, and global rank 2 group rank 1), bad input's ValueError
    included."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(3, env=env) as pool:
        _, waiting, refusing = pool.run(FR.refusal_on_a_sub_group, timeout_s=60)
    assert waiting[0] == "UBEPPeerAbortedError" and waiting[1] == [1], waiting
    assert "as global ranks: 0 is 1, 1 is 2" in waiting[2], waiting
    # (bad input: the ValueError names the rank whose input it was, with its global rank too)
    assert refusing[0] == "ValueError" and "(rank 1)" in refusing[2] and "0 is 1, 1 is 2" in refusing[2], refusing
    assert waiting[3].startswith("UBEPBrokenError") and "0 is 1, 1 is 2" in waiting[3], waiting[3]
    for mismatch in (waiting[4], refusing[4]):
        assert "differs" in mismatch and "0 is 1, 1 is 2" in mismatch, mismatch


def test_destroy_leaves_live_views_and_ends_waits():
    """(former bugs: a kept get_local_buffer_tensor view read unmapped memory after destroy(), and destroy()
    from another thread unmapped the memory a waiting call polled; both crashed the process)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (total, waited), (total1, _) = pool.run(FR.destroy_under_views, timeout_s=60)
    assert total == total1 == 48
    assert waited[0] == "UBEPBrokenError" and waited[1] < 3.0 and "destroyed while waiting" in waited[2], waited


def test_destroy_from_another_thread_during_one_step_calls():
    """``destroy()`` from another thread while the calling thread is inside the one-step C exchanges (or the
    general wait after their short one): the call raises ``UBEPBrokenError`` at once, the process does not
    crash, and the peer learns of it (``UBEPPeerLostError``: "destroyed its Buffer") well before its
    deadline (20 s; its pool run would time out)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    delays = [0.05, 0.113, 0.171, 0.25, 0.31, 0.37]
    with RankPool(2, env=env) as pool:
        mine, peer = pool.run(FR.destroy_during_one_step_calls, delays, timeout_s=120)
    for (kind, after, done), (peer_kind, message) in zip(mine, peer):
        assert kind == "UBEPBrokenError" and after < 3.0 and done > 0, mine
        assert peer_kind == "UBEPPeerLostError" and "destroyed its Buffer" in message, peer


def test_a_failure_while_destroying_leaves_the_destroy_as_the_cause():
    """(former race, seen once in the test above: the call that failed because of the destroy told the peers
    that this rank failed, and the destroy then told them nothing, so they named an abort, not the destroy)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        _, cause = pool.run(FR.failure_while_destroying, timeout_s=60)
    assert cause == "destroyed its Buffer", cause


def test_dropped_and_destroyed_buffers_release_their_memory():
    """(former bugs: a Buffer dropped without destroy() stayed mapped until the cycle collector ran, through
    a reference cycle of its own; after destroy(), a kept view or a kept exception's frames kept every
    segment mapped, so each such Buffer held its shared memory)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        res = pool.run(FR.dropped_buffers_release_memory, timeout_s=60)
    for rank, (alive, dropped, freed, after, total, _) in enumerate(res):
        assert alive >= 2 and dropped == 0 and freed, (rank, alive, dropped, freed)
        assert after == 0 and total == 16, (rank, after, total)
    assert res[0][5] == "UBEPPeerLostError" and res[1][5] == "NoneType", res


def test_failed_setup_unlinks_every_peer_name(tmp_path):
    """(former bugs: a peer killed during set-up whose process was not yet seen dead, or a peer stalled in
    set-up and killed by the launcher after the others gave up, kept its segment until a later set-up swept
    it) A failed set-up unlinks every peer's announced name, alive or not, and only names of that peer's pid
    in this directory."""
    heap = ugas.SymmetricHeap.__new__(ugas.SymmetricHeap)
    heap.rank, heap.directory, heap.peer_pids = 0, str(tmp_path), [os.getpid(), os.getpid(), 4242]
    ns = ugas._pid_namespace()
    names = [f"ubep-{os.getpid()}-{ns}-{'aa' * 16}", f"ubep-{os.getpid()}-{ns}-{'ab' * 16}",
             f"ubep-4242-{ns}-{'ac' * 16}", f"ubep-4243-{ns}-{'ad' * 16}"]
    for n in names:
        open(tmp_path / n, "w").close()
    heap._unlink_peer_names([str(tmp_path / names[0]), str(tmp_path / names[1]), str(tmp_path / names[2])])
    assert set(os.listdir(tmp_path)) == {names[0], names[3]}     # its own stays (its own `finally`)
    sub = tmp_path / "sub"
    sub.mkdir()
    open(sub / names[2], "w").close()
    # not the peer's pid, or not in this directory: left alone
    heap._unlink_peer_names([None, str(tmp_path / names[3]), str(sub / names[2])])
    assert set(os.listdir(tmp_path)) == {names[0], names[3], "sub"} and os.listdir(sub) == [names[2]]


def test_settings_from_the_environment_are_checked_and_named(monkeypatch, tmp_path):
    """(former bugs: a bad UBEP_SPIN_S failed ``import ubep_torch``; a trailing slash in the shared-memory
    directory broke every set-up; a missing directory gave a bare OSError; a Path was refused)"""
    import pathlib

    from ubep_torch import protocol as P
    for value in ("abc", "-1", "-0.5", "nan", "5"):
        monkeypatch.setenv("UBEP_SPIN_S", value)
        with pytest.raises(ValueError, match="UBEP_SPIN_S"):
            P.spin_seconds()
    monkeypatch.setenv("UBEP_SPIN_S", "0")
    assert P.spin_seconds() == 0.0
    monkeypatch.delenv("UBEP_SPIN_S")
    assert P.spin_seconds() == 0.002
    # UBEP_NATIVE is a switch like the others (former bug: only "0" turned the C path off; "false", "no" and
    # any typo left it on)
    from ubep_torch import native_engine
    from ubep_torch.engine import make_engine
    for value in ("0", "false", "No", "off"):
        monkeypatch.setenv("UBEP_NATIVE", value)
        assert make_engine("auto").name == "torch", value
    for value in ("2", "maybe"):
        monkeypatch.setenv("UBEP_NATIVE", value)
        with pytest.raises(ValueError, match="UBEP_NATIVE"):
            make_engine("auto")
    monkeypatch.setenv("UBEP_NATIVE", "yes")
    assert make_engine("auto").name == ("native" if native_engine.available() else "torch")
    monkeypatch.delenv("UBEP_NATIVE")
    d = str(tmp_path)
    assert ugas.shm_dir(d + "/") == ugas.shm_dir(pathlib.Path(d)) == d
    monkeypatch.setenv("UBEP_SHM_DIR", d + "//")
    assert ugas.shm_dir() == ugas.shm_dir("") == d
    for bad, what in ((os.path.join(d, "missing"), "not an existing directory"),
                      (__file__, "not an existing directory")):
        monkeypatch.setenv("UBEP_SHM_DIR", bad)
        with pytest.raises(ValueError, match=f"UBEP_SHM_DIR .*{what}"):
            ugas.shm_dir()
        with pytest.raises(ValueError, match=f"shm_dir .*{what}"):
            ugas.shm_dir(bad)
    with pytest.raises(TypeError, match="shm_dir"):
        ugas.shm_dir(5)


def test_too_little_shared_memory_is_an_error_when_the_buffer_is_built(tmp_path):
    """Every page of a segment is reserved when the Buffer is built (former bug: sparse segments of several
    Buffers that each fit the free space outgrew the tmpfs together, and touching them killed the ranks
    with SIGBUS). Here the reservation fails as on a full tmpfs: a clear error, nothing left behind."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": str(tmp_path)}
    with RankPool(2, env=env) as pool:
        for name, msg, _ in pool.run(FR.build_on_full_tmpfs, "all", timeout_s=60):
            assert name == "RuntimeError" and "bytes of shared memory" in msg and "UBEP_SHM_DIR" in msg, msg
            assert "shm_dir=" in msg, msg       # (the constructor's argument too, not only the variable)
        assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")], os.listdir(tmp_path)
        # rank 1 alone: rank 0 learns why in the set-up exchange instead of waiting for its deadline
        (name0, msg0, took0), (name1, msg1, _) = pool.run(FR.build_on_full_tmpfs, "one", timeout_s=60)
        assert name1 == "RuntimeError" and "UBEP_SHM_DIR" in msg1, msg1
        assert name0 == "RuntimeError" and "rank(s) [1]" in msg0 and "UBEP_SHM_DIR" in msg0 and took0 < 5, msg0
        assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")], os.listdir(tmp_path)


def test_second_thread_and_forked_child_are_refused():
    """A second thread's call while another waits, and a forked child's calls, raise RuntimeError before
    touching anything: the waiting call completes correctly, later calls stay correct, and the ranks' call
    counts still agree (a refusal on one rank reaches the other in about 1 s, not at its deadline)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (refused0, errors0), (refused1, errors1) = pool.run(FR.second_thread_and_fork, timeout_s=60)
    assert "another thread" in refused0["thread"], refused0
    assert refused0["fork"].count("forked child") == 4, refused0
    assert errors0 == [0.0, 0.0] and errors1 == [0.0, 0.0], (errors0, errors1)
    assert refused1["peer"][0] == "ValueError", refused1
    assert refused0["peer"][0] == "UBEPPeerAbortedError" and refused0["peer"][1] < 5, refused0


@pytest.mark.parametrize("mode,how", [("normal", "object"), ("ll", "object"), ("normal", "tuple"),
                                      ("ll", "tuple"), ("normal", "cached")])
def test_combines_of_different_dispatches_fail_instead_of_mixing_rows(mode, how):
    """Ranks that combine the handles of two different dispatches (of the same shapes) raise an error that
    names the mismatch instead of summing each other's rows of the wrong tokens; so do ranks that pass them
    as plain tuples of the handles' own tensors, or to cached dispatches (former bugs: both went unchecked
    and gave the wrong rows)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        out = pool.run(FR.swapped_combines, mode, how, timeout_s=60)
    assert all(name == "UBEPMismatchError" and "same dispatch" in msg for name, msg in out), out


def test_handles_changed_after_their_call():
    """A handle object's entries rewritten in place change nothing (its layout is its dispatch's), also when
    a combine runs in several exchanges; a cloned low-latency copy equal to several recent handles is told
    apart by the combine's topk_idx; a copy with rewritten entries is refused saying so."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        out = pool.run(FR.edited_handles, timeout_s=90)
    for res in out:
        assert res["normal edited in place"] and res["normal next call"], res
        assert res["expert-major edited in place"], res
        assert res["reports of an edited handle"] == [("combine", 2 * 64)], res     # (T = 64 rows to R = 2 ranks)
        assert res["ll clone of equal handles"] and res["ll next call"], res
        assert "entries were changed" in res["ll edited clone"], res


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_handles_of_another_buffer_pair_only_when_every_rank_passes_them(mode):
    """A handle of Buffer A passed to Buffer B's combine on one rank only (the same call number on both
    Buffers, the same counts) fails naming the other Buffer; passed on every rank, it combines correctly."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        mixed = pool.run(FR.handles_of_another_buffer, mode, "mixed", timeout_s=60)
        same = pool.run(FR.handles_of_another_buffer, mode, "same", timeout_s=60)
    assert all(name == "UBEPMismatchError" and "another Buffer" in msg for name, msg in mixed), mixed
    assert all(name == "ok" and err < 0.05 for name, err in same), same


def test_rank_pool_reports_a_rank_process_that_died_at_once():
    """``RankPool.run`` names a rank whose process exited without answering (here with code 3) within a
    few seconds, not at the pool's deadline, and the answers of the other ranks stay out of the error; the pool
    is stopped then, and says so. What cannot be pickled (the function, or a result) is named at once."""
    import time

    from ubep_torch.testing import RankFailure
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with pytest.raises(ValueError, match="world_size"):
        RankPool(0)
    with pytest.raises(ValueError, match="at most 1024"):     # (it opened queues until the file limit)
        RankPool(2 ** 63)
    with pytest.raises(TypeError, match="world_size"):
        RankPool(2.0)
    with pytest.raises(TypeError, match="timeout_s"):
        RankPool(2, timeout_s="60")
    with pytest.raises(TypeError, match="env"):
        RankPool(2, env={"A": 1})
    with RankPool(np.int64(2), env=env, timeout_s=60) as pool:     # (a numpy integer was refused)
        assert pool.run(FR.exit_on_rank, -1, 0) == [0, 1]
        # (former bug: a bad timeout_s failed after the ranks had the call, whose results the next run took)
        for bad in ("x", -1, float("nan")):
            with pytest.raises((TypeError, ValueError), match="timeout_s"):
                pool.run(FR.exit_on_rank, -1, 0, timeout_s=bad)
        assert pool.run(FR.exit_on_rank, -1, 0) == [0, 1]
        with pytest.raises(TypeError, match="picklable"):
            pool.run(lambda ctx: ctx.rank)
        start = time.monotonic()
        with pytest.raises(RankFailure) as bad_result:
            pool.run(FR.unpicklable_result)
        assert time.monotonic() - start < 5 and sorted(bad_result.value.failures) == [0, 1]
        assert all("pickle" in tb for tb in bad_result.value.failures.values()), bad_result.value.failures
        assert pool.run(FR.exit_on_rank, -1, 0) == [0, 1]          # (an error in the function: still usable)
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(FR.exit_on_rank, 1, 3)
        took = time.monotonic() - start
        with pytest.raises(RuntimeError, match=r"closed \(rank\(s\) \[1\] died\)"):
            pool.run(FR.exit_on_rank, -1, 0)
    assert took < 5, took
    assert list(info.value.failures) == [1] and "exited (code 3) before answering" in info.value.failures[1], \
        info.value.failures
    # the other ranks' answers, on their way when the death is seen, stay out of the error too (rank 0 was
    # reported as "still running" where its answer came some 0.2 s after the death)
    with RankPool(2, env=env, timeout_s=60) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(FR.exit_on_rank, 1, 3, 0.5)
    assert list(info.value.failures) == [1], info.value.failures


_KILLED_POOL = """
import multiprocessing, os, signal, threading, time
from ubep_torch.testing import RankPool
import fault_rank_fns as FR
if __name__ == "__main__":
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    main = RankPool(1, env=env)                       # started from the main thread
    other = []                                       # and one started from a thread that then ends
    t = threading.Thread(target=lambda: other.append(RankPool(1, env=env)))
    t.start()
    t.join()
    pids = main.run(FR.pid_after, 0) + other[0].run(FR.pid_after, 0)
    # a child of the pool's process that outlives it (it holds what that process held when it forked)
    extra = multiprocessing.get_context("fork").Process(target=time.sleep, args=(20,), daemon=True)
    extra.start()
    print(*pids, extra.pid, flush=True)
    for pool in (main, other[0]):      # both busy in a call
        threading.Thread(target=pool.run, args=(FR.pid_after, 60), daemon=True).start()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
"""


_FORKED_CHILD_POOL = """
import multiprocessing, os, sys
from ubep_torch.testing import RankPool
import fault_rank_fns as FR

def child(env):
    with RankPool(2, env=env, start_method="forkserver") as pool:
        ok = pool.run(FR.environment_of, ["UBEP_TEST_POOL"])[0][0] == {"UBEP_TEST_POOL": "env"}
        print(type(pool._procs[0]).__name__, flush=True)
    os._exit(0 if ok else 1)

if __name__ == "__main__":
    env = {"UBEP_TEST_POOL": "env"}
    with RankPool(2, env=env, start_method="forkserver") as pool:
        pool.run(FR.environment_of, [])
        print(type(pool._procs[0]).__name__, flush=True)
    p = multiprocessing.get_context("fork").Process(target=child, args=(env,))
    p.start()
    p.join(120)
    sys.exit(p.exitcode)
"""


def test_rank_pool_start_methods_and_the_pools_environment(monkeypatch, tmp_path):
    """By default a pool spawns its ranks; ``start_method="forkserver"`` (or ``$UBEP_POOL_START_METHOD``) has
    them forked by a fork server that imported torch once (they import torch themselves otherwise, some 2 s
    each), yet each sees the environment a spawned rank would: the pool's process's environment when the pool
    starts, with ``env`` on top. A pool whose ranks would import torch under other values of the variables
    torch may read then (``TORCH*``, ``OMP_*``, ...) than the server did spawns them."""
    from ubep_torch.testing import START_METHODS
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_TEST_POOL": "env"}
    names = ["UBEP_TEST_SET_LATER", "UBEP_TEST_POOL", "TORCH_UBEP_TEST"]
    monkeypatch.delenv("UBEP_POOL_START_METHOD", raising=False)
    with RankPool(2, env=env) as pool:
        spawned = pool.run(FR.environment_of, names)
        assert {type(p).__name__ for p in pool._procs} == {"SpawnProcess"}
    assert [e for e, _ in spawned] == [{names[0]: None, names[1]: "env", names[2]: None}] * 2, spawned
    assert {ppid for _, ppid in spawned} == {os.getpid()}, spawned
    assert START_METHODS == ("spawn", "forkserver")
    with pytest.raises(ValueError, match="start_method must be one of"):
        RankPool(2, start_method="fork")
    with pytest.raises(TypeError, match="start_method must be a str"):
        RankPool(2, start_method=["spawn"])
    monkeypatch.setenv("UBEP_POOL_START_METHOD", "nope")
    with pytest.raises(ValueError, match="UBEP_POOL_START_METHOD must be one of"):
        RankPool(2)
    monkeypatch.setenv("UBEP_POOL_START_METHOD", "forkserver")
    with RankPool(2, env=env) as pool:
        first = pool.run(FR.environment_of, names)
        kinds = {type(p).__name__ for p in pool._procs}
    assert kinds == {"ForkServerProcess"}, kinds
    assert [e for e, _ in first] == [{names[0]: None, names[1]: "env", names[2]: None}] * 2, first
    monkeypatch.setenv("UBEP_TEST_SET_LATER", "later")     # (after the fork server started)
    monkeypatch.delenv("UBEP_POOL_START_METHOD")
    with RankPool(2, env=env, start_method="forkserver") as pool:
        later = pool.run(FR.environment_of, names)
        assert {type(p).__name__ for p in pool._procs} == {"ForkServerProcess"}
    assert [e for e, _ in later] == [{names[0]: "later", names[1]: "env", names[2]: None}] * 2, later
    assert os.getpid() not in {ppid for _, ppid in first + later}, (first, later)    # (the server's children)
    with RankPool(2, env={**env, "TORCH_UBEP_TEST": "1"}, start_method="forkserver") as pool:
        spawned = pool.run(FR.environment_of, names)
        assert {type(p).__name__ for p in pool._procs} == {"SpawnProcess"}
    assert [e for e, _ in spawned] == [{names[0]: "later", names[1]: "env", names[2]: "1"}] * 2, spawned
    assert {ppid for _, ppid in spawned} == {os.getpid()}, spawned
    # in a process forked from one that set the fork server up, a pool spawns its ranks (multiprocessing's
    # fork server fails there: ChildProcessError)
    script = tmp_path / "forked_child_pool.py"
    script.write_text(_FORKED_CHILD_POOL)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env, "TMPDIR": str(tmp_path)}, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.split() == ["ForkServerProcess", "SpawnProcess"], \
        (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_ranks_of_a_killed_pool_end_with_it(tmp_path, start_method):
    """(former bug: the ranks of a RankPool whose process was killed, as ``timeout`` or a CI runner kills it,
    lived on for good, reparented, holding their Buffers' memory.) Ranks busy in a call die with the pool's
    process whatever thread started their pool (one started from another thread lived on until its call
    returned), also where that process has a child that lives on (forked ranks lived as long as it did: it
    held their fork server); and a pool started from a thread that has ended keeps its ranks."""
    import signal
    import time
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        pytest.skip("no pidfd here (Linux 5.3, Python 3.9): a busy rank may outlive a pool started from a thread")
    script = tmp_path / "killed_pool.py"
    script.write_text(_KILLED_POOL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]),
           "UBEP_POOL_START_METHOD": start_method, "TMPDIR": str(tmp_path)}   # (the killed server's socket dir)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:      # (a file, not a pipe: ranks that outlive the script would hold a pipe open)
        code = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT, timeout=120,
                              env=env, cwd=str(tmp_path)).returncode
    text = out.read_text()
    assert code == -signal.SIGKILL, (code, text[-2000:])
    *pids, extra = [int(p) for p in text.split()]
    assert len(pids) == 2, text
    try:
        deadline = time.monotonic() + 10
        while any(FR._running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in pids if FR._running(p)]
        for p in alive:
            os.kill(p, signal.SIGKILL)
    finally:
        os.kill(extra, signal.SIGKILL)
    assert not alive, f"rank processes {alive} outlived their pool"


@pytest.mark.parametrize("sync", ["tff", "dc", "sp", "sw"])
def test_a_call_refused_on_one_rank_is_cancelled_on_every_rank(sync):
    """Bad input on one rank only, then every rank makes the call again (the refusing one after a delay,
    the others once the call raised): the refused call is cancelled on every rank, each Buffer usable,
    however soon the refusing rank calls again, and every rank ends with the same call done and correct
    results, in every sync mode, normal and low-latency (former behaviours: the ranks that waited were
    broken, and every Buffer had to be rebuilt; later, a call made again within a second completed the
    peers' cancelled call, whatever it was)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    cases = [("normal", 0.0), ("normal", 1.6), ("ll", 1.6), ("normal", 1.0), ("ll", 0.95), ("ll_hook", 1.6),
             ("clean", 1.6)]
    if sync in ("dc", "sp"):
        # (the calls made again soon, where rows of the cancelled attempt may still arrive, and the recv hook;
        # the late retries' course is the same in every sync mode, and tff and sw run them)
        cases = [case for case in cases if case[1] < 1.5 or case[0] == "ll_hook"]
    with RankPool(2, env=env) as pool:
        waiting, refusing = pool.run(FR.refused_then_retried, sync, cases, timeout_s=120)
    for (kind, delay), (w_attempts, w_err), (r_attempts, r_err) in zip(cases, waiting[0], refusing[0]):
        assert r_attempts[0][0] == "ValueError" and r_attempts[-1][0] == "ok", (kind, delay, r_attempts)
        assert w_attempts[-1][0] == "ok", (kind, delay, w_attempts)
        assert w_attempts == [("UBEPPeerAbortedError", True), ("ok", False)], (kind, delay, w_attempts)
        assert r_attempts == [("ValueError", False), ("ok", False)], (kind, delay, r_attempts)
        assert w_err < 1e-2 and r_err < 1e-2, (kind, delay, w_err, r_err)
    assert max(waiting[1] + refusing[1]) < 1e-2, (waiting[1], refusing[1])


def test_calls_refused_on_two_of_three_ranks_are_cancelled_consistently():
    """Two ranks refuse a call and make it again after different delays: the third leaves it at once, and
    every rank ends with the same calls done and correct results (former bugs: a rank whose early retry was
    cancelled by the other refusal broke every Buffer; a barrier-only call completed on one rank while the
    others cancelled it, and the next call waited for its deadline)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    cases = [("clean", {0: 1.1, 2: 0.85}), ("normal", {1: 1.5, 2: 0.5}), ("ll", {0: 0.3, 1: 1.5})]
    with RankPool(3, env=env) as pool:
        out = pool.run(FR.refused_then_retried, "sp", cases, timeout_s=120)
    for rank, (results, after) in enumerate(out):
        for (kind, refusers), (attempts, err) in zip(cases, results):
            want = [("ValueError", False)] if rank in refusers else [("UBEPPeerAbortedError", True)]
            assert attempts == want + [("ok", False)] and err < 1e-2, (rank, kind, attempts, err)
        assert max(after) < 1e-2, (rank, after)


@pytest.mark.parametrize("late", [None, {2: 2.5}])
def test_a_call_refused_on_one_of_three_ranks_is_cancelled_on_all_three(late):
    """Both waiting ranks leave the call the third refused; or (``late``) rank 2 comes to it 2.5 s late and
    leaves it at once, while the refusing rank's next call waits for it to."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    cases = [("normal", 1.5), ("ll", 1.5)]
    with RankPool(3, env=env) as pool:
        out = pool.run(FR.refused_then_retried, "tff", cases, late, timeout_s=120)
    for rank, (results, after) in enumerate(out):
        for attempts, err in results:
            if rank == 1:
                assert [a[0] for a in attempts] == ["ValueError", "ok"], attempts
            else:
                assert attempts == [("UBEPPeerAbortedError", True), ("ok", False)], attempts
            assert err < 1e-2, err
        assert max(after) < 1e-2, after


def test_a_cancelled_sp_call_rearms_the_slots_it_wrote():
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        waiting, refusing = pool.run(FR.sp_cancel_rearms, timeout_s=60)
    assert waiting == ("UBEPPeerAbortedError", True), waiting
    assert refusing == (("ValueError", None), 0), refusing


@pytest.mark.parametrize("case", ["sync", "size", "shm_dir", "engine", "huge"])
def test_a_bad_constructor_argument_on_one_rank_is_named_by_the_others(case, tmp_path):
    """(former behaviour: the other ranks waited for their whole deadline, then named no cause, and
    different shared-memory directories gave errors about an invalid segment path; an error other than
    ValueError or TypeError before the set-up, such as an engine that cannot be made, was not told)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (good, ok0), (bad, ok1) = pool.run(FR.bad_constructor_argument, case, str(tmp_path), timeout_s=60)
    assert ok0 and ok1, (good, bad)
    assert good[0] == "ValueError" and good[1] < 10.0, good
    assert bad[0] in ("ValueError", "TypeError", "OSError"), bad
    if case == "shm_dir":
        assert "directory" in good[2] and str(tmp_path) in good[2] and str(tmp_path) in bad[2], (good, bad)
    else:
        assert "rank(s) [1]" in good[2] and ("bogus" in good[2] or "num_nvl_bytes" in good[2]), good
    if case == "huge":      # (former bug: RuntimeError, as for too little shared memory)
        assert bad[0] == "ValueError" and "TiB a process can map" in bad[2], bad


def test_a_buffer_dropped_without_destroy_is_seen_to_be_gone():
    """(former behaviour: its peers waited for their whole deadline)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        waiting, _ = pool.run(FR.dropped_buffer, timeout_s=60)
    assert waiting[0] == "UBEPPeerLostError" and waiting[1] < 2.0 and "destroyed its Buffer" in waiting[2], waiting


def test_a_refusing_rank_whose_next_call_is_of_another_kind_is_a_mismatch():
    """(former bug: the refusing rank moved the epoch of its own call's region, the others that of theirs,
    and its next call read a control message of the cancelled call, then waited for its deadline)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        waiting, refusing = pool.run(FR.refused_then_another_kind, timeout_s=60)
    # (the second refusal's call is a mismatch on rank 0 too: it was told "cancelled" and found its Buffer
    # broken at the next call)
    assert [w[0] for w in waiting] == ["UBEPPeerAbortedError", "UBEPMismatchError", "UBEPBrokenError"], waiting
    assert "cancelled on every rank" in waiting[0][2], waiting
    assert "rank 1 refused that call as dispatch or combine" in waiting[1][2], waiting
    assert waiting[2][1] < 5.0 and "unusable" in waiting[2][2], waiting
    assert [r[0] for r in refusing] == ["ValueError", "ok", "ValueError", "ok", "UBEPMismatchError"], refusing
    assert "refused call 2" in refusing[4][2] and "same calls in the same order" in refusing[4][2], refusing


@pytest.mark.parametrize("sync", ["tff", "sw"])
def test_a_rank_late_to_a_refused_call_and_the_refusing_rank_name_the_mismatch(sync):
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(3, env=env) as pool:
        r0, r1, r2 = pool.run(FR.late_rank_after_a_refusal, "late_combine", sync, timeout_s=60)
        assert r0[0][0] == "UBEPPeerAbortedError" and "cancelled" in r0[0][1], r0   # (the same call: cancelled)
        # (then the others' aborts come from the mismatch, which it names: former bug, a peer abort)
        assert r0[1][0] == "UBEPMismatchError" and "rank 2 was in low_latency_combine in that call" in r0[1][1], r0
        assert [s[0] for s in r1] == ["ValueError", "UBEPMismatchError"], r1
        assert "rank 1 refused call 2 of this Buffer as low_latency_dispatch, but rank 2 was in " \
            "low_latency_combine" in r1[1][1], r1
        assert r2[0][0] == "UBEPMismatchError" and "rank 1 refused that call as low_latency_dispatch" in r2[0][1], r2
        r0, r1, r2 = pool.run(FR.late_rank_after_a_refusal, "late_dispatch", sync, timeout_s=60)
        assert r0[0][0] == "UBEPMismatchError" and "rank 1 refused that call" in r0[0][1], r0
        assert [s[0] for s in r1] == ["ValueError", "UBEPMismatchError"], r1
        assert r2[0][0] == "UBEPMismatchError" and \
            "rank 0 was in low_latency_combine in that call, which a peer refused" in r2[0][1], r2


@pytest.mark.parametrize("mode,ranks", [("in_call", 2), ("hook", 2), ("in_call", 4)])
def test_a_call_refused_as_a_dispatch_where_peers_combine_is_a_mismatch_on_every_rank(mode, ranks):
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(ranks, env=env) as pool:
        out = pool.run(FR.refused_while_peers_combine, mode, timeout_s=60)
    refusing = out[1]
    assert [r[0] for r in refusing] == ["ValueError", "UBEPMismatchError"], refusing
    assert "refused call 3 of this Buffer as low_latency_dispatch, but rank 0 was in low_latency_combine" \
        in refusing[1][1], refusing
    for waiting in out[:1] + out[2:]:      # (on four ranks, rank 3 came late)
        # (with a deferred hook the mismatch is found by the combine itself where rank 1's refusal is there when
        # it starts, else by the next call)
        first = next(s for s in waiting if s[0] != "ok")
        assert first[0] == "UBEPMismatchError" and "rank 1 refused that call as low_latency_dispatch" in first[1], out
        assert mode == "hook" or waiting[0] == first, out


@pytest.mark.parametrize("sync", ["tff", "sw"])
def test_a_recv_hook_between_a_refused_call_and_its_retry(sync):
    """(former bug, ``sync="sw"``: the refusing rank's hook took part in the barrier of the call its peer
    was cancelling, every later barrier paired with the wrong one, and the retry waited for its deadline)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (waiting, w_err), (refusing, r_err) = pool.run(FR.refused_with_a_hook_between, sync, timeout_s=90)
    assert waiting == [("normal", "UBEPPeerAbortedError", True), ("hook", "ok", None), ("retry", "ok", None)], waiting
    assert refusing == [("refuse", "ValueError", None), ("hook", "ok", None), ("retry", "ok", None)], refusing
    assert w_err == 0.0 and r_err == 0.0, (w_err, r_err)


@pytest.mark.parametrize("k", [2, 3])
def test_a_retry_after_a_cancel_is_refused_when_its_half_is_held(k):
    """(former bug: the refusing rank checked the half of the cancelled call, not of its retry, so the retry
    waited for a hook it could not run, and both ranks waited for their deadline)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        waiting, refusing = pool.run(FR.refused_while_a_half_is_held, k, timeout_s=90)
    assert waiting == [("UBEPPeerAbortedError", True), "held", "ok"], waiting
    assert refusing == ["refused", "held", "ok"], refusing


def test_what_follows_a_cancel():
    """(former bugs: a cancelled call's hook run again broke the Buffer and aborted the peers; the refusal of
    a retry that found its half held was not posted once the cancel had been counted, so the peer waited
    for the retry; combining a cancelled dispatch's handle was posted as a refusal of the next call; with
    sync="sw", a hook run 64 calls late lowered the barrier count of a later call that shares its row)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (w, w_err), (r, r_err) = pool.run(FR.after_a_cancel, "hook twice", timeout_s=90)
        assert [s[:2] for s in w] == [("hook", "UBEPPeerAbortedError"), ("hook again", "CancelledCallError"),
                                      ("rt", "ok"), ("rt", "ok")] and w[0][3] and w_err < 1e-2, w
        assert [s[1] for s in r] == ["ValueError", "ok", "ok"] and r_err < 1e-2, r
        (w, w_err), (r, r_err) = pool.run(FR.after_a_cancel, "combine", timeout_s=90)
        assert [s[:2] for s in w] == [("hook", "UBEPPeerAbortedError"), ("combine", "CancelledCallError"),
                                      ("rt", "ok"), ("rt", "ok")] and w_err < 1e-2, w
        assert [s[1] for s in r] == ["ValueError", "ok", "ok"] and r_err < 1e-2, r
        (w, w_err), (r, r_err) = pool.run(FR.after_a_cancel, "held", timeout_s=90)
        # rank 0's second attempt is cancelled by rank 1's refusal of it (half held), not kept waiting for the
        # retry 2 s later
        assert [s[1] for s in w] == ["ok", "UBEPPeerAbortedError", "UBEPPeerAbortedError", "ok", "ok"], w
        assert w[2][2] < 1.9 and w[2][3], w
        assert [s[1] for s in r] == ["ValueError", "ValueError", "ok", "ok", "ok"] and r_err < 1e-2, r
        (w, w_err), (r, r_err) = pool.run(FR.after_a_cancel, "sw late hook", timeout_s=90)
        assert [s[1] for s in w] == [s[1] for s in r] == ["ok"] * 4 and w_err < 1e-2 and r_err < 1e-2, (w, r)


def test_a_refusing_rank_that_goes_on_to_its_next_step_stays_in_step():
    """Bad input on one rank, which goes straight on to its next step (new rows, new routing), as every rank
    does after an error: the refused step is cancelled on every rank, and every later step moves only its
    own rows (former bug: the peers' call of the refused step took the refusing rank's next step, so its
    results mixed two steps' rows, silently, and the ranks stayed a call out of step)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(3, env=env) as pool:
        # (interrupt: Ctrl-C during the input checks, caught by the loop, also leaves the call before it
        # reached the peers: former bug, nothing told them, and their step 1 took rank 1's step 2)
        for how, error in (("bad id", "ValueError"), ("interrupt", "KeyboardInterrupt"),
                           ("interrupt in layout", "KeyboardInterrupt")):
            out = pool.run(FR.refused_then_next_step, how=how, timeout_s=120)
            for rank, steps in enumerate(out):
                assert steps[0] == ((error, None) if rank == 1 else ("UBEPPeerAbortedError", True)), (how, rank, steps)
                for step, got in enumerate(steps[1:], start=2):
                    assert got[0] == "ok" and got[2] == 0.0, (how, rank, step, got)
                    assert got[1] and all(10 * step <= v < 10 * step + 3 for v in got[1]), (how, rank, step, got)


def test_a_ctrl_c_while_a_refusing_rank_waits_for_its_peers_ends_the_wait_at_once():
    """A refusing rank's next call waits at its start for its peers to leave the refused call; a Ctrl-C
    there raises at once and breaks the Buffer (the ranks' counts of calls may differ then), telling the
    peers (former behaviour: the interrupt was taken as a refusal of that call, whose posting waited for
    the peers again, up to the deadline)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        r0, r1 = pool.run(FR.interrupted_refusal_handoff, timeout_s=90)
    assert r1[0][0] == "ValueError" and r1[1][0] == "KeyboardInterrupt" and r1[1][1] < 1.5, r1
    assert r1[2][0] == "UBEPBrokenError", r1
    assert r0[0][0] == "UBEPPeerAbortedError" and r0[0][1] < 3.0, r0       # (told at once, not at 20 s)
    assert r0[1][0] == "UBEPBrokenError", r0


def test_a_refusing_rank_that_times_out_waiting_for_its_peers_names_the_refused_call():
    """The late peer learns that the refusing rank gave up in the call it refused (the peer's call 1), not in
    an earlier call (former message: 'an earlier call (call 0 of this Buffer; this is call 1)', a call that
    never was)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        r0, r1 = pool.run(FR.refusal_handoff_times_out, timeout_s=90)
    assert [s[0] for s in r1] == ["ValueError", "UBEPTimeoutError"], r1
    assert "the start of the next call" in r1[1][1], r1
    assert r0[0][0] == "UBEPPeerAbortedError" and "in this call" in r0[0][1] and "earlier" not in r0[0][1], r0
    assert r0[1][0] == "UBEPBrokenError", r0


def test_an_abort_seen_in_a_wait_names_the_call_it_was_in():
    """A peer's abort that a rank finds while waiting in a call names the call the peer aborted, as the
    checks at the start and end of a call do (former message: 'failed or gave up in this call' for an
    abort of the call before)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        for later, words in ((False, "an earlier call (call 1 of this Buffer; this is call 2)"),
                             (True, "a later call (call 3 of this Buffer; this is call 2)")):
            r0, _ = pool.run(FR.abort_of_an_earlier_call_seen_in_a_wait, later, timeout_s=90)
            assert r0[0] == "UBEPPeerAbortedError" and r0[2] < 5.0, r0
            assert f"gave up in {words} and aborted it" in r0[1] and "in this call" not in r0[1], r0
    # ranks that aborted different calls: each one's (former message: the first one's call for all)
    with RankPool(3, env=env) as pool:
        r0 = pool.run(FR.abort_of_an_earlier_call_seen_in_a_wait, False, timeout_s=90)[0]
        assert r0[0] == "UBEPPeerAbortedError" and r0[2] < 5.0, r0
        assert "gave up in calls 1 (rank 1), 2 (rank 2) of this Buffer (this is call 2)" in r0[1], r0


def test_a_bad_handle_for_the_zero_copy_combine_buffer_refuses_that_combine():
    """get_next_low_latency_combine_buffer raising on one rank (a handle that is not one) refuses the
    combine it prepares, as get_dispatch_layout does its dispatch: the peer in that combine leaves it at
    once, cancelled, and both go on (former bug: nothing told the peer; its combine paired with the other
    rank's next call, an operation mismatch that broke both Buffers)."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (out0, _, err0), (out1, took1, err1) = pool.run(FR.ll_next_buffer_refused, timeout_s=90)
    assert out0[0][0] in ("TypeError", "ValueError") and out0[1] == "ok" and err0 < 0.02, (out0, err0)
    assert out1[0] == ("UBEPPeerAbortedError", True) and took1 < 3.0 and out1[1] == "ok" and err1 < 0.02, \
        (out1, took1, err1)


def test_an_interrupt_in_a_zero_copy_combine_refuses_that_combine_once():
    """(former bug: the combine fetched its zero-copy buffer through the public method, which refuses the
    combine it prepares: an interrupt there refused two calls, and the ranks fell out of step)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (out0, errs0), (out1, errs1) = pool.run(FR.ll_zero_copy_combine_interrupted, timeout_s=90)
    assert out0 == [("KeyboardInterrupt", None), "ok", "ok"], out0
    assert out1 == [("UBEPPeerAbortedError", True), "ok", "ok"], out1
    assert all(e is not None and e < 0.02 for e in errs0[-2:] + errs1[-2:]), (errs0, errs1)


def test_asking_a_normal_buffer_for_a_zero_copy_combine_buffer_refuses_nothing():
    """(former bug: the error counted as refusing a low-latency combine the Buffer can never make; its next
    normal call then broke every Buffer with an operation mismatch)"""
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        (out0, err0), (out1, err1) = pool.run(FR.zero_copy_buffer_of_a_normal_buffer, timeout_s=90)
    assert out0 == [("ValueError", None), "ok"] and out1 == ["ok"] and err0 < 0.05 and err1 < 0.05, \
        (out0, out1, err0, err1)


def test_decisions_on_refused_calls_outlast_the_calls_a_rank_runs_ahead():
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        r0, r1 = pool.run(FR.refusals_behind_pending_hooks, timeout_s=90)
    assert r0[:-1] == [("normal bad", "ValueError", None), ("hook 0", "UBEPPeerAbortedError", True),
                       ("hook 1", "ok"), ("hook 2", "ok"), ("hook 3", "ok"), ("normal", "ok")], r0
    assert r1[:-1] == [("combine bad", "ValueError", None), ("hook 1", "ok"), ("hook 2", "ok"), ("hook 3", "ok"),
                       ("normal", "UBEPPeerAbortedError", True), ("normal", "ok")], r1
    assert r0[-1] == r1[-1] and r0[-1][2] is None, (r0[-1], r1[-1])       # same calls and attempts, usable


def test_a_hook_of_a_refused_call_holds_no_buffer_half():
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(2, env=env) as pool:
        r0, r1 = pool.run(FR.refused_call_holding_a_half, timeout_s=90)
    assert r0 == [("ll 1", "ok"), ("ll 2", "ok"), ("ll 3", "ok"), ("hook 0", "CancelledCallError", None),
                  ("hook 1", "ok")], r0
    assert r1 == [("ll 1", "ValueError", None), ("ll 2", "ok"), ("ll 3", "ok"), ("hook 0", "ok")], r1


def test_decisions_outlast_a_lagging_rank_on_five_ranks():
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    with RankPool(5, env=env) as pool:
        out = pool.run(FR.refusals_while_one_rank_lags, timeout_s=120)
    for rank, steps in enumerate(out):
        want = [("ValueError", None) if rank == r else ("UBEPPeerAbortedError", True) for r in (1, 2, 3, 4)]
        want += ["ok"] * 16 + [("ValueError", None) if rank == 0 else ("UBEPPeerAbortedError", True)]
        want += ["ok"] * 17
        assert steps[:-1] == want, (rank, steps)
    assert len({steps[-1] for steps in out}) == 1 and out[0][-1][2] is None, [steps[-1] for steps in out]
