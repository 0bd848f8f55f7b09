"""setup.py exists for two reasons: the top-level ``kernels/`` folder (Triton kernels only) is installed
as the subpackage ``ubep_torch.kernels``, and the C data path ``ubep_torch._native`` is compiled. The C
module is optional: without a C compiler the package installs without it and ``backend="auto"`` uses the
torch path. Everything else is declared in pyproject.toml."""
from setuptools import Extension, setup

native = Extension(
    "ubep_torch._native",
    sources=["ubep_torch/csrc/native.c"],
    # no fused multiply-add: every backend must round the same products and sums
    extra_compile_args=["-O3", "-ffp-contract=off", "-std=c11"],
    optional=True,
)

setup(
    packages=["ubep_torch", "ubep_torch.sim", "ubep_torch.kernels"],
    package_dir={"ubep_torch": "ubep_torch", "ubep_torch.kernels": "kernels"},
    ext_modules=[native],
)
