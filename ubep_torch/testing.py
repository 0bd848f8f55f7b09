"""A persistent pool of rank processes for tests, benchmarks and examples.

``RankPool(world_size)`` starts ``world_size`` processes once, each joined to a gloo process group, and
``pool.run(fn, *args)`` calls ``fn(ctx, *args)`` on every rank and returns the list of results in rank
order. ``fn`` must be importable (a module-level function). ``ctx`` is a :class:`RankContext` with the
rank, world size, group and a per-process ``cache`` dict where tests keep Buffers between calls (buffers
are created once per pool, not once per test). An exception on any rank is re-raised in the caller with
every failing rank's traceback (the pool stays usable); a rank whose process dies, or that does not answer
within ``timeout_s``, fails the call and stops the pool (later calls raise RuntimeError: start a new pool).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional

from .protocol import check_deadline
from .utils import check_count


@dataclass
class RankContext:
    rank: int
    world_size: int
    group: Any
    cache: Dict[str, Any] = field(default_factory=dict)


class RankFailure(RuntimeError):
    def __init__(self, failures: Dict[int, str]):
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


def _check_env(env) -> None:
    """``env`` is None or maps variable names to strings; else TypeError."""
    if env is not None and not (isinstance(env, Mapping) and
                                all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError(f"env must map variable names to strings, got {env!r}"[:200])


def rendezvous_store():
    """A ``TCPStore`` server on a port the system picks, held by the caller for its ranks to meet through
    (``join_group``). Picking a free port and binding it later in a rank races other processes for it
    (``EADDRINUSE`` now and then); the store keeps the port from the start."""
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def join_group(port: int, rank: int, world_size: int, **kwargs) -> None:
    """``init_process_group("gloo")`` of a rank through the ``rendezvous_store`` listening on ``port``."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, None, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **kwargs)


#: how often an idle rank checks that the pool's process is still there (seconds)
_PARENT_CHECK_S = 1.0


#: environment variables that torch, or a library it loads, may read when it is imported
_IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_")
_server_env: Optional[Dict[str, str]] = None   # those variables as the fork server imported torch with them
_server_owner = 0       # the process that set the fork server up (a child forked from it cannot use that server)
START_METHODS = ("spawn", "forkserver")


def _import_time_env(env: Mapping) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


def _start_context(start_method: Optional[str], env: Dict[str, str]):
    """Where a pool's rank processes start from (see ``RankPool``): ``spawn``, or, asked for
    (``start_method`` or ``$UBEP_POOL_START_METHOD``), ``forkserver``, a fork server that imported torch
    once, so that a rank starts in a fraction of a second instead of importing torch itself. ``spawn`` where
    the platform has no fork server, and where a rank's import of torch would see other values of the
    variables it may read then (``env``, this process's environment now) than the server's did."""
    global _server_env, _server_owner
    source = "start_method"
    if start_method is None:
        start_method, source = os.environ.get("UBEP_POOL_START_METHOD") or "spawn", "UBEP_POOL_START_METHOD"
    elif not isinstance(start_method, str):
        raise TypeError(f"start_method must be a str, one of {START_METHODS}, got {type(start_method).__name__}")
    if start_method not in START_METHODS:
        raise ValueError(f"{source} must be one of {START_METHODS}, got {start_method!r}")
    if start_method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if _server_env is not None and _server_owner != os.getpid():
        # (a process forked from the one that set the server up inherits its state, and multiprocessing's
        # fork server then fails in it: "ChildProcessError: No child processes")
        return mp.get_context("spawn")
    if _server_env is None:
        _server_owner = os.getpid()
        _server_env = _import_time_env(os.environ)
        from multiprocessing import forkserver
        preload = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])   # (the program's own)
        mp.get_context("forkserver").set_forkserver_preload(
            preload + [m for m in ("torch", "torch.distributed") if m not in preload])
    if _import_time_env({**os.environ, **env}) != _server_env:
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def _parent_alive(pool_pid: int, parent: int) -> bool:
    """Whether the pool's process is still there: the rank's parent (the pool's process, or the fork server,
    which ends with it) has not changed and the pool's pid still exists."""
    if os.getppid() != parent:
        return False
    try:
        os.kill(pool_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _die_with_parent(pool_pid: int, parent: int, signal_on_death: bool) -> None:
    """A rank outlives no pool: a thread of the rank waits on a pidfd of the pool's process and kills the
    rank when it ends (Linux 5.3 and later); Linux also kills the rank when its parent ends
    (``PR_SET_PDEATHSIG``): under ``spawn``, where the pool was started from the main thread, the pool's
    process (the signal fires when the thread that started the rank ends, so not for a pool started from
    another thread); under ``forkserver``, the fork server, which ends with the pool's process unless another
    process holds it. An idle rank also checks every ``_PARENT_CHECK_S`` (see ``_worker``). A rank whose pool
    is already gone exits now."""
    if signal_on_death and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)       # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:
        watched = os.pidfd_open(pool_pid)
    except (AttributeError, OSError):       # (no pidfd here, or the pool's process is gone already)
        watched = None
    if not _parent_alive(pool_pid, parent):
        os._exit(1)
    if watched is not None:
        def watch() -> None:
            ended = select.poll()
            ended.register(watched, select.POLLIN)      # (readable once the process has ended)
            while not ended.poll():
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, name="ubep-pool-watch", daemon=True).start()


def _leave_fork_server() -> None:
    """A process the fork server forked holds the server's "alive" pipe, as the process that started the
    server does, so that it could start processes of its own; the server lives while any holder does. A rank
    lets go of it: the server then ends with the pool's process, and the rank with the server (see
    ``_die_with_parent``). (A pool the rank starts itself starts a server of its own.)"""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(fd)
        except OSError:
            pass


def _worker(rank: int, world_size: int, port: int, inbox, outbox, env: Dict[str, str], pool_pid: int = 0,
            signal_on_death: bool = False, pool_env: Optional[Dict[str, str]] = None) -> None:
    parent = os.getppid()
    if pool_env is not None:     # (a forked rank: let go of the server, and take the pool's environment)
        _leave_fork_server()
        os.environ.clear()
        os.environ.update(pool_env)
    if pool_pid:
        _die_with_parent(pool_pid, parent, signal_on_death or parent != pool_pid)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_group(port, rank, world_size)
    ctx = RankContext(rank, world_size, dist.group.WORLD)
    orphan = False
    while True:
        try:
            msg = inbox.get(timeout=_PARENT_CHECK_S)
        except queue.Empty:
            if pool_pid and not _parent_alive(pool_pid, parent):     # (the pool's process died: its ranks end too)
                orphan = True
                break
            continue
        if msg is None:
            break
        call, fn, args, kwargs = msg
        try:
            result = fn(ctx, *args, **kwargs)
            ForkingPickler.dumps(result)   # (the queue pickles in a thread of its own: a failure there is only printed)
        except BaseException:  # noqa: BLE001 - report everything to the parent
            outbox.put((call, rank, False, traceback.format_exc()))
        else:
            outbox.put((call, rank, True, result))
    for obj in ctx.cache.values():
        destroy = getattr(obj, "destroy", None)
        if callable(destroy):
            try:
                destroy()
            except Exception:
                pass
    if orphan:      # (the group's store lived in the pool's process: nothing to take down in order)
        os._exit(0)
    from .ugas import pending_setup_waits
    if pending_setup_waits():
        # (a Buffer set-up interrupted here, by Ctrl-C say, left a wait on a gloo receive running until its
        # deadline: taking the group down under it, or exiting the interpreter around it, aborts the process)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


#: how long ``RankPool.run`` takes the other ranks' answers after finding a rank dead (seconds; a rank that has
#: its answer ready sends it at once, but on two loaded cores one took 1.2 s to answer a call that returns at once)
_ANSWER_GRACE_S = 3.0

#: the most ranks a RankPool starts (each is a process of this host with its own queue)
MAX_POOL_RANKS = 1024


class RankPool:
    """``world_size`` persistent gloo ranks. Use as a context manager or call :meth:`close`.

    ``start_method``: how the rank processes start. ``"spawn"`` (the default; ``$UBEP_POOL_START_METHOD``
    names another): each is a new interpreter that imports torch (some 2 s on a small machine).
    ``"forkserver"``: each is forked by multiprocessing's fork server, which imported torch once when the
    first such pool started (a pool starts in a fraction of a second; the test suite uses it). Forked ranks
    take the pool's process's environment when the pool starts, plus ``env``, but the rest of their process
    state is the server's from when it started: its stdout and stderr, CPU affinity, resource limits, umask
    and signal dispositions, and what the interpreter read at its start (``PYTHONHASHSEED``); a pool whose
    environment would have torch imported under other values of the variables it reads then (``TORCH*``,
    ``OMP_*``, ``MKL_*``...) than the server's is spawned instead, and so is one in a process forked from the
    one that started the server. A process killed while its fork server runs leaves the server's socket
    directory (``pymp-*``) in its ``TMPDIR``."""

    def __init__(self, world_size: int, timeout_s: float = 120.0, env: Optional[Dict[str, str]] = None,
                 start_method: Optional[str] = None):
        world_size = check_count("world_size", world_size, 1)     # (a numpy integer too)
        if world_size > MAX_POOL_RANKS:
            raise ValueError(f"RankPool starts its ranks as processes of this host: world_size must be at most "
                             f"{MAX_POOL_RANKS}, got {world_size}")
        _check_env(env)
        self.world_size = world_size
        self.timeout_s = check_deadline("timeout_s", timeout_s)
        self._call = 0          # (every call's results carry its number: a late one of an earlier call is dropped)
        self._closed: Optional[str] = None      # why the pool can no longer run anything
        ctx = _start_context(start_method, env or {})
        self._store = rendezvous_store()     # (held while the pool lives: the ranks' group meets through it)
        port = self._store.port
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        base_env = {"OMP_NUM_THREADS": "1"}
        base_env.update(env or {})
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._inboxes[r], self._outbox, base_env,
                                              os.getpid(), threading.current_thread() is threading.main_thread(),
                                              dict(os.environ) if ctx.get_start_method() == "forkserver" else None),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args, timeout_s: Optional[float] = None, **kwargs) -> List[Any]:
        if self._closed:
            raise RuntimeError(f"this RankPool is closed ({self._closed}): start a new one")
        limit = self.timeout_s if timeout_s is None else check_deadline("timeout_s", timeout_s)
        try:       # (the queues pickle in threads of their own, where a failure is only printed)
            ForkingPickler.dumps((fn, args, kwargs))   # (what the queues do, serializing only)
        except Exception as e:  # noqa: BLE001 - pickling raises many types
            raise TypeError(f"RankPool.run: the function and its arguments must be picklable for the spawned ranks "
                            f"to receive them (a module-level function of a module or script file, not a lambda or "
                            f"a nested function): {type(e).__name__}: {e}") from None
        self._call += 1
        for q in self._inboxes:
            q.put((self._call, fn, args, kwargs))
        results: Dict[int, Any] = {}
        failures: Dict[int, str] = {}
        start = time.monotonic()
        deadline = start + limit
        while len(results) + len(failures) < self.world_size:
            # (short waits: a rank process that died is reported at once, not at the deadline)
            if not self._take(results, failures, min(0.2, max(deadline - time.monotonic(), 0.0))):
                missing = [r for r in range(self.world_size) if r not in results and r not in failures]
                dead = {r: self._procs[r].exitcode for r in missing if not self._procs[r].is_alive()}
                if not dead and time.monotonic() < deadline:
                    continue
                if dead:    # (answers of the other ranks may still be on their way: take them for a moment)
                    self._collect(results, failures, min(time.monotonic() + _ANSWER_GRACE_S, deadline))
                    missing = [r for r in missing if r not in results and r not in failures]
                self.close(force=True)
                elapsed = time.monotonic() - start
                why = {r: f"its process exited (code {code}) before answering: it crashed or was killed in the "
                          f"function, or, at start-up, could not import it (define it in a module or a script file, "
                          f"not in an interactive session or a script read from stdin, and in a script start the pool "
                          f"under `if __name__ == \"__main__\":`)" for r, code in dead.items()}
                why.update({r: f"still running {elapsed:.1f} s into the call when rank(s) {sorted(dead)} died; "
                               f"stopped with the pool" if dead else f"no answer within {limit}s"
                            for r in missing if r not in dead})
                self._closed = f"rank(s) {sorted(dead)} died" if dead else f"a call ran past {limit}s"
                raise RankFailure(why | failures) from None
        if failures:
            raise RankFailure(failures)
        return [results[r] for r in range(self.world_size)]

    def _collect(self, results: Dict[int, Any], failures: Dict[int, str], until: float) -> None:
        """Take the current call's answers that arrive before ``until`` (monotonic), or until every rank
        still alive has answered."""
        while True:
            waiting = [r for r in range(self.world_size)
                       if r not in results and r not in failures and self._procs[r].is_alive()]
            left = until - time.monotonic()
            if not waiting or left <= 0:
                return
            self._take(results, failures, min(0.05, left))

    def _take(self, results: Dict[int, Any], failures: Dict[int, str], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for one answer and file it (an earlier call's, whose wait was
        interrupted, is dropped); False when none came."""
        try:
            call, rank, ok, value = self._outbox.get(timeout=timeout)
        except queue.Empty:
            return False
        if call == self._call:
            (results if ok else failures)[rank] = value
        return True

    def close(self, force: bool = False) -> None:
        self._closed = self._closed or "closed"
        if not force:
            for q in self._inboxes:
                try:
                    q.put(None)
                except Exception:
                    pass
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_torchrun(script: str, args: Optional[List[str]] = None, nproc: int = 2, timeout_s: float = 180.0,
                 env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None):
    """Run ``script`` under ``torchrun`` on ``nproc`` local ranks and return the CompletedProcess.

    The launcher gets its own process group, so a timeout kills every rank it started (a killed torchrun
    alone would leave its workers behind), a rendezvous port it binds itself (``--standalone``: a port picked
    here and bound there later could be taken in between), and a temporary directory of its own
    (``TMPDIR``), removed afterwards: torchrun leaves a ``torchelastic_*`` log directory there.
    """
    import signal
    import subprocess
    import sys
    import tempfile

    if not isinstance(script, (str, os.PathLike)):
        raise TypeError(f"script must be a path (str or os.PathLike), got {type(script).__name__}")
    if isinstance(args, (str, bytes)):
        raise TypeError(f"args must be a list of strings (one per argument), got {args!r}"[:200])
    args = list(args or [])           # (an iterator is read once, here)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be a list of strings (one per argument), got {args!r}"[:200])
    nproc = check_count("nproc", nproc, 1)
    timeout_s = None if timeout_s is None else check_deadline("timeout_s", timeout_s)   # (None: no limit)
    _check_env(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.fspath(script)] + args
    with tempfile.TemporaryDirectory(prefix="ubep-torchrun-") as tmp:
        full_env = dict(os.environ, OMP_NUM_THREADS="1")
        full_env.update(env or {})
        full_env["TMPDIR"] = tmp
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            msg = f"{' '.join(cmd)} did not finish within {timeout_s}s:\n{out[-2000:]}\n{err[-2000:]}"
            raise RuntimeError(msg) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
