"""Reading the configuration file: at most 1 MiB of a regular file, parsed by a YAML loader that
refuses duplicate keys and YAML 1.1 numbers."""

from __future__ import annotations

import os
import re
import stat
from typing import Any

import yaml

from sparkguard.config.errors import ConfigError
from sparkguard.untrusted import others_can_write, read_fd


MAX_FILE_BYTES = 1024**2     # a config is a few KiB; more is the wrong file (/dev/zero, a log)
#: Nodes a document may hold once every alias is counted as the nodes it stands for.  A full
#: config with a 4-node cluster is about 300; a 1 MiB file of plain keys is at most ~100,000.
#: Aliases that multiply (``a: &a [x, x]``, ``b: &b [*a, *a]``, ...) reach billions in a few
#: hundred bytes, and whatever walks the value (a parser, ``repr`` in an error message) pays that.
MAX_NODES = 100_000
#: Levels of nesting, aliases followed; a sparkguard config is 4 deep (engine.lanes.NAME.args).
MAX_DEPTH = 32


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _regular(path: str, st: os.stat_result) -> None:
    """ConfigError naming the kind of file unless ``st`` is a regular file's."""
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a plain file")
        raise ConfigError(path, "(file)", None, f"is {kind}, not a regular file")


def read_bounded(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Opened with O_NONBLOCK, so a FIFO without a writer cannot hang the caller (open(2) returns at
    once for a reader), then refused by fstat(2) like any other non-regular file; at most
    ``limit + 1`` bytes are read, so /dev/zero or a file that grows cannot take memory.
    A file that a user other than root (or this process's own) can change, itself or through a
    folder above it, is refused (:func:`sparkguard.untrusted.others_can_write`, sshd's
    StrictModes): the daemon runs ``engine.command`` from it as root.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: not a regular file, larger than ``limit`` bytes, unreadable (the OS reason),
            or writable by another user (its owner and mode, and how to fix it).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        try:
            _regular(path, os.stat(path))            # a socket: open(2) fails with ENXIO
        except OSError:
            pass
        raise ConfigError(path, "(file)", None, f"cannot read: {e.strerror}") from None
    try:
        _regular(path, os.fstat(fd))
        why = others_can_write(path)
        if why is not None:
            raise ConfigError(path, "(file)", None, why)
        data = read_fd(fd, limit)
        if len(data) > limit:
            raise ConfigError(path, "(file)", None, f"larger than {limit // 1024} KiB: not a sparkguard config")
        return data
    except OSError as e:
        raise ConfigError(path, "(file)", None, f"cannot read: {e.strerror}") from None
    finally:
        os.close(fd)


#: Plain scalars read as numbers: decimal only (YAML 1.2 core schema without its 0o/0x forms).  An int
#: of more than 19 digits stays a string (and is refused by the key), so no int is too long for repr.
_INT = r"^[-+]?(?:0|[1-9][0-9]{0,18})$"
_FLOAT = (r"^[-+]?(?:(?:0|[1-9][0-9]*)\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"
          r"|^[-+]?(?:0|[1-9][0-9]*)[eE][-+]?[0-9]+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")
_RESOLVED_AGAIN = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")


class YamlFloat(float):
    """A float read from the file; ``text`` is the scalar as written, for keys that take strings."""

    text = ""


class Loader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)
    and reads numbers as the decimal written.

    YAML 1.1 (PyYAML) reads ``010`` as 8, ``0x10`` as 16, ``1_000`` as 1000, ``1:30`` as 90 and
    ``2026-01-01`` as a date.  Here those plain scalars stay strings, which every numeric key
    refuses with its reason (sparkguard.units); ``1e400`` and ``.inf`` are floats (inf), refused as
    not finite.  Booleans (``yes``/``no``/``on``/``off``/``true``/``false``) resolve as in YAML 1.1.
    """

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag not in _RESOLVED_AGAIN]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _real(loader: Loader, node: yaml.ScalarNode) -> YamlFloat:
    f = YamlFloat(loader.construct_yaml_float(node))
    f.text = node.value
    return f


def _mapping(loader: Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key that is a {type(key).__name__}", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(_INT), list("-+0123456789"))
Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT), list("-+0123456789."))
Loader.add_constructor("tag:yaml.org,2002:float", _real)
Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def check_size(node: yaml.Node, path: str) -> None:
    """Refuse a composed document that is too large or too deep once its aliases are expanded.

    Works on the node graph PyYAML composes (an alias is the anchored node itself, shared), in
    time and memory proportional to the distinct nodes, never to the expansion: each node's
    expanded size and depth are computed once (post-order, iterative) and reused wherever an
    alias points at it.
    Raises:
        ConfigError: more than :data:`MAX_NODES` nodes or :data:`MAX_DEPTH` levels once expanded,
        or an alias inside the node it names (a recursive document).
    """
    size: dict[int, tuple[int, int]] = {}      # id(node) -> (expanded nodes, depth)
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        i = id(n)
        kids = n.value if isinstance(n, yaml.SequenceNode) else (
            [k for pair in n.value for k in pair] if isinstance(n, yaml.MappingNode) else ())
        if done:
            on_path.discard(i)
            total, depth = 1, 0
            for k in kids:
                t, d = size[id(k)]
                total, depth = total + t, max(depth, d)
            size[i] = (total, depth + 1)
            if total > MAX_NODES:
                raise ConfigError(path, "(syntax)", None, f"YAML document of more than {MAX_NODES:,} nodes once "
                                  f"its aliases are expanded (near line {n.start_mark.line + 1}): refused")
            if depth + 1 > MAX_DEPTH:
                raise ConfigError(path, "(syntax)", None, f"YAML nested more than {MAX_DEPTH} levels deep "
                                  f"(near line {n.start_mark.line + 1}): refused")
            continue
        if i in size:
            continue
        if i in on_path:
            raise ConfigError(path, "(syntax)", None, f"YAML alias inside the node it names "
                              f"(line {n.start_mark.line + 1}): a recursive document is refused")
        on_path.add(i)
        stack.append((n, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


def parse(text: bytes | str, path: str) -> Any:
    """The YAML document ``text`` read with :class:`Loader`.

    The document is composed first and checked by :func:`check_size` before any Python value
    is built from it, so aliases that multiply cost nothing but their own nodes.
    Args:
        text: the file's content; path: the file name for errors.
    Returns:
        the parsed document (None for an empty file).
    Raises:
        ConfigError: a YAML syntax error (with its line and column), a duplicate or unhashable
        key, a document nested too deeply for the parser, or one too large once its aliases are
        expanded (:func:`check_size`).
    """
    try:
        loader = Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            check_size(node, path)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        where = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: " if e.problem_mark else ""
        raise ConfigError(path, "(syntax)", None, f"YAML error at {where}{e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, "(syntax)", None, f"YAML error: {e}".replace("\n", " ")) from None
    except RecursionError:
        raise ConfigError(path, "(syntax)", None, "YAML nested too deeply") from None
