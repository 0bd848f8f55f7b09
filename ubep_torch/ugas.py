"""Simulated unified global address space (UGAS): one module owns the shared memory.

Every rank's "HBM" is one segment in a shared-memory directory (default ``/dev/shm``, override with
``UBEP_SHM_DIR``), mapped by every rank of the host. ``SymmetricHeap.peer(r)`` is a uint8 tensor that
aliases rank ``r``'s segment: a store into it is a store into rank ``r``'s memory. Protocol code only
receives these views; it never allocates or maps memory itself.

Life cycle and hygiene
----------------------
* A segment is created with ``O_CREAT | O_EXCL`` and mode ``0600`` under an unguessable name
  (``ubep-<pid>-<PID namespace>-<128 random bits>``), sized with ``ftruncate`` and, once every name is
  gone (below), reserved with ``posix_fallocate``: like device memory, a Buffer's memory is committed
  when it is built, so too little shared memory is an error then, on every rank (naming the bytes and
  ``UBEP_SHM_DIR``), never a SIGBUS when several Buffers' pages are touched later. Reserving takes about
  0.25 s per GiB; done while the names still existed, it was most of the time in which a group killed
  entirely (every rank at once) left its files behind.
* Its first page is a header: magic, layout version, a random 128-bit group token chosen by the group's
  first rank, the owner's rank, world size and segment size. A rank maps a peer's segment only after
  checking that it is a regular file owned by this user with mode 0600, of the announced size, and that
  the header carries this group's token and the expected rank. Nothing read from shared memory is ever
  unpickled; sizes come from the bootstrap exchange and are checked against the file.
* Set-up runs in three exchanges: (1) host, pid, sizes, tokens, the arguments that must agree across ranks and
  the segment name each rank will create; (2) every rank has created its segment; (3) every rank has mapped
  every segment. Where every rank runs in one PID namespace (the usual case: one job on one host), each rank
  unlinks its segment's name the moment the file exists, before anything waits, and step 2's message carries
  the file's descriptor: the peers open it through ``/proc/<pid>/fd/<fd>`` (after checking that the descriptor
  still names that file), so the names exist for microseconds and a group killed whole inside its set-up
  (SIGKILL, or a launcher's SIGTERM: neither runs ``atexit``) leaves nothing. Elsewhere (ranks in several PID
  namespaces: containers sharing ``/dev/shm``), or where /proc refuses some rank that access (or
  ``UBEP_SHM_BY_NAME=1`` on any rank), the segments are shared by name: after step 3 every rank unlinks every
  segment name (its own and its peers'): the mappings live on, the names are gone, so a process killed later
  leaves nothing behind, and a rank killed right before its own unlink has its file removed by the others. A
  set-up that fails on a rank unlinks every peer's announced segment name too (the set-up cannot complete any
  more: a peer that died or stalled in it would leave its file); a group that dies entirely inside a set-up by
  name is covered by a sweep at the next start (segments whose creator pid is dead) and by an ``atexit`` hook.
* torch.distributed (gloo) is used for this bootstrap only, never on the data path. Each bootstrap step
  is a point-to-point exchange with every peer under the Buffer's deadline, so a rank that never builds
  its Buffer makes the others raise ``UBEPTimeoutError`` naming the step and that rank (gloo's own
  collectives would wait for the process group's timeout, 30 minutes by default).
"""
from __future__ import annotations

import atexit
import datetime
import errno
import json
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import sys
import threading
import time
import zlib
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .errors import UBEPError, UBEPPeerLostError, UBEPTimeoutError

HEADER_BYTES = 4096
_MAGIC = b"UBEPUGAS"
_VERSION = 1
_HEADER_FMT = "<8sI16sIIQ"   # magic, version, group token, rank, world size, segment bytes
# ubep-<creating pid>-<its PID namespace>-<128 random bits>: a pid means something only in its namespace
_NAME_RE = re.compile(r"^ubep-(\d+)-(\d+)-[0-9a-f]{32}$")
_PENDING: Dict[str, None] = {}   # segment paths created by this process and not yet unlinked


def shm_dir(directory=None) -> str:
    """The shared-memory directory, as an absolute normalised path: ``directory`` (a str or path) unless it
    is None or empty, else ``$UBEP_SHM_DIR`` unless that is unset or empty, else ``/dev/shm``. It must be
    an existing directory this process can create files in; else ValueError naming where it came from."""
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"shm_dir must be a str or os.PathLike path, got {type(directory).__name__}")
    source = "shm_dir"
    if directory is None or os.fspath(directory) == "":
        env = os.environ.get("UBEP_SHM_DIR")
        directory, source = (env, "UBEP_SHM_DIR") if env else ("/dev/shm", "the default shared-memory directory")
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise ValueError(f"ubep_torch: {source} {os.fspath(directory)!r} is not an existing directory; point "
                         f"UBEP_SHM_DIR (or Buffer(shm_dir=...)) at a directory on a tmpfs such as /dev/shm")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"ubep_torch: {source} {os.fspath(directory)!r} is not writable by this process "
                         f"(read-only or another owner's); point UBEP_SHM_DIR (or Buffer(shm_dir=...)) at "
                         f"a writable tmpfs directory")
    if os.statvfs(path).f_blocks == 0:
        # no size: a tmpfs without a limit (size=0), or a file system that takes no segments although access()
        # lets root write (proc, sysfs: no files; mqueue: files that cannot be sized or written)
        probe = _segment_path(path)     # (a segment's name: a probe left by a killed process is swept)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise _unusable(source, directory, e) from None
        try:
            os.ftruncate(fd, 4096)
            os.pwrite(fd, b"\0", 0)
        except OSError as e:
            raise _unusable(source, directory, e) from None
        finally:
            os.close(fd)
            _unlink_quietly(probe)
    return path


def _unusable(source: str, directory, e: OSError) -> ValueError:
    return ValueError(f"ubep_torch: {source} {os.fspath(directory)!r} cannot hold a shared-memory segment "
                      f"({e.strerror}: a pseudo file system such as /proc?); point UBEP_SHM_DIR (or "
                      f"Buffer(shm_dir=...)) at a tmpfs directory such as /dev/shm")


def _pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where that cannot be read). Jobs in
    other PID namespaces (containers sharing /dev/shm) see other pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def sweep_stale_segments(directory: Optional[str] = None) -> List[str]:
    """Unlink ubep segments of this user whose creating process no longer exists (only segments created in
    this PID namespace: another namespace's pids cannot be checked from here). Returns their paths."""
    directory = directory or os.environ.get("UBEP_SHM_DIR") or "/dev/shm"
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid, namespace = os.getuid(), _pid_namespace()
    for name in names:
        m = _NAME_RE.match(name)
        if not m or int(m.group(2)) != namespace:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _unlink_quietly(path: str) -> None:
    """Remove a segment name; one that is already gone is fine."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _unlink_pending() -> None:
    for path in list(_PENDING):
        _unlink_quietly(path)
        _PENDING.pop(path, None)


atexit.register(_unlink_pending)


class SymmetricHeap:
    """One shared segment per rank of ``group``, all mapped by every rank (same host only).

    Args:
        group: the torch.distributed process group (gloo) used to bootstrap.
        nbytes: usable bytes per rank (the header page comes on top).
        directory: shared-memory directory; default ``$UBEP_SHM_DIR`` or ``/dev/shm``.
        timeout_s: deadline of each bootstrap step (default: ``UBEP_TIMEOUT_S`` or 60 s).
        agree: JSON values every rank must pass identically (the Buffer's sizes and modes); a difference
            raises ValueError on every rank, naming the values, before any segment exists.
        on_leave: called with the heap, its segments still mapped, when the set-up fails on this rank in its
            last step (an interrupted wait, say), where peers may have completed theirs.
    """

    def __init__(self, group, nbytes: int, directory: Optional[str] = None, timeout_s: Optional[float] = None,
                 agree: Optional[Dict[str, object]] = None, on_leave: Optional[Callable] = None):
        from .protocol import default_timeout
        from .utils import check_count
        try:
            self.timeout_s = default_timeout(timeout_s)
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.directory = shm_dir(directory)
            self.nbytes = check_count("nbytes", nbytes)
            if self.nbytes * self.world_size > _MAX_MAPPED_BYTES:    # (every rank maps every segment)
                raise ValueError(f"ubep_torch: {self.world_size} segments of {self.nbytes} bytes exceed the "
                                 f"{_MAX_MAPPED_BYTES >> 40} TiB a process can map: create the Buffer with smaller "
                                 f"num_nvl_bytes/num_rdma_bytes (see get_nvl_buffer_size_hint and "
                                 f"get_low_latency_rdma_size_hint)")
        except (ValueError, TypeError) as e:
            refuse_setup(group, e)
            raise
        self.segment_bytes = HEADER_BYTES + _round_up(self.nbytes, 4096)
        self._maps: List[tuple] = []      # (mmap, (st_dev, st_ino) of its file) of every mapped segment
        self._views: Dict[int, torch.Tensor] = {}
        sweep_stale_segments(self.directory)

        # 1. agree on a group token and check that the group shares one host and enough shared memory.
        token = secrets.token_hex(16)
        own_path = _segment_path(self.directory)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "pidns": _pid_namespace(),
                "bytes": self.segment_bytes, "token": token, "free": _free_bytes(self.directory),
                "dir": self.directory, "path": own_path, "agree": agree or {},
                "by_name": os.environ.get("UBEP_SHM_BY_NAME", "") not in ("", "0")}
        infos = _all_gather(info, group, self.world_size, self.timeout_s, _FIRST_STEP)
        refused = {r: i["refused"] for r, i in enumerate(infos) if "refused" in i}
        if refused:
            raise ValueError(f"ubep_torch: rank(s) {sorted(refused)} of the group could not build their Buffer ("
                             + "; ".join(f"rank {r}: {m}" for r, m in sorted(refused.items()))
                             + "), so no rank did")
        dirs = [i["dir"] for i in infos]
        if any(d != dirs[0] for d in dirs):
            raise ValueError("ubep_torch: the shared-memory directory must be the same on every rank of the group "
                             "(shm_dir= or UBEP_SHM_DIR), but it differs: "
                             + ", ".join(f"rank {r}: {d!r}" for r, d in enumerate(dirs)))
        for key in sorted({k for i in infos for k in i["agree"]}):
            values = [i["agree"].get(key) for i in infos]
            if any(v != values[0] for v in values):
                raise ValueError(f"ubep_torch: Buffer arguments must be the same on every rank of the group, but "
                                 f"{key} differs: " + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))
        hosts = sorted({i["host"] for i in infos})
        if len(hosts) != 1:
            raise RuntimeError(f"ubep_torch's simulated UGAS maps shared memory, so every rank of the group "
                               f"must run on one host; this group spans hosts {hosts}")
        group_token = bytes.fromhex(infos[0]["token"])
        self.group_token = group_token      # (random, the same on every rank: names this group's heap)
        self.peer_pids = [int(i["pid"]) for i in infos]
        # a peer in another PID namespace cannot be watched by pid: it counts as alive (deadlines still hold)
        self._watchable = [int(i["pidns"]) == _pid_namespace() for i in infos]
        total = sum(int(i["bytes"]) for i in infos)
        if total > int(infos[0]["free"]):
            raise self._too_little(total, int(infos[0]["free"]))

        # 2-4. share the segments: through /proc/<pid>/fd where every rank runs in this PID namespace (no name
        # outlives its file's creation: see the module's docstring), else, or where /proc refuses, by name
        paths = [i["path"] for i in infos]
        by_fd = len({int(i["pidns"]) for i in infos}) == 1 and int(infos[0]["pidns"]) != 0 and \
            not any(i.get("by_name") for i in infos)       # (UBEP_SHM_BY_NAME=1 on any rank: by name)
        fd = self._share(group, infos, paths, by_fd) if by_fd else None
        if fd is None:
            fd = self._share(group, infos, paths, False)
        # 5. reserve the segment's memory (nothing can be left behind any more), and learn that every peer
        # reserved its own: too little shared memory fails on every rank, before any page is touched.
        error: Optional[BaseException] = None
        try:
            self._reserve(fd)
        except (OSError, RuntimeError) as e:
            error = e
        finally:
            os.close(fd)
        try:
            self._settle_step(group, "Buffer set-up: waiting for every rank to reserve its segment's memory", error,
                              "reserve their shared memory")
        except BaseException:
            # (peers that had every message of this step, this rank's included, have completed their set-up:
            # an interrupted wait here leaves them a Buffer whose first call would wait for this rank.
            # ``on_leave(self)`` tells them through the segments, still mapped)
            if on_leave is not None:
                try:
                    on_leave(self)
                except Exception:  # noqa: BLE001  (the set-up's own error is the one to raise)
                    pass
            self.close()
            raise
        self.local = self._views[self.rank][HEADER_BYTES:]

    # ------------------------------------------------------------------ public views
    def peer(self, r: int) -> torch.Tensor:
        """uint8 view of rank ``r``'s usable memory (writes land in that rank's segment)."""
        return self._views[r][HEADER_BYTES:]

    def peer_alive(self, r: int) -> bool:
        return not self._watchable[r] or _pid_alive(self.peer_pids[r])

    def close(self) -> None:
        """Unmap every segment. A mapping that a tensor view still uses (one the caller kept, or one held by
        the frames of a kept exception) cannot be unmapped yet: its pages are replaced by private zero pages
        at the same addresses, so the shared memory is released now and the view stays valid (it no longer
        reaches any rank's memory); the mapping goes with the last view."""
        self._views = {}
        self.local = None
        for m, file in self._maps:
            try:
                m.close()
            except BufferError:
                _detach(m, file)
        self._maps = []

    def _share(self, group, infos: list, paths: List[str], by_fd: bool) -> Optional[int]:
        """Set-up steps 2 to 4: create this rank's segment under the name announced in step 1 and write its
        header, map every peer's segment, and remove every name. ``by_fd``: this rank unlinks its name at
        once and its peers open the file through ``/proc/<pid>/fd/<descriptor>`` (step 2's message carries
        the descriptor and the file's ``(st_dev, st_ino)``). Returns the segment's descriptor, kept open until
        its memory is reserved (step 5); None where /proc refused that access to some rank (``by_fd`` only):
        every rank has then closed what it mapped, and the caller shares the segments by name."""
        created_step = "Buffer set-up: waiting for every rank to create its segment"
        try:
            path, fd = self._create_segment(self.group_token, paths[self.rank])
        except Exception as e:
            self._settle_step(group, created_step, e, "create their segment")
        try:
            mine: object = True
            if by_fd:
                _unlink_quietly(path)
                _PENDING.pop(path, None)
                st = os.fstat(fd)
                mine = {"fd": fd, "file": [st.st_dev, st.st_ino]}
            where = self._settle_step(group, created_step, None, "create their segment", ok=mine)
            # 3. map every peer's segment after checking it is what the group announced; how it went is
            # settled with the peers (a rank that fails here tells them, instead of leaving them to their
            # deadline).
            map_error: Optional[Exception] = None
            try:
                for r in range(self.world_size):
                    if r == self.rank:
                        continue
                    try:
                        self._map_peer(r, paths[r], int(infos[r]["bytes"]), self.group_token,
                                       where[r] if by_fd else None)
                    except FileNotFoundError:
                        # its file is gone: it left the set-up after creating it (its descriptor is closed); by
                        # name, a rank that left the set-up may have removed the name (_unlink_peer_names).
                        # Settled with the peers like any failure here, not raised at once: a rank that left
                        # now would close its own descriptor, and a peer still mapping would name it instead
                        # of the rank that left first. The exchange names the rank that left where it fails.
                        map_error = UBEPPeerLostError(
                            "Buffer set-up: mapping every rank's segment", self.rank, [r], [r],
                            "No Buffer was created.", cause="exited" if not self.peer_alive(r) else
                            "left the set-up (its segment is gone: its own set-up failed, see its error)" if by_fd
                            else "left the set-up, or another rank that left it removed its segment's name "
                                 "(see the other ranks' errors)")
                        break
            except Exception as e:  # noqa: BLE001  (settled below: raised here, told to the peers)
                map_error = e
            if self._settle_step(group, "Buffer set-up: waiting for every rank to map every segment", map_error,
                                 "map every segment", fallback=_ProcRefused if by_fd else None) is None:
                self.close()
                os.close(fd)
                return None
            # every rank has mapped every segment: each rank removes every name (its own in `finally`), so
            # a rank killed before its own unlink leaves nothing behind while one rank of the group lives
            for r, p in enumerate(paths):
                if r != self.rank:
                    _unlink_quietly(p)
        except BaseException:
            self._unlink_peer_names(paths)
            os.close(fd)
            raise
        finally:
            # 4. everyone has mapped everything (or failed): the name is no longer needed.
            _unlink_quietly(path)
            _PENDING.pop(path, None)
        return fd

    def _settle_step(self, group, phase: str, error: Optional[BaseException], what: str, ok: object = True,
                     fallback: Optional[type] = None) -> Optional[list]:
        """End a set-up step that can fail on any rank: tell every peer how it went here (``error``, None when
        it succeeded; a bare error of this rank's own would leave the peers waiting for their deadline), then
        raise this rank's own error, or a RuntimeError naming the peers that could not ``what``. Returns what
        every rank sent where the step succeeded everywhere: ``ok`` (JSON data, not a string) from each.
        ``fallback``: an error class; where every failure of the step, on any rank, is of that class, every
        rank returns None instead of raising; where other failures come with them, or the exchange itself fails,
        those are raised, never this rank's own error of that class. An ``error`` that is a
        ``UBEPPeerLostError`` only follows from a peer that left the set-up (its segment is gone): where the
        exchange fails, its error, which names the ranks that did not deliver (the one that left first), is
        raised instead."""
        try:
            outcome = _all_gather(ok if error is None else f"{type(error).__name__}: {error}"[:1000], group,
                                  self.world_size, self.timeout_s, phase)
        except Exception:  # noqa: BLE001  (this rank's own error is the one to raise, but a fallback's)
            if error is None or isinstance(error, UBEPPeerLostError) or \
                    (fallback is not None and isinstance(error, fallback)):
                raise
            outcome = None
        failed = [r for r, c in enumerate(outcome or ()) if isinstance(c, str)]
        if fallback is not None:
            tag = f"{fallback.__name__}: "
            if failed and all(outcome[r].startswith(tag) for r in failed):
                return None
            # (other failures too: those are the set-up's errors, a fallback's is not one)
            failed = [r for r in failed if not outcome[r].startswith(tag)]
            if isinstance(error, fallback):
                error = None
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"ubep_torch: rank {self.rank} in phase '{phase}': rank(s) {failed} could not "
                               f"{what}: " + "; ".join(str(outcome[r]) for r in failed))
        return outcome

    def _unlink_peer_names(self, paths: List[str]) -> None:
        """After a failed set-up: unlink every peer's announced segment name. Once one rank leaves the
        set-up it cannot complete (every later step waits for that rank's messages), so no rank maps these
        any more, and a peer that died in it, or stalled and is killed later (as a launcher does once
        another rank failed), could not unlink its own. Mappings live on; a name a peer creates after this
        is unlinked by its own failed set-up (or by the next start's sweep, if it is killed first)."""
        for r, p in enumerate(paths):
            if r == self.rank or not isinstance(p, str):
                continue
            m = _NAME_RE.match(os.path.basename(p))
            if m and int(m.group(1)) == self.peer_pids[r] and os.path.dirname(p) == self.directory:
                _unlink_quietly(p)

    # ------------------------------------------------------------------ internals
    def _too_little(self, total: int, free: int) -> RuntimeError:
        return RuntimeError(
            f"ubep_torch needs {total} bytes of shared memory in {self.directory} "
            f"({self.world_size} ranks x {self.segment_bytes} bytes) but only {free} are free. Point UBEP_SHM_DIR (or "
            f"Buffer(shm_dir=...)) at a larger tmpfs, enlarge /dev/shm (docker: --shm-size), or create the Buffer "
            f"with smaller num_nvl_bytes/num_rdma_bytes.")

    def _create_segment(self, group_token: bytes, path: Optional[str] = None) -> tuple:
        """Create, size (sparse) and map this rank's segment and write its header. Returns ``(path, fd)``:
        the caller reserves the memory through ``fd`` (``_reserve``) and closes it."""
        path = path or _segment_path(self.directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        _PENDING[path] = None
        header = struct.pack(_HEADER_FMT, _MAGIC, _VERSION, group_token, self.rank, self.world_size,
                             self.segment_bytes)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, self.segment_bytes)
            # the header through the file, not the mapping: a tmpfs that filled up since the check of step 1
            # fails this write with ENOSPC, where a store into the sparse mapping would kill with SIGBUS
            try:
                os.pwrite(fd, header, 0)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise self._too_little(self.world_size * self.segment_bytes, _free_bytes(self.directory)) from e
            m = mmap.mmap(fd, self.segment_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            st = os.fstat(fd)
        except BaseException:
            _unlink_quietly(path)
            _PENDING.pop(path, None)
            os.close(fd)
            raise
        self._maps.append((m, (st.st_dev, st.st_ino)))
        self._views[self.rank] = _pinned_view(m)
        return path, fd

    def _reserve(self, fd: int) -> None:
        """Reserve every page of this rank's segment now: a sparse file that outgrows its tmpfs later kills
        with SIGBUS. Too little shared memory raises the error that names the bytes and ``UBEP_SHM_DIR``."""
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):     # (ENOMEM: a tmpfs without a size limit)
                raise
            raise self._too_little(self.world_size * self.segment_bytes, _free_bytes(self.directory)) from e

    def _map_peer(self, r: int, path: str, nbytes: int, group_token: bytes, where: Optional[dict] = None) -> None:
        """Map rank ``r``'s segment, announced at ``path``, or, with ``where`` (its step-2 message: ``fd`` and
        the file's ``(st_dev, st_ino)``), through ``/proc/<its pid>/fd/<fd>``; refuses anything but a private
        regular file of this user, of the announced size, whose header names rank ``r`` of this group.
        FileNotFoundError: the file is gone (the peer left the set-up); ``_ProcRefused``: /proc refused this
        process access to the peer's descriptors."""
        if where is None:
            if not isinstance(path, str) or os.path.dirname(path) != self.directory or \
                    not _NAME_RE.match(os.path.basename(path)):
                raise RuntimeError(f"ubep_torch: rank {r} announced an invalid segment path {path!r}")
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        else:
            fd = _open_by_descriptor(self.peer_pids[r], where, r)
        try:
            st = os.fstat(fd)
            if where is not None and [st.st_dev, st.st_ino] != where["file"]:
                raise FileNotFoundError(errno.ENOENT, f"rank {r}'s segment descriptor now names another file")
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or (st.st_mode & 0o077):
                raise RuntimeError(f"ubep_torch: refusing to map {path}: not a private regular file of this "
                                   f"user (mode {oct(st.st_mode)}, uid {st.st_uid})")
            if st.st_size != nbytes or nbytes < HEADER_BYTES:
                raise RuntimeError(f"ubep_torch: refusing to map {path}: size {st.st_size} != announced {nbytes}")
            m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, token, hrank, hworld, hbytes = struct.unpack_from(_HEADER_FMT, m, 0)
        if magic != _MAGIC or version != _VERSION or token != group_token or hrank != r \
                or hworld != self.world_size or hbytes != nbytes:
            m.close()
            raise RuntimeError(f"ubep_torch: refusing to map {path}: its header does not belong to rank {r} "
                               f"of this group")
        self._maps.append((m, (st.st_dev, st.st_ino)))
        self._views[r] = _pinned_view(m)


class _ProcRefused(OSError):
    """/proc refused this process access to a peer's file descriptors (the set-up then shares by name)."""


def _open_by_descriptor(pid: int, where: object, r: int) -> int:
    """Open the file that process ``pid`` (rank ``r``) holds at descriptor ``where["fd"]``, through
    ``/proc/<pid>/fd``, after checking that it is still the file ``where["file"]`` (``(st_dev, st_ino)``) names:
    a descriptor its process closed and reused for another file is never opened."""
    if not (isinstance(where, dict) and isinstance(where.get("fd"), int) and where["fd"] >= 0
            and isinstance(where.get("file"), list) and len(where["file"]) == 2
            and all(isinstance(v, int) for v in where["file"])):
        raise RuntimeError(f"ubep_torch: rank {r} announced an invalid segment descriptor {where!r}")
    link = f"/proc/{pid}/fd/{where['fd']}"
    try:
        st = os.stat(link)
        if [st.st_dev, st.st_ino] != where["file"]:
            raise FileNotFoundError(errno.ENOENT, f"rank {r}'s segment descriptor now names another file")
        return os.open(link, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except PermissionError as e:
        raise _ProcRefused(e.errno, f"cannot open rank {r}'s segment through {link}: {e.strerror}") from None


def _detach(m: mmap.mmap, file: tuple) -> bool:
    """Replace the pages of mapping ``m`` by private anonymous ones at the same addresses (Linux ``mmap`` with
    ``MAP_FIXED``), and point the descriptor of the file ``m`` keeps open (Python's mmap holds a duplicate
    of it; ``file`` is its ``(st_dev, st_ino)``) at /dev/null: the shared memory is released once no other
    process maps it, while tensors over ``m`` stay valid. ``m`` unmaps the range and closes that descriptor
    when it is collected. False where this cannot be done (then the shared pages stay until the last view
    goes)."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for name in os.listdir("/proc/self/fd"):
                try:
                    st = os.fstat(int(name))
                except (OSError, ValueError):
                    continue
                if (st.st_dev, st.st_ino) == file:
                    os.dup2(null, int(name))
        finally:
            os.close(null)
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        probe = ctypes.c_char.from_buffer(m)        # (an export of m, for its address only)
        addr = ctypes.addressof(probe)
        del probe
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10   # MAP_FIXED
        got = libc.mmap(addr, len(m), mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        return got == addr
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def _pinned_view(m: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over the whole mapping that keeps it mapped while the tensor or any view of it lives:
    it holds a memoryview, an export of ``m`` (``torch.frombuffer(m)`` alone lets ``m.close()`` unmap the
    memory under it), so ``close`` raises BufferError then and the mapping goes with the last view."""
    return torch.frombuffer(memoryview(m), dtype=torch.uint8)


def _segment_path(directory: str) -> str:
    """A fresh unguessable segment path: ``ubep-<pid>-<PID namespace>-<128 random bits>`` in ``directory``."""
    return os.path.join(directory, f"ubep-{os.getpid()}-{_pid_namespace()}-{secrets.token_hex(16)}")


#: what one process can map at most (x86-64 and AArch64 user address space: 128 TiB)
_MAX_MAPPED_BYTES = 1 << 47


def _round_up(x: int, a: int) -> int:
    return -(-int(x) // a) * a


def _free_bytes(directory: str) -> int:
    """The bytes free in ``directory``'s file system; for one without a size (a tmpfs mounted with size=0,
    which holds what the machine's memory does), the memory available to new allocations."""
    st = os.statvfs(directory)
    if st.f_blocks:
        return st.f_bavail * st.f_frsize
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_MSG_BYTES = 4096
_TAG = 0x5542   # bootstrap messages
_IN_FLIGHT: list = []   # works abandoned at a deadline: their buffers must outlive them
#: process groups on which a set-up was interrupted (Ctrl-C, another exception) while its messages were in flight
_INTERRUPTED: list = []


def _closed_connection(e: RuntimeError, phase: str, me: int, r: int) -> UBEPError:
    """The error for a process group whose connection to rank ``r`` is closed before the set-up exchange.
    gloo closes a connection itself when a wait on it timed out (this rank's earlier set-up); closed from
    the other end, the peer's process is gone, or its own earlier set-up on this group timed out."""
    again = "build the Buffer on a new process group"
    if "application timeout" in str(e).lower():
        return UBEPError(f"ubep_torch: rank {me} in phase '{phase}': an earlier Buffer set-up on this process group "
                         f"timed out, and gloo closed the group's connection to rank {r} ({e}): {again}. "
                         f"No Buffer was created.")
    return UBEPPeerLostError(phase, me, [r], [r], f"No Buffer was created (gloo: {e}).",
                             cause=f"closed its connection to this rank (its process exited, or a Buffer set-up "
                                   f"of its own on this group timed out: then {again})")


#: (thread, deadline) of the waits an interrupted set-up left running
_ABANDONED_WAITS: list = []


def _live_abandoned_waits() -> list:
    return [(t, d) for t, d in _ABANDONED_WAITS if t.is_alive()]


def _end_abandoned_waits() -> None:
    """At the exit of a program that ends normally: let the waits an interrupted set-up left running end
    first (at their deadline at the latest). gloo cannot withdraw a posted receive, and a process that exits
    while a thread waits on one aborts (SIGABRT, "terminate called without an active exception"), which
    would turn its success into a failure. A program that ends on an uncaught exception exits at once."""
    live = _live_abandoned_waits()
    if not live or getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return      # (none left, or the program ends on an uncaught exception, Ctrl-C say: it fails either way)
    last = max(d for _, d in live)
    sys.stderr.write(f"ubep_torch: an interrupted Buffer set-up still waits for a peer's message (gloo cannot "
                     f"withdraw the receive, and exiting under it would abort the process): exit waits "
                     f"{max(last - time.monotonic(), 0.0):.0f} s at most for it to end\n")
    sys.stderr.flush()
    for t, d in live:
        t.join(max(d - time.monotonic(), 0.0) + 5.0)


atexit.register(_end_abandoned_waits)


def _wait_work(work, deadline: float, in_flight: tuple, group) -> None:
    """Wait for a gloo send or receive until ``deadline`` (gloo's own wait raises there, or as soon as the
    peer's connection breaks, and closes the connection at a timeout). The wait runs in a helper thread
    while this one waits on an event, so that signals (Ctrl-C) are handled at once instead of after one
    uninterruptible wait; interrupted, the works and buffers are kept alive (``in_flight``) until the
    helper's wait ends at the deadline, and ``group`` takes no other set-up (``_INTERRUPTED``)."""
    if work.is_completed():
        work.wait()
        return
    done, failed = threading.Event(), []

    def wait():
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as e:
            failed.append(e)
        finally:
            done.set()
    thread = threading.Thread(target=wait, name="ubep-setup-wait", daemon=True)
    thread.start()
    try:
        ended = done.wait(max(deadline - time.monotonic(), 0.0) + 5.0)
    except BaseException:
        _IN_FLIGHT.append(in_flight)
        _ABANDONED_WAITS.append((thread, deadline))
        _INTERRUPTED.append(group)
        raise
    if not ended:       # (gloo's wait has the deadline; this one only bounds it; the caller keeps in_flight)
        raise RuntimeError("the wait timed out")
    if failed:
        raise failed[0]


def pending_setup_waits() -> int:
    """How many waits on set-up messages an interrupted Buffer set-up left running (each ends at its set-up's
    deadline; see ``_wait_work``)."""
    return len(_live_abandoned_waits())


_FIRST_STEP = "Buffer set-up: waiting for every rank to create its Buffer"


def refuse_setup(group, error: BaseException) -> None:
    """This rank cannot build its Buffer (an argument it was given is bad): take part in the set-up's first
    step with ``error`` instead of its own data, so that the peers, which wait there, raise at once naming
    this rank and its error instead of timing out, and no bootstrap message of this set-up is left over
    for the next one. It waits for the peers' messages 10 s at most (they arrive with theirs then); its
    own failures are dropped, as the caller raises ``error``."""
    try:
        group = dist.group.WORLD if group is None else group
        world = dist.get_world_size(group)
        if world > 1 and dist.get_rank(group) >= 0:
            _all_gather({"refused": f"{type(error).__name__}: {error}"[:1000]}, group, world, 10.0, _FIRST_STEP)
    except Exception:  # noqa: BLE001  (a group this rank cannot use: the peers time out, as before)
        pass


def _all_gather(obj, group, world_size, timeout_s: Optional[float] = None, phase: str = "Buffer set-up"):
    """Every rank's ``obj`` (JSON data), in rank order.

    On gloo groups, one message to and from every peer, received with a deadline: a peer whose message
    does not arrive in ``timeout_s`` is named in a ``UBEPTimeoutError`` (a gloo collective would wait
    for the process group's timeout). Other backends use ``all_gather_object``.
    """
    if timeout_s is None or world_size == 1 or dist.get_backend(group) != "gloo":
        out = [None] * world_size
        dist.all_gather_object(out, obj, group=group)
        return out
    me = dist.get_rank(group)
    if any(g is group for g in _INTERRUPTED):
        # (its receives are still posted: they would take the peers' messages of this set-up, which would
        # then wait for them until its deadline and name ranks that did deliver)
        raise UBEPError(f"ubep_torch: rank {me} in phase '{phase}': an earlier Buffer set-up on this process group "
                        f"was interrupted (Ctrl-C or another exception) while its messages were in flight, and "
                        f"they would be taken for this set-up's: build the Buffer on a new process group. No "
                        f"Buffer was created.")
    # every step has its own tag and names itself: a message left over from an earlier set-up that failed
    # on this process group is recognised instead of being taken for this step's
    tag = _TAG + zlib.crc32(phase.encode()) % 4096
    data = json.dumps({"step": phase, "data": obj}).encode()
    if len(data) > _MSG_BYTES - 4:
        raise ValueError(f"ubep_torch: bootstrap message of {len(data)} bytes is too long")
    msg = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
    msg[:4] = torch.tensor(list(struct.pack("<I", len(data))), dtype=torch.uint8)
    msg[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    peers = [r for r in range(world_size) if r != me]
    bufs = {r: torch.zeros(_MSG_BYTES, dtype=torch.uint8) for r in peers}
    recvs, sends = {}, {}
    in_flight = (msg, bufs, recvs, sends)     # (kept alive in _IN_FLIGHT by a step that gives up on them)
    closed = {}     # peers whose connection was closed already: (error, gloo's error)
    for r in peers:
        try:
            recvs[r] = dist.irecv(bufs[r], src=dist.get_global_rank(group, r), group=group, tag=tag)
            sends[r] = dist.isend(msg, dst=dist.get_global_rank(group, r), group=group, tag=tag)
        except RuntimeError as e:
            # (the message still goes to the other peers: a rank that raised here at once and exited would
            # close its own connections, and the peers still on their way to this step would name it)
            closed[r] = (_closed_connection(e, phase, me, r), e)
    for err, e in closed.values():
        if not isinstance(err, UBEPPeerLostError):      # (this group is unusable: see the error)
            _IN_FLIGHT.append(in_flight)
            raise err from e
    deadline = time.monotonic() + timeout_s
    missing, lost = list(closed), list(closed)
    for r in peers:
        if r in closed:
            continue
        try:
            _wait_work(recvs[r], deadline, in_flight, group)
        except RuntimeError as e:
            missing.append(r)
            if "timed out" not in str(e).lower():
                lost.append(r)      # the connection broke: the peer's process is gone, or its wait timed out
    if missing:
        _IN_FLIGHT.append(in_flight)
        consequence = "No Buffer was created."
        # this rank's message reaches the peers that are still there before it raises: a rank that leaves the
        # set-up at once (and exits) would otherwise close its connections with the message unsent, and they
        # would name it as lost too, though it only gave up on the same lost peer (a second at most)
        for r in peers:
            if r not in missing:
                try:
                    _wait_work(sends[r], min(deadline, time.monotonic() + 1.0), in_flight, group)
                except RuntimeError:
                    pass
        if missing == list(closed) and len(closed) == 1:
            err, e = next(iter(closed.values()))
            raise err from e
        if lost:
            # (gloo closes a connection whose wait timed out: a peer whose deadline ran out first, alive,
            # looks the same from here as one whose process exited)
            missing, lost = sorted(missing), sorted(lost)
            raise UBEPPeerLostError(phase, me, missing, lost, consequence,
                                    cause="closed its connection to this rank (its process exited, or its own "
                                          "wait in this set-up timed out first: then build the Buffer on a new "
                                          "process group)")
        raise UBEPTimeoutError(phase, me, missing, timeout_s, consequence)
    undelivered, cause = [], None
    for r, w in sends.items():
        try:
            _wait_work(w, deadline, in_flight, group)
        except RuntimeError as e:
            undelivered.append(r)
            cause = e
    if undelivered:
        _IN_FLIGHT.append(in_flight)
        raise UBEPError(f"ubep_torch: rank {me} in phase '{phase}': its message to rank(s) {undelivered} was not "
                        f"delivered ({cause}). No Buffer was created.") from cause
    out = []
    for r in range(world_size):
        if r == me:
            out.append(obj)
            continue
        b = bytes(bufs[r].numpy())
        n = struct.unpack("<I", b[:4])[0]
        try:
            msg_r = json.loads(b[4:4 + n].decode()) if n <= _MSG_BYTES - 4 else None
        except ValueError:
            msg_r = None
        if not isinstance(msg_r, dict) or msg_r.get("step") != phase or "data" not in msg_r:
            raise RuntimeError(f"ubep_torch: rank {me} in phase '{phase}': rank {r} sent a bootstrap message "
                               f"of another set-up step (left over from an earlier Buffer set-up that failed "
                               f"on this process group?); build the Buffer on a new process group")
        out.append(msg_r["data"])
    return out
