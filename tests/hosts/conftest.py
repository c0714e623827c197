"""Tests across hosts: Linux network namespaces on one bridge (tests/hosts/netns.py). They need
root and iproute2's `ip`; without either, every test here is skipped, saying which."""

from __future__ import annotations

import pytest

from tests.hosts import netns


@pytest.fixture(scope="package", autouse=True)
def hosts_usable() -> None:
    reason = netns.unusable()
    if reason is not None:
        pytest.skip(f"multi-host tests: {reason}")
