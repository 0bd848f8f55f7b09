"""The README's usage example runs as written, on 2 torchrun ranks."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_example_runs(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, UBEP_SHM_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ubep-")]
