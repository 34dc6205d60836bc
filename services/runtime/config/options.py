"""How an option is declared, turned into a flag and a ``KVMESH_*`` variable, and checked.

An option is a field of a frozen config dataclass declared with :func:`opt`:
its default, help text and limits (``choices``, ``minimum``, ``maximum``) live
in the field's metadata, so the flag's help, argparse's ``choices`` and the
check in ``__post_init__`` all read the same declaration. An option
``foo_bar`` is the flag ``--foo-bar`` and the variable ``KVMESH_FOO_BAR``; the
flag wins over the variable, the variable over the default. A
``tuple[str, ...]`` option takes several values (``--lora-modules a=/x b=/y``),
and its variable holds them shell-quoted and space-separated.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "KVMESH_"

T = TypeVar("T")


def opt(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    minimum: int | float | None = None,
    maximum: int | float | None = None,
) -> Any:
    """A config field: its default, help text and limits, declared together."""
    metadata = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum}
    return field(default=default, metadata=metadata)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def converter(tp: Any) -> Callable[[str], Any]:
    """How the text of a flag or variable becomes a value of type ``tp``."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return converter(inner[0])
    if tp is bool:
        return parse_bool
    if origin is tuple:
        return lambda text: tuple(shlex.split(text))
    if tp is Path:
        return lambda text: Path(text).expanduser()
    return tp


def as_env_text(value: Any) -> str:
    if isinstance(value, tuple):
        return shlex.join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_choice(name: str, value: str, choices: Collection[str]) -> None:
    """The one place a value is checked against its declared choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def limits_text(f: dataclasses.Field[Any]) -> str:
    """The limits of option ``f`` in words, from its declaration."""
    choices, low, high = (f.metadata.get(k) for k in ("choices", "minimum", "maximum"))
    if choices is not None:
        return "one of " + ", ".join(choices)
    if low is not None and high is not None:
        return f"{low}..{high}"
    if low is not None:
        return f">= {low}"
    if high is not None:
        return f"<= {high}"
    return ""


def check_limits(config: Any) -> None:
    """Refuse any field of ``config`` outside its declared limits (the default always passes)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        choices, low, high = (f.metadata.get(k) for k in ("choices", "minimum", "maximum"))
        if choices is not None:
            check_choice(f.name, value, choices)
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"{f.name} must be {limits_text(f)}; got {value!r}")


@dataclass(frozen=True)
class Options:
    """Base of every config dataclass: checks each field against its declared limits."""

    def __post_init__(self) -> None:
        check_limits(self)


def _help(f: dataclasses.Field[Any]) -> str:
    facts = [f"env {env_name(f.name)}", f"default {f.default!r}"]
    if limits := limits_text(f):
        facts.append(limits)
    # argparse expands % in help text.
    return f"{f.metadata.get('help', '')} [{'; '.join(facts)}]".replace("%", "%%")


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    exclude: Collection[str] = (),
) -> None:
    """Add one flag per field of the config dataclass ``cls`` (except those in ``exclude``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_help(f),
            )
            continue
        if typing.get_origin(hints[f.name]) is tuple:
            parser.add_argument(flag, dest=f.name, nargs="*", default=None, help=_help(f))
            continue
        choices = f.metadata.get("choices")
        extra: dict[str, Any] = {}
        if choices is not None:
            # The default may stand outside the choices ("" for "decide for me").
            allowed = choices if f.default in choices else [f.default, *choices]
            extra = {"choices": allowed, "metavar": "{" + ",".join(choices) + "}"}
        parser.add_argument(
            flag,
            dest=f.name,
            type=converter(hints[f.name]),
            default=None,
            help=_help(f),
            **extra,
        )


def config_from_namespace(
    cls: type[T], namespace: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> T:
    """Build ``cls`` from parsed flags, then env vars, then field defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag_value = getattr(namespace, f.name, None)
        if flag_value is not None:
            values[f.name] = tuple(flag_value) if isinstance(flag_value, list) else flag_value
            continue
        raw = environ.get(env_name(f.name))
        if raw is not None and raw != "":
            try:
                values[f.name] = converter(hints[f.name])(raw)
            except ValueError as e:
                raise ValueError(f"{env_name(f.name)}={raw!r}: {e}") from e
    return cls(**values)


def config_to_env(config: Any) -> dict[str, str]:
    """The ``KVMESH_*`` variables that reproduce ``config`` in a child process."""
    env: dict[str, str] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is not None:
            env[env_name(f.name)] = as_env_text(value)
    return env
