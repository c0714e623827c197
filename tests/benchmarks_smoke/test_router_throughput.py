"""Smoke test of benchmarks/router_throughput.py: a tiny run, checked for correctness only.

The synthetic decode worker and the real router each run in their own process; every stream
must get exactly its max_tokens tokens (finish_reason "length") and every number must be
positive. No speed is asserted: this machine's cores are shared.
"""

from __future__ import annotations

from benchmarks.router_throughput import main

MAX_TOKENS = 20
STREAMS = 8


def test_tiny_grpc_run_streams_every_token_on_both_fronts(capsys) -> None:
    results = main(["--fronts", "grpc", "--streams", str(STREAMS), "--max-tokens",
                    str(MAX_TOKENS), "--duration", "2", "--step-ms", "10",
                    "--grpc-server", "h2,grpcio"])
    assert [r["grpc_server"] for r in results] == ["h2", "grpcio"]
    for result in results:
        check(result)
    assert "router_us_per_token" in capsys.readouterr().out


def check(result: dict) -> None:
    assert result["errors"] == {}
    assert result["requests"] >= STREAMS  # every stream finished at least one request
    assert result["outcomes"] == {f"{MAX_TOKENS} length": result["requests"]}
    assert result["tokens"] == result["requests"] * MAX_TOKENS
    for key in ("tok_s", "router_us_per_token", "router_cpu", "p50_ms", "p99_ms"):
        assert result[key] > 0, key
    assert result["threads"]["router"] > 0
