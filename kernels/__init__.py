"""Triton kernels of ubep_torch (installed as ``ubep_torch.kernels``).

* ``data_as_flag``: TFF / DC / SP block writers and pollers, the emulated 512 B atomic write.
* ``dispatch``: the AIV-group send kernel (token group + count group), Token-Reordering, CalCumSum.
* ``combine``: the combine reductions read straight from arrived blocks.
* ``mapper``: quaternary search, expert remapping by logical matrix transposition, AIV slices.

The launchers live in ``ubep_torch.triton_engine`` and next to each kernel. The kernels address the
host shared-memory UGAS heap, so they always run under the Triton interpreter: importing this package (or
any module of it, in any order) defines all four modules with ``TRITON_INTERPRET=1`` set for exactly that
import, then restores the variable, so kernels defined elsewhere (for a GPU) keep compiling normally.
"""
import contextlib
import importlib
import os


def _define_interpreted() -> tuple:
    # Triton's own library (``triton.language.standard``, gluon) is defined as the process configured it;
    # only these kernel modules are defined under the interpreter.
    import triton  # noqa: F401
    import triton.language  # noqa: F401
    with contextlib.suppress(ImportError):
        import triton.experimental.gluon  # noqa: F401
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return tuple(importlib.import_module(f"{__name__}.{m}") for m in ("data_as_flag", "dispatch", "combine",
                                                                            "mapper"))
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


data_as_flag, dispatch, combine, mapper = _define_interpreted()
