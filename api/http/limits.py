"""Input limits only the HTTP doors have (the engine's own are in limits.py; docs/limits.md
lists both). Set through ServerOptions; each check counts before it reads, and answers 400
naming the field (`param`), the limit and the option, with OpenAI's codes:

    check_count(len(body.prompt), limits.max_prompts, "prompt", "max_prompts")
    # 400 {"param": "prompt", "code": "array_above_max_length", "message": "prompt has 300
    #      entries, more than the limit of 256 (max_prompts)"}
"""

from __future__ import annotations

import msgspec

from shoal import limits as engine_limits
from shoal.api.http.errors import ApiError, bad_request
from shoal.api.http.json_depth import DEFAULT_MAX_JSON_DEPTH
from shoal.limits import LimitExceeded

MIN_ID_CHARS = 48  # "session-" and 32 hex digits, as the server makes them, with room


class HttpLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # arrays / objects nested in a body or frame
    max_prompts: int = 256  # prompts in one /v1/completions or /generate batch
    max_content_parts: int = 256  # parts of one chat message's content
    max_id_chars: int = 256  # request ids, session ids, model names, `user`
    max_path_chars: int = 4096  # update_weights_from_disk's model_path
    max_ws_message_bytes: int = 4 * 2**20  # one websocket frame

    def validate(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_id_chars < MIN_ID_CHARS:  # the server's own ids must pass
            raise ValueError(f"max_id_chars must be >= {MIN_ID_CHARS}, got {self.max_id_chars}")


def api_error(exc: LimitExceeded, field: str | None = None) -> ApiError:
    """The 400 for an engine limit, its field spoken in the API's name when given."""
    name = field or exc.field
    return bad_request(exc.spoken(name), name, exc.code)


def check_count(count: int, limit: int, field: str, option: str) -> None:
    try:
        engine_limits.check_count(count, limit, field, option)
    except LimitExceeded as exc:
        raise api_error(exc) from None


def check_chars(length: int, limit: int, field: str, option: str) -> None:
    try:
        engine_limits.check_chars(length, limit, field, option)
    except LimitExceeded as exc:
        raise api_error(exc) from None


def check_id(value: str | None, limits: HttpLimits, field: str) -> None:
    """A request id, session id, model name or user string: at most max_id_chars."""
    if value is not None:
        check_chars(len(value), limits.max_id_chars, field, "max_id_chars")
