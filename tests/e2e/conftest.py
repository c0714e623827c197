"""A real two-node Ray cluster: the head carries "prefill", the second node "decode"."""

from __future__ import annotations

import pytest

from tests.ray_cluster import local_cluster


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster([(2, {"prefill": 2}), (4, {"decode": 2})]) as cluster:
        yield cluster
