"""Test ordering.

Tests marked ``multicore`` launch several simulated replica threads in one
forked process. They run first, while this pytest process has not yet run any
backward itself: after a caller-side backward, several replica threads can crash
natively on the autograd state they inherit (a documented limit, see
xla_utils.runtime._replica_main). Within each group the file order is kept.
"""


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("multicore") is None)
