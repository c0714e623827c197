"""--router-processes: the default by cores, the setting's refusals, the spec a child gets."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.launch.router_front import RouterSpec
from pdserve.launch.router_processes import (
    available_cpus,
    cpu_quota,
    default_router_processes,
)
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings
from pdserve.router.config import RouterConfig
from pdserve.router.validation import RequestLimits
from pdserve.tls import TLSFiles


@pytest.mark.parametrize("cpus,routers", [
    (1, 1), (2, 1), (15, 1), (16, 1), (31, 1), (32, 2), (64, 4), (127, 7), (128, 8), (512, 8),
])
def test_one_router_per_16_cores_from_1_to_8(cpus, routers):
    assert default_router_processes(cpus) == routers


@pytest.mark.parametrize("cpu_max,cores", [
    ("max 100000\n", None), ("400000 100000\n", 4.0), ("150000 100000", 1.5), ("", None),
])
def test_a_cgroup_cpu_limit_is_read_from_cpu_max(cpu_max, cores):
    assert cpu_quota(cpu_max) == cores


def test_available_cpus_is_capped_by_the_cgroup_quota(tmp_path):
    import os

    affinity = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("50000 100000\n")  # half a core: still one router
    assert available_cpus(str(limit)) == 1
    limit.write_text("max 100000\n")
    assert available_cpus(str(limit)) == affinity
    assert available_cpus(str(tmp_path / "absent")) == affinity


def test_zero_router_processes_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="router_processes must be >= 1"):
        ServeSettings(router_processes=0)
    assert ServeSettings(router_processes=3).router_processes == 3
    assert ServeSettings().router_processes is None  # by the cores


def test_the_flag_env_and_yaml_reach_the_setting(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    ServeSettings.add_arguments(parser)
    args = parser.parse_args(["--router-processes", "4"])
    assert ServeSettings.load(args, environ={}).router_processes == 4
    assert ServeSettings.load(parser.parse_args([]),
                              environ={"PDSERVE_ROUTER_PROCESSES": "2"}).router_processes == 2
    config = tmp_path / "c.yaml"
    config.write_text("router_processes: 5\n")
    assert ServeSettings.load(parser.parse_args(["--config", str(config)]),
                              environ={}).router_processes == 5


def test_spec_goes_through_json_whole_and_hides_its_secrets_from_repr(tmp_path):
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    tls = TLSFiles(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "ca.pem"))
    spec = RouterSpec(
        model_path="/m", model_name="m", dtype="auto", max_model_len=512,
        config=RouterConfig(block_size=32, colocated=True), limits=RequestLimits(3, 9, 4),
        host="127.0.0.1", port=5001, http_port=5002, grpc_timeout_s=7.0, http_timeout_s=8.0,
        grpc_server="grpcio",
        tls=tls, worker_tls=None, redis_url="redis://:pw-in-url@h:1/0", redis_namespace="ns",
        session_ttl_s=9, session_max_tokens=99, max_sessions_per_tenant=5,
        redis_password="redis-pw", api_tokens=("tok-a", "tok-b"))
    assert RouterSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    for secret in ("tok-a", "redis-pw", "pw-in-url"):
        assert secret not in repr(spec)


class _Records:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    async def stop(self) -> None:
        self.log.append(self.name)


def test_service_stops_the_other_router_processes_before_its_own_router():
    service, stopped = Service(ServeSettings()), []
    service.router_processes = _Records(stopped, "router processes")
    service.http = _Records(stopped, "http")
    service.router_server = _Records(stopped, "router")
    asyncio.run(asyncio.wait_for(service.stop(), 5))
    assert stopped == ["router processes", "http", "router"]
