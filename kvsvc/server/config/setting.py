"""What one setting is: its declaration (name, flag, environment variable, default,
parser, help), made once as a field of a settings dataclass, from which ``kvsvc
serve``'s flags, the KVSVC_* reader and docs/configuration.md's tables are generated."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "KVSVC_"


class ConfigError(Exception):
    """A setting this host cannot honour (no such directory, no CUDA, a port in
    use), found before serving: ``kvsvc serve`` prints it as one line, exits 2."""


def default_show(value: object) -> str:
    """A value as written unless its setting says otherwise: on/off, 10, none (empty)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else "none"


@dataclass(frozen=True)
class Setting:
    """One setting. ``name`` is its field in its group (and the flag and variable,
    unless ``env`` names another); ``help`` may hold `code` spans (README keeps
    them, --help drops the backticks); ``note`` says what the default means."""

    name: str
    group: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    note: str = ""
    env: str = ""
    shows: Callable[[Any], str] = default_show

    def __post_init__(self) -> None:
        if not self.env and self.name:
            object.__setattr__(self, "env", ENV_PREFIX + self.name.upper())

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return isinstance(self.default, bool)

    def show(self, value: object) -> str:
        """A value as --help and README write it (1G, 10, off, none); parse reads it back."""
        return self.shows(value)

    def from_env(self, environ: Mapping[str, str]) -> Any:
        """This setting's variable, parsed; the default when it is unset."""
        if self.env not in environ:
            return self.default
        try:
            return self.parse(environ[self.env])
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"{self.env}={environ[self.env]!r}: {exc}") from None


def setting(
    default: Any,
    parse: Callable[[str], Any],
    help: str,
    *,
    note: str = "",
    env: str = "",
    shows: Callable[[Any], str] = default_show,
) -> Any:
    """Declare a setting as a settings-dataclass field (its name and group come from
    the field and the class: see ``declared``)."""
    spec = Setting("", "", default, parse, help, note, env, shows)
    return field(default=default, metadata={"setting": spec})


def declared(cls: type, group: str) -> tuple[Setting, ...]:
    """The settings a group dataclass declares, in field order."""
    return tuple(
        dataclasses.replace(f.metadata["setting"], name=f.name, group=group)
        for f in dataclasses.fields(cls)
    )
