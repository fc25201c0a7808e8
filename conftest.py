"""Test-session settings: they must be in place before torch is imported anywhere."""

import os

# One thread per process: on 2 shared cores, 2 threads was 2-30x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# No network at test time: Hugging Face loaders must use local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

# Hypothesis keeps nothing in the working directory: by default it writes .hypothesis/ there
# (an example database it replays, a constants cache), so a run would depend on an earlier one's
# leftovers. Its home is a folder of this session's own, removed at exit; failures worth keeping
# are pinned with @example in the test.
import atexit
import shutil
import tempfile

try:  # the vLLM stage's environment has no Hypothesis: nothing to configure there
    from hypothesis import settings
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:
    settings = None
if settings is not None:
    _HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="rlblocks-hypothesis-")
    atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)
    set_hypothesis_home_dir(_HYPOTHESIS_HOME)
    settings.register_profile("rlblocks", database=None)
    settings.load_profile("rlblocks")
