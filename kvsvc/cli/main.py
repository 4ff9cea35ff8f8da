"""The ``kvsvc`` command: ``serve``, ``demo``, ``init-auth``, ``drop-namespace``,
``stats`` (kvsvc.cli.stats) and ``failpoints``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvsvc import __version__
from kvsvc.cli import stats
from kvsvc.logs import setup_logging
from kvsvc.server.config import (
    TOKEN_FILE_ENV,
    ConfigError,
    ServerConfig,
    add_server_arguments,
    check_host,
    check_listen,
    check_security,
    effective_toml,
    env_name,
    read_token_file,
    resolve_args,
)
from kvsvc.server.config.values import positive_float, target_address
from kvsvc.server.ops import failpoints


class _Parser(argparse.ArgumentParser):
    """A usage error is one line naming its cause: serve's usage alone runs to forty
    lines, which buried it. --help still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="kvsvc",
        description="kvsvc: moves LLM KV-cache blocks between engine workers and a cache server",
    )
    parser.add_argument("--version", action="version", version=f"kvsvc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the server",
        description="Run the kvsvc server. Every flag has a KVSVC_* environment equivalent "
        "and a key of the same name in a --config file.",
    )
    add_server_arguments(serve)

    demo = sub.add_parser(
        "demo",
        help="map a synthetic KV cache, store, look up, retrieve, verify, show errors",
        description="Run the kvsvc demo against --target, or against a server it starts itself.",
    )
    demo.add_argument(
        "--target",
        default=None,
        type=target_address,
        help="HOST:PORT or unix:PATH of a running server (default: start one)",
    )
    demo.add_argument(
        "--shm-dir",
        default=os.environ.get("KVSVC_SHM_DIR", "/dev/shm"),
        help="shared-memory directory the server maps from (env KVSVC_SHM_DIR)",
    )
    demo.add_argument(
        "--memfd",
        action="store_true",
        help="pass sealed memfds over the server's fd socket instead of files in the shm "
        "dir: what an engine in another container does",
    )
    demo.add_argument(
        "--fd-socket",
        default=None,
        help="the server's fd socket as this process sees it (default: where the server "
        "says it is)",
    )

    demo.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV, ""),
        help=f"file holding the bearer token of a server with --auth-token-file (env "
        f"{TOKEN_FILE_ENV}); the token is never taken on the command line",
    )

    init_auth = sub.add_parser(
        "init-auth",
        help="make a first tenant file and its token, unless the tenant file exists",
        description="Write a tenant file with one tenant (every namespace) and a random "
        "256-bit token, stored there only as its SHA-256, and the token itself in "
        "'token' beside it; both mode 0600. Does nothing if the tenant file exists.",
    )
    init_auth.add_argument(
        "--tenant-file",
        default=os.environ.get(env_name("auth_token_file"), ""),
        help=f"where the tenant file goes (env {env_name('auth_token_file')})",
    )

    drop = sub.add_parser(
        "drop-namespace",
        help="drop every chunk of one namespace (e.g. a deleted user's cache salt)",
        description="Drop every chunk of NAMESPACE on the server at --target, from memory "
        "and every tier it has: disk, Redis, S3, Mooncake (DropNamespace); a tenant drops "
        "only its own namespaces.",
    )
    drop.add_argument("namespace", help="the namespace, as the caller's other calls name it")
    drop.add_argument(
        "--target", default="127.0.0.1:50051", type=target_address, help="HOST:PORT or unix:PATH"
    )
    drop.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV, ""),
        help=f"file holding the bearer token (env {TOKEN_FILE_ENV})",
    )
    drop.add_argument(
        "--timeout", type=positive_float, default=30.0, help="seconds the call may take"
    )

    stats.add_parser(sub)

    sub.add_parser("failpoints", help="list the fault-injection points (KVSVC_FAILPOINTS)")

    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            return _serve(args, serve)
        except KeyboardInterrupt:  # Ctrl-C before serve() handles signals: nothing made yet
            return 130
    if args.command == "demo":
        from kvsvc.cli.demo import run_demo
        from kvsvc.server.security.auth import warn_if_exposed

        setup_logging("WARNING", "text")
        try:
            token = read_token_file(args.token_file) if args.token_file else None
        except ConfigError as exc:
            print(f"kvsvc demo: {exc}", file=sys.stderr)
            return 2
        if args.token_file:
            warn_if_exposed(args.token_file, "--token-file")
        return run_demo(
            args.target, args.shm_dir, memfd=args.memfd, fd_socket=args.fd_socket, token=token
        )
    if args.command == "init-auth":
        return _init_auth(args.tenant_file)
    if args.command == "drop-namespace":
        return _drop_namespace(args)
    if args.command == "stats":
        return stats.run(args)
    if args.command == "failpoints":
        try:
            failpoints.parse(os.environ.get(failpoints.ENV, ""))
        except ValueError as exc:
            print(f"kvsvc failpoints: {failpoints.ENV}: {exc}", file=sys.stderr)
            return 2

        print("Set KVSVC_FAILPOINTS='name=[TAG@][P*]ACTION;...' before the server starts.")
        print(
            "Actions: raise, sleep(MS), hang, kill-thread; TAG@ limits a point to a rank or RPC.\n"
        )
        for name, where in failpoints.POINTS.items():
            print(f"  {name:24} {where}")
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


def _drop_namespace(args: argparse.Namespace) -> int:
    """One DropNamespace; what was dropped on one line, or the typed error (exit 1)."""
    from kvsvc.client import KVCacheClient
    from kvsvc.errors import KVServiceError

    try:
        token = read_token_file(args.token_file) if args.token_file else None
    except ConfigError as exc:
        print(f"kvsvc drop-namespace: {exc}", file=sys.stderr)
        return 2
    try:
        with KVCacheClient(args.target, token=token) as client:
            r = client.drop_namespace(args.namespace, timeout=args.timeout)
    except (KVServiceError, ValueError) as exc:
        print(f"kvsvc drop-namespace: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    # Only what was dropped is named: a zero cannot say whether the server has that
    # tier at all (the reply does not tell), and "0 Redis keys" read as if it had.
    dropped = [f"{r.dropped_chunks} chunks ({r.dropped_bytes} bytes) from memory"]
    if r.disk_chunks:
        dropped.append(f"{r.disk_chunks} chunk files ({r.disk_bytes} bytes) from disk")
    if r.redis_keys:
        dropped.append(f"{r.redis_keys} keys from Redis")
    if r.s3_objects:
        dropped.append(f"{r.s3_objects} objects ({r.s3_bytes} bytes) from S3")
    if r.mooncake_values:
        dropped.append(f"{r.mooncake_values} values from Mooncake")
    unfinished = [
        f"; the {tier} did not finish: run it again"
        for tier, complete in (
            ("Redis scan", r.redis_complete),
            ("S3 deletes", r.s3_complete),
            ("Mooncake removal", r.mooncake_complete),
        )
        if not complete
    ]
    said = f"{args.namespace}: dropped {', '.join(dropped)}{''.join(unfinished)}"
    print(f"kvsvc drop-namespace: {said}")
    return 1 if unfinished else 0


def _init_auth(path: str) -> int:
    from kvsvc.server.security.auth import TOKEN_FILE_NAME, init_tenant_file

    if not path:
        print(
            f"kvsvc init-auth: give --tenant-file or {env_name('auth_token_file')}",
            file=sys.stderr,
        )
        return 2
    directory = os.path.dirname(path) or "."
    token_path = os.path.join(directory, TOKEN_FILE_NAME)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        print(f"kvsvc init-auth: --tenant-file {path}: {directory} {what}", file=sys.stderr)
        return 2
    try:
        made = init_tenant_file(path)
    except OSError as exc:
        print(f"kvsvc init-auth: cannot write in {directory}: {exc.strerror}", file=sys.stderr)
        return 2 if isinstance(exc, PermissionError) else 1
    done = "wrote" if made else "kept the existing"
    print(f"kvsvc init-auth: {done} {path} (token in {token_path})")
    return 0


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Every invalid configuration is one line and exit 2, before anything is made:
    a bad flag or KVSVC_* value, or one this host cannot honour, is a usage error;
    an address that cannot be bound or a refused security setup is
    `kvsvc serve: ...`. Only a ConfigError is such a line: what kvsvc.server.config's
    checks cannot foresee is a bug to see whole, with its traceback."""
    try:
        resolved = resolve_args(args, parser)
    except ConfigError as exc:  # the --config file's: names the file and the key
        return _refuse(exc)
    config = resolved.config
    if args.print_config:
        sys.stdout.write(effective_toml(resolved))
        if not args.check:
            return 0
    try:
        check_host(config)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        check_listen(config)
        check_security(config)
    except ConfigError as exc:
        return _refuse(exc)
    if args.check:
        return _check_rest(config)
    setup_logging(config.observability.log_level, config.observability.log_format)
    try:
        failpoints.load_from_env()  # the only place a failpoint table is installed
    except ValueError as exc:
        return _refuse(f"{failpoints.ENV}: {exc}")
    from kvsvc.server.ops.lifecycle import serve as run_server

    try:
        return asyncio.run(run_server(config))
    except ConfigError as exc:  # the port was taken between the check and the bind
        return _refuse(exc)


def _check_rest(config: ServerConfig) -> int:
    """`serve --check`, past the host checks: what a start reads before serving (the
    tenant file, KVSVC_FAILPOINTS), read and judged here; nothing is made or bound."""
    from kvsvc.server.security.auth import TenantFileError, load_tables

    try:
        failpoints.parse(os.environ.get(failpoints.ENV, ""))
    except ValueError as exc:
        return _refuse(f"{failpoints.ENV}: {exc}")
    if config.security.auth_token_file:
        try:
            load_tables(config.security.auth_token_file)
        except TenantFileError as exc:
            return _refuse(f"--auth-token-file: {exc}")
    print(f"kvsvc serve --check: the configuration is valid here (listen {config.network.listen})")
    return 0


def _refuse(why: object) -> int:
    print(f"kvsvc serve: {why}", file=sys.stderr)
    return 2
