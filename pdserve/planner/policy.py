"""The planner's policy (a YAML file users tune) and `decide`, its pure decision function.

Method — the SLA planner of NVIDIA Dynamo, after DistServe: size each pool from a performance
model so that the *targets* hold at the observed load, instead of reacting to utilisation.

1. Load of the last interval: request rate x mean input tokens (prefill tokens/s) and
   request rate x mean output tokens (decode tokens/s), each times (1 + headroom).
2. Capacity of one worker at the targets (`PerfModel`): a prefill worker sustains
   `prefill_capacity(input, ttft_target)` tokens/s (M/D/1 queueing keeps the mean TTFT under
   the target); a decode worker batches `decode_capacity(context, itl_target)` sequences while
   its step stays under the ITL target, context = input + output / 2. By Little's law the
   decode pool holds rate x (output - 1) x itl_target sequences at once.
3. Desired workers = ceil(load / capacity) per pool; the prefill:decode ratio follows from
   the two. SLOs violated in the interval add a floor: TTFT p90 over target with a queue ->
   at least one more prefill worker; ITL p90 over target, or KV usage over `kv_high_water`
   -> at least one more decode worker.
4. Bounds, then damping: a scale-up takes effect at once (jumping to the desired count) unless
   one happened less than `scale_up_cooldown_s` ago; a scale-down only once the desired count
   has stayed below the current one for `scale_down_cooldown_s` *and* the pool's utilisation
   at its current size is under `low_water` (hysteresis: load hovering at a boundary never
   makes the pool flap).

`decide` is pure: (policy, perf model, observation, state) -> (decision, new state).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from pdserve.planner.perf_model import PerfModel

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
COST_MODELS = ("measured", "profile")
_TEXT_KEYS = ("name", "cost_model")  # every other key is a number


@dataclass(frozen=True)
class PlannerPolicy:
    """Every knob of the planner; the YAML keys are these field names (see deploy/policies)."""

    name: str = ""
    interval_s: float = 5.0  # how often the planner decides
    ttft_target_s: float = 2.0  # time-to-first-token target (the p90 is checked)
    itl_target_s: float = 0.2  # inter-token latency target (YAML: itl_target_s or tpot_target_s)
    min_prefill_workers: int = 1
    max_prefill_workers: int = 8
    min_decode_workers: int = 1
    max_decode_workers: int = 8
    scale_up_cooldown_s: float = 15.0  # no second scale-up of a pool within this
    scale_down_cooldown_s: float = 120.0  # desired < current this long before a scale-down
    low_water: float = 0.6  # ... and the pool's utilisation under this fraction
    headroom: float = 0.2  # plan for (1 + headroom) x the observed load
    kv_high_water: float = 0.9  # decode KV usage above this asks for one more decode worker
    prefill_cost_per_hour: float = 1.0  # cost of one worker-hour (any currency)
    decode_cost_per_hour: float = 1.0
    # what a worker can do: "measured" (the step-time fits the workers report, which the
    # router places prompts by; the profile's numbers until a worker has measured) or
    # "profile" (`pdserve profile`'s numbers alone)
    cost_model: str = "measured"

    def __post_init__(self) -> None:
        for key in _TEXT_KEYS:
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"{key}: must be a string, got {getattr(self, key)!r}")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model: must be one of {', '.join(COST_MODELS)}, got "
                             f"{self.cost_model!r}")
        for f in fields(self):
            if f.name not in _TEXT_KEYS:
                _check_number(f.name, getattr(self, f.name), f.type == "int")
        for key in ("interval_s", "ttft_target_s", "itl_target_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: must be > 0 seconds, got {getattr(self, key)}")
        for role in ROLES:
            lo, hi = self.bounds(role)
            if lo < 1:
                raise ValueError(f"min_{role}_workers: must be >= 1, got {lo}")
            if hi < lo:
                raise ValueError(f"max_{role}_workers: must be >= min_{role}_workers ({lo}), "
                                 f"got {hi}")
        for key in ("scale_up_cooldown_s", "scale_down_cooldown_s", "headroom",
                    "prefill_cost_per_hour", "decode_cost_per_hour"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("low_water", "kv_high_water"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"{key}: must be a fraction in (0, 1], got {getattr(self, key)}")

    def bounds(self, role: str) -> tuple[int, int]:
        return getattr(self, f"min_{role}_workers"), getattr(self, f"max_{role}_workers")

    def cost_per_hour(self, role: str) -> float:
        return getattr(self, f"{role}_cost_per_hour")


def _check_number(key: str, value: Any, integer: bool) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if integer else "a number"
        raise ValueError(f"{key}: must be {want}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key}: must be finite, got {value!r}")


def load_policy(path: str | Path) -> PlannerPolicy:
    """A `PlannerPolicy` from YAML; missing keys keep their defaults, `name` defaults to the
    file's stem. Unknown keys and bad values raise ValueError naming the key."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of policy keys, got {type(data).__name__}")
    if "tpot_target_s" in data:
        if "itl_target_s" in data:
            raise ValueError(f"{path}: tpot_target_s: give itl_target_s or tpot_target_s, "
                             f"not both")
        data["itl_target_s"] = data.pop("tpot_target_s")
    known = {f.name for f in fields(PlannerPolicy)}
    for key in data:
        if key not in known:
            raise ValueError(f"{path}: unknown key {key!r}; known keys: {sorted(known)}")
    data.setdefault("name", Path(path).stem)
    try:
        return PlannerPolicy(**data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class Observation:
    """One interval of router metrics (rates and means over the interval, p90s of what
    finished in it; nan p90 = no data). Worker counts include workers still starting."""

    time_s: float
    request_rate: float  # requests/s arrived
    mean_input_tokens: float
    mean_output_tokens: float
    ttft_p90_s: float
    itl_p90_s: float
    queue_depth: int  # requests waiting for a prefill worker
    kv_usage: float  # decode KV cache used / total, 0..1
    num_prefill: int
    num_decode: int


@dataclass(frozen=True)
class PlannerState:
    """What the planner remembers between intervals, per role ("prefill", "decode"); a
    missing role means never. Never mutated: `decide` returns a new one."""

    last_scale_up_s: dict[str, float] = field(default_factory=dict)
    last_scale_down_s: dict[str, float] = field(default_factory=dict)
    below_since_s: dict[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    num_prefill: int
    num_decode: int
    reason: str


def load_in_workers(
    policy: PlannerPolicy, perf: PerfModel, obs: Observation, headroom: float
) -> dict[str, float]:
    """The observed load (x (1 + headroom)) in workers at the targets, unrounded."""
    scale = obs.request_rate * (1 + headroom)
    prefill_cap = perf.prefill_capacity(obs.mean_input_tokens, policy.ttft_target_s)
    context = obs.mean_input_tokens + obs.mean_output_tokens / 2
    decode_cap = perf.decode_capacity(context, policy.itl_target_s)
    decode_seqs = scale * max(obs.mean_output_tokens - 1, 0.0) * policy.itl_target_s
    return {"prefill": scale * obs.mean_input_tokens / prefill_cap,
            "decode": decode_seqs / decode_cap}


def desired_workers(policy: PlannerPolicy, perf: PerfModel, obs: Observation) -> dict[str, int]:
    """Workers each pool needs for the observed load at the targets (before bounds/damping)."""
    load = load_in_workers(policy, perf, obs, policy.headroom)
    return {role: math.ceil(n - 1e-9) for role, n in load.items()}


def utilisation(policy: PlannerPolicy, perf: PerfModel, obs: Observation, role: str) -> float:
    """The pool's load at its current size as a fraction of its capacity at the targets
    (headroom excluded; for decode the KV usage counts too)."""
    need = load_in_workers(policy, perf, obs, 0.0)[role]
    current = obs.num_prefill if role == "prefill" else obs.num_decode
    util = need / max(current, 1)
    return max(util, obs.kv_usage) if role == "decode" else util


def _slo_floor(policy: PlannerPolicy, obs: Observation) -> dict[str, tuple[int, str]]:
    """Counts that SLO violations seen directly demand, with why."""
    floors: dict[str, tuple[int, str]] = {}
    if obs.ttft_p90_s > policy.ttft_target_s and obs.queue_depth > 0:  # nan compares False
        floors["prefill"] = (obs.num_prefill + 1, f"TTFT p90 {obs.ttft_p90_s:.3g}s > target "
                                                  f"with {obs.queue_depth} queued")
    if obs.itl_p90_s > policy.itl_target_s:
        floors["decode"] = (obs.num_decode + 1, f"ITL p90 {obs.itl_p90_s:.3g}s > target")
    elif obs.kv_usage > policy.kv_high_water:
        floors["decode"] = (obs.num_decode + 1, f"KV usage {obs.kv_usage:.0%} > high water")
    return floors


def _damp(
    policy: PlannerPolicy, role: str, current: int, desired: int, util: float, now: float,
    state: PlannerState,
) -> tuple[int, str, PlannerState]:
    """Apply cooldowns and hysteresis to one pool: (count, why, new state)."""
    below = dict(state.below_since_s)
    if desired > current:
        below[role] = None
        since = now - state.last_scale_up_s.get(role, -math.inf)
        if since < policy.scale_up_cooldown_s:
            why = f"up to {desired} held: cooldown ({since:.0f}s since last)"
            return current, why, replace(state, below_since_s=below)
        ups = {**state.last_scale_up_s, role: now}
        return desired, f"up to {desired}", replace(state, last_scale_up_s=ups,
                                                     below_since_s=below)
    if desired == current:
        below[role] = None
        return current, "hold", replace(state, below_since_s=below)
    start = below.get(role)
    below[role] = now if start is None else start
    held = now - below[role]
    last_down = now - state.last_scale_down_s.get(role, -math.inf)
    if held < policy.scale_down_cooldown_s or last_down < policy.scale_down_cooldown_s:
        why = f"down to {desired} held: below for {held:.0f}s of {policy.scale_down_cooldown_s:g}s"
        return current, why, replace(state, below_since_s=below)
    if util >= policy.low_water:
        why = f"down to {desired} held: utilisation {util:.0%} >= low water"
        return current, why, replace(state, below_since_s=below)
    below[role] = None
    downs = {**state.last_scale_down_s, role: now}
    return desired, f"down to {desired}", replace(state, last_scale_down_s=downs,
                                                   below_since_s=below)


def decide(
    policy: PlannerPolicy, perf: PerfModel, obs: Observation, state: PlannerState
) -> tuple[Decision, PlannerState]:
    """Worker counts for the next interval and the state to pass next time (see module doc)."""
    desired = desired_workers(policy, perf, obs)
    floors = _slo_floor(policy, obs)
    counts, reasons = {}, []
    for role in ROLES:
        want, why = desired[role], f"model {desired[role]}"
        if role in floors and floors[role][0] > want:
            want, why = floors[role][0], floors[role][1]
        lo, hi = policy.bounds(role)
        want = min(max(want, lo), hi)
        current = obs.num_prefill if role == "prefill" else obs.num_decode
        util = utilisation(policy, perf, obs, role)
        count, action, state = _damp(policy, role, current, want, util, obs.time_s, state)
        counts[role] = min(max(count, lo), hi)  # a pool found outside its bounds moves at once
        reasons.append(f"{role} {current}->{counts[role]} ({why}; {action})")
    decision = Decision(counts["prefill"], counts["decode"], "; ".join(reasons))
    logger.debug("t=%.1f %s", obs.time_s, decision.reason)
    return decision, state
