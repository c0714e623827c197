"""InvalidArgument: a request refused, naming the field; BadParameter: naming the OpenAI
parameter. Both are answered before any worker holds state (INVALID_ARGUMENT / 400)."""

from __future__ import annotations

import re


class InvalidArgument(ValueError):
    """A request the router refuses; the message starts with the field's name."""


class BadParameter(InvalidArgument):
    """A 400: `param` is the OpenAI parameter at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def from_router(cls, exc: InvalidArgument, max_tokens_param: str, prompt_param: str,
                    structured_param: str = "structured_outputs") -> BadParameter:
        """The router's message, its field renamed to the parameter the client sent."""
        message = str(exc)
        field = re.match(r"[A-Za-z_]+", message.removeprefix("sampling."))
        name = field.group(0) if field else prompt_param
        if name == "max_tokens":
            name = max_tokens_param
        elif name in ("prompt", "prompt_token_ids", "messages"):
            name = prompt_param
        elif name == "structured_outputs":
            name = structured_param
        text = message.removeprefix("sampling.")
        if text.startswith("max_tokens"):
            text = max_tokens_param + text.removeprefix("max_tokens")
        return cls(name, text)
