"""Shared-memory security: owner-only segments with unguessable names; peers' segments are mapped only
after checking owner, mode, size and the group token; nothing from shared memory is unpickled; sizes a
peer writes into shared memory are bounds-checked before use."""
import ast
import os
import re
import stat
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ubep_torch import Buffer, ugas  # noqa: E402
from ubep_torch import protocol as P  # noqa: E402
from ubep_torch.errors import UBEPError  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402

PKG = os.path.join(os.path.dirname(HERE), "ubep_torch")


def _bare_heap(directory, rank=0, world=2, nbytes=4096):
    h = object.__new__(ugas.SymmetricHeap)
    h.directory, h.rank, h.world_size = str(directory), rank, world
    h.nbytes = nbytes
    h.segment_bytes = ugas.HEADER_BYTES + nbytes
    h._maps, h._views = [], {}
    return h


def _make_peer(directory, token, rank=1, world=2, nbytes=8192, mode=0o600):
    import secrets
    import struct
    path = os.path.join(str(directory), f"ubep-{os.getpid()}-{ugas._pid_namespace()}-{secrets.token_hex(16)}")
    with open(path, "wb") as f:
        f.write(struct.pack(ugas._HEADER_FMT, ugas._MAGIC, ugas._VERSION, token, rank, world, nbytes))
        f.truncate(nbytes)
    os.chmod(path, mode)
    return path


def test_created_segment_is_private_with_unguessable_name(tmp_path):
    h = _bare_heap(tmp_path)
    token = os.urandom(16)
    path, fd = h._create_segment(token)
    os.close(fd)
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert re.fullmatch(r"ubep-\d+-\d+-[0-9a-f]{32}", os.path.basename(path))
        assert st.st_size == h.segment_bytes
        old = os.umask(0)
        try:
            path2, fd2 = h._create_segment(token)     # a permissive umask does not widen the mode
            os.close(fd2)
            assert stat.S_IMODE(os.stat(path2).st_mode) == 0o600
            assert os.path.basename(path2) != os.path.basename(path)
        finally:
            os.umask(old)
    finally:
        h.close()
        for n in os.listdir(tmp_path):
            os.unlink(os.path.join(tmp_path, n))
            ugas._PENDING.pop(os.path.join(str(tmp_path), n), None)


def test_segment_that_cannot_be_sized_is_removed(tmp_path, monkeypatch):
    """A failure between creating the file and mapping it leaves no file behind."""
    h = _bare_heap(tmp_path)

    def no_space(fd, n):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ugas.os, "ftruncate", no_space)
    with pytest.raises(OSError):
        h._create_segment(os.urandom(16))
    assert os.listdir(tmp_path) == [] and not any(p.startswith(str(tmp_path)) for p in ugas._PENDING)


def test_map_peer_accepts_a_genuine_segment(tmp_path):
    token = os.urandom(16)
    path = _make_peer(tmp_path, token)
    h = _bare_heap(tmp_path)
    h._map_peer(1, path, 8192, token)
    assert h.peer(1).numel() == 8192 - ugas.HEADER_BYTES
    h.close()


def test_map_peer_by_descriptor_opens_only_the_announced_file(tmp_path):
    """Segments shared through /proc/<pid>/fd: a genuine one maps (its name already gone); a descriptor that
    names another file than the announced ``(st_dev, st_ino)`` (closed and reused by its process) is never
    opened, and a malformed announcement is refused."""
    token = os.urandom(16)
    path = _make_peer(tmp_path, token)
    fd, other = os.open(path, os.O_RDWR), os.open(os.devnull, os.O_RDWR)
    os.unlink(path)
    st = os.fstat(fd)
    h = _bare_heap(tmp_path)
    h.peer_pids = [os.getpid(), os.getpid()]
    try:
        h._map_peer(1, None, 8192, token, {"fd": fd, "file": [st.st_dev, st.st_ino]})
        assert h.peer(1).numel() == 8192 - ugas.HEADER_BYTES
        h.close()
        real_open = ugas.os.open
        opened = []
        ugas.os.open = lambda p, *a: opened.append(p) or real_open(p, *a)
        try:
            with pytest.raises(FileNotFoundError, match="another file"):
                h._map_peer(1, None, 8192, token, {"fd": other, "file": [st.st_dev, st.st_ino]})
        finally:
            ugas.os.open = real_open
        assert opened == [] and 1 not in h._views
        for bad in (None, {"fd": -1, "file": [1, 2]}, {"fd": fd}, {"fd": "3", "file": [1, 2]},
                    {"fd": fd, "file": [st.st_dev]}, {"fd": fd, "file": ["a", "b"]}):
            with pytest.raises(RuntimeError, match="invalid segment descriptor"):
                ugas._open_by_descriptor(os.getpid(), bad, 1)
    finally:
        h.close()
        os.close(fd)
        os.close(other)


@pytest.mark.parametrize("forgery", ["token", "rank", "world", "header size", "file size", "mode", "mode 0640",
                                     "symlink", "outside dir", "bad name", "owner", "directory", "magic"])
def test_map_peer_refuses_forged_segments(tmp_path, forgery):
    token = os.urandom(16)
    d = tmp_path
    kw = {}
    announced = 8192
    if forgery == "token":
        kw["token"] = os.urandom(16)
    elif forgery == "rank":
        kw["rank"] = 0
    elif forgery == "world":
        kw["world"] = 3
    elif forgery == "header size":
        kw["nbytes"] = 8192
        announced = 8192
    elif forgery in ("mode", "mode 0640"):
        kw["mode"] = 0o644 if forgery == "mode" else 0o640
    path = _make_peer(d, kw.pop("token", token), **kw)
    if forgery == "header size":
        with open(path, "r+b") as f:
            f.truncate(12288)          # file and announced size agree, the header says otherwise
        announced = 12288
    elif forgery == "file size":
        announced = 4096 * 3
    elif forgery == "symlink":
        link = os.path.join(str(d), f"ubep-{os.getpid()}-{ugas._pid_namespace()}-{'0' * 32}")
        os.symlink(path, link)
        path = link
    elif forgery == "outside dir":
        other = d / "sub"
        other.mkdir()
        p2 = os.path.join(str(other), os.path.basename(path))
        os.rename(path, p2)
        path = p2
    elif forgery == "bad name":
        p2 = os.path.join(str(d), "ubep-notours")
        os.rename(path, p2)
        path = p2
    elif forgery == "owner":
        if os.getuid() != 0:
            pytest.skip("needs root to chown")
        os.chown(path, 4321, 4321)
    elif forgery == "directory":
        os.unlink(path)
        os.mkdir(path)
    elif forgery == "magic":
        with open(path, "r+b") as f:
            f.write(b"NOTUBEP!")
    h = _bare_heap(d)
    with pytest.raises((RuntimeError, OSError)):
        h._map_peer(1, path, announced, token)
    assert 1 not in h._views
    h.close()


def test_nothing_from_shared_memory_is_unpickled():
    """No module of the package deserializes objects (pickle, marshal, torch.load, numpy allow_pickle,
    eval/exec; ``json.loads`` is allowed: it builds plain data only). The bootstrap exchanges small JSON
    dicts over gloo, never through the segments."""
    banned_modules = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"}
    found = []
    for root, _, files in os.walk(PKG):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    if any(m.split(".")[0] in banned_modules for m in mods):
                        found.append((path, node.lineno, mods))
                elif isinstance(node, ast.Call):
                    f = node.func
                    fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    is_json = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "json"
                    if fname in ("eval", "exec") or (fname == "loads" and not is_json) or (
                            fname == "load" and isinstance(f, ast.Attribute)
                                                               and getattr(f.value, "id", "") in ("torch", "np")):
                        found.append((path, node.lineno, fname))
                    for kw in node.keywords:
                        if kw.arg == "allow_pickle":
                            found.append((path, node.lineno, "allow_pickle"))
    assert not found, found


# ----------------------------------------------------------------------------- hostile peer
def hostile_ctrl(ctx, what, sync):
    """Rank 1 plays a hostile peer: instead of dispatching it forges rank 0's control message for call 1.
    Rank 0 must raise a UBEPError naming the problem, quickly, never crash or read out of bounds."""
    R = ctx.world_size
    rdma = Buffer.get_low_latency_rdma_size_hint(8, 128, R, 2 * R)
    buf = Buffer(ctx.group, 1 << 20, rdma, low_latency_mode=True, sync=sync, timeout_s=3.0)
    import time as _t
    try:
        ll = what.startswith("ll")
        rid = P.REGION_LL_DISPATCH if ll else P.REGION_DISPATCH
        region = buf._regions[rid]
        if ctx.rank == 1:
            # the layout rank 0 expects, so that the forged sizes (not the signature) are what it must refuse:
            # normal rows carry K = 2 expert ids and 2 float32 weights; low-latency rows (one per token and
            # rank) the pair count and K (expert|slot, position) pairs
            fmt_x = P.row_format(sync, (("x", 128 * 2),), 1 + 2 * 2) if ll else \
                P.row_format(sync, (("x", 128 * 2),), 2 + 2, "torch.bfloat16/2/torch.float32")
            words = [0] * (P.CTRL_COUNTS + 2 + R)
            words[P.CTRL_SIGNATURE] = fmt_x.signature()
            if what == "rows too many":
                words[P.CTRL_NROWS] = 10 ** 9
            elif what == "rows negative":
                words[P.CTRL_NROWS] = -5
            elif what == "ll count too many":
                words[P.CTRL_COUNTS] = 10 ** 6
            elif what == "ll rows too many":
                words[P.CTRL_COUNTS] = 1
                words[P.CTRL_NROWS] = 10 ** 6
            elif what == "ll count negative":
                words[P.CTRL_COUNTS] = -3
                words[P.CTRL_COUNTS + 1] = 3
            nctrl = P.ctrl_blocks(2 if ll else 2 + R)
            ctrl = region.ctrl(buf._heap.peer(0), region.half(1), 1, nctrl)
            buf.engine.write_ctrl(ctrl, torch.tensor(words, dtype=torch.int64), P.flag_word(1, rid))
            _t.sleep(1.0)
            return "forged"
        t0 = _t.monotonic()
        x = torch.randn(2, 128).bfloat16()
        topk = torch.tensor([[0, 1], [1, 0]])
        try:
            if ll:
                buf.low_latency_dispatch(x, topk, 8, 2 * R, use_fp8=False)
            else:
                buf.dispatch(x, topk_idx=topk, topk_weights=torch.rand(2, 2), num_experts=2 * R)
        except UBEPError as e:
            return ("UBEPError", round(_t.monotonic() - t0, 2), str(e)[:200])
        except Exception as e:  # noqa: BLE001
            return ("other", type(e).__name__, str(e)[:300])
        return ("accepted",)
    finally:
        buf.destroy()


@pytest.fixture(scope="module")
def pool2(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("shm"))
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": d}
    with RankPool(2, env=env) as p:
        yield p


@pytest.mark.parametrize("what", ["rows too many", "rows negative", "ll count too many", "ll count negative",
                                  "ll rows too many"])
def test_sizes_from_shared_memory_are_bounds_checked(pool2, what):
    res = pool2.run(hostile_ctrl, what, "tff")
    assert res[1] == "forged"
    kind = res[0][0]
    assert kind == "UBEPError", res[0]
    assert "different layout" not in res[0][2], res[0]     # the forged sizes, not the signature, are refused
    assert res[0][1] < 3.0, res[0]      # refused at once, not by the deadline
