"""ServeSettings: every knob of `pdserve up`, each with a flag, an env var and a config key.

One table (the dataclass fields) drives all three: the field `max_num_seqs` is the flag
`--max-num-seqs`, the variable `PDSERVE_MAX_NUM_SEQS` and the YAML key `max_num_seqs`.
Precedence: flag > environment > config file (`--config` / `PDSERVE_CONFIG`) > default.

Why one file: the table is the one place a setting is declared, documented and checked;
split, a setting could be declared twice or checked in neither half.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import defaults
from pdserve.bench.metrics import SLO, parse_slo
from pdserve.engine.config import CacheConfig, LoRAConfig, check_cuda_graph_sizes
from pdserve.engine.spec.config import parse_speculative_config
from pdserve.redis_keys import DEFAULT_NAMESPACE
from pdserve.router.config import GRPC_SERVERS, PREFILL_PLACEMENTS
from pdserve.router.lora_adapters import parse_lora_modules
from pdserve.router.reasoning import check_parser
from pdserve.router.tools import TOOL_PARSERS
from pdserve.tls import TLSFiles
from pdserve.worker_grpc import worker_tls

ENV_PREFIX = "PDSERVE_"


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ServeSettings:
    # model and engine (each worker)
    model: str = _opt("smollm2-135m", "HF model directory or a bundled name")
    dtype: str = _opt("auto", "weights and KV: auto (the checkpoint's) | float32 | bfloat16")
    max_model_len: int | None = _opt(None, "context window (default: the model's)")
    block_size: int = _opt(16, "tokens per KV block")
    kv_cache_memory_bytes: int = _opt(1 << 30, "KV cache budget per worker, bytes")
    num_kv_blocks: int | None = _opt(None, "KV blocks per worker (overrides the budget)")
    kv_cache_dtype: str = _opt("auto", "auto | int8")
    quantization: str | None = _opt(
        None, "weight-only quantized linears: int8 | int4 (quantized at load) | gguf (the model "
        "directory's GGUF as is) | gptq | awq (default: as the checkpoint is)")
    quantization_group_size: int = _opt(0, "input columns per scale for int4/int8 (0: int4 "
                                        "32, int8 one per output channel)")
    enable_prefix_caching: bool = _opt(True, "reuse KV of shared prompt prefixes")
    kv_host_bytes: int = _opt(
        0, "KV tier in host memory per worker, bytes: prefix-cache blocks the device pool "
        "evicts stay there and load back instead of being recomputed (0: off; needs "
        "enable_prefix_caching; a decode_tp group's ranks each keep their shard)")
    kv_disk_path: str | None = _opt(
        None, "KV tier on local disk below the host tier: a directory on each worker's node, "
        "each worker using its own subdirectory <path>/<worker id> (with kv_disk_bytes and "
        "kv_host_bytes)")
    kv_disk_bytes: int = _opt(0, "disk KV tier per worker, bytes (with kv_disk_path)")
    max_num_seqs: int = _opt(64, "sequences per engine step")
    max_num_batched_tokens: int = _opt(2048, "tokens per engine step (chunked prefill)")
    prefill_step_ms: float = _opt(
        200.0, "prefill workers size each step to last about this long, from a fit of their "
        "measured step times, so the first prompts of a burst are not held behind the rest "
        "(0: no target, max_num_batched_tokens alone)")
    scheduling_policy: str = _opt(
        "srpt", "prefill workers' queue order: srpt (shortest remaining prompt first, aged "
        "so that none starves) | fcfs")
    device: str = _opt("cpu", "torch device of the workers: cpu | cuda")
    kernel_backend: str | None = _opt(None, "cpu | torch | triton (default: by device)")
    enforce_eager: bool = _opt(
        False, "decode steps run eagerly: no CUDA graphs captured (vLLM's); graphs are only "
        "ever used on CUDA, and prefill workers never capture them")
    cuda_graph_sizes: str | None = _opt(
        None, "decode batch sizes captured as CUDA graphs, e.g. '1 2 4 8 16' (default: 1, 2, "
        "4, then every multiple of 8 up to max_num_seqs)")
    seed: int = _opt(0, "engine seed for unseeded sampling")
    speculative_config: str | None = _opt(
        None, "speculative decoding in the decode (and colocated) workers, JSON as vLLM's: "
        '{"method": "ngram", "num_speculative_tokens": 4} ("draft": with "model": DIR); '
        "prefill workers never speculate; a YAML file may give the mapping itself", json=True)
    enable_lora: bool = _opt(False, "serve LoRA adapters over the base model (vLLM's)")
    lora_modules: str | None = _opt(
        None, "LoRA adapters served from the start: name=path entries (spaces or commas "
        "between), or a JSON object {name: path}; a client picks one by the request's model; "
        "each path is a PEFT directory on every node (turns enable_lora on)", json=True)
    max_loras: int = _opt(1, "LoRA adapters one engine step may run (device slots)")
    max_lora_rank: int = _opt(16, "the highest LoRA rank served")
    max_cpu_loras: int | None = _opt(
        None, "LoRA adapters each worker keeps in host memory (default: max_loras)")
    # pools
    mode: str = _opt("disaggregated", "disaggregated | colocated (each decode worker prefills "
                     "its own prompts; no prefill pool: the baseline to compare with)")
    prefill_workers: int = _opt(1, "prefill workers")
    decode_workers: int = _opt(1, "decode worker groups")
    decode_tp: int = _opt(1, "tensor-parallel ranks per decode group")
    decode_tp_placement: str = _opt(
        "STRICT_PACK", "where a decode group's ranks go, as Ray places them: STRICT_PACK (one "
        "node) | PACK (one node where one holds them, else several) | SPREAD | STRICT_SPREAD "
        "(a node each); across nodes, activations cross the network every layer")
    enable_expert_parallel: bool = _opt(
        False, "MoE models: each decode rank holds num_experts / decode_tp experts whole "
        "(expert parallelism) instead of a slice of every expert")
    prefill_threads: int | None = _opt(None, "torch threads per prefill worker")
    decode_threads: int | None = _opt(None, "torch threads per decode rank")
    planner_policy: str | None = _opt(
        None, "autoscaling policy YAML (deploy/policies/); off when unset"
    )
    planner_perf: str | None = _opt(None, "performance model JSON from `pdserve profile`")
    # router
    host: str = _opt(defaults.HOST, "address the router, metrics and bundled Redis bind")
    worker_host: str = _opt(
        defaults.HOST, "address workers bind; 'auto': each node's IP (multi-node clusters)"
    )
    port: int = _opt(defaults.ROUTER_PORT, "router gRPC port (0: any free port)")
    metrics_port: int = _opt(defaults.METRICS_PORT,
                             "Prometheus metrics HTTP port (0: any free port)")
    http_port: int = _opt(defaults.HTTP_PORT, "OpenAI-compatible HTTP API port (0: off)")
    http_timeout_s: float = _opt(defaults.HTTP_TIMEOUT_S,
                                 "longest an HTTP request may run (caps a client's timeout)")
    grpc_timeout_s: float = _opt(defaults.GRPC_TIMEOUT_S,
                                 "longest a gRPC Generate may run (caps a client's deadline)")
    grpc_server: str = _opt(
        "h2", "the public gRPC front: h2 (the router's own HTTP/2 server on its event loop: "
        "a message is a frame in the connection's next write) | grpcio (grpc.aio's server: "
        "grpc's C core, about 30-50 us of CPU more per streamed message)")
    router_processes: int | None = _opt(
        None, "router processes sharing the gRPC and HTTP ports and the workers (SO_REUSEPORT; "
        "default: one per 16 cores this process may use, 1 to 8)")
    tls_cert: str | None = _opt(None, "PEM certificate (chain) of the gRPC and HTTP fronts: "
                                "TLS on when set, with --tls-key")
    tls_key: str | None = _opt(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = _opt(
        None, "PEM CA bundle: clients of both fronts must present a certificate it signed")
    # worker plane (router <-> workers gRPC): mutual TLS on top of the cluster secret
    cluster_tls_cert: str | None = _opt(
        None, "PEM certificate of the worker plane (mutual TLS, with cluster_tls_key and "
        "cluster_tls_ca): DNS name pdserve-worker, server and client auth; same path on "
        "every node")
    cluster_tls_key: str | None = _opt(None, "PEM private key of --cluster-tls-cert")
    cluster_tls_ca: str | None = _opt(
        None, "PEM CA bundle that signed --cluster-tls-cert (workers and router verify it)")
    tool_call_parser: str = _opt(
        "hermes", "how the model writes tool calls (tool_choice auto): hermes (Hermes, Qwen "
        "2.5 / 3) | llama3_json (Llama 3.1 / 3.2) | openai (gpt-oss's harmony messages to "
        "functions.NAME; needs --reasoning-parser openai_gptoss)")
    reasoning_parser: str | None = _opt(
        None, "split a chat reply's <think>...</think> reasoning from its answer "
        "(reasoning_content apart from content, tool calls read from the answer): deepseek_r1 "
        "(DeepSeek R1, QwQ: a reply that never opens <think> reasons up to </think>) | qwen3 "
        "(reasoning only in a reply that opens <think>) | openai_gptoss (gpt-oss's harmony "
        "channels: analysis is the reasoning, final the answer); unset: no split")
    max_stop_strings: int = _opt(16, "stop strings one request may give")
    max_stop_string_chars: int = _opt(256, "characters per stop string")
    max_stop_token_ids: int = _opt(64, "stop token ids one request may give")
    max_inflight_requests: int = _opt(256, "requests dispatched to workers at once")
    max_queued_requests: int = _opt(1024, "requests waiting for admission before refusing")
    kv_transfer_timeout_s: float = _opt(30.0, "deadline of one prompt's prefill + KV transfer")
    prefill_placement: str = _opt(
        "adaptive", "where a prompt is prefilled (disaggregated mode): adaptive (per request, "
        "on a prefill worker or on its decode worker between decode steps, whichever the "
        "workers' measured step times predict gives the first token sooner without costing "
        "the decode batch more than it saves, or its TPOT more than the SLO's tpot) | fixed "
        "(always a prefill worker, but for max_local_prefill_tokens)")
    max_local_prefill_tokens: int = _opt(
        256, "a session's decode worker prefills up to this many uncached tokens itself (with "
        "adaptive placement: until the workers' step times are measured)"
    )
    slo: str | None = _opt(
        None, "the service's latency SLO, e.g. ttft=2000,tpot=200 (milliseconds): what "
        "--early-rejection holds a request's first token to, and (tpot) the bound adaptive "
        "placement keeps decode batches within: a decode step that prefills lasts about half")
    early_rejection: bool = _opt(
        False, "refuse a request at once, RESOURCE_EXHAUSTED / 429 with a retry hint "
        "(grpc-retry-pushback-ms / Retry-After), when every prefill worker is predicted to miss "
        "the SLO's ttft for it (its queued and this prompt's uncached tokens at its measured "
        "prefill rate), instead of queueing it (Mooncake's early rejection); needs --slo ttft")
    worker_silence_s: float = _opt(
        10.0, "seconds a worker may stay silent (no output message or keepalive to the router, "
        "no answer to the supervisor's ping) before it is taken for dead")
    drain_timeout_s: float = _opt(
        30.0, "on SIGTERM or SIGINT: seconds the requests in flight get to finish (none new is "
        "taken, readiness fails at once) before the service stops; a second signal stops at "
        "once. Keep it under Kubernetes' terminationGracePeriodSeconds")
    migration_limit: int = _opt(
        1, "times a request whose decode worker dies mid-stream is moved to another one "
        "(its prompt and streamed tokens prefilled again; 0: it fails UNAVAILABLE)")
    router_only: bool = _opt(
        False, "serve as one more router of a running deployment (found through --ray-address): "
        "start no workers, Redis or planner")
    # cluster services
    ray_address: str | None = _opt(None, "existing Ray cluster (default: start a local one)")
    redis_url: str | None = _opt(None, "redis://host:port/db (default: start a bundled one)")
    redis_password: str | None = _opt(None, "Redis password")
    redis_max_memory_bytes: int = _opt(
        256 << 20, "memory cap of the bundled Redis (least recently used keys are evicted)")
    api_token: str | None = _opt(
        None, "clients must send `authorization: Bearer <token>` (health stays open); "
        "prefer --api-token-file: argv shows in `ps`")
    api_token_file: str | None = _opt(
        None, "file of API tokens, one per line (several clients, each its own sessions)")
    redis_namespace: str = _opt(
        DEFAULT_NAMESPACE, "prefix of every Redis key; on a Ray cluster pdserve joined, also "
        "the deployment's name (its registry, its detached workers' names)")
    session_ttl_s: int = _opt(3600, "seconds a session outlives its last turn")
    session_max_tokens: int = _opt(16384, "tokens of a session's history kept in Redis")
    max_sessions_per_token: int = _opt(
        10000, "sessions kept per API token (the least recently used go first)")

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "decode_tp", "max_inflight_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.router_processes is not None and self.router_processes < 1:
            raise ValueError(f"router_processes must be >= 1 (or unset: by the cores), got "
                             f"{self.router_processes}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.prefill_step_ms < math.inf:
            raise ValueError(f"prefill_step_ms must be >= 0 (0: off), got {self.prefill_step_ms}")
        if self.scheduling_policy not in ("srpt", "fcfs"):
            raise ValueError(f"scheduling_policy must be srpt or fcfs, got "
                             f"{self.scheduling_policy!r}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.prefill_placement not in PREFILL_PLACEMENTS:
            raise ValueError(f"prefill_placement must be adaptive or fixed, got "
                             f"{self.prefill_placement!r}")
        if not self.redis_namespace or "/" in self.redis_namespace:
            raise ValueError(f"redis_namespace must be a non-empty name without '/', got "
                             f"{self.redis_namespace!r}")
        if self.decode_tp_placement not in defaults.TP_PLACEMENTS:
            raise ValueError("decode_tp_placement must be one of "
                             f"{', '.join(defaults.TP_PLACEMENTS)}, "
                             f"got {self.decode_tp_placement!r}")
        if self.grpc_server not in GRPC_SERVERS:
            raise ValueError(f"grpc_server must be one of {', '.join(GRPC_SERVERS)}, got "
                             f"{self.grpc_server!r}")
        for name in ("port", "metrics_port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("http_timeout_s", "grpc_timeout_s", "worker_silence_s", "drain_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        for name in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                     "session_max_tokens", "max_sessions_per_token", "redis_max_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.api_token is not None and self.api_token_file is not None:
            raise ValueError("api_token and api_token_file are both set: give the token(s) "
                             "one way (api_token_file keeps them out of argv and env)")
        parse_speculative_config(self.speculative_config)  # ValueError naming the bad field
        self.graph_sizes()
        self.lora_config()
        self.kv_tiers()
        parse_lora_modules(self.lora_modules)
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        check_parser(self.reasoning_parser)
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError("tool_call_parser openai reads the calls reasoning_parser "
                             "openai_gptoss finds in gpt-oss's harmony reply: set both, got "
                             f"reasoning_parser {self.reasoning_parser!r}")
        if self.ttft_slo_s() is None and self.early_rejection:  # parses slo either way
            raise ValueError("early_rejection needs a TTFT bound to hold requests to: set slo, "
                             "e.g. ttft=2000 (milliseconds)")
        if not 0 < self.kv_transfer_timeout_s < math.inf:
            raise ValueError(
                f"kv_transfer_timeout_s must be a positive number, got {self.kv_transfer_timeout_s}"
            )

    def ttft_slo_s(self) -> float | None:
        """The SLO's TTFT bound in seconds (None: no SLO, or none on TTFT); ValueError naming
        `slo` when it does not parse."""
        slo = self._slo()
        return slo.ttft_s if slo is not None else None

    def tpot_slo_s(self) -> float | None:
        """The SLO's TPOT bound in seconds, as `ttft_slo_s`."""
        slo = self._slo()
        return slo.tpot_s if slo is not None else None

    def _slo(self) -> SLO | None:
        if self.slo is None:
            return None
        try:
            return parse_slo(self.slo)
        except ValueError as exc:
            raise ValueError(f"slo: {exc}") from None

    def graph_sizes(self) -> list[int] | None:
        """--cuda-graph-sizes as a list (spaces or commas between sizes); None: the default."""
        if self.cuda_graph_sizes is None:
            return None
        try:
            sizes = [int(x) for x in self.cuda_graph_sizes.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"cuda_graph_sizes: {self.cuda_graph_sizes!r} is not a list of "
                             "integers such as '1 2 4 8'") from None
        return list(check_cuda_graph_sizes(sizes))

    def lora_config(self) -> dict[str, Any] | None:
        """The workers' LoRAConfig fields (checked), or None: LoRA is on with enable_lora or
        lora_modules."""
        if not (self.enable_lora or self.lora_modules):
            return None
        config = {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                  "max_cpu_loras": self.max_cpu_loras}
        LoRAConfig(**config)
        return config

    def kv_tiers(self) -> dict[str, Any]:
        """The workers' KV tier fields of CacheConfig (checked; ValueError naming the setting).
        Each worker's disk tier is its own subdirectory of kv_disk_path (WorkerSpec)."""
        tiers = {"kv_host_bytes": self.kv_host_bytes, "kv_disk_path": self.kv_disk_path,
                 "kv_disk_bytes": self.kv_disk_bytes}
        CacheConfig(enable_prefix_caching=self.enable_prefix_caching, **tiers)
        return tiers

    def tls(self) -> TLSFiles | None:
        """The fronts' TLS files (checked to exist), or None when TLS is off."""
        return TLSFiles.optional(self.tls_cert, self.tls_key, self.tls_client_ca)

    def _cluster_tls_paths(self) -> dict[str, str | None]:
        return {"cluster_tls_cert": self.cluster_tls_cert, "cluster_tls_key": self.cluster_tls_key,
                "cluster_tls_ca": self.cluster_tls_ca}

    def cluster_tls(self) -> TLSFiles | None:
        """The worker plane's mutual-TLS files, or None when off; ValueError unless all three
        are given (naming the missing settings) and exist. Service() calls it at once."""
        return worker_tls(self._cluster_tls_paths())

    def api_tokens(self) -> tuple[str, ...]:
        """The accepted API tokens (none: the API is open), read from api_token_file if set."""
        if self.api_token_file is not None:
            return read_tokens(self.api_token_file)
        return (self.api_token,) if self.api_token else ()

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One `--flag` per field; unset flags stay None so lower layers show through."""
        parser.add_argument("--config", default=None,
                            help=f"YAML file of settings (env {ENV_PREFIX}CONFIG)")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if _base_type(f) is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                    help=f.metadata["help"])
            else:
                parser.add_argument(flag, default=None, metavar=f.name.upper(),
                                    help=f"{f.metadata['help']} (default: {f.default})")

    @classmethod
    def load(
        cls,
        args: argparse.Namespace | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ServeSettings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
        if path:
            values.update(_read_config(Path(path), cls))
        for f in dataclasses.fields(cls):
            env = environ.get(ENV_PREFIX + f.name.upper())
            if env is not None:
                values[f.name] = _parse(f, env, f"{ENV_PREFIX}{f.name.upper()}")
            flag = getattr(args, f.name, None) if args is not None else None
            if flag is not None:
                values[f.name] = _parse(f, flag, "--" + f.name.replace("_", "-"))
        return cls(**values)


def read_tokens(path: str) -> tuple[str, ...]:
    """API tokens from a file: one per line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"api_token_file {path!r}: {exc.strerror}") from None
    tokens = tuple(t for t in (line.strip() for line in lines) if t and not t.startswith("#"))
    if not tokens:
        raise ValueError(f"api_token_file {path!r} holds no token (one per line)")
    if any(any(c.isspace() for c in t) for t in tokens):
        raise ValueError(f"api_token_file {path!r}: a token contains whitespace")
    return tokens


def _read_config(path: Path, cls: type) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: expected a mapping of settings")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"config {path}: unknown keys {unknown}; known: {sorted(fields)}")
    return {k: _parse(fields[k], v, f"{path}: {k}") for k, v in data.items()}


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(ServeSettings)


def _base_type(f: dataclasses.Field) -> type:
    hint = _hints()[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _parse(f: dataclasses.Field, value: Any, where: str) -> Any:
    """A flag, env or YAML value as the field's type; ValueError naming where it came from."""
    kind = _base_type(f)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
        if f.default is None:
            return None
        raise ValueError(f"{where}: {f.name} needs a value")
    if isinstance(value, Mapping) and f.metadata.get("json"):  # a YAML mapping: its JSON text
        return json.dumps(dict(value))
    wrong = ValueError(f"{where}: {f.name} must be {_TYPE_NAMES[kind]}, got {value!r}")
    if isinstance(value, bool) != (kind is bool) and not isinstance(value, str):
        raise wrong
    if isinstance(value, kind):
        return value
    if kind is str or not isinstance(value, (str, int, float)):
        raise wrong
    text = str(value).strip().lower()
    if kind is bool:
        if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise wrong
        return text in ("1", "true", "yes", "on")
    try:
        return int(text.replace("_", "")) if kind is int else float(text)
    except ValueError:
        raise wrong from None
