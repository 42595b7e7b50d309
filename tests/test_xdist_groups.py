"""make test's xdist groups reach xdist's scheduler (tests/conftest.py,
``pytest_collection_modifyitems``): under ``--dist loadgroup`` a test marked
``xdist_group(NAME)`` has a node id ending in ``@NAME``, which is all the scheduler sees of its
group.  Under pytest 9 with xdist 3.8 no suffix was set, so the namespace-cluster files ran on
both workers, two clusters at once (issue 38)."""
from __future__ import annotations

import pytest


@pytest.mark.xdist_group("namespace-cluster")
def test_a_marked_test_tells_the_scheduler_its_group(request):
    marks = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert marks == ["namespace-cluster"]
    if getattr(request.config.option, "loadgroup", False):   # an xdist worker, loadgroup
        assert request.node.nodeid.endswith("::test_a_marked_test_tells_the_scheduler_its_group"
                                             "@namespace-cluster"), request.node.nodeid
    else:
        assert "@" not in request.node.nodeid, request.node.nodeid


def test_the_namespace_cluster_files_share_one_group(request):
    """The files conftest.py groups by name (one namespace cluster at a time) get the mark."""
    from conftest import NAMESPACE_CLUSTER_FILES
    items = [i for i in request.session.items if i.path.name in NAMESPACE_CLUSTER_FILES]
    assert all("namespace-cluster" in [m.args[0] for m in i.iter_markers("xdist_group")]
               for i in items), [i.nodeid for i in items]


def test_a_tests_own_group_wins_over_its_modules(request):
    """test_cluster_faults.py is one group, its vanished-host test the namespace-cluster one
    (it uses that group's cluster): the node id carries the test's own."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only under xdist's --dist loadgroup (make test)")
    ids = [i.nodeid for i in request.session.items
           if i.name == "test_a_vanished_pool_host_leaves_the_ring_shown_and_rests"]
    assert all(i.endswith("@namespace-cluster") for i in ids), ids
