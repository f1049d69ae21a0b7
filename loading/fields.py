"""Typed reads of a JSON object's fields (config.json and its kin), each error naming the file
and the field: "config.json: num_hidden_layers must be a positive integer, got null"."""

from __future__ import annotations

import math
from typing import Any

from shoal.loading.checkpoint import CheckpointError, json_value

MAX_SIZE = 2**31 - 1  # the largest size (vocab, hidden, layers, positions, ...) we accept
_REQUIRED = object()  # the default of a field that must be present


class ConfigFields:
    """Typed reads of one JSON object's fields. An absent field takes its default (or is an
    error without one); null does too where `nullable`, else it is a wrong type."""

    def __init__(self, values: dict[str, Any], file_name: str, prefix: str = "") -> None:
        self.values = values
        self.file_name = file_name
        self.prefix = prefix  # "rope_scaling." for the fields of a nested object

    def has(self, name: str) -> bool:
        return name in self.values

    def positive_int(self, name: str, default: Any = _REQUIRED) -> int:
        value = self._get(name, default, False)
        if not _is_int(value) or not 0 < value <= MAX_SIZE:
            raise self.error(name, "a positive integer", value)
        result: int = value
        return result

    def optional_positive_int(self, name: str) -> int | None:
        """Absent or null reads as None."""
        if self.values.get(name) is None:
            return None
        return self.positive_int(name)

    def positive_number(self, name: str, default: Any = _REQUIRED) -> float:
        value = self._get(name, default, False)
        number = _is_int(value) or isinstance(value, float)
        if not number or not math.isfinite(value) or value <= 0:
            raise self.error(name, "a positive number", value)
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self._get(name, default, False)
        if not isinstance(value, bool):
            raise self.error(name, "true or false", value)
        return value

    def text(self, name: str, default: Any = _REQUIRED) -> str:
        value = self._get(name, default, False)
        if not isinstance(value, str):
            raise self.error(name, "a string", value)
        return value

    def nested(self, name: str) -> dict[str, Any]:
        """A nested object; absent or null reads as {}."""
        value = self._get(name, {}, True)
        if not isinstance(value, dict):
            raise self.error(name, "an object", value)
        return value

    def token_ids(self, name: str, vocab_size: int) -> tuple[int, ...]:
        """A token id or a list of them (absent or null: none), unique, order kept."""
        value = self._get(name, None, True)
        ids = [] if value is None else value if isinstance(value, list) else [value]
        if not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
            wanted = f"a token id or a list of token ids below vocab_size {vocab_size}"
            raise self.error(name, wanted, value)
        return tuple(dict.fromkeys(ids))

    def error(self, name: str, wanted: str, value: object) -> CheckpointError:
        return CheckpointError(
            f"{self.file_name}: {self.prefix}{name} must be {wanted}, got {json_value(value)}"
        )

    def _get(self, name: str, default: Any, nullable: bool) -> Any:
        if name not in self.values:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.file_name}: {self.prefix}{name} is missing")
            return default
        value = self.values[name]
        return default if value is None and nullable and default is not _REQUIRED else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
