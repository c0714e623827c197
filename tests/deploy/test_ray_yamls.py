"""deploy/ray/*.yaml through Ray's own offline validation and pdserve.launch.deploy_check.

Ray's `prepare_config` + `validate_config` are what `ray up` runs before its first cloud call;
the negative cases pin down which mistakes Ray catches by itself and which only deploy_check
does, so a Ray upgrade that changes that shows up here.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdserve.cli import build_parser
from pdserve.launch.deploy_check import ClusterYamlError, main, validate_cluster_yaml
from pdserve.launch.settings import ServeSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "ray"
CLUSTER, LOCAL = DEPLOY / "cluster.yaml", DEPLOY / "local.yaml"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _ray_validate(config: dict) -> dict:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _rejected_by_deploy_check(config: dict) -> list[str]:
    with pytest.raises(ClusterYamlError) as info:
        validate_cluster_yaml(config)
    return info.value.problems


def _start_settings(config: dict) -> ServeSettings:
    argv = shlex.split(config["metadata"]["pdserve_up"])
    assert argv[:2] == ["pdserve", "up"]
    return ServeSettings.load(build_parser().parse_args(argv[1:]), environ={})


# ---- the shipped files pass ----


@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_ray_accepts_the_shipped_yaml(path):
    prepared = _ray_validate(_load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_deploy_check_accepts_the_shipped_yaml(path):
    check = validate_cluster_yaml(path)
    assert check.settings is not None and check.settings.ray_address == "auto"


@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_start_command_parses_with_pdserve_cli_and_keeps_router_private(path):
    s = _start_settings(_load(path))
    assert s.worker_host == "auto"
    assert s.host == "127.0.0.1"  # router, metrics and bundled Redis stay off the network
    assert s.redis_password is None  # a password comes from the environment, never the YAML


@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_dashboard_binds_loopback_only(path):
    config = _load(path)
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    assert "0.0.0.0" not in path.read_text().split("metadata:")[0]


def test_cluster_yaml_node_types():
    config = _load(CLUSTER)
    types = config["available_node_types"]
    assert config["head_node_type"] == "head" and config["provider"]["region"] == "us-east-1"
    assert types["head"]["resources"] == {"CPU": 0}  # nothing of Ray's lands on the head
    assert types["prefill_h100"]["node_config"]["InstanceType"] == "p5.48xlarge"
    assert types["decode_h200"]["node_config"]["InstanceType"] == "p5en.48xlarge"
    prefill, decode = types["prefill_h100"]["resources"], types["decode_h200"]["resources"]
    assert prefill["prefill"] == prefill["GPU"] and "decode" not in prefill  # a GPU per worker
    assert decode["decode"] >= 1 and "prefill" not in decode
    for t in types.values():
        assert t.get("min_workers", 0) <= t.get("max_workers", 0)
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]


def test_decode_units_are_gpus_over_decode_tp():
    config = _load(CLUSTER)
    decode = config["available_node_types"]["decode_h200"]["resources"]
    assert decode["decode"] * _start_settings(config).decode_tp == decode["GPU"]


def test_local_yaml_gives_each_worker_one_role():
    raw = _load(LOCAL)
    assert raw["provider"]["type"] == "local" and "available_node_types" not in raw
    groups = validate_cluster_yaml(LOCAL).groups
    roles = {g.name: set(g.resources) for g in groups}
    assert roles == {"192.168.0.11": {"prefill"}, "192.168.0.12": {"decode"}}


# ---- what Ray's validation catches by itself ----


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(head_node_type="gpu_head"), "head_node_type"),
        (lambda c: c.update(max_workers=1), "sum of `min_workers`"),
        (lambda c: c.update(pdserve_up="pdserve up"), "Additional properties"),
        (lambda c: c["available_node_types"]["decode_h200"]["resources"].update(decode=0.5),
         "not of type 'integer'"),
    ],
    ids=["bad-head-node-type", "max-below-sum-of-mins", "unknown-top-level-key", "float-resource"],
)
def test_ray_rejects(mutate, message):
    config = _load(CLUSTER)
    mutate(config)
    with pytest.raises(Exception, match=message):
        _ray_validate(config)
    problems = _rejected_by_deploy_check(config)
    assert len(problems) == 1 and problems[0].startswith("Ray:")


def test_ray_rejects_node_types_on_the_local_provider():
    config = _load(LOCAL)
    config["available_node_types"] = {"prefill": {"resources": {"prefill": 1}, "node_config": {}}}
    problems = _rejected_by_deploy_check(config)
    assert problems[0].startswith("Ray:") and "not supported" in problems[0]


# ---- what only deploy_check catches ----


def test_min_workers_above_max_workers_passes_ray_but_not_deploy_check():
    config = _load(CLUSTER)
    config["available_node_types"]["decode_h200"].update(min_workers=3, max_workers=2)
    _ray_validate(config)  # Ray accepts it (and would start only 2)
    problems = _rejected_by_deploy_check(config)
    assert any("decode_h200: min_workers 3 > max_workers 2" in p for p in problems)


def test_missing_role_resource():
    config = _load(CLUSTER)
    del config["available_node_types"]["prefill_h100"]["resources"]["prefill"]
    _ray_validate(config)
    problems = _rejected_by_deploy_check(config)
    assert any("no node carries the `prefill` resource" in p for p in problems)


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--decode-tp 4", "4 decode x --decode-tp 4"),  # decode: 4 no longer fits 8 GPUs
        # ranks may leave the node, but the cluster's GPUs still hold them all
        ("--decode-tp 8 --decode-tp-placement PACK", "4 decode x --decode-tp 8 = 40 GPUs"),
        ("--prefill-workers 9", "asks for 9 prefill workers"),
        ("--decode-threads 32", "--decode-threads = 256 CPU"),
        ("--prefil-workers 2", "unrecognized arguments"),  # the CLI's own parser
        ("--decode-tp 0", "decode_tp must be >= 1"),  # the settings' own validation
        ("--worker-host 127.0.0.1", "--worker-host auto"),
        ("--redis-password hunter2", "PDSERVE_REDIS_PASSWORD"),
    ],
)
def test_start_command_must_fit_the_cluster(flags, message):
    config = _load(CLUSTER)
    config["metadata"]["pdserve_up"] += " " + flags
    _ray_validate(config)  # Ray never reads metadata
    problems = _rejected_by_deploy_check(config)
    assert any(message in p for p in problems), problems


def test_start_command_must_join_the_cluster():
    config = _load(CLUSTER)
    config["metadata"]["pdserve_up"] = config["metadata"]["pdserve_up"].replace(
        "--ray-address auto", "")
    assert any("no --ray-address" in p for p in _rejected_by_deploy_check(config))


def test_settings_in_a_config_file_on_the_head_are_not_read_here():
    config = _load(CLUSTER)
    config["metadata"]["pdserve_up"] = "pdserve up --config /home/ubuntu/pdserve.yaml"
    check = validate_cluster_yaml(config)  # the addresses may be in the file
    assert any("--config /home/ubuntu/pdserve.yaml are not checked" in n for n in check.notes)


def test_local_worker_without_a_role():
    config = _load(LOCAL)
    config["provider"]["worker_ips"].append("192.168.0.13")
    _ray_validate(config)
    problems = _rejected_by_deploy_check(config)
    assert problems == [problems[0]] and "worker 192.168.0.13 has no role" in problems[0]


def test_local_role_for_an_unlisted_address():
    config = _load(LOCAL)
    config["provider"]["worker_ips"] = ["192.168.0.11"]
    problems = _rejected_by_deploy_check(config)
    assert any("gives 192.168.0.12 a role" in p for p in problems)
    assert any("no node carries the `decode` resource" in p for p in problems)


# ---- the command line ----


def test_cli(tmp_path, capsys):
    assert main([str(CLUSTER), str(LOCAL)]) == 0
    assert capsys.readouterr().out.count(": ok: ") == 2
    bad = _load(CLUSTER)
    bad["head_node_type"] = "nope"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main([str(path), str(tmp_path / "missing.yaml")]) == 1
    err = capsys.readouterr().err
    assert "Ray: `head_node_type` must be one of" in err and "can't read it" in err


@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_every_node_starts_ray_with_the_one_mounted_token(path):
    """One auth mode on every node, and the launcher's token on each (docs/deploy.md)."""
    config = _load(path)
    starts = [line for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for line in config[key] if "ray start" in line]
    assert len(starts) == 2
    assert all("RAY_AUTH_MODE=token ray start" in line for line in starts)
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
