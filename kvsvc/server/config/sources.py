"""Where a ServerConfig comes from: ``kvsvc serve``'s flags, else KVSVC_* variables,
else a TOML file (``--config``), else the declared defaults; and the effective
configuration written back as such a file, each value's source beside it
(``--print-config``). Flags, the variable reader and the file's keys are generated
from the declarations in kvsvc.server.config.settings; nothing here names a setting."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvsvc.server.config.setting import ConfigError, Setting, default_show
from kvsvc.server.config.settings import GROUPS, SETTINGS, ServerConfig

#: The variable that names the configuration file when --config is not given.
CONFIG_ENV = "KVSVC_CONFIG"
DEFAULT = "default"


def plain(text: str) -> str:
    """Help as a terminal shows it: README's `code` spans without their backticks."""
    return text.replace("`", "")


def help_line(s: Setting, environ: Mapping[str, str]) -> str:
    """A flag's --help: what it does, its variable and its default (the variable's
    value when set: what the server would use)."""
    try:
        shown = s.show(s.from_env(environ))
    except ConfigError:
        shown = f"{s.show(s.default)}; {s.env} is invalid"
    else:
        if s.note and s.env not in environ:
            shown += f": {s.note}"
    return f"{plain(s.help)} (env {s.env}; default {shown})"


def add_server_arguments(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """One flag per declared setting, in an argument group per concern. A flag left
    out is None here and falls back to its KVSVC_* variable in config_from_args, so
    a bad variable is a usage error of `kvsvc serve` only, reported with its name."""
    env = os.environ if environ is None else environ
    about = parser.add_argument_group(
        "configuration file and checks",
        'A TOML file of settings by name (store_bytes = "2G"); a flag or KVSVC_* '
        "variable overrides the file.",
    )
    about.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"read settings from this TOML file (or the file {CONFIG_ENV} names)",
    )
    about.add_argument(
        "--check",
        action="store_true",
        help="check the settings and this host as a start would (a port in use is refused), "
        "serve nothing, exit 0 or 2",
    )
    about.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration as TOML, each value's source beside it, "
        "and exit (with --check: then check)",
    )
    for g in GROUPS:
        group = parser.add_argument_group(f"{g.title.lower()} settings", g.about)
        for s in g.settings:
            help_text = help_line(s, env).replace("%", "%%")
            if s.is_bool:
                group.add_argument(
                    s.flag,
                    dest=s.name,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
            else:
                group.add_argument(s.flag, dest=s.name, type=s.parse, default=None, help=help_text)


@dataclass(frozen=True)
class Resolved:
    """A configuration and where each setting's value came from: ``flag --x``,
    ``env KVSVC_X``, ``file PATH`` or ``default``, by setting name."""

    config: ServerConfig
    origins: Mapping[str, str]


def config_from_args(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Flags, else KVSVC_* variables, else the --config file, else defaults (see
    resolve_args for the errors)."""
    return resolve_args(args, parser, environ).config


def resolve_args(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser | None = None,
    environ: Mapping[str, str] | None = None,
) -> Resolved:
    """Flags, else KVSVC_* variables, else the --config file, else defaults. A bad
    variable is parser.error (exit 2 with usage) when a parser is given, else
    ConfigError; anything wrong in the file is a ConfigError naming the file."""
    env = os.environ if environ is None else environ
    path = getattr(args, "config", None) or env.get(CONFIG_ENV, "")
    from_file = read_config_file(path) if path else {}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for s in SETTINGS.values():
        value = getattr(args, s.name, None)
        origin = f"flag {s.flag}"
        if value is None and s.env in env:
            origin = f"env {s.env}"
            try:
                value = s.from_env(env)
            except ConfigError as exc:
                if parser is None:
                    raise
                parser.error(str(exc))
        if value is None:
            value, origin = (
                (from_file[s.name], f"file {path}")
                if s.name in from_file
                else (
                    s.default,
                    DEFAULT,
                )
            )
        values[s.name], origins[s.name] = value, origin
    return Resolved(ServerConfig.from_settings(**values), origins)


# --- the configuration file -------------------------------------------------------
_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}


def read_config_file(path: str) -> dict[str, Any]:
    """The settings a TOML file sets, parsed as their flags are: top-level keys named
    as the settings (``store_bytes``), values as strings written as for the flag
    ("2G", "off") or as TOML numbers and booleans. Any unknown key, bad value or
    unreadable file is a ConfigError naming the file (and the key)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, raw in data.items():
        s = SETTINGS.get(key)
        if s is None:
            raise ConfigError(f"{path}: {key}: {_unknown(key, raw)}")
        try:
            values[key] = s.parse(_as_text(s, raw))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"{path}: {key}: {exc}") from None
    return values


def _unknown(key: str, raw: object) -> str:
    """Why ``key`` is refused, with the setting it most likely meant."""
    if isinstance(raw, dict):
        return 'unknown table: settings are top-level keys (store_bytes = "2G"), not sections'
    name = key.replace("-", "_").lower()
    guess = (
        name if name in SETTINGS else next(iter(difflib.get_close_matches(name, SETTINGS, 1)), "")
    )
    return f"unknown setting (did you mean {guess}?)" if guess else "unknown setting"


def _as_text(s: Setting, raw: object) -> str:
    """A TOML value as the flag's text, so the setting's one parser judges it."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, bool):
        if not s.is_bool:
            raise ValueError(f"expected {_expected(s)}, not a boolean")
        return "true" if raw else "false"
    if isinstance(raw, (int, float)) and not s.is_bool:
        if isinstance(raw, float) and not math.isfinite(raw):
            raise ValueError(f"expected {_expected(s)}, not {raw}")
        return str(raw)
    kind = _TOML_TYPES.get(type(raw), f"a TOML {type(raw).__name__}")
    if isinstance(raw, list):
        kind = "an array"
    raise ValueError(f"expected {_expected(s)}, not {kind}")


def _expected(s: Setting) -> str:
    if s.is_bool:
        return "true or false"
    kind = type(s.default)
    return "a string" if kind is str else f"a number or a string such as {_toml(s, s.default)}"


# --- the effective configuration, as a file --------------------------------------
def effective_toml(resolved: Resolved) -> str:
    """The configuration as a TOML file ``--config`` reads back to the same values,
    grouped as --help groups it, each value's source in a comment. Values are shown
    as their settings show them (a Redis URL's password as ***)."""
    lines = [
        "# kvsvc serve: the effective configuration; each value's source is beside it.",
        "# Read it back with: kvsvc serve --config FILE (flags and KVSVC_* override it).",
    ]
    config = resolved.config
    for g in GROUPS:
        lines += ["", f"# {g.title}: {g.about}"]
        for s in g.settings:
            value = getattr(getattr(config, g.attr), s.name)
            lines.append(f"{s.name} = {_toml(s, value)}  # {resolved.origins[s.name]}")
    return "\n".join(lines) + "\n"


def _toml(s: Setting, value: object) -> str:
    """One value as TOML: a boolean, a number, or a string (a size as "1G")."""
    if s.shows is not default_show:
        return _toml_string(s.show(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # finite: every float setting's parser refuses inf and nan
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, except that TOML also
    escapes DEL and has no surrogate pairs (hence ensure_ascii=False)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def parse_server_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """The config `kvsvc serve ARGV` would run with (exit 2 on a bad flag or variable)."""
    parser = argparse.ArgumentParser(prog="kvsvc serve")
    add_server_arguments(parser, environ)
    return config_from_args(parser.parse_args(argv), parser, environ)
