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
