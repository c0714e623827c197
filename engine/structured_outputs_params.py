"""StructuredOutputsParams: the shape a request's output must take (vLLM's `structured_outputs`).

No torch, no xgrammar: SamplingParams carries it, and the router imports SamplingParams.
Compiling and enforcing it is engine.structured_output's.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one kind: a JSON Schema (as JSON text), a regex, a choice among strings, an
    EBNF grammar (xgrammar's dialect, rule `root`), or any JSON object."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of "
                             f"{', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
