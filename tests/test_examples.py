"""The examples run at a tiny size: the training loss falls, the expert-parallel curve equals the
single-process curve, and low-latency decoding agrees with the dense model. The Buffer benchmark runs
to its table on more than two ranks."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TORCHRUN = ["torchrun"]


def _buffer_available() -> bool:
    try:
        from ubep_torch.buffer import Buffer  # noqa: F401
    except Exception:  # noqa: BLE001 - the Buffer may be absent in a partial checkout
        return False
    return True


needs_buffer = pytest.mark.skipif(not _buffer_available(), reason="ubep_torch.buffer is not importable")


# What a rank prints when gloo's threads are torn down badly at interpreter exit, after the script has
# finished and destroyed its process group, with or without a Buffer in the script (README, "Exiting under
# torchrun": torch._dynamo imported after init_process_group keeps the group alive; the examples import it
# before). Should another cause leave a thread running, such a run is repeated once (the repeat must pass).
_EXIT_ABORT = "terminate called without an active exception"


def _run(cmd, timeout=150):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if cmd[0] == "torchrun":   # own process group + fixed loopback port: a timeout leaves no rank behind
        from ubep_torch.testing import run_torchrun
        proc = run_torchrun(cmd[1], cmd[2:], nproc=2, timeout_s=timeout, env=env, cwd=ROOT)
        if proc.returncode != 0 and _EXIT_ABORT in proc.stderr and "exitcode: -6" in proc.stderr:
            proc = run_torchrun(cmd[1], cmd[2:], nproc=2, timeout_s=timeout, env=env, cwd=ROOT)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@needs_buffer
def test_train_expert_parallel_matches_single_process(tmp_path):
    ep, single = tmp_path / "ep.json", tmp_path / "single.json"
    _run(TORCHRUN + [os.path.join(EXAMPLES, "train_moe.py"), "--tiny", "--steps", "8", "--loss-file", str(ep)])
    _run([sys.executable, os.path.join(EXAMPLES, "train_moe.py"), "--tiny", "--steps", "8", "--single",
          "--world", "2", "--loss-file", str(single)])
    a, b = json.loads(ep.read_text())["loss"], json.loads(single.read_text())["loss"]
    assert len(a) == len(b) == 8
    assert a[-1] < a[0] - 0.1, f"loss did not fall: {a}"
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"curves differ:\n{a}\n{b}"


_GROUP_AFTER_TRAINING = """
import gc, os, sys, weakref
import torch.distributed as dist
sys.path.insert(0, {examples!r})
import train_moe
groups = []
destroy = dist.destroy_process_group
def watched(*args, **kwargs):
    groups.append(weakref.ref(dist.group.WORLD))
    return destroy(*args, **kwargs)
dist.destroy_process_group = watched
train_moe.train(train_moe.parse_args(["--tiny", "--steps", "2"]))
gc.collect()
# (one write: the ranks share stdout)
os.write(1, ("group " + ("kept" if groups[0]() is not None else "released") + "\\n").encode())
"""


@needs_buffer
def test_train_example_lets_its_process_group_go(tmp_path):
    """destroy_process_group at the end of the training example takes the group down: gloo's threads are
    joined there instead of being left to the interpreter's exit, where they may abort the finished run
    (former bug: the optimizer imported torch._dynamo after init_process_group, which kept the group)."""
    script = tmp_path / "group_after_training.py"
    script.write_text(_GROUP_AFTER_TRAINING.format(examples=EXAMPLES))
    out = _run(TORCHRUN + [str(script)])
    assert out.splitlines().count("group released") == 2, out


@needs_buffer
def test_infer_low_latency_agrees_with_dense(tmp_path):
    ck = tmp_path / "moe.pt"
    _run(TORCHRUN + [os.path.join(EXAMPLES, "train_moe.py"), "--tiny", "--steps", "4", "--save", str(ck)])
    out = _run(TORCHRUN + [os.path.join(EXAMPLES, "infer_moe.py"), "--tiny", "--check", "--ckpt", str(ck)])
    assert "time per output token" in out and "modeled CM384 MoE exchange" in out, out
    # (former bug: --no-cost-model printed "ubep_torch.cost_model not available")
    off = _run(TORCHRUN + [os.path.join(EXAMPLES, "infer_moe.py"), "--tiny", "--tokens", "2", "--no-cost-model"])
    assert "time per output token" in off and "modeled" not in off and "not available" not in off, off
    diff = float(out.split("max |logit diff|")[1].split(",")[0])
    agree, total = out.split("greedy tokens agree ")[1].split()[0].split("/")
    # bf16 transport of the MoE exchange: logits stay close to the float32 dense model.
    assert diff < 0.25, out
    assert int(agree) >= 0.9 * int(total), out
    # every rank's tokens are counted (former bug: rank 0's alone)
    tokens, batch = (int(v) for v in out.split("decoded ")[1].split(" sequences")[0].split(" tokens x "))
    assert int(total) == tokens * batch * 2, out
    # more positions than the checkpoint's model has: one line (former bug: load_state_dict's size mismatch)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    long = subprocess.run([sys.executable, os.path.join(EXAMPLES, "infer_moe.py"), "--single", "--ckpt", str(ck),
                           "--tokens", "500"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert long.returncode != 0 and "Traceback" not in long.stderr, long.stderr
    msg = long.stderr.strip().splitlines()[-1]
    assert "trained with --seq" in msg, long.stderr
    # the most tokens that fit: positions 0 .. len(prompt) + tokens - 2 are fed (former bug: two fewer)
    seq, chars = int(msg.split("--seq ")[1].split(":")[0]), int(msg.split("prompt (")[1].split(" ")[0])
    fit = int(msg.split("at most --tokens ")[1].split()[0])
    assert fit == seq - chars + 1, msg
    ok = subprocess.run([sys.executable, os.path.join(EXAMPLES, "infer_moe.py"), "--single", "--ckpt", str(ck),
                         "--tokens", str(fit)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                        check=False)
    assert ok.returncode == 0, ok.stderr


@needs_buffer
def test_a_rank_stalled_outside_the_buffer_fails_the_others_by_the_timeout():
    """(former bug: the examples' gloo group kept its 30-minute default, so a rank stalled in the gradient
    all-reduce kept the others waiting far past --timeout)"""
    import time

    from ubep_torch.testing import run_torchrun
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = run_torchrun(os.path.join(ROOT, "tests", "stall_in_sync.py"), ["--tiny", "--steps", "6", "--timeout", "4"],
                        nproc=2, timeout_s=120, env=env, cwd=ROOT)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 45, (took, proc.stdout[-2000:], proc.stderr[-2000:])
    assert re.search(r"[Tt]imed? ?out", proc.stderr), proc.stderr[-3000:]


def test_a_checkpoint_whose_weights_do_not_fit_is_one_line(tmp_path):
    """(former bug: load_state_dict's missing-keys traceback)"""
    ck = tmp_path / "empty.pt"
    shape = {"dim": 32, "heads": 2, "layers": 1, "experts": 4, "top_k": 2, "ffn": 32, "shared": 0,
             "router": "softmax", "seq": 64}
    torch.save({"args": shape, "state": {}}, ck)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "infer_moe.py"), "--single", "--ckpt", str(ck)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "weights do not fit" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_infer_single_process():
    out = _run([sys.executable, os.path.join(EXAMPLES, "infer_moe.py"), "--tiny", "--single", "--check"])
    assert "max |logit diff| 0.0000" in out


@needs_buffer
def test_buffer_benchmark_prints_its_table_on_three_ranks():
    """Beyond two ranks every rank receives a different number of bytes (the benchmark once hung there)."""
    out = _run([sys.executable, "benchmarks/bench_buffer.py", "--ranks", "3", "--tokens", "6", "--hidden", "512",
                "--experts", "12", "--topk", "4", "--iters", "2", "--rounds", "1", "--backends", "auto,torch"],
               timeout=240)
    lines = [line.strip() for line in out.splitlines()]
    from ubep_torch.engine import make_engine
    # (where "auto" is the torch engine, without the C module, its rows are printed once, untagged)
    tagged = ("ubep normal (torch)", "ubep low_latency (torch)") if make_engine("auto").name != "torch" else ()
    for name in ("ubep normal", "ubep low_latency", *tagged, "naive gloo (rank rows)", "naive gloo (expert rows)",
                 "plain copy, in cache", "plain copy, 64 MiB buffers", "store to peer + load back"):
        line = next((line for line in lines if line.startswith(name + "  ")), None)
        assert line is not None, f"no {name!r} row in:\n{out}"
        numbers = [float(v.rstrip("x")) for v in line[len(name):].split() if v[0].isdigit()]
        assert numbers and numbers[0] > 0 and all(v >= 0 for v in numbers), line   # (ratios may print 0.00)
    assert any(line.startswith("store to peer + load back, round by round") for line in lines), out
    work = re.search(r"per-call work: .*?next to no bytes\): ([0-9.]+) ms", out, re.S)
    assert work is not None and float(work.group(1)) > 0, out
    if make_engine("auto").name != "torch":     # (the C path's one-step exchanges, timed inside round trips)
        for kind in ("dispatch", "combine"):
            ex = re.search(kind + r"'s exchange \(medians\): ([0-9.]+) ms on a rank .*? entered it ([0-9.]+) ms "
                           r"apart,\s+and the last to leave left ([0-9.]+) ms after .*?\((\d+) of (\d+) calls",
                           out, re.S)
            # (a call whose peer came later than the engine's short wait went on the general way: not counted)
            assert (ex is not None and float(ex.group(1)) > 0 and 1 <= int(ex.group(4)) <= int(ex.group(5)) == 2
                    or f"  {kind}: no call took the one-step exchange" in out), out
        rest = re.search(r"outside the exchanges .*?:\s+([0-9.]+) ms of ([0-9.]+) ms", out, re.S)
        assert rest is not None and 0 < float(rest.group(1)) < float(rest.group(2)), out
    loops = ("torch operators", "the C data path's") if make_engine("auto").name != "torch" else ("torch operators",)
    for how in loops:
        floor = next((line for line in lines if line.startswith(how) and "naive gloo" in line), None)
        assert floor is not None, f"no plain-copies round trip with {how} in:\n{out}"
        assert float(floor.split("round trip ")[1].split()[0]) > 0, floor


@needs_buffer
def test_stores_benchmark_prints_every_policy():
    """bench_stores.py: every round prints the probe and the round trip under each store policy."""
    from ubep_torch import native_engine
    if not native_engine.available():
        pytest.skip("bench_stores.py times the C path's stores")
    out = _run([sys.executable, "benchmarks/bench_stores.py", "--rounds", "2", "--iters", "2", "--tokens", "6",
                "--hidden", "512"], timeout=240)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"], out
    for r in rows:
        assert all(float(v) > 0 for v in r[1:7]) and r[7] in ("plain", "streaming"), r


@needs_buffer
def test_checks_benchmark_prints_both_routings_of_every_hidden_size():
    """bench_checks.py: a row per hidden size and routing, with the short and the full checks' times."""
    out = _run([sys.executable, "benchmarks/bench_checks.py", "--tokens", "6", "--hidden", "64,96", "--blocks", "2",
                "--calls", "2"], timeout=240)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], " ".join(r[1:3])) for r in rows] == [("64", "one, repeated"), ("64", "new every"),
                                                      ("96", "one, repeated"), ("96", "new every")], out
    for r in rows:
        assert all(float(v) > 0 for v in r[-4:-1]), r


@needs_buffer
@pytest.mark.parametrize("compare,title", [("tries", "normal round trip, with against without the one-step "
                                                     "exchanges of new routings"),
                                          ("ll_steps", "low-latency round trip, with against without the one-step "
                                                       "receives")])
def test_checks_benchmark_compares_the_one_step_calls_of_new_routings(compare, title):
    """bench_checks.py --compare tries / ll_steps: a row per hidden size, new routings only, with both times."""
    out = _run([sys.executable, "benchmarks/bench_checks.py", "--compare", compare, "--tokens", "6", "--hidden", "64",
                "--blocks", "2", "--calls", "2"], timeout=240)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], " ".join(r[1:3])) for r in rows] == [("64", "new every")], out
    assert all(float(v) > 0 for v in rows[0][-4:-1]), rows
    assert title in out, out


def test_sums_benchmark_prints_every_path():
    """The sum benchmark checks every path's bits against the torch path before it times them."""
    out = _run([sys.executable, "benchmarks/bench_sums.py", "--tokens", "5", "--hidden", "300", "--iters", "2"],
               timeout=120)
    lines = [line.strip() for line in out.splitlines()]
    names = ["torch.add (plain tensors)", "torch path (slots)"]
    if "C path not built" not in out:
        names += ["C path, pair loops", "C path, element loops"]
    for name in names:
        line = next((line for line in lines if line.startswith(name + "  ")), None)
        assert line is not None, f"no {name!r} row in:\n{out}"
        numbers = [float(v.rstrip("x")) for v in line[len(name):].split()]
        assert len(numbers) == 6 and all(v > 0 for v in numbers), line


BAD_OPTIONS = [
    (["examples/train_moe.py", "--single", "--steps", "0"], "--steps"),
    (["examples/train_moe.py", "--single", "--dim", "30", "--heads", "4"], "--heads"),
    (["examples/infer_moe.py", "--single", "--prompt", "XYZ"], "vocabulary"),
    (["examples/infer_moe.py", "--single", "--ckpt", "README.md"], "not a checkpoint"),
    (["benchmarks/bench_buffer.py", "--ranks", "0"], "--ranks"),
    (["benchmarks/bench_sums.py", "--hidden", "0"], "--hidden"),
    (["benchmarks/bench_checks.py", "--hidden", "128,x"], "--hidden"),
    (["benchmarks/bench_checks.py", "--ranks", "3"], "--ranks 3"),
    (["benchmarks/bench_checks.py", "--compare", "speed"], "--compare"),
    (["examples/demo.py"], "torchrun"),                 # (not under torchrun)
    (["examples/train_moe.py", "--tiny"], "--single"),
    (["examples/infer_moe.py"], "--single"),
    # (former tracebacks, some after a whole run)
    (["examples/train_moe.py", "--single", "--lr", "nan"], "--lr"),
    (["examples/train_moe.py", "--single", "--save", "examples"], "is a directory"),
    (["examples/train_moe.py", "--single", "--seq", "200000"], "--seq"),
    (["examples/infer_moe.py", "--single", "--timeout", "0"], "--timeout"),
    (["benchmarks/bench_buffer.py", "--backends", "nope"], "--backends"),
    (["benchmarks/bench_buffer.py", "--topk", "17", "--experts", "32"], "--topk"),   # (failed on every rank)
    (["benchmarks/bench_buffer.py", "--ranks", "3"], "--experts 16 must be a multiple"),   # (blamed --topk too)
    (["benchmarks/bench_buffer.py", "--tokens", "1" + "0" * 15], "memory"),   # (a rank's allocation error)
    (["benchmarks/sim_speed.py", "--ranks", "8"], "unrecognized"),              # (ran the whole benchmark)
    (["benchmarks/stress.py", "--parallel", "0"], "--parallel"),
    (["benchmarks/stress.py", "--timeout", "nan"], "--timeout"),
    (["examples/train_moe.py", "--single", "--timeout", "1e300"], "--timeout"),   # (timedelta's OverflowError)
    (["examples/infer_moe.py", "--single", "--timeout", "1e300"], "--timeout"),
    # (former tracebacks of the allocator: sizes past the machine's memory)
    (["benchmarks/bench_sums.py", "--hidden", "1" + "0" * 12, "--iters", "1"], "more memory than this machine"),
    (["examples/train_moe.py", "--single", "--tiny", "--batch", "1" + "0" * 11, "--steps", "1"], "--batch"),
    (["examples/train_moe.py", "--single", "--dim", "1" + "0" * 9, "--steps", "1"], "more memory than this machine"),
    (["examples/infer_moe.py", "--single", "--tiny", "--tokens", "1" + "0" * 12], "more memory than this machine"),
    (["benchmarks/bench_sums.py", "--tokens", "4" + "0" * 12, "--hidden", "4" + "0" * 12, "--iters", "1"],
     "a tensor size overflowed"),
    (["examples/infer_moe.py", "--single", "--tiny", "--batch", "1" + "0" * 20], "--batch"),   # (ran without end)
    (["examples/train_moe.py", "--single", "--tiny", "--ffn", "1" + "0" * 12], "more than this machine's memory"),
]


def test_bad_options_give_one_line_errors(tmp_path):
    """Every command of ``BAD_OPTIONS`` fails with one line that names the problem, no traceback (run by
    ``run_scripts.py``, which imports torch once and forks a child per command: each spent most of its time
    importing torch)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    commands = tmp_path / "commands.json"
    commands.write_text(json.dumps([cmd for cmd, _ in BAD_OPTIONS]))
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "run_scripts.py"), str(commands), str(tmp_path)],
                   cwd=ROOT, env=env, timeout=600, check=True)
    for i, (cmd, what) in enumerate(BAD_OPTIONS):
        rc, err = (tmp_path / f"{i}.rc").read_text(), (tmp_path / f"{i}.err").read_text()
        assert rc not in ("0", "timeout") and "Traceback" not in err, (cmd, rc, err)
        assert what in err.strip().splitlines()[-1], (cmd, err)


def test_run_torchrun_checks_its_arguments(tmp_path):
    """(former bugs: a string of args was split into characters, a negative timeout ran the script, env values
    that are not strings raised os's TypeError, nproc=0 reached torchrun)"""
    from ubep_torch.testing import run_torchrun
    for kwargs, error in (({"args": "--flag"}, TypeError), ({"timeout_s": -1}, ValueError),
                          ({"nproc": 0}, ValueError), ({"env": {"A": 1}}, TypeError), ({"args": [1]}, TypeError)):
        with pytest.raises(error, match=next(iter(kwargs))):
            run_torchrun("examples/demo.py", **kwargs)
    # a path object and an iterator of arguments (refused, and read empty, by the first version of the checks)
    import pathlib
    script = tmp_path / "args.py"
    script.write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    proc = run_torchrun(pathlib.Path(script), iter(["--x", "1"]), nproc=1, timeout_s=120)
    assert proc.returncode == 0 and "ARGS ['--x', '1']" in proc.stdout, (proc.stdout, proc.stderr)


@pytest.mark.parametrize("extra", [[], ["--rmw-acquire"]])
def test_triton_gpu_checks_run_interpreted(extra):
    """The GPU script's checks, under the interpreter on the CPU (small sizes); ``--rmw-acquire`` defines
    the kernels as with a Triton release without ``tl.atomic_load``."""
    out = _run([sys.executable, "benchmarks/triton_gpu.py", "--device", "cpu", "--small", "--iters", "0", *extra],
               timeout=300)
    lines = [line for line in out.splitlines() if line.rstrip().endswith(("pass", "FAIL")) or " FAIL " in line]
    assert len(lines) >= 15 and all(line.rstrip().endswith("pass") for line in lines), out
    assert "every check passed" in out
