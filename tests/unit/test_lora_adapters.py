"""The router's LoRA adapter table: `--lora-modules` parsed, adapters checked before they are
listed, a request's `model` resolved to its adapter, and the table kept equal to the one the
deployment's router processes share (Redis) by `sync`."""

from __future__ import annotations

import pytest

from pdserve.engine.lora_request import LoRARequest
from pdserve.proto import pdserve_pb2
from pdserve.router.invalid_argument import InvalidArgument
from pdserve.router.lora_adapters import parse_lora_modules
from pdserve.router.validation import ModelContext, validate


def test_lora_modules_forms():
    assert parse_lora_modules("a=/x b=/y,c=/z") == {"a": "/x", "b": "/y", "c": "/z"}
    assert parse_lora_modules('{"a": "/x"}') == {"a": "/x"}
    assert parse_lora_modules(None) == {}
    for bad in ("a", "=x", "a=", '{"a": 1}', "{nope"):
        with pytest.raises(ValueError, match="lora_modules"):
            parse_lora_modules(bad)


@pytest.fixture(scope="module")
def model(tiny_llama_dir, tiny_lora_dirs) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=256, max_lora_rank=16,
                             lora_modules={"all": str(tiny_lora_dirs["all"])})


def test_model_field_picks_the_adapter(model):
    loras = list(model.loras)
    assert [(a.lora_name, a.lora_int_id) for a in loras] == [("all", 1)]
    request = pdserve_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], model="all")
    assert validate(request, model).lora == loras[0]
    request.model = "tiny"
    assert validate(request, model).lora is None
    request.model = "none-such"
    with pytest.raises(InvalidArgument, match="'none-such' is not served here; this router "
                                              "serves 'tiny', 'all'"):
        validate(request, model)


def test_check_refuses_before_listing(model, tiny_lora_dirs, tmp_path):
    loras = model.loras
    for name, path, why in [("all", tiny_lora_dirs["mlp"], "already served"),
                            ("tiny", tiny_lora_dirs["mlp"], "already served"),
                            ("bad name!", tiny_lora_dirs["mlp"], "lora_name must be"),
                            ("x", str(tmp_path), "no adapter_config.json")]:
        with pytest.raises(ValueError, match=why):
            loras.check(name, str(path))
    assert [a.lora_name for a in loras] == ["all"]


def test_sync_serves_exactly_the_shared_table(model, tiny_lora_dirs):
    loras = model.loras
    first = loras.get("all")
    mlp = LoRARequest("mlp", 7, str(tiny_lora_dirs["mlp"]))
    loras.sync({"all": first, "mlp": mlp})
    assert sorted(a.lora_name for a in loras) == ["all", "mlp"]
    reloaded = LoRARequest("all", 9, first.lora_path)  # unloaded and loaded again elsewhere
    loras.sync({"all": reloaded})
    assert list(loras) == [reloaded]
    loras.sync({"all": first})
    assert list(loras) == [first]


def test_adapters_for_other_families_are_refused_by_name(tiny_llama_dir, tiny_lora_dirs):
    import dataclasses

    from pdserve.engine.config import load_model_config
    from pdserve.engine.lora_adapter import check_adapter

    llama = load_model_config(tiny_llama_dir)
    assert check_adapter(str(tiny_lora_dirs["all"]), llama, 16).rank > 0
    for arch in ("DeepseekV3ForCausalLM", "GptOssForCausalLM"):
        with pytest.raises(ValueError, match=f"lora_path: .*{arch}'s layers"):
            check_adapter(str(tiny_lora_dirs["all"]),
                          dataclasses.replace(llama, architecture=arch), 16)
