"""Check a Ray cluster YAML for pdserve, offline: Ray's own validation, then what Ray leaves out.

    python -m pdserve.launch.deploy_check deploy/ray/cluster.yaml deploy/ray/local.yaml

Ray first, as `ray up` does it up to the first cloud call (`cluster_yaml`). Neither step
touches the network; what `ray up` does next (resource autodetection, IAM / VPC bootstrap)
needs the cloud and is not run here.

Then pdserve's invariants, which Ray does not check:

- each node type's `min_workers <= max_workers` (Ray accepts more and quietly starts `max`);
- some node carries the `decode` resource and, unless the pool is colocated, `prefill`:
  pdserve places its workers by them;
- local provider (one node type: every worker runs the same start command): each worker IP
  gets its role in a `case` arm of `worker_start_ray_commands`, `*" <ip> "*) R='<json>' ;;`,
  as in deploy/ray/local.yaml;
- `metadata.pdserve_up`, the service's start command, when present (`start_command`): it
  parses with `pdserve up`'s own parser, joins the cluster with routable workers, keeps the
  Redis password off the command line, and its pool fits the nodes the cluster starts with.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.launch import cluster_yaml, start_command
from pdserve.launch.cluster_yaml import ClusterYamlError, NodeGroup
from pdserve.launch.settings import ServeSettings


@dataclass
class ClusterCheck:
    config: dict[str, Any]  # as Ray prepared it (defaults filled)
    groups: list[NodeGroup]
    settings: ServeSettings | None  # metadata.pdserve_up, parsed
    notes: list[str] = field(default_factory=list)


def validate_cluster_yaml(source: str | Path | Mapping[str, Any]) -> ClusterCheck:
    """Ray's validation, then pdserve's invariants; ClusterYamlError listing every problem."""
    raw, where = cluster_yaml.load(source)
    config = cluster_yaml.ray_validate(raw, where)
    problems = cluster_yaml.min_max_problems(config)
    groups, found = cluster_yaml.node_groups(raw, config)
    problems += found
    settings, notes = None, []
    command = (config.get("metadata") or {}).get(start_command.START_KEY)
    if command is not None:
        settings, found, notes = start_command.parse_start_command(command)
        problems += found
    problems += start_command.role_problems(groups, settings)
    if settings is not None:
        problems += start_command.fit_problems(groups, settings)
    if problems:
        raise ClusterYamlError(where, problems)
    return ClusterCheck(config, groups, settings, notes)


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
