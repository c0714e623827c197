"""ServeSettings: every field through its flag, env var and YAML key; precedence; refusals."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.launch.settings import ENV_PREFIX, ServeSettings

FIELDS = dataclasses.fields(ServeSettings)
FIELD_NAMES = [f.name for f in FIELDS]
NON_BOOL = [f.name for f in FIELDS if not isinstance(f.default, bool)]
# fields with a fixed set of values: too few for the three-layer precedence test
CHOICES = {"mode": ("disaggregated", "colocated"), "tool_call_parser": ("hermes", "llama3_json"),
           "reasoning_parser": ("deepseek_r1", "qwen3"),
           "scheduling_policy": ("srpt", "fcfs"), "prefill_placement": ("adaptive", "fixed"),
           "grpc_server": ("h2", "grpcio"),
           "decode_tp_placement": ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")}
# text fields whose values have a form: valid samples
SAMPLES = {"speculative_config": [f'{{"method": "ngram", "num_speculative_tokens": {n}}}'
                                  for n in (1, 2, 3)],
           "lora_modules": ["a=/adapters/a", "b=/adapters/b c=/adapters/c", '{"d": "/d"}'],
           "cuda_graph_sizes": ["1 2 4", "8,16", "3"],
           "slo": ["ttft=500", "ttft=1000,tpot=50", "tpot=20"]}
# fields valid only beside others (a disk KV tier takes its directory, its size and a host tier
# above it; early rejection a TTFT SLO): what those are set to, in the environment, wherever
# the field is set
COMPANIONS = {"kv_disk_path": {"kv_disk_bytes": 1 << 30, "kv_host_bytes": 1 << 30},
              "kv_disk_bytes": {"kv_disk_path": "/var/tmp/kv", "kv_host_bytes": 1 << 30},
              "early_rejection": {"slo": "ttft=1000"}}
# optional fields that None turns off only with their companions: test_kv_tier_settings.py
OPTIONAL = [f.name for f in FIELDS if f.default is None and f.name not in COMPANIONS]


def _field(name: str) -> dataclasses.Field:
    return next(f for f in FIELDS if f.name == name)


def _kind(name: str) -> type:
    """The field's value type, read from its annotation (`int | None` -> int)."""
    hint = str(_field(name).type)
    for kind in (bool, int, float, str):
        if hint.split(" | ")[0] == kind.__name__:
            return kind
    raise AssertionError(f"unexpected annotation {hint!r} of {name}")


def _values(name: str, n: int = 3) -> list[Any]:
    """`n` distinct valid values of the field, none of them its default."""
    default, kind = _field(name).default, _kind(name)
    if name in CHOICES:
        return [c for c in CHOICES[name] if c != default]
    if name in SAMPLES:
        return SAMPLES[name][:n]
    if kind is bool:
        return [not default]
    if kind is int:
        base = default if default is not None else 0
        return [base + i for i in range(1, n + 1)]
    if kind is float:
        return [default + i + 0.5 for i in range(n)]
    return [f"{name}-value-{i}" for i in range(n)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _companions(name: str) -> dict[str, str]:
    """The environment of the fields `name` needs beside it (COMPANIONS)."""
    return {_env(k): str(v) for k, v in COMPANIONS.get(name, {}).items()}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServeSettings.add_arguments(p)
    return p


def _flag_argv(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [_flag(name) if value else "--no-" + _flag(name)[2:]]
    return [_flag(name), _text(value)]


def _write_config(tmp_path: Path, data: Any, name: str = "settings.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_when_nothing_is_set(parser) -> None:
    assert ServeSettings.load(parser.parse_args([]), {}) == ServeSettings()
    assert ServeSettings.load(None, {}) == ServeSettings()


def test_every_field_has_a_flag(parser) -> None:
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {_flag(n) for n in FIELD_NAMES} <= flags
    assert "--config" in flags


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_field_through_flag(parser, name: str) -> None:
    value = _values(name)[0]
    settings = ServeSettings.load(parser.parse_args(_flag_argv(name, value)), _companions(name))
    assert getattr(settings, name) == value
    assert type(getattr(settings, name)) is type(value)


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_field_through_env(parser, name: str) -> None:
    value = _values(name)[0]
    settings = ServeSettings.load(parser.parse_args([]),
                                  {_env(name): _text(value), **_companions(name)})
    assert getattr(settings, name) == value
    assert type(getattr(settings, name)) is type(value)


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_field_through_config_file(parser, tmp_path, name: str) -> None:
    value = _values(name)[0]
    path = _write_config(tmp_path, {name: value})
    settings = ServeSettings.load(parser.parse_args(["--config", str(path)]), _companions(name))
    assert getattr(settings, name) == value
    assert type(getattr(settings, name)) is type(value)


@pytest.mark.parametrize("name", [n for n in NON_BOOL if n not in CHOICES])
def test_precedence_flag_over_env_over_file_over_default(parser, tmp_path, name: str) -> None:
    in_file, in_env, in_flag = _values(name)
    path = _write_config(tmp_path, {name: in_file})
    config = ["--config", str(path)]
    env = {_env(name): _text(in_env), **_companions(name)}
    load = ServeSettings.load
    all_three = parser.parse_args(config + _flag_argv(name, in_flag))
    assert getattr(load(all_three, env), name) == in_flag
    assert getattr(load(parser.parse_args(config), env), name) == in_env
    assert getattr(load(parser.parse_args(config), _companions(name)), name) == in_file
    assert getattr(load(parser.parse_args([]), {}), name) == _field(name).default


def test_bool_precedence_and_spellings(parser, tmp_path) -> None:
    name, env_name = "enable_prefix_caching", "PDSERVE_ENABLE_PREFIX_CACHING"
    assert ServeSettings().enable_prefix_caching is True
    no_flag = parser.parse_args(["--no-enable-prefix-caching"])
    assert ServeSettings.load(no_flag, {env_name: "true"}).enable_prefix_caching is False
    yes_flag = parser.parse_args(["--enable-prefix-caching"])
    assert ServeSettings.load(yes_flag, {env_name: "false"}).enable_prefix_caching is True
    for text in ("false", "0", "no", "off", "FALSE"):
        assert ServeSettings.load(None, {env_name: text}).enable_prefix_caching is False, text
    for text in ("true", "1", "yes", "on", "True"):
        assert ServeSettings.load(None, {env_name: text}).enable_prefix_caching is True, text
    path = _write_config(tmp_path, {name: False})
    config = parser.parse_args(["--config", str(path)])
    assert ServeSettings.load(config, {}).enable_prefix_caching is False
    assert ServeSettings.load(config, {env_name: "1"}).enable_prefix_caching is True


@pytest.mark.parametrize("name", OPTIONAL)
def test_optional_fields_accept_none_in_every_layer(parser, tmp_path, name: str) -> None:
    set_value = _values(name)[0]
    path = _write_config(tmp_path, {name: set_value})
    config = ["--config", str(path)]
    assert getattr(ServeSettings.load(parser.parse_args(config), {}), name) == set_value
    for text in ("none", "None", "null"):
        loaded = ServeSettings.load(parser.parse_args(config), {_env(name): text})
        assert getattr(loaded, name) is None, text
    by_flag = ServeSettings.load(parser.parse_args(config + [_flag(name), "none"]), {})
    assert getattr(by_flag, name) is None
    null_file = _write_config(tmp_path, {name: None}, "null.yaml")
    by_file = ServeSettings.load(parser.parse_args(["--config", str(null_file)]), {})
    assert getattr(by_file, name) is None


def test_required_int_refuses_none(parser) -> None:
    with pytest.raises(ValueError, match="PDSERVE_MAX_NUM_SEQS: max_num_seqs needs a value"):
        ServeSettings.load(None, {"PDSERVE_MAX_NUM_SEQS": "none"})
    with pytest.raises(ValueError, match="--block-size"):
        ServeSettings.load(parser.parse_args(["--block-size", "none"]), {})


def test_ints_accept_underscores(parser) -> None:
    args = parser.parse_args(["--kv-cache-memory-bytes", "2_000_000"])
    assert ServeSettings.load(args, {}).kv_cache_memory_bytes == 2_000_000


def test_config_path_from_env_and_flag_beats_it(parser, tmp_path) -> None:
    by_env = _write_config(tmp_path, {"max_num_seqs": 5}, "env.yaml")
    by_flag = _write_config(tmp_path, {"max_num_seqs": 7}, "flag.yaml")
    env = {"PDSERVE_CONFIG": str(by_env)}
    assert ServeSettings.load(parser.parse_args([]), env).max_num_seqs == 5
    assert ServeSettings.load(None, env).max_num_seqs == 5
    args = parser.parse_args(["--config", str(by_flag)])
    assert ServeSettings.load(args, env).max_num_seqs == 7


def test_environ_defaults_to_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_DECODE_WORKERS", "3")
    assert ServeSettings.load().decode_workers == 3


def test_empty_config_file_means_defaults(parser, tmp_path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert ServeSettings.load(parser.parse_args(["--config", str(path)]), {}) == ServeSettings()


def test_config_several_keys_at_once(parser, tmp_path) -> None:
    data = {
        "max_num_seqs": 8,
        "dtype": "bfloat16",
        "kv_transfer_timeout_s": 5,
        "enable_prefix_caching": False,
        "redis_url": "redis://h:1/0",
    }
    path = _write_config(tmp_path, data)
    settings = ServeSettings.load(parser.parse_args(["--config", str(path)]), {})
    assert {k: getattr(settings, k) for k in data} == {**data, "kv_transfer_timeout_s": 5.0}
    assert isinstance(settings.kv_transfer_timeout_s, float)


# ---- refusals ----


def test_unknown_yaml_key(parser, tmp_path) -> None:
    path = _write_config(tmp_path, {"max_num_seqs": 4, "max_num_seq": 4})
    with pytest.raises(ValueError, match=r"unknown keys \['max_num_seq'\]"):
        ServeSettings.load(parser.parse_args(["--config", str(path)]), {})


@pytest.mark.parametrize("data", [["max_num_seqs", 4], "just text", 42])
def test_non_mapping_yaml(parser, tmp_path, data) -> None:
    path = _write_config(tmp_path, data)
    with pytest.raises(ValueError, match="expected a mapping"):
        ServeSettings.load(parser.parse_args(["--config", str(path)]), {})


@pytest.mark.parametrize(
    ("env_name", "text"),
    [
        ("PDSERVE_MAX_NUM_SEQS", "many"),
        ("PDSERVE_MAX_NUM_SEQS", "3.5"),
        ("PDSERVE_MAX_MODEL_LEN", "long"),
        ("PDSERVE_KV_TRANSFER_TIMEOUT_S", "soon"),
        ("PDSERVE_ENABLE_PREFIX_CACHING", "maybe"),
    ],
)
def test_wrong_type_in_env_names_the_variable(env_name: str, text: str) -> None:
    with pytest.raises(ValueError, match=env_name) as info:
        ServeSettings.load(None, {env_name: text})
    assert repr(text) in str(info.value)


def test_wrong_type_in_flag_names_the_flag(parser) -> None:
    with pytest.raises(ValueError, match="--decode-workers: decode_workers must be an integer"):
        ServeSettings.load(parser.parse_args(["--decode-workers", "two"]), {})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_num_seqs", "many"),
        ("max_num_seqs", 3.5),
        ("max_num_seqs", True),  # YAML booleans are not ints
        ("enable_prefix_caching", 2),
        ("kv_transfer_timeout_s", "soon"),
    ],
)
def test_wrong_type_in_yaml_names_file_and_key(parser, tmp_path, key: str, value) -> None:
    path = _write_config(tmp_path, {key: value})
    with pytest.raises(ValueError, match=f"{path}: {key}"):
        ServeSettings.load(parser.parse_args(["--config", str(path)]), {})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("decode_tp", 0),
        ("prefill_workers", 0),
        ("decode_workers", -1),
        ("max_inflight_requests", 0),
        ("max_queued_requests", -1),
        ("port", 65536),
        ("metrics_port", -1),
        ("kv_transfer_timeout_s", 0.0),
        ("cuda_graph_sizes", "4,2"),
        ("prefill_step_ms", -1.0),
        ("scheduling_policy", "lifo"),
        ("prefill_placement", "always"),
        ("reasoning_parser", "deepseek-r1"),
        ("cuda_graph_sizes", "1,x"),
        ("kv_host_bytes", -1),
        ("kv_disk_bytes", 1 << 30),  # no kv_disk_path
        ("kv_disk_path", "/var/tmp/kv"),  # no kv_disk_bytes
    ],
)
def test_invalid_value_names_the_field_in_every_layer(parser, tmp_path, key: str, value) -> None:
    path = _write_config(tmp_path, {key: value})
    layers = [
        (parser.parse_args(["--config", str(path)]), {}),
        (None, {_env(key): str(value)}),
        (parser.parse_args([_flag(key), str(value)]), {}),
    ]
    for args, env in layers:
        with pytest.raises(ValueError, match=key):
            ServeSettings.load(args, env)


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser() -> None:
    with pytest.raises(ValueError, match="tool_call_parser openai .* reasoning_parser None"):
        ServeSettings(tool_call_parser="openai")
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3'"):
        ServeSettings(tool_call_parser="openai", reasoning_parser="qwen3")
    ServeSettings(tool_call_parser="openai", reasoning_parser="openai_gptoss")
    ServeSettings(reasoning_parser="openai_gptoss")  # calls not read: still a valid service


def test_zero_ports_are_valid() -> None:
    settings = ServeSettings.load(None, {"PDSERVE_PORT": "0", "PDSERVE_METRICS_PORT": "0"})
    assert (settings.port, settings.metrics_port) == (0, 0)


def test_yaml_list_for_a_float_names_file_and_key(parser, tmp_path) -> None:
    path = _write_config(tmp_path, {"kv_transfer_timeout_s": [1]})
    with pytest.raises(ValueError, match="kv_transfer_timeout_s"):
        ServeSettings.load(parser.parse_args(["--config", str(path)]), {})


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_transfer_timeout_is_refused(value) -> None:
    with pytest.raises(ValueError, match="kv_transfer_timeout_s"):
        ServeSettings.load(None, {"PDSERVE_KV_TRANSFER_TIMEOUT_S": value})


@pytest.mark.parametrize("fields,threads", [
    ({}, {"prefill": 1, "decode": 2}),  # the embedded default on 2 cores: decode gets both
    ({"mode": "colocated"}, {"decode": 2}),  # a lone colocated worker gets both
    ({"mode": "colocated", "decode_workers": 2}, {"decode": 1}),
    ({"prefill_workers": 2, "decode_workers": 2}, {"prefill": 1, "decode": 1}),
    ({"prefill_workers": 3, "decode_workers": 4}, {"prefill": 1, "decode": 1}),  # at least 1
    ({"decode_tp": 2}, {"prefill": 1, "decode": 1}),  # a rank per core
    ({"decode_threads": 3}, {"prefill": 1, "decode": 3}),  # given wins
])
def test_worker_threads_split_the_cores(monkeypatch, fields, threads) -> None:
    from pdserve.launch.service import Service

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    service = Service(ServeSettings(**fields))
    assert {role: service._threads(role) for role in threads} == threads


def test_api_token_two_ways_is_an_error_naming_both(tmp_path) -> None:
    with pytest.raises(ValueError, match="api_token and api_token_file are both set"):
        ServeSettings.load(None, {"PDSERVE_API_TOKEN": "t", "PDSERVE_API_TOKEN_FILE": "f"})


def test_api_tokens_from_setting_or_file(tmp_path) -> None:
    assert ServeSettings().api_tokens() == ()
    assert ServeSettings(api_token="t").api_tokens() == ("t",)
    path = tmp_path / "tokens"
    path.write_text("a\n  b  \n# c\n\n")
    assert ServeSettings(api_token_file=str(path)).api_tokens() == ("a", "b")
    path.write_text("a b\n")
    with pytest.raises(ValueError, match="whitespace"):
        ServeSettings(api_token_file=str(path)).api_tokens()
    with pytest.raises(ValueError, match="api_token_file"):
        ServeSettings(api_token_file=str(tmp_path / "missing")).api_tokens()


def test_tls_files_are_checked_when_used(tmp_path) -> None:
    assert ServeSettings().tls() is None
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    tls = ServeSettings(tls_cert=str(cert), tls_key=str(key)).tls()
    assert (tls.cert, tls.key, tls.ca) == (str(cert), str(key), None)
    with pytest.raises(ValueError, match="does not exist"):
        ServeSettings(tls_cert=str(cert), tls_key=str(key),
                      tls_client_ca=str(tmp_path / "none")).tls()
    with pytest.raises(ValueError, match="both a certificate and its key"):
        ServeSettings(tls_key=str(key)).tls()


def test_cluster_tls_needs_all_three_files(tmp_path) -> None:
    assert ServeSettings().cluster_tls() is None
    paths = {}
    for name in ("cert", "key", "ca"):
        paths[f"cluster_tls_{name}"] = str(tmp_path / f"{name}.pem")
        (tmp_path / f"{name}.pem").write_text(name)
    tls = ServeSettings(**paths).cluster_tls()
    assert (tls.cert, tls.key, tls.ca) == tuple(paths.values())
    with pytest.raises(ValueError, match="cluster_tls_ca not set"):
        ServeSettings(**(paths | {"cluster_tls_ca": None})).cluster_tls()
    with pytest.raises(ValueError, match="does not exist"):
        ServeSettings(**(paths | {"cluster_tls_key": str(tmp_path / "none")})).cluster_tls()


@pytest.mark.parametrize("name", ["max_stop_strings", "max_stop_string_chars",
                                  "max_stop_token_ids", "session_max_tokens",
                                  "max_sessions_per_token", "redis_max_memory_bytes"])
def test_caps_must_be_positive(name) -> None:
    with pytest.raises(ValueError, match=name):
        ServeSettings(**{name: 0})


@pytest.mark.parametrize("value", [0.0, float("inf")])
def test_grpc_timeout_must_be_finite_and_positive(value) -> None:
    with pytest.raises(ValueError, match="grpc_timeout_s"):
        ServeSettings(grpc_timeout_s=value)
