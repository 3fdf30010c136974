"""Reading the sidecar's config: YAML text -> the schema's frozen dataclasses. Unknown keys and
bad values are errors, all listed at once (`ConfigError.problems`); a file is read with bounds
(size, YAML nodes) before it is parsed."""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import typing
from typing import Any, Optional

from torch_watchdog.sidecar.config.files import host_problems
from torch_watchdog.sidecar.config.schema import MiB, Config, semantic_problems


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def from_mapping(data: Any, recorded: bool = False) -> Config:
    """Build a Config from parsed YAML; raises ConfigError listing every problem.
    `recorded`: the config a live sidecar ran with (its sample log): only its types are
    checked, as a replay must decide as that sidecar did, even where today's rules differ."""
    if recorded:
        problems: list[str] = []
        config: Config = _build(Config, data, "", problems)
        if problems:
            raise ConfigError(problems)
        return config
    config, problems = _validate(data)
    if problems:
        raise ConfigError(problems)
    return config


def _validate(data: Any) -> tuple[Config, list[str]]:
    """The Config (a bad value replaced by its default) and every problem with `data`."""
    problems: list[str] = []
    config = _build(Config, data, "", problems)
    for warning in deprecated(data):
        log.warning("%s", warning)
    return config, problems + semantic_problems(config)


log = logging.getLogger(__name__)
DEPRECATED = {("forecast", "headroom_bytes"): "ignored: the forecast is to where allocation "
              "fails, and the margin is policy.reload_lead_s (seconds)"}


def deprecated(data: Any) -> list[str]:
    """The deprecated keys `data` sets, each with what became of it."""
    if not isinstance(data, dict):
        return []
    return [f"{section}.{key}: deprecated, {why}" for (section, key), why in DEPRECATED.items()
            if isinstance(data.get(section), dict) and key in data[section]]


MAX_FILE_BYTES = 1 * MiB  # the shipped file, every key documented, is 7 KB
# Expanded YAML nodes: the shipped file has ~100. An alias (*name) is not copied by PyYAML but
# whatever walks the result (type checks, error messages) expands it: 9 levels of 10 aliases,
# 2 KB of text, are 10^9 nodes (the "billion laughs"). Counted before construction, in time
# linear in the text.
MAX_NODES = 10_000


def check(path: str, host: bool = True) -> tuple[Optional[Config], list[str]]:
    """(config, []) for a good file, (None, problems) for a bad one; never raises for a bad file
    (missing, unreadable, empty, too large, not YAML, not a mapping, bad values) — for
    check-config, the sidecar's start and SIGHUP (a bad file keeps the old config). With
    `host`, also whether this machine lets the sidecar write where the config says
    (`host_problems`); a command that only reads the config's values passes host=False.
    Every problem is listed at once; none repeats `path` (the caller names the file once)."""
    try:
        config, problems = _validate(_mapping(path))
    except ConfigError as e:
        return None, list(e.problems)
    if host:
        reported = {p.split(":", 1)[0] for p in problems}  # a bad value's default: not checked
        problems += [p for p in host_problems(config) if p.split(":", 1)[0] not in reported]
    return (None, problems) if problems else (config, [])


def load(path: str) -> Config:
    """Parse and validate the file at `path` (its values only); ConfigError lists every
    problem."""
    return from_mapping(_mapping(path))


def _mapping(path: str) -> dict[Any, Any]:
    """The file's top-level YAML mapping; ConfigError for anything else."""
    data = _parse_yaml(_read(path))
    if data is None:
        raise ConfigError(["empty config (no keys, only blank space or comments): write `{}` "
                           "to run with every default"])
    if not isinstance(data, dict):
        kinds: dict[type, str] = {list: "list", str: "line of text"}
        kind = kinds.get(type(data), type(data).__name__)
        raise ConfigError([f"not a watchdog config: a YAML {kind}, not a mapping of "
                           "keys (key: value)"])
    return data


def _read(path: str) -> str:
    try:
        if os.path.isdir(path):
            raise ConfigError(["is a directory, not a config file"])
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(["no such file"]) from None
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror or e}"]) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([f"larger than {MAX_FILE_BYTES // MiB} MiB: not a watchdog config "
                           "(the documented one is 7 KB)"])
    if data[:2] == b"\x1f\x8b":
        raise ConfigError(["gzip-compressed, not a YAML config"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text (byte {e.start}): not a YAML config"]) from None


def _parse_yaml(text: str) -> Any:
    """yaml.safe_load, refusing a document that expands to more than MAX_NODES nodes."""
    import yaml  # the sidecar's dependency; replay with defaults needs no YAML

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node)
        if nodes > MAX_NODES:
            raise ConfigError([f"refused: its aliases (*name) expand to more than {MAX_NODES:,} "
                               "values (a YAML alias bomb?); a watchdog config has ~100"])
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = "; ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError([f"not valid YAML{where}: {what}"]) from None
    except yaml.YAMLError as e:  # a reader error: a control character, for instance
        raise ConfigError([f"not valid YAML: {e}"]) from None
    except RecursionError:
        raise ConfigError(["not a watchdog config: nested too deeply"]) from None
    finally:
        loader.dispose()


def _expanded_nodes(root: Any) -> int:
    """How many nodes the YAML tree under `root` has once every alias is expanded (capped
    just past MAX_NODES); a recursive alias counts as too many."""
    import yaml

    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:  # &a [*a]: infinite once expanded
            return MAX_NODES + 1
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [x for pair in node.value for x in pair]
        else:
            children = []
        for child in children:
            total = min(total + size(child), MAX_NODES + 1)
        active.discard(key)
        memo[key] = total
        return total

    return size(root)


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    if data is None:  # an empty file, or a section whose keys are all commented out
        return cls()
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "config"
        problems.append(f"{where}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(set(data) - names, key=str):
        near = difflib.get_close_matches(str(key), sorted(names), n=1)
        hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
        problems.append(f"{prefix}{key}: unknown key{hint}")
    values = {}
    for name in names & set(data):
        hint, raw = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            # is_dataclass narrows to an instance or a class; a field's type is a class
            values[name] = _build(typing.cast(type, hint), raw, f"{prefix}{name}.", problems)
            continue
        item = (typing.get_args(hint) or (None,))[0]
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(item):
            if not isinstance(raw, list):
                problems.append(f"{prefix}{name}: expected a list, got {type(raw).__name__}")
                continue
            values[name] = [_build(typing.cast(type, item), x, f"{prefix}{name}[{i}].", problems)
                            for i, x in enumerate(raw)]
            continue
        value, problem = _check(_COERCE.get(prefix + name, _same)(raw), hint)
        if problem:
            problems.append(f"{prefix}{name}: {problem}")
        else:
            values[name] = value
    return cls(**values)


def _check(raw: Any, hint: Any) -> tuple[Any, Optional[str]]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        if raw is None:
            return None, None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        if not isinstance(raw, list) or not all(type(x) is args[0] for x in raw):
            return None, f"expected a list of {args[0].__name__}, got {raw!r}"
        return list(raw), None
    if hint is bool:
        return (raw, None) if isinstance(raw, bool) else (None, f"expected true/false, got {raw!r}")
    if hint is str:
        return (raw, None) if isinstance(raw, str) and raw else \
            (None, f"expected text, got {raw!r}")
    if hint in (int, float):
        return _check_number(raw, hint)
    return None, f"unsupported type {hint}"


def _check_number(raw: Any, hint: type) -> tuple[Any, Optional[str]]:
    """A finite number >= 0; an int field takes 2.0 as 2 but not 1.5."""
    try:
        value = hint(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
    except (OverflowError, ValueError):  # int(inf), int(nan), an int too large for a float
        value = None
    if value is None or (not math.isfinite(value) if hint is float else value != raw):
        return None, f"expected {'an integer' if hint is int else 'a number'}, got {raw!r}"
    if value < 0:
        return None, f"must be >= 0, got {raw!r}"
    return value, None


# --- values given as text that mean a number -------------------------------------------------

def _same(raw: Any) -> Any:
    return raw


def _octal_mode(raw: Any) -> Any:
    """A file mode may be written as text, read as octal like chmod: "0660", "0o660", "660".
    (Unquoted 0660 is already an int, 432, to YAML 1.1; unquoted 0o660 is text to PyYAML.)"""
    if not isinstance(raw, str):
        return raw
    digits = raw.strip().lower()
    digits = digits[2:] if digits.startswith("0o") else digits
    if digits and all(c in "01234567" for c in digits):
        return int(digits, 8)
    return raw  # left as text: the type check reports it


_COERCE = {"agent.socket_mode": _octal_mode, "reload.control_mode": _octal_mode}
