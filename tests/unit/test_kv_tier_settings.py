"""The KV cache tiers' settings, from where `pdserve up` takes them to the engines: the flags
`--kv-host-bytes`, `--kv-disk-path`, `--kv-disk-bytes` (their env vars and YAML keys) -> every
worker's WorkerSpec, prefill and decode alike, as plain JSON, -> its CacheConfig, the disk tier
in a directory of the worker's own. A setting the tiers cannot run with stops start-up naming
it, never later inside a Ray actor."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pdserve.cli import main as cli_main
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings
from pdserve.worker_spec import WorkerSpec

TIERS = {"kv_host_bytes": 64 << 20, "kv_disk_path": "/var/tmp/kv", "kv_disk_bytes": 1 << 30}


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServeSettings.add_arguments(p)
    return p


def test_flags_env_and_yaml_give_the_tiers(parser, tmp_path) -> None:
    flags = ["--kv-host-bytes", "67_108_864", "--kv-disk-path", "/var/tmp/kv",
             "--kv-disk-bytes", "1073741824"]
    by_flag = ServeSettings.load(parser.parse_args(flags), {})
    by_env = ServeSettings.load(None, {f"PDSERVE_{k.upper()}": str(v) for k, v in TIERS.items()})
    path = tmp_path / "settings.yaml"
    path.write_text(json.dumps(TIERS))  # JSON is YAML
    by_file = ServeSettings.load(parser.parse_args(["--config", str(path)]), {})
    for settings in (by_flag, by_env, by_file):
        assert settings.kv_tiers() == TIERS
    off = {"kv_host_bytes": 0, "kv_disk_path": None, "kv_disk_bytes": 0}
    assert ServeSettings().kv_tiers() == off  # no tiers by default
    host_only = ServeSettings.load(None, {"PDSERVE_KV_HOST_BYTES": "4096"})
    assert host_only.kv_tiers() == {**off, "kv_host_bytes": 4096}
    tp_group = ServeSettings(kv_host_bytes=4096, decode_tp=2)  # each rank tiers its shard
    assert tp_group.kv_tiers() == {**off, "kv_host_bytes": 4096}


@pytest.mark.parametrize(("fields", "names"), [
    ({"kv_host_bytes": 1 << 20, "kv_disk_path": "/var/tmp/kv"},
     "kv_disk_path and kv_disk_bytes go together"),
    ({"kv_host_bytes": 1 << 20, "kv_disk_bytes": 1 << 30},
     "kv_disk_path and kv_disk_bytes go together"),
    ({"kv_disk_path": "/var/tmp/kv", "kv_disk_bytes": 1 << 30}, "set kv_host_bytes too"),
    ({"kv_host_bytes": 1 << 20, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_disk_bytes": -1}, "kv_disk_bytes must be a byte count >= 0"),
])
def test_settings_the_tiers_cannot_run_with_are_refused(fields, names) -> None:
    with pytest.raises(ValueError, match=names):
        ServeSettings(**fields)


def test_off_again_in_a_higher_layer(parser, tmp_path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(json.dumps(TIERS))
    args = parser.parse_args(["--config", str(path), "--kv-disk-path", "none",
                              "--kv-disk-bytes", "0"])
    assert ServeSettings.load(args, {}).kv_tiers() == {**TIERS, "kv_disk_path": None,
                                                       "kv_disk_bytes": 0}


def test_pdserve_up_exits_like_other_bad_flags(capsys) -> None:
    assert cli_main(["up", "--kv-host-bytes", "4096", "--kv-disk-path", "/var/tmp/kv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: kv_disk_path and kv_disk_bytes go together"), err


def _specs(model_dir, **fields) -> dict[str, WorkerSpec]:
    """Every worker's spec as `pdserve up` hands it to its Ray actor: through JSON."""
    service = Service(ServeSettings(**fields))
    pool = service._make_pool(str(model_dir), "tiny", "redis://127.0.0.1:1/0")
    wire = {wid: json.dumps(w.spec.to_dict()) for wid, w in pool._workers.items()}
    return {wid: WorkerSpec.from_dict(json.loads(text)) for wid, text in wire.items()}


def test_every_worker_gets_the_tiers_and_a_disk_directory_of_its_own(tiny_llama_dir,
                                                                     monkeypatch,
                                                                     tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # a relative path is the launcher's, made absolute
    specs = _specs(tiny_llama_dir, prefill_workers=2, decode_workers=2, num_kv_blocks=64,
                   **{**TIERS, "kv_disk_path": "kv"})
    assert sorted(specs) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    dirs = set()
    for wid, spec in specs.items():
        cache = spec.engine_config().cache
        assert (cache.kv_host_bytes, cache.kv_disk_bytes) == (64 << 20, 1 << 30)
        assert cache.kv_disk_path == os.path.join(tmp_path, "kv", wid)
        dirs.add(cache.kv_disk_path)
    assert len(dirs) == 4
    plain = _specs(tiny_llama_dir, num_kv_blocks=64)
    for spec in plain.values():
        cache = spec.engine_config().cache
        assert (cache.kv_host_bytes, cache.kv_disk_path, cache.kv_disk_bytes) == (0, None, 0)


def test_colocated_workers_get_the_tiers(tiny_llama_dir) -> None:
    specs = _specs(tiny_llama_dir, mode="colocated", num_kv_blocks=64, kv_host_bytes=1 << 20)
    assert [s.engine_config().cache.kv_host_bytes for s in specs.values()] == [1 << 20]


def test_worker_spec_puts_the_disk_tier_under_the_worker_id() -> None:
    spec = WorkerSpec("decode-3", "m", "m", **TIERS)
    assert spec.disk_dir() == "/var/tmp/kv/decode-3"
    assert WorkerSpec("decode-3", "m", "m").disk_dir() is None
    for bad in ("a/b", "..", ".", ""):
        with pytest.raises(ValueError, match="worker_id .* plain file name"):
            WorkerSpec(bad, "m", "m", **TIERS)
    WorkerSpec("a/b", "m", "m")  # no disk tier: the id names no directory
