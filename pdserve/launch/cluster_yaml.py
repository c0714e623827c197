"""A Ray cluster YAML as Ray reads it, offline, and the nodes it starts with.

`load` reads it; `ray_validate` runs Ray's own `prepare_config` (fills defaults; for a local
provider, turns head_ip / worker_ips into its one node type) and `validate_config` (the JSON
schema, `head_node_type` in `available_node_types`, the global `max_workers` at least the sum
of `min_workers`), as `ray up` does up to its first cloud call; `node_groups` counts the nodes
and their resources. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.launch.worker import DECODE, PREFILL

_CASE_ARM = re.compile(r"""\*"\s*([^"\s]+)\s*"\*\)\s*R='(\{[^']*\})'""")


class ClusterYamlError(ValueError):
    """The config is refused; `problems` says why (`Ray:` ones come from Ray's validation)."""

    def __init__(self, where: str, problems: Sequence[str]) -> None:
        self.where, self.problems = where, list(problems)
        super().__init__(f"{where}:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class NodeGroup:
    """Nodes the cluster starts with: `count` of them, each with `resources` (as declared)."""

    name: str
    count: int
    resources: Mapping[str, float]


def load(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The raw config and what to call it in errors (its path)."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), "<config>"
    import yaml

    where = str(source)
    try:
        raw = yaml.safe_load(Path(source).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ClusterYamlError(where, [f"can't read it: {exc}"]) from exc
    if not isinstance(raw, dict):
        raise ClusterYamlError(where, ["expected a mapping (a Ray cluster config)"])
    return raw, where


def ray_validate(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Ray's prepare_config + validate_config, their errors as a ClusterYamlError."""
    import click
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        with _quiet_ray():  # its errors come back in the exception; its INFO lines are noise
            config = prepare_config(copy.deepcopy(raw))
            validate_config(config)
    except jsonschema.ValidationError as exc:
        at = "/".join(map(str, exc.absolute_path)) or "top level"
        raise ClusterYamlError(where, [f"Ray: {exc.message} (at {at})"]) from exc
    except click.ClickException as exc:
        raise ClusterYamlError(where, [f"Ray: {exc.format_message()}"]) from exc
    except KeyError as exc:
        raise ClusterYamlError(where, [f"Ray: missing key {exc}"]) from exc
    except (ValueError, RuntimeError) as exc:
        raise ClusterYamlError(where, [f"Ray: {exc}"]) from exc
    return config


@contextlib.contextmanager
def _quiet_ray():
    util_logger = logging.getLogger("ray.autoscaler._private.util")
    saved = util_logger.level
    util_logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        util_logger.setLevel(saved)


def min_max_problems(config: Mapping[str, Any]) -> list[str]:
    """Each node type's `min_workers <= max_workers` (Ray accepts more, quietly starts max)."""
    return [p for name, t in config["available_node_types"].items()
            if (p := _min_max_problem(name, t))]


def _min_max_problem(name: str, node_type: Mapping[str, Any]) -> str | None:
    lo, hi = node_type.get("min_workers", 0), node_type.get("max_workers", 0)
    if lo > hi:
        return (f"pdserve: available_node_types.{name}: min_workers {lo} > max_workers {hi} "
                f"(Ray accepts it and starts only {hi})")
    return None


def node_groups(raw: Mapping[str, Any],
                config: Mapping[str, Any]) -> tuple[list[NodeGroup], list[str]]:
    """The nodes the cluster starts with, and what keeps them from being known."""
    if config["provider"]["type"] == "local":
        return _local_groups(raw)
    return _typed_groups(config)


def _typed_groups(config: Mapping[str, Any]) -> tuple[list[NodeGroup], list[str]]:
    """Every node type, counted as the cluster starts: the head once, workers min_workers."""
    head = config["head_node_type"]
    return [NodeGroup(name, 1 if name == head else t.get("min_workers", 0), t["resources"])
            for name, t in config["available_node_types"].items()], []


def _local_groups(raw: Mapping[str, Any]) -> tuple[list[NodeGroup], list[str]]:
    """Local provider: each worker IP's resources, from the `case` in its start command."""
    commands = " ".join(raw.get("worker_start_ray_commands") or [])
    roles, problems = {}, []
    for ip, text in _CASE_ARM.findall(commands):
        try:
            roles[ip] = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append(f"pdserve: worker_start_ray_commands: resources of {ip}: {exc}")
    ips = [str(ip) for ip in raw["provider"].get("worker_ips", [])]
    for ip in ips:
        if ip not in roles:
            problems.append(f"pdserve: worker {ip} has no role: add "
                            f"`*\" {ip} \"*) R='{{\"{PREFILL}\": 1}}' ;;` (or {DECODE}) to the "
                            "`case` in worker_start_ray_commands")
    problems += [f"pdserve: worker_start_ray_commands gives {ip} a role, but worker_ips "
                 "does not list it" for ip in roles if ip not in ips]
    return [NodeGroup(ip, 1, roles.get(ip, {})) for ip in ips], problems
