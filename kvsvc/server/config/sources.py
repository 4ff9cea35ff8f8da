"""Where a ServerConfig comes from: ``kvsvc serve``'s flags, else KVSVC_* variables,
else the declared defaults. Flags and the variable reader are generated from the
declarations in kvsvc.server.config.settings; nothing here names a setting."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.server.config.setting import ConfigError, Setting
from kvsvc.server.config.settings import GROUPS, SETTINGS, ServerConfig


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


def config_from_args(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Flags, else KVSVC_* variables, else defaults. A bad variable is
    parser.error (exit 2 with usage) when a parser is given, else ConfigError."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in SETTINGS.values():
        value = getattr(args, s.name, None)
        if value is None:
            try:
                value = s.from_env(env)
            except ConfigError as exc:
                if parser is None:
                    raise
                parser.error(str(exc))
        values[s.name] = value
    return ServerConfig.from_settings(**values)


def parse_server_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """The config `kvsvc serve ARGV` would run with (exit 2 on a bad flag or variable)."""
    parser = argparse.ArgumentParser(prog="kvsvc serve")
    add_server_arguments(parser, environ)
    return config_from_args(parser.parse_args(argv), parser, environ)
