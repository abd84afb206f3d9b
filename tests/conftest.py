import os
import sys

import torch

# Tests import the repo's packages without an install step.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU the Triton kernels run (on CPU tensors) in Triton's interpreter. It must be
# chosen before triton is first imported, for the whole process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup). Each worker is one
# of the machine's two cores: one intra-op thread keeps them from fighting over both. Tests that
# are about thread counts set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


SPREAD_FILES = ("tests/test_examples.py",)


def pytest_collection_modifyitems(config, items):
    """A test file is one xdist group unless its tests name their own (the docs test groups its
    blocks by page), meant to keep its tests on one worker.

    With pytest 9.2 and pytest-xdist 3.8 no group takes effect: xdist tags a group onto
    ``item._nodeid``, and pytest 9 builds ``nodeid`` from ``item._id`` instead, so
    ``--dist loadgroup`` schedules test by test (a file whose four tests are all marked
    ``xdist_group("g")`` runs on both workers). Expensive fixtures (a trained run, a
    checkpoint) are therefore session-scoped: each worker builds one at most once."""
    import pytest

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::")[0]
            # long, independent subprocess runs (tmp_path outputs, no shared fixture): one
            # group each, so that they spread over both workers
            group = item.nodeid if path in SPREAD_FILES else path
            item.add_marker(pytest.mark.xdist_group(group))
