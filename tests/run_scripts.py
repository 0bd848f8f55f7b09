"""Runs many short commands ``python SCRIPT ARGS...`` with torch imported once: each command runs in a child
forked from this process after ``import torch`` (most of a short command's time is that import), two at a
time. A child runs its script much as the interpreter would (``runpy.run_path`` as ``__main__``, ``sys.argv``
and ``sys.path[0]`` set as for ``python SCRIPT``; an uncaught exception prints its traceback and exits 1; a
``RankPool`` the script starts runs its ranks from the script's file), with stdout and stderr in files. What
differs: torch, torch.distributed and ubep_torch are imported before the script runs (an environment variable
the script sets for their import comes too late), a KeyboardInterrupt exits with 1 (not 130), and a missing
script is a traceback. The commands these tests run fail on bad arguments, which none of that changes.

    python tests/run_scripts.py COMMANDS.json OUT_DIR

COMMANDS.json: a list of argument lists (each a script path and its arguments, relative to the working
directory). For command i, OUT_DIR gets ``i.out``, ``i.err`` and ``i.rc`` (the exit status; -N for a signal,
"timeout" where it ran past 120 s and was killed)."""
from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time

import torch  # noqa: F401  (imported once, before the forks, with what every script imports)
import torch.distributed  # noqa: F401

import ubep_torch  # noqa: F401

TIMEOUT_S = 120.0
PARALLEL = 2


def _child(cmd: list, out_dir: str, i: int) -> None:
    """In the forked child: run the command, never return."""
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{i}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.setpgid(0, 0)       # (the command and any ranks it starts end together at a timeout)
    script = cmd[0]
    sys.argv = list(cmd)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)      # (an exception or SystemExit leaves as it would leave ``python SCRIPT``)


def main() -> None:
    commands = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    todo = list(enumerate(commands))
    running: dict = {}      # pid -> (index, deadline)
    while todo or running:
        while todo and len(running) < PARALLEL:
            i, cmd = todo.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _child(cmd, out_dir, i)
                except SystemExit:
                    raise
                except BaseException:
                    import traceback
                    traceback.print_exc()
                    sys.exit(1)
            running[pid] = (i, time.monotonic() + TIMEOUT_S)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (i, deadline) in list(running.items()):
                if now > deadline:
                    try:
                        os.killpg(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.waitpid(p, 0)
                    del running[p]
                    with open(os.path.join(out_dir, f"{i}.rc"), "w") as f:
                        f.write("timeout")
            time.sleep(0.02)
            continue
        if pid not in running:
            continue
        i, _ = running.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        with open(os.path.join(out_dir, f"{i}.rc"), "w") as f:
            f.write(str(rc))


if __name__ == "__main__":
    main()
