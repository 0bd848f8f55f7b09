"""Triton kernels of ubep_torch (installed as ``ubep_torch.kernels``).

* ``data_as_flag``: TFF / DC / SP block writers and pollers, the emulated 512 B atomic write.
* ``dispatch``: the AIV-group send kernel (token group + count group), Token-Reordering, CalCumSum.
* ``combine``: the combine reductions read straight from arrived blocks.
* ``mapper``: quaternary search, expert remapping by logical matrix transposition, AIV slices.

Import them through ``ubep_torch.triton_engine``, which enables the Triton interpreter for exactly
these modules (see its docstring); the launchers live there and next to each kernel.
"""
