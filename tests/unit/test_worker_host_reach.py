"""`unreachable_worker_host`: a loopback or wildcard worker host is refused once any node of the
Ray cluster is not on loopback (issue 39, multi-node set-up); one machine keeps it."""

from __future__ import annotations

import pytest

from pdserve.launch.ray_runtime import unreachable_worker_host

ONE_MACHINE = ["127.0.0.1", "127.0.0.1"]
TWO_MACHINES = ["10.0.0.1", "127.0.0.1", "10.0.0.2"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "::"])
def test_loopback_and_wildcard_hosts_serve_one_machine(host):
    assert unreachable_worker_host(host, ONE_MACHINE) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "::"])
def test_loopback_and_wildcard_hosts_are_refused_across_machines(host):
    problem = unreachable_worker_host(host, TWO_MACHINES)
    assert problem is not None
    assert f"worker_host {host!r}" in problem and "--worker-host auto" in problem
    assert "10.0.0.1, 10.0.0.2" in problem  # the nodes it could not reach, once each


@pytest.mark.parametrize("host", ["auto", "10.0.0.1", "fd00::5"])
def test_a_routable_host_is_the_operator_s_choice(host):
    assert unreachable_worker_host(host, TWO_MACHINES) is None
