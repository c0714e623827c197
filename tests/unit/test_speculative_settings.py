"""Speculative decoding's configuration, from where it is given to the engines that decode:
`LLM(speculative_config=...)`, and `pdserve up --speculative-config` / PDSERVE_SPECULATIVE_CONFIG
/ `speculative_config:` in the YAML file -> the decode (and colocated) workers' WorkerSpec, as
plain JSON, -> their EngineConfig; never a prefill worker's. A bad value stops start-up naming
the field."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from pdserve.cli import main as cli_main
from pdserve.engine.spec.config import SpeculativeConfig, parse_speculative_config
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings
from pdserve.llm import LLM
from pdserve.worker_spec import WorkerSpec
from tests.tiny_models import write_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
NGRAM_CONFIG = SpeculativeConfig("ngram", 3, prompt_lookup_max=5)
# (value, what the error must name)
BAD = [
    ('{"method": "ngram", "num_speculative_tokens": 3', "speculative_config: not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_token": 3}', r"unknown field\(s\) \['num_speculative"),
    ('{"method": "medusa", "num_speculative_tokens": 3}', "speculative_config.method"),
    ('{"method": "draft", "num_speculative_tokens": 3}', "speculative_config.model"),
    ('["ngram", 3]', "speculative_config must be a JSON object"),
]


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServeSettings.add_arguments(p)
    return p


def test_flag_env_and_yaml_give_the_same_config(parser, tmp_path) -> None:
    text = json.dumps(NGRAM)
    by_flag = ServeSettings.load(parser.parse_args(["--speculative-config", text]), {})
    by_env = ServeSettings.load(parser.parse_args([]), {"PDSERVE_SPECULATIVE_CONFIG": text})
    as_text, as_mapping = tmp_path / "text.yaml", tmp_path / "mapping.yaml"
    as_text.write_text(yaml.safe_dump({"speculative_config": text}))
    as_mapping.write_text(yaml.safe_dump({"speculative_config": NGRAM}))  # the mapping itself
    by_files = [ServeSettings.load(parser.parse_args(["--config", str(p)]), {})
                for p in (as_text, as_mapping)]
    for settings in (by_flag, by_env, *by_files):
        assert parse_speculative_config(settings.speculative_config) == NGRAM_CONFIG
    assert ServeSettings().speculative_config is None  # off by default
    empty = ServeSettings.load(None, {"PDSERVE_SPECULATIVE_CONFIG": ""})
    assert empty.speculative_config is None


@pytest.mark.parametrize(("value", "names"), BAD, ids=[n for _, n in BAD])
def test_bad_value_names_the_field_in_every_layer(parser, tmp_path, value, names) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({"speculative_config": value}))
    layers = [(parser.parse_args(["--speculative-config", value]), {}),
              (None, {"PDSERVE_SPECULATIVE_CONFIG": value}),
              (parser.parse_args(["--config", str(path)]), {})]
    for args, env in layers:
        with pytest.raises(ValueError, match=names):
            ServeSettings.load(args, env)


def test_a_yaml_list_is_no_config(parser, tmp_path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({"speculative_config": ["ngram", 3]}))
    with pytest.raises(ValueError, match=f"{path}: speculative_config: .* must be a string"):
        ServeSettings.load(parser.parse_args(["--config", str(path)]), {})


def test_pdserve_up_exits_like_other_bad_flags(capsys) -> None:
    bad = '{"method": "ngram", "num_speculative_tokens": 99}'
    assert cli_main(["up", "--speculative-config", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: speculative_config.num_speculative_tokens"), err


def _specs(model_dir, **fields) -> dict[str, WorkerSpec]:
    """Every worker's spec as `pdserve up` hands it to its Ray actor: through JSON."""
    service = Service(ServeSettings(**fields))
    pool = service._make_pool(str(model_dir), "tiny", "redis://127.0.0.1:1/0")
    wire = {wid: json.dumps(w.spec.to_dict()) for wid, w in pool._workers.items()}
    return {wid: WorkerSpec.from_dict(json.loads(text)) for wid, text in wire.items()}


def test_decode_workers_speculate_prefill_workers_never(tiny_llama_dir) -> None:
    specs = _specs(tiny_llama_dir, prefill_workers=2, decode_workers=2, num_kv_blocks=64,
                   speculative_config=json.dumps(NGRAM))
    assert sorted(specs) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    for wid, spec in specs.items():
        config = spec.engine_config()
        if wid.startswith("decode"):
            assert spec.speculative_config == NGRAM_CONFIG.to_dict()
            assert config.speculative == NGRAM_CONFIG
        else:
            assert spec.speculative_config is None and config.speculative is None


def test_colocated_workers_speculate_and_none_without_the_setting(tiny_llama_dir) -> None:
    specs = _specs(tiny_llama_dir, mode="colocated", decode_workers=2, num_kv_blocks=64,
                   speculative_config=json.dumps(NGRAM))
    assert sorted(specs) == ["decode-0", "decode-1"]
    assert all(s.engine_config().speculative == NGRAM_CONFIG for s in specs.values())
    plain = _specs(tiny_llama_dir, num_kv_blocks=64)
    assert all(s.speculative_config is None for s in plain.values())


def test_a_draft_model_is_checked_at_start_up(tiny_llama_dir, tmp_path) -> None:
    draft = {"method": "draft", "num_speculative_tokens": 2, "model": str(tiny_llama_dir)}
    specs = _specs(tiny_llama_dir, num_kv_blocks=64, speculative_config=json.dumps(draft))
    assert specs["decode-0"].engine_config().speculative == SpeculativeConfig(**draft)
    other = write_tiny_model(tmp_path / "other-vocab", "llama", vocab_size=512)
    with pytest.raises(ValueError, match="speculative_config.model"):  # not in a Ray actor
        _specs(tiny_llama_dir, num_kv_blocks=64,
               speculative_config=json.dumps({**draft, "model": str(other)}))


def test_worker_spec_refuses_a_bad_config() -> None:
    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_min"):
        WorkerSpec("w", "m", "m", speculative_config={**NGRAM, "prompt_lookup_min": 9})


def test_llm_takes_a_dict_or_json_text(tiny_llama_dir) -> None:
    for given in (NGRAM, json.dumps(NGRAM), NGRAM_CONFIG):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, speculative_config=given)
        assert llm.config.speculative == NGRAM_CONFIG
    assert LLM(str(tiny_llama_dir), num_kv_blocks=64).config.speculative is None


def test_llm_refuses_a_bad_config_before_loading_anything(tmp_path) -> None:
    missing = str(tmp_path / "no-model-here")  # never read: the config is refused first
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(missing, speculative_config={"method": "ngram", "num_speculative_tokens": 17})
