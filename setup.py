"""setup.py exists for one reason: the top-level ``kernels/`` folder (Triton kernels only) is installed
as the subpackage ``ubep_torch.kernels``. Everything else is declared in pyproject.toml."""
from setuptools import setup

setup(
    packages=["ubep_torch", "ubep_torch.sim", "ubep_torch.kernels"],
    package_dir={"ubep_torch": "ubep_torch", "ubep_torch.kernels": "kernels"},
)
