"""Check a Ray cluster YAML for pdserve, offline: Ray's own validation, then what Ray leaves out.

    python -m pdserve.launch.deploy_check deploy/ray/cluster.yaml deploy/ray/local.yaml

Ray first, as `ray up` does it up to the first cloud call: `prepare_config` (fills defaults;
for a local provider, turns head_ip / worker_ips into its one node type) and `validate_config`
(the JSON schema, `head_node_type` in `available_node_types`, the global `max_workers` at least
the sum of `min_workers`); then the nodes the cluster starts with are counted, with their
resources. Nothing here touches the network; what `ray up` does next (resource
autodetection, IAM / VPC bootstrap) needs the cloud and is not run here.

Then pdserve's invariants, which Ray does not check:

- each node type's `min_workers <= max_workers` (Ray accepts more and quietly starts `max`);
- some node carries the `decode` resource and, unless the pool is colocated, `prefill`:
  pdserve places its workers by them;
- local provider (one node type: every worker runs the same start command): each worker IP
  gets its role in a `case` arm of `worker_start_ray_commands`, `*" <ip> "*) R='<json>' ;;`,
  as in deploy/ray/local.yaml;
- `metadata.pdserve_up`, the service's start command, when present: it must parse with
  `pdserve up`'s own parser and settings; join the cluster (`--ray-address`) with workers on a
  routable address (`--worker-host`); keep the Redis password off the command line; and its
  pool must fit the nodes the cluster starts with (`pdserve up` checks resources at once, it
  does not wait for the autoscaler): prefill and decode units of the `min_workers` nodes, and
  on CUDA, per node, `prefill + decode x decode_tp <= GPU` (so decode = GPUs / --decode-tp;
  where `--decode-tp-placement` lets a group span nodes, only its rank 0 is bound to the node
  with the `decode` resource, and the cluster's GPUs must hold every rank), the same with CPUs
  and the thread counts when those are given.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import defaults
from pdserve.launch.settings import ServeSettings
from pdserve.launch.worker import DECODE, PREFILL

START_KEY = "pdserve_up"  # under `metadata`, which Ray keeps and never reads
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


@dataclass
class ClusterCheck:
    config: dict[str, Any]  # as Ray prepared it (defaults filled)
    groups: list[NodeGroup]
    settings: ServeSettings | None  # metadata.pdserve_up, parsed
    notes: list[str] = field(default_factory=list)


def validate_cluster_yaml(source: str | Path | Mapping[str, Any]) -> ClusterCheck:
    """Ray's validation, then pdserve's invariants; ClusterYamlError listing every problem."""
    raw, where = _load(source)
    config = _ray_validate(raw, where)
    problems = _min_max_problems(config)
    groups, found = _node_groups(raw, config)
    problems += found
    settings, notes = None, []
    command = (config.get("metadata") or {}).get(START_KEY)
    if command is not None:
        settings, found, notes = _parse_start_command(command)
        problems += found
    problems += _role_problems(groups, settings)
    if settings is not None:
        problems += _fit_problems(groups, settings)
    if problems:
        raise ClusterYamlError(where, problems)
    return ClusterCheck(config, groups, settings, notes)


def _load(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
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


def _ray_validate(raw: dict[str, Any], where: str) -> dict[str, Any]:
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


def _min_max_problems(config: Mapping[str, Any]) -> list[str]:
    """Each node type's `min_workers <= max_workers` (Ray accepts more, quietly starts max)."""
    return [p for name, t in config["available_node_types"].items()
            if (p := _min_max_problem(name, t))]


def _min_max_problem(name: str, node_type: Mapping[str, Any]) -> str | None:
    lo, hi = node_type.get("min_workers", 0), node_type.get("max_workers", 0)
    if lo > hi:
        return (f"pdserve: available_node_types.{name}: min_workers {lo} > max_workers {hi} "
                f"(Ray accepts it and starts only {hi})")
    return None


def _node_groups(raw: Mapping[str, Any],
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


def _parse_start_command(command: str) -> tuple[ServeSettings | None, list[str], list[str]]:
    """metadata.pdserve_up through pdserve's own parser and settings; (settings, problems,
    notes)."""
    where = f"pdserve: metadata.{START_KEY}"
    try:
        argv = shlex.split(command) if isinstance(command, str) else []
    except ValueError as exc:
        return None, [f"{where}: {exc}"], []
    if len(argv) < 2 or Path(argv[0]).name != "pdserve" or argv[1] != "up":
        return None, [f"{where}: expected `pdserve up ...`, got {command!r}"], []
    from pdserve.cli import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv[1:])
    except SystemExit:
        said = stderr.getvalue().strip().splitlines() or ["refused by `pdserve up`'s parser"]
        return None, [f"{where}: {said[-1]}"], []
    notes, config_file = [], args.config
    if config_file:  # a file on the head; what it sets can't be seen from here
        notes.append(f"settings in --config {config_file} are not checked here")
        args.config = None
    try:
        settings = ServeSettings.load(args, environ={})
    except ValueError as exc:
        return None, [f"{where}: {exc}"], notes
    problems = _start_problems(where, argv, settings, bool(config_file))
    return settings, problems, notes + _redis_notes(settings)


def _start_problems(where: str, argv: Sequence[str], s: ServeSettings,
                    has_config_file: bool) -> list[str]:
    problems = []
    # With --config the addresses may come from the file, which stays on the head.
    if s.ray_address is None and not has_config_file:
        problems.append(f"{where}: no --ray-address: it would start a Ray of its own on the "
                        "head instead of joining the cluster (use --ray-address auto)")
    if s.worker_host in defaults.LOOPBACK_HOSTS and not has_config_file:
        problems.append(f"{where}: --worker-host {s.worker_host}: workers on other nodes would "
                        "be out of the router's reach (use --worker-host auto)")
    for flag, instead in (("--redis-password", "set PDSERVE_REDIS_PASSWORD"),
                          ("--api-token", "use --api-token-file (or PDSERVE_API_TOKEN_FILE)")):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            problems.append(f"{where}: {flag} on the command line shows in `ps` and shell "
                            f"history: {instead} instead")
    return problems


def _redis_notes(s: ServeSettings) -> list[str]:
    if s.redis_url is not None or s.worker_host in defaults.LOOPBACK_HOSTS:
        return []
    return ["the bundled Redis listens on the head's node address (where the workers reach it), "
            "with PDSERVE_REDIS_PASSWORD or else a generated password; --redis-url points at a "
            "managed one instead"]


def _role_problems(groups: Sequence[NodeGroup], s: ServeSettings | None) -> list[str]:
    roles = [DECODE] if s is not None and s.mode == "colocated" else [PREFILL, DECODE]
    return [f"pdserve: no node carries the `{role}` resource pdserve places its {role} "
            "workers by" for role in roles
            if not any(g.resources.get(role, 0) > 0 for g in groups)]


def _fit_problems(groups: Sequence[NodeGroup], s: ServeSettings) -> list[str]:
    """The pool of the start command against the nodes the cluster starts with."""
    num_prefill = 0 if s.mode == "colocated" else s.prefill_workers
    problems = []
    for role, need in ((PREFILL, num_prefill), (DECODE, s.decode_workers)):
        have = sum(g.count * g.resources.get(role, 0) for g in groups)
        if need > have:
            problems.append(
                f"pdserve: metadata.{START_KEY} asks for {need} {role} workers, the nodes the "
                f"cluster starts with carry {have:g} `{role}` (raise min_workers: pdserve "
                "does not wait for the autoscaler)")
    for g in groups:
        problems += _node_fit_problems(g, s)
    gpus = sum(g.count * g.resources.get("GPU", 0) for g in groups)
    need = num_prefill + s.decode_workers * s.decode_tp
    if s.device.startswith("cuda") and need > gpus:
        problems.append(f"pdserve: {num_prefill} prefill + {s.decode_workers} decode x "
                        f"--decode-tp {s.decode_tp} = {need} GPUs, the nodes the cluster starts "
                        f"with have {gpus:g}")
    return problems


def _node_fit_problems(g: NodeGroup, s: ServeSettings) -> list[str]:
    """Every role unit a node declares must be usable at once on that node."""
    p, d = g.resources.get(PREFILL, 0), g.resources.get(DECODE, 0)
    # the ranks of a group bound to its `decode` node: all of them, or rank 0 where the
    # placement lets the others go to other nodes
    tp = s.decode_tp if s.decode_tp_placement == "STRICT_PACK" else 1
    uses = []  # (resource, units needed, how they add up)
    if s.device.startswith("cuda"):
        uses.append(("GPU", p + d * tp,
                     f"{p:g} prefill + {d:g} decode x --decode-tp {tp} (one GPU "
                     "each: decode = (GPUs - prefill) / --decode-tp)"))
    if (s.prefill_threads or not p) and (s.decode_threads or not d):
        cpus = p * (s.prefill_threads or 0) + d * tp * (s.decode_threads or 0)
        uses.append(("CPU", cpus, f"{p:g} prefill x --prefill-threads + {d:g} decode x "
                     "--decode-tp x --decode-threads"))
    return [f"pdserve: {g.name}: {how} = {n:g} {key}, the node has {g.resources[key]:g}"
            for key, n, how in uses
            if (p or d) and key in g.resources and n > g.resources[key]]


def _summary(check: ClusterCheck) -> str:
    nodes = ", ".join(f"{g.name} x{g.count}" for g in check.groups if g.count)
    s = check.settings
    if s is None:
        return f"starts with {nodes}"
    return (f"{s.prefill_workers if s.mode != 'colocated' else 0} prefill + {s.decode_workers} "
            f"decode x TP {s.decode_tp} on {nodes}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch.deploy_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="Ray cluster YAML files")
    status = 0
    for path in parser.parse_args(argv).paths:
        try:
            check = validate_cluster_yaml(path)
        except ClusterYamlError as exc:
            print(exc, file=sys.stderr)
            status = 1
            continue
        print(f"{path}: ok: {_summary(check)}")
        for note in check.notes:
            print(f"  note: {note}")
    return status


if __name__ == "__main__":
    sys.exit(main())
