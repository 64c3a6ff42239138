"""Settings as frozen dataclasses: a field holds the setting's default, its help text and,
when it may come from the environment, its `ORCHARD_*` name. The CLI's flags are generated
from the fields (`add_flags`) and parsed back into an instance (`from_args`), so a new
setting is one field and a new secret from the environment is one `env=` in its metadata.

A field is on the command line when its metadata has `help` (make it with `setting`):

    help      the flag's help text
    flag      the flag's name when it is not --field-name (no leading dash: a positional)
    env       an environment variable that, when set, replaces the default (a secret, say:
              then it is never typed on a command line); the help text says so
    off       the command line's spelling of None: "off" for addresses (an empty value too),
              -1 for ports
    choices   the allowed values, or a function that returns them
    negate    a bool that is on by default, spelt --no-...: the flag turns it off
    repeat    a tuple whose flag may be given again and again (each adds one value)
    metavar, nargs   as argparse

A field whose type is a config dataclass and whose metadata has `group` nests: its flags
sit in that argument group, with defaults taken from the field's default instance.

This module imports nothing of Orchard's: the config classes live beside what they
configure, and every module below the CLI may use them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any


def setting(default: Any = MISSING, help: str | None = None, *, default_factory: Any = MISSING,
            **metadata: Any) -> Any:
    """A dataclass field with its help text and command-line metadata (see the module docstring)."""
    if help is not None:
        metadata["help"] = help
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of the config dataclass `cls` (for a setting that
    another config shares, so that the value is written once)."""
    f = {f.name: f for f in fields(cls)}[name]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default")


def port_of(address: str) -> int:
    """The port of a HOST:PORT default (a port setting derived from an address setting)."""
    return int(address.rpartition(":")[2])


class BadSize(ValueError, argparse.ArgumentTypeError):
    """A size that does not parse (argparse shows its message as it is)."""


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
               "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


class ByteSize(int):
    """A setting's size in bytes, written as a number with an optional unit: 24GiB, 512MiB,
    1.5G (K, M, G, T and KiB ... TiB are powers of 1024; KB ... TB of 1000), or bytes."""

    def __new__(cls, value: int | str = 0):
        if isinstance(value, str):
            text = value.strip().replace(" ", "")
            number = text.rstrip("KMGTkmgtIiBb")
            unit = text[len(number):].lower()
            try:
                value = int(float(number) * _SIZE_UNITS[unit])
            except (ValueError, KeyError, OverflowError):
                raise BadSize(f"{value!r} is not a size (a number of bytes, or with a unit: 512MiB, 24GiB)") from None
        if value < 0:
            raise BadSize(f"a size cannot be negative: {value}")
        return super().__new__(cls, value)


def human_bytes(n: int) -> str:
    """A size for people: GiB with one decimal from 1 GiB, else MiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1:
        return args[0]
    return tp


def _is_group(f: dataclasses.Field, tp: Any) -> bool:
    return "group" in f.metadata and is_dataclass(tp)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return _flag(f).lstrip("-").replace("-", "_")


def _scalar(tp: Any) -> Any:
    """The type argparse converts one value with (the element type of a tuple)."""
    if typing.get_origin(tp) is tuple:
        return typing.get_args(tp)[0]
    return tp


def _from_env(f: dataclasses.Field, tp: Any, default: Any) -> Any:
    env = f.metadata.get("env")
    if env and os.environ.get(env) is not None:
        return _scalar(tp)(os.environ[env])
    return default


def add_flags(parser: argparse.ArgumentParser, cls: type, *, base: Any = None) -> None:
    """Add the flags of config dataclass `cls` to `parser` (or an argument group). Their
    defaults are `base`'s values when given (an instance), else the fields' defaults, then
    the environment for fields that name a variable."""
    hints = _hints(cls)
    for f in fields(cls):
        tp = _strip_optional(hints[f.name])
        required = base is None and f.default is MISSING and f.default_factory is MISSING
        if base is not None:
            default = getattr(base, f.name)
        else:
            default = None if required else default_of(cls, f.name)
        if _is_group(f, tp):
            add_flags(parser.add_argument_group(f.metadata["group"]), tp, base=default)
            continue
        if "help" not in f.metadata:
            continue
        default = _from_env(f, tp, default)
        flag, kw = _flag(f), {"help": f.metadata["help"]}
        if f.metadata.get("env"):
            kw["help"] += f" (default: ${f.metadata['env']})"
        for key in ("metavar", "nargs"):
            if key in f.metadata:
                kw[key] = f.metadata[key]
        choices = f.metadata.get("choices")
        if choices is not None:
            kw["choices"] = choices() if callable(choices) else choices
        if tp is bool:
            if f.metadata.get("negate"):
                if default is not True:
                    raise TypeError(f"{cls.__name__}.{f.name}: a negated flag needs the default True")
                kw.update(action="store_true", default=False)
            else:
                kw.update(action="store_true", default=bool(default))
        elif f.metadata.get("repeat"):
            if default:
                raise TypeError(f"{cls.__name__}.{f.name}: a repeatable flag starts empty")
            kw.update(action="append", type=_scalar(tp), default=None)
        else:
            kw.update(type=_scalar(tp), default=default)
        if flag.startswith("-"):
            kw["dest"] = _dest(f)
            if required:
                kw["required"] = True
        elif default == ():
            del kw["default"]  # an empty positional list
        parser.add_argument(flag, **kw)


def _value(f: dataclasses.Field, raw: Any) -> Any:
    """A parsed flag's value as the field holds it."""
    if f.metadata.get("negate"):
        return not raw
    if f.metadata.get("repeat") or f.metadata.get("nargs") in ("*", "+"):
        return tuple(raw or ())
    off = f.metadata.get("off")
    if off is not None and (raw == off or (isinstance(off, str) and raw == "")):
        return None
    return raw


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """An instance of config dataclass `cls` from parsed flags (those `add_flags(..., cls)`
    added); `given` sets fields that are not flags (or overrides them)."""
    hints = _hints(cls)
    values = {}
    for f in fields(cls):
        if f.name in given:
            continue
        tp = _strip_optional(hints[f.name])
        if _is_group(f, tp):
            values[f.name] = from_args(tp, args)
        elif "help" in f.metadata:
            values[f.name] = _value(f, getattr(args, _dest(f)))
    return cls(**values, **given)

