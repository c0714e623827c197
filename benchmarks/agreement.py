"""Greedy agreement between systems: the same prompts, token for token, against pdserve's."""

from __future__ import annotations


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    prefix = []
    for x, y in zip(a, b, strict=True):
        pairs = enumerate(zip(x, y, strict=False))
        n = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
        prefix.append(n / max(1, len(x)))
    exact = sum(x == y for x, y in zip(a, b, strict=True))
    first32 = sum(x[:32] == y[:32] for x, y in zip(a, b, strict=True))
    return {"exact": exact, "first32": first32, "of": len(a),
            "mean_common_prefix": sum(prefix) / len(prefix)}


def report(results: list[dict]) -> dict:
    """Greedy tokens of every other system against pdserve's, printed; by system."""
    agreement = {}
    for other in results[1:]:
        agreement[other["system"]] = compare(results[0]["token_ids"], other["token_ids"])
        a = agreement[other["system"]]
        print(
            f"greedy agreement pdserve vs {other['system']}: {a['exact']}/{a['of']} requests "
            f"identical, first 32 tokens identical in {a['first32']}/{a['of']}, mean common "
            f"prefix {a['mean_common_prefix']:.1%} of the output"
        )
    return agreement
