"""`metadata.pdserve_up`, the service's start command in a Ray cluster YAML, checked offline.

It must parse with pdserve's own CLI and settings; join the cluster (`--ray-address`) with
workers on a routable address (`--worker-host`); keep the Redis password off the command
line; and its pool must fit the nodes the cluster starts with (`pdserve up` checks resources
at once, it does not wait for the autoscaler): prefill and decode units of the `min_workers`
nodes, and on CUDA, per node, `prefill + decode x decode_tp <= GPU` (so decode = GPUs /
--decode-tp), the same with CPUs and the thread counts when those are given.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from collections.abc import Sequence
from pathlib import Path

from pdserve import defaults
from pdserve.launch.cluster_yaml import NodeGroup
from pdserve.launch.settings import ServeSettings
from pdserve.launch.worker import DECODE, PREFILL

START_KEY = "pdserve_up"  # under `metadata`, which Ray keeps and never reads


def parse_start_command(command: str) -> tuple[ServeSettings | None, list[str], list[str]]:
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


def role_problems(groups: Sequence[NodeGroup], s: ServeSettings | None) -> list[str]:
    roles = [DECODE] if s is not None and s.mode == "colocated" else [PREFILL, DECODE]
    return [f"pdserve: no node carries the `{role}` resource pdserve places its {role} "
            "workers by" for role in roles
            if not any(g.resources.get(role, 0) > 0 for g in groups)]


def fit_problems(groups: Sequence[NodeGroup], s: ServeSettings) -> list[str]:
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
    return problems


def _node_fit_problems(g: NodeGroup, s: ServeSettings) -> list[str]:
    """Every role unit a node declares must be usable at once on that node."""
    p, d = g.resources.get(PREFILL, 0), g.resources.get(DECODE, 0)
    uses = []  # (resource, units needed, how they add up)
    if s.device.startswith("cuda"):
        uses.append(("GPU", p + d * s.decode_tp,
                     f"{p:g} prefill + {d:g} decode x --decode-tp {s.decode_tp} (one GPU "
                     "each: decode = (GPUs - prefill) / --decode-tp)"))
    if (s.prefill_threads or not p) and (s.decode_threads or not d):
        cpus = p * (s.prefill_threads or 0) + d * s.decode_tp * (s.decode_threads or 0)
        uses.append(("CPU", cpus, f"{p:g} prefill x --prefill-threads + {d:g} decode x "
                     "--decode-tp x --decode-threads"))
    return [f"pdserve: {g.name}: {how} = {n:g} {key}, the node has {g.resources[key]:g}"
            for key, n, how in uses
            if (p or d) and key in g.resources and n > g.resources[key]]
