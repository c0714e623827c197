"""Smoke test of benchmarks/quality.py: the tiny model in fp32, checked for shape only.

A second configuration with a dtype the engine refuses shows the error row: the run goes on.
"""

from __future__ import annotations

import json
import math

from benchmarks.quality import main, parse_configs, perplexity


def test_tiny_fp32_run_scores_the_passage(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "quality.json"
    results = main(["--model", str(tiny_llama_dir), "--configs", "float32,float31",
                    "--threads", "2", "--max-tokens", "200", "--json", str(out)])
    ok, bad = results
    assert ok["config"] == "float32" and ok["num_tokens"] == 200 and ok["ratio"] == 1.0
    # a random model is far from the passage: perplexity near the vocabulary size or above
    assert math.isfinite(ok["perplexity"]) and ok["perplexity"] > 1
    assert ok["perplexity"] == math.exp(-ok["mean_logprob"])
    assert ok["weight_bytes"] > 0 and ok["load_s"] > 0 and ok["score_s"] > 0
    assert "float31" in bad["error"] or "dtype" in bad["error"]
    assert json.loads(out.read_text())["results"][0]["perplexity"] == ok["perplexity"]
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "float31" in printed


def test_config_parsing_and_perplexity() -> None:
    assert parse_configs("bfloat16, float32+int4") == [("bfloat16", None), ("float32", "int4")]
    assert perplexity([math.log(0.5)] * 3) == 2.0
