# torch is pinned here, not in pyproject: on a CPU machine 2.13.0 is a local CPU wheel, while a loose
# requirement would pull a multi-GB CUDA build. GPU hosts keep the torch they have (>= 2.11).
PYTHON ?= python3
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.0
# Test processes (pytest-xdist; whole files to a worker, so a module's fixtures are built once). Most
# multi-process tests wait on their ranks more than they compute: two workers fill 2 cores.
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
PYTEST = $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: install test test-fast demo lint clean

install:
	$(PYTHON) -m pip install $(TORCH)
	$(PYTHON) -m pip install -e ".[dev]"
	# The public DFlash inference code, to test that exports load in it. --no-deps: its metadata pins
	# exact versions of tqdm/datasets/requests that the code itself does not need.
	$(PYTHON) -m pip install --no-deps dflash==0.1.0
	# Triton, for the tests alone: its interpreter runs the project's GPU kernels on CPU in
	# subprocesses (tests/triton_interp.py); the suite's own process keeps the plain CPU install.
	$(PYTHON) -m pip install --no-deps --upgrade --target build/triton-interp $(TRITON)

test:
	$(PYTEST)

test-fast:
	$(PYTEST) -m "not slow"

demo:
	torchrun --nproc-per-node 3 -m dflash_mp.main

clean:
	rm -rf outputs .pytest_cache
