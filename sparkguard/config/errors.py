"""Configuration errors: :class:`ConfigError` names the file, the dotted key and the value."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong.

    Attributes:
        path: str, the file (or ``"<defaults>"``).
        key: str, dotted key such as ``"guard.grace"``.
        value: the offending value as read.
        reason: str, what is wrong and what is expected.
    """

    def __init__(self, path: str, key: str, value: Any, reason: str):
        self.path, self.key, self.value, self.reason = path, key, value, reason
        if key.startswith("("):        # (file), (syntax): no value to show
            super().__init__(f"{path}: {reason}")
        else:
            super().__init__(f"{path}: {key}: {_show(value)}: {reason}")


def _show(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; an int too long for repr (Python >= 3.11 refuses
    more than 4300 digits) is shown by its size."""
    try:
        text = repr(value)
    except ValueError:
        return f"<a number of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


class NestedValueError(ValueError):
    """A ValueError about a value nested below the key being parsed (``engine.lanes.big.args``).

    Attributes:
        subkey: str appended to the dotted key, e.g. ``".big.args"``.
        value: the offending nested value.
    """

    def __init__(self, subkey: str, value: Any, reason: str):
        super().__init__(reason)
        self.subkey, self.value = subkey, value
