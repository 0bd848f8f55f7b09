"""The README's usage example runs as written, on 2 torchrun ranks."""
import glob
import os
import re
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_example_runs(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    from ubep_torch.testing import run_torchrun
    logs = os.path.join(tempfile.gettempdir(), "torchelastic_*")
    before = set(glob.glob(logs))
    proc = run_torchrun(str(script), nproc=2, timeout_s=180, env={"PYTHONPATH": ROOT, "UBEP_SHM_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")]
    assert set(glob.glob(logs)) <= before, "torchrun's log directory was left behind"


def test_readme_rank_pool_example_runs(tmp_path):
    """The README's second example (RankPool, 4 ranks, no torchrun) runs as written and says it is correct."""
    import subprocess
    import sys
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2, "README has no RankPool example"
    script = tmp_path / "pool_example.py"
    script.write_text(blocks[1])
    env = dict(os.environ, PYTHONPATH=ROOT, UBEP_SHM_DIR=str(tmp_path))
    env.pop("UBEP_POOL_START_METHOD", None)       # (as a user runs it: spawned ranks, not the test suite's)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and all(line.endswith("combine correct: True") for line in lines), proc.stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")]
