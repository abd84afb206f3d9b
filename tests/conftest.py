import collections
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
    blocks by page), so that its tests run on one worker, in order, sharing its fixtures.

    pytest-xdist 3.8 tags a test's group onto ``item._nodeid``, which pytest 9 no longer
    reads (it builds ``nodeid`` from ``item._id``), so ``--dist loadgroup`` would schedule
    test by test; :func:`_tag_group` puts the tag where pytest reads it."""
    import pytest

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::")[0]
            # long, independent subprocess runs (tmp_path outputs, no shared fixture): one
            # group each, so that they spread over both workers
            group = item.nodeid if path in SPREAD_FILES else path
            item.add_marker(pytest.mark.xdist_group(group))
    # Slowest groups first: xdist hands a worker the next group whenever it finishes one, so
    # the long groups start early and the many short ones fill in at the end, instead of one
    # worker running a long group alone at the end. (A stable sort: each group keeps its order.)
    slow_tests = collections.Counter(_group(item) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_tests[_group(item)])
    if getattr(config.option, "dist", None) == "loadgroup" or getattr(config.option,
                                                                        "loadgroup", False):
        for item in items:
            _tag_group(item)


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _tag_group(item) -> None:
    """``nodeid@group``, as xdist's loadgroup scheduler expects, where this pytest reads it."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # an older pytest: xdist's own tag takes effect
        return
    if "@" in item.nodeid or not hasattr(item, "_id"):
        return
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
