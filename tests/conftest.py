"""Session-wide test environment: every cache the suite fills lives in one temporary directory.

Set at import, before any test module imports `datasets` or `huggingface_hub` (both read these
variables once, at their own import); torchrun subprocesses inherit them through os.environ.
A DFLASH_MP_CACHE set by the caller is kept: it is an explicit choice (e.g. to reuse the learned
target between runs), never the user's ~/.cache by default.
"""

import atexit
import os
import shutil
import tempfile

import pytest

_ROOT = tempfile.mkdtemp(prefix="dflash_mp-tests-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)

os.environ["HF_HOME"] = os.path.join(_ROOT, "hf")
os.environ["HF_DATASETS_CACHE"] = os.path.join(_ROOT, "hf", "datasets")
os.environ.setdefault("DFLASH_MP_CACHE", os.path.join(_ROOT, "dflash_mp"))
for _var in ("HF_HOME", "HF_DATASETS_CACHE", "DFLASH_MP_CACHE"):
    os.makedirs(os.environ[_var], exist_ok=True)


@pytest.fixture(autouse=True)
def _no_inherited_progress_switch(monkeypatch):
    """Tests that build a role in this process run `metrics.quiet_console`, which may turn datasets'
    bars off for the process through HF_DATASETS_DISABLE_PROGRESS_BARS. Each test starts without it
    (and it is undone after), so a job a test launches shows only the switches the job sets itself."""
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
