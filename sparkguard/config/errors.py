"""Configuration errors: :class:`ConfigError` names the file, the dotted key and the value."""

from __future__ import annotations

from typing import Any

from sparkguard.units import shown


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

    def __reduce__(self):
        """Pickled as its message and names, the value shown in it (a reload's reader process
        hands its ConfigError to the daemon: :mod:`sparkguard.guard.reconfig`)."""
        return _rebuild, (self.path, self.key, self.reason, str(self))


def _rebuild(path: str, key: str, reason: str, message: str) -> ConfigError:
    e = ConfigError.__new__(ConfigError)
    ValueError.__init__(e, message)
    e.path, e.key, e.value, e.reason = path, key, None, reason
    return e


def _show(value: Any, limit: int = 200) -> str:
    """:func:`sparkguard.units.shown`: a repr built from bounded pieces, cut to ``limit`` characters."""
    return shown(value, limit)


class NestedValueError(ValueError):
    """A ValueError about a value nested below the key being parsed (``engine.lanes.big.args``).

    Attributes:
        subkey: str appended to the dotted key, e.g. ``".big.args"``.
        value: the offending nested value.
    """

    def __init__(self, subkey: str, value: Any, reason: str):
        super().__init__(reason)
        self.subkey, self.value = subkey, value
