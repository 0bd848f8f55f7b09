# Two entry points for a fresh machine: `make demo` and `make test`. Both run `make install` first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch comes in as the CPU build that lies on these machines; the package itself only needs torch>=2.1.
TORCH_SPEC ?= torch==2.13.0
NPROC  ?= 4
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py ubep_torch/csrc/native.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	@$(PY) -c "from ubep_torch import native_engine as n; print('ubep_torch: C data path built' if n.available() \
	else 'ubep_torch: C data path NOT built (no C compiler?); backend=\"auto\" uses the torch path')"
	touch $(STAMP)

# (torchrun leaves a log directory in TMPDIR: a temporary one, removed afterwards)
demo: install
	@tmp=$$(mktemp -d); OMP_NUM_THREADS=1 TMPDIR=$$tmp $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		examples/demo.py; status=$$?; rm -rf $$tmp; exit $$status

test: install
	$(PY) -m pytest tests

bench: install
	$(PY) benchmarks/bench_buffer.py

lint: install
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check ubep_torch kernels tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
