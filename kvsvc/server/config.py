"""The server's settings (flags with ``KVSVC_*`` environment equivalents), the
checks made against this host before serving, and the server's fixed limits."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import pwd
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvsvc.limits import (
    DEFAULT_TRANSFER_DEADLINE_S,
    GRPC_SOCKET_NAME,
    GiB,
    MiB,
    validate_deadline,
)

# --- sealed memfd passing (kvsvc.client.fdpass) ---
# A passed fd that a Map has used is held until this long after it was passed (a
# failed Map can be retried, ranks can share one fd); one that no Map has used is
# closed FD_TOKEN_UNUSED_TTL_S after it was passed, so an abandoned pass frees its
# place promptly.
FD_TOKEN_TTL_S = 60.0
FD_TOKEN_UNUSED_TTL_S = 10.0
# At most this many passed fds held at once (and at most a quarter of the soft
# RLIMIT_NOFILE), and at most FD_TOKENS_PER_PEER_MAX from one process, so one
# cannot take every place. Peers in another pid namespace show as pid 0: they
# share one per-peer quota.
FD_TOKENS_MAX = 1024
FD_TOKENS_PER_PEER_MAX = 256
# The fd socket serves up to FD_PEERS_MAX connections at once; one that has not
# sent its fd FD_PEER_TIMEOUT_S after it was accepted is closed, and never delays
# the others.
FD_PEERS_MAX = 64
FD_PEER_TIMEOUT_S = 2.0
# Lease connections (kvsvc.client.fdpass.FdLease) stay open while their engine lives: at
# most this many at once (one fd each; an engine process needs one).
FD_LEASES_MAX = 1024
# How often the server looks for mappings whose memfd owner is gone without
# being told (a one-shot pass's pid exited); a lease that ends wakes it at once.
MAPPING_REAP_INTERVAL_S = 1.0

# --- the remote tier (kvsvc.server.tiers.redis) ---
REMOTE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
# Failures in a row that open the breaker; then one probe call after this long.
REMOTE_BREAKER_FAILURES = 3
REMOTE_BREAKER_OPEN_S = 2.0
# Threads that read from Redis (at most this many exchanges wait on it at once;
# beyond, a read is a miss at once) and that write to it.
REMOTE_FETCHERS = 4
REMOTE_WRITERS = 2
# A writer sends up to this many bytes of queued chunks in one pipeline (its
# staging buffer holds them: smaller batches let one writer copy while the other sends).
REMOTE_WRITE_BATCH_BYTES = 16 * MiB
# A Retrieve's GET replies are handed to the copy into the store in groups of
# about this many bytes while the next replies are still being read.
REMOTE_FETCH_GROUP_BYTES = 16 * MiB
# Bytes the sync clients (they carry values) read from the socket at once
# (redis-py's default: 64 KiB, one read and one parser feed per 64 KiB of a value).
REMOTE_SOCKET_READ_BYTES = 1 * MiB
# With --remote, glibc's malloc keeps up to this many freed bytes at the top of
# each heap and serves large blocks from its heaps, not fresh mmaps: the bytes
# objects hiredis makes for values (one per value, megabytes each) then reuse
# memory already faulted in (kvsvc.server.tiers.redis.reuse_freed_memory).
REMOTE_MALLOC_KEEP_BYTES = 256 * MiB
# --remote's host name is looked up again this often (a failed lookup: after
# REMOTE_BREAKER_OPEN_S); Redis is called only while the last answer was good.
REMOTE_DNS_REFRESH_S = 30.0


# --- server settings ---
class ConfigError(Exception):
    """A setting this host cannot honour (no such directory, no CUDA, a port in
    use), found before serving: ``kvsvc serve`` prints it as one line, exits 2."""


_SIZE_UNITS = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}


def _parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1GiB', '64M' or '2G'."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if s and s[-1] in _SIZE_UNITS:
        mult, s = _SIZE_UNITS[s[-1]], s[:-1]
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def _size_or_off(text: str) -> int:
    """A size, or 0 for '0' / 'off'."""
    return 0 if _off(text) or text.strip() == "0" else _parse_size(text)


def format_size(n: int) -> str:
    """The shortest form _parse_size reads back exactly: 1073741824 -> '1G'."""
    for unit in "TGMK":
        mult = _SIZE_UNITS[unit.lower()]
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _positive_float(text: str) -> float:
    try:
        return validate_deadline(float(text), "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _optional_path(text: str) -> str:
    """A path, or '' for 'none' (how --help writes an unset path)."""
    return "" if text.strip().lower() in ("", "none") else text


def _value_size(text: str) -> int:
    """A Redis value: room for a header, at most Redis' default proto-max-bulk-len."""
    value = _parse_size(text)
    if not MiB <= value <= 512 * MiB:
        raise argparse.ArgumentTypeError(f"must be between 1M and 512M: {text!r}")
    return value


def _remote_url(text: str) -> str:
    """'off' or a Redis URL; a password in it is refused (it would show in ps and logs)."""
    if text.strip().lower() in ("", "off"):  # empty: a variable set to nothing
        return "off"
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in REMOTE_SCHEMES:
        raise argparse.ArgumentTypeError(
            f"expected off or {', '.join(s + '://HOST:PORT' for s in REMOTE_SCHEMES)}; "
            f"got {redact_url(text)!r}"
        )
    userinfo, at, hostpart = rest.partition("@")
    if at and ":" in userinfo:
        raise argparse.ArgumentTypeError(
            "the Redis password goes in --remote-password-file, not in the URL"
        )
    host = (hostpart if at else rest).split("/", 1)[0].split("?", 1)[0]
    if not host:
        raise argparse.ArgumentTypeError(f"no host in {redact_url(text)!r}")
    return text


def redact_url(url: str) -> str:
    """A URL as logs may show it: any password replaced by ***."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.partition("@")
    if sep and at and ":" in userinfo:
        return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hostpart}"
    return url


def remote_password(config: ServerConfig) -> str | None:
    """The Redis password from --remote-password-file (one line; the newline dropped)."""
    if not config.remote_password_file:
        return None
    try:
        with open(config.remote_password_file, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(
            f"--remote-password-file {config.remote_password_file}: {exc.strerror}"
        ) from None


def check_remote_tls(config: ServerConfig) -> None:
    """TLS files for Redis: only with rediss://, cert and key together, readable."""
    files = (
        ("--remote-tls-ca", config.remote_tls_ca),
        ("--remote-tls-cert", config.remote_tls_cert),
        ("--remote-tls-key", config.remote_tls_key),
    )
    if config.remote == "off" or not any(path for _, path in files):
        return
    if not config.remote.startswith("rediss"):
        raise ConfigError("--remote-tls-* need a rediss:// (or rediss+cluster://) --remote")
    if bool(config.remote_tls_cert) != bool(config.remote_tls_key):
        raise ConfigError("--remote-tls-cert and --remote-tls-key go together")
    for flag, path in files:
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{flag} {path}: not a readable file")


def _port(text: str) -> int:
    """0 (pick a free port / off) or 1-65535; grpc would wrap 99999 to 34463."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535 (or 0), got {text!r}")
    return value


def _listen_address(text: str) -> str:
    """HOST:PORT ([IPv6]:PORT) or unix:PATH; whether it can be bound is checked later."""
    if text.startswith("unix:"):
        if not text.removeprefix("unix:"):
            raise argparse.ArgumentTypeError("unix: needs a socket path, e.g. unix:/tmp/kvsvc.sock")
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or unix:PATH, got {text!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(
            f"an IPv6 host goes in brackets ([::1]:50051), got {text!r}"
        )
    _port(port)
    return text


def _off(text: str) -> bool:
    """An optional setting left off: empty, or 'off'."""
    return text.strip().lower() in ("", "off")


def _choice(*choices: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        for choice in choices:
            if text.strip().lower() == choice.lower():
                return choice
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}; got {text!r}")

    return convert


def _env_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false (1/0, yes/no, on/off); got {text!r}")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one ``kvsvc serve`` process (flags, else KVSVC_* env, else default)."""

    listen: str = "127.0.0.1:50051"
    store_bytes: int = GiB
    shm_dir: str = "/dev/shm"
    fd_socket: str = "auto"
    socket_dir: str = ""
    socket_group: str = ""
    device: str = "auto"
    transfer_threads: int = 2
    inline_copy_bytes: int = 4 * MiB
    shutdown_grace: float = 10.0
    stall_timeout: float = 10.0
    default_deadline: float = DEFAULT_TRANSFER_DEADLINE_S
    exit_on_fatal: bool = False
    metrics_port: int = 0
    log_format: str = "text"
    log_level: str = "INFO"
    remote: str = "off"
    remote_password_file: str = ""
    remote_prefix: str = "kvsvc"
    remote_timeout: float = 0.5
    remote_lookup_budget: float = 0.005
    remote_queue_bytes: int = 256 * MiB
    remote_ttl: int = 0
    remote_value_bytes: int = 64 * MiB
    remote_tls_ca: str = ""
    remote_tls_cert: str = ""
    remote_tls_key: str = ""
    shm_uids: str = "self"
    auth_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    allow_insecure: bool = False
    health_listen: str = ""

    @property
    def authenticated(self) -> bool:
        """Calls on the main port must carry credentials (a token or a client cert)."""
        return bool(self.auth_token_file or self.tls_client_ca)


_HELP = {
    "listen": "address to listen on: HOST:PORT (port 0 picks a free one) or unix:PATH",
    "store_bytes": "chunk store capacity in bytes (suffixes K, M, G; MiB/GiB accepted); "
    "least recently used chunks are evicted beyond it",
    "shm_dir": "existing, writable directory holding clients' shared-memory regions; "
    "names cannot escape it",
    "fd_socket": "unix socket that takes clients' sealed memfds (the fast CPU region kind): "
    "a path, 'auto' (fd.sock in --socket-dir, else a per-server name in the shm dir) or 'off'",
    "socket_dir": "directory shared with engines in other containers or pods (a volume or "
    "hostPath, e.g. /run/kvsvc): the fd socket (fd.sock) and a gRPC unix socket (grpc.sock) "
    "live there, mode 0660; made 0750 if missing; '' = none",
    "socket_group": "group (name or gid) given the sockets in --socket-dir and, when the "
    "server owns it, the directory: engines in that group may connect; '' = the server's",
    "device": "where mapped regions live: 'cpu', 'cuda' (fails at start-up without CUDA), "
    "or 'auto' (cuda when available)",
    "transfer_threads": "worker threads that run copies off the event loop",
    "inline_copy_bytes": "a Store/Retrieve of at most this many bytes between sealed memfds "
    "(or the message) and the store copies on the event loop's thread, sparing two thread "
    "hand-offs (GIL released while it copies); of a larger one the loop copies one share "
    "(up to 16 MiB) beside the copy threads; 0 = every copy on the worker threads",
    "shutdown_grace": "seconds that SIGTERM/SIGINT lets in-flight calls finish",
    "stall_timeout": "seconds a copy may run before the server declares itself stalled",
    "default_deadline": "seconds a call that carries no gRPC deadline may take here: "
    "queueing, copying and the handler alike",
    "exit_on_fatal": "exit non-zero after a fatal failure once in-flight copies are fenced",
    "metrics_port": "Prometheus metrics HTTP port (0 = off)",
    "log_format": "'text' or 'json' (one JSON object per line, with request ids)",
    "log_level": "logging level: DEBUG, INFO, WARNING or ERROR",
    "remote": "shared remote tier: redis://[USER@]HOST:PORT[/DB], rediss:// (TLS), "
    "redis+cluster:// or rediss+cluster:// (Redis Cluster, any node), or 'off'; "
    "best-effort: a Redis failure is a miss",
    "remote_password_file": "file holding the Redis password (never on the command line)",
    "remote_prefix": "first part of every Redis key kvsvc writes",
    "remote_timeout": "seconds each Redis connect/read/write may take (no retries)",
    "remote_lookup_budget": "seconds a Lookup may wait for Redis beyond the local store",
    "remote_queue_bytes": "bytes of stored chunks waiting to be written to Redis "
    "(at most a quarter of the store); beyond, writes are dropped and counted",
    "remote_ttl": "seconds Redis keeps a value (0 = no expiry)",
    "remote_value_bytes": "largest Redis value; larger chunks are split into parts",
    "remote_tls_ca": "PEM CA bundle that signed Redis' certificate (rediss://; default: "
    "the system's CAs)",
    "remote_tls_cert": "PEM client certificate for Redis (rediss://, with --remote-tls-key; "
    "Redis asks for one unless tls-auth-clients is no)",
    "remote_tls_key": "PEM private key of --remote-tls-cert",
    "shm_uids": "whose files under the shm dir the server maps by name, with its own "
    "rights: comma-separated uids or user names ('self' = the server's uid), or 'off' "
    "(memfd passing only, where the client hands over an fd it opened itself). Every "
    "client that can call Map is trusted with every listed uid's regular, single-link, "
    "owner-writable files there",
    "auth_token_file": "JSON tenant file: each tenant's bearer tokens (or their SHA-256), client "
    "certificate names, namespaces and quotas; every call must then carry a token "
    "(or a listed client certificate). Re-read on SIGHUP. Off: one default tenant",
    "tls_cert": "PEM certificate chain: serve TLS on --listen (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates it signed (mTLS); a "
    "certificate's name picks its tenant in the tenant file",
    "allow_insecure": "allow plaintext without authentication on an address other than "
    "loopback or a unix socket (anyone who reaches it can read every cached prompt)",
    "health_listen": "HOST:PORT of a plaintext listener serving only grpc.health.v1, for "
    "probes that cannot present credentials (empty: off)",
}
_TYPES: dict[str, Callable[[str], Any]] = {
    "listen": _listen_address,
    "store_bytes": _parse_size,
    "device": _choice("auto", "cpu", "cuda"),
    "transfer_threads": _positive_int,
    "inline_copy_bytes": _size_or_off,
    "shutdown_grace": _positive_float,
    "stall_timeout": _positive_float,
    "default_deadline": _positive_float,
    "exit_on_fatal": _env_bool,
    "metrics_port": _port,
    "log_format": _choice("text", "json"),
    "log_level": _choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "remote": _remote_url,
    "remote_password_file": _optional_path,
    "remote_timeout": _positive_float,
    "remote_lookup_budget": _positive_float,
    "remote_queue_bytes": _parse_size,
    "remote_ttl": _non_negative_int,
    "remote_value_bytes": _value_size,
    "remote_tls_ca": _optional_path,
    "remote_tls_cert": _optional_path,
    "remote_tls_key": _optional_path,
    "shm_uids": lambda text: (shm_owner_uids(text), text.strip())[1],
    "allow_insecure": _env_bool,
    "health_listen": lambda text: "" if _off(text) else _listen_address(text),
    "auth_token_file": lambda text: "" if _off(text) else text,
    "tls_cert": lambda text: "" if _off(text) else text,
    "tls_key": lambda text: "" if _off(text) else text,
    "tls_client_ca": lambda text: "" if _off(text) else text,
}


def shm_owner_uids(setting: str) -> frozenset[int] | None:
    """The uids of --shm-uids (None: 'off', nothing is mapped by name)."""
    if setting.strip().lower() == "off":
        return None
    uids: set[int] = set()
    for item in (part.strip() for part in setting.split(",")):
        if item == "self":
            uids.add(os.geteuid())
        elif item.isdigit():
            uids.add(int(item))
        else:
            try:
                uids.add(pwd.getpwnam(item).pw_uid)
            except KeyError:
                raise argparse.ArgumentTypeError(
                    f"--shm-uids: {item!r} is neither a uid, a user name, 'self' nor 'off'"
                ) from None
    return frozenset(uids)


def env_name(field_name: str) -> str:
    return "KVSVC_" + field_name.upper()


def show_value(field_name: str, value: object) -> str:
    """A setting as README's table and ``--help`` write it (1G, 10, off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if field_name.endswith("_bytes") and isinstance(value, int):
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _from_env(field_name: str) -> Any:
    """The KVSVC_* value of a setting, converted; its default when unset."""
    env = env_name(field_name)
    default = ServerConfig.__dataclass_fields__[field_name].default
    if env not in os.environ:
        return default
    conv = _TYPES.get(field_name, str)
    try:
        return conv(os.environ[env])
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ConfigError(f"{env}={os.environ[env]!r}: {exc}") from None


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare one flag per ServerConfig field. A flag left out is None here and
    falls back to its KVSVC_* variable in config_from_args, so a bad variable is a
    usage error of `kvsvc serve` only, reported with its name."""
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = env_name(f.name)
        try:
            shown = show_value(f.name, _from_env(f.name))
        except ConfigError:
            shown = f"{show_value(f.name, f.default)}; {env} is invalid"
        help_text = f"{_HELP[f.name]} (env {env}; default {shown})".replace("%", "%%")
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        conv: Callable[[str], Any] = _TYPES.get(f.name, str)
        parser.add_argument(flag, type=conv, default=None, help=help_text)


def config_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> ServerConfig:
    """Flags, else KVSVC_* variables, else defaults. A bad variable is
    parser.error (exit 2 with usage) when a parser is given, else ConfigError."""
    values: dict[str, Any] = {}
    for f in fields(ServerConfig):
        value = getattr(args, f.name, None)
        if value is None:
            try:
                value = _from_env(f.name)
            except ConfigError as exc:
                if parser is None:
                    raise
                parser.error(str(exc))
        values[f.name] = value
    return ServerConfig(**values)


def parse_server_config(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="kvsvc serve")
    add_server_arguments(parser)
    return config_from_args(parser.parse_args(argv), parser)


# --- checks against this host, before serving ---
def grpc_socket(config: ServerConfig) -> str | None:
    """The gRPC unix socket the server also listens on (``unix:PATH``), if any."""
    if not config.socket_dir:
        return None
    return "unix:" + os.path.join(config.socket_dir, GRPC_SOCKET_NAME)


def socket_gid(config: ServerConfig) -> int:
    """The gid of --socket-group (-1: keep the server's)."""
    group = config.socket_group.strip()
    if not group:
        return -1
    if group.isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group {group}: no such group") from None


def check_host(config: ServerConfig) -> None:
    """What the flags name must exist here: a ConfigError naming the flag if not.
    Without these a server reports SERVING and then times out every Map."""
    check_shm_dir(config.shm_dir, "--shm-dir")
    socket_gid(config)
    if config.socket_dir:
        d = config.socket_dir
        if os.path.exists(d) and not os.path.isdir(d):
            raise ConfigError(f"--socket-dir {d}: not a directory")
        parent = d if os.path.isdir(d) else os.path.dirname(os.path.abspath(d))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"--socket-dir {d}: {parent} is not a writable directory")
    if config.remote_password_file and config.remote != "off":
        remote_password(config)  # readable, or a ConfigError naming the flag
    check_remote_tls(config)
    if config.fd_socket not in ("auto", "off"):
        parent = os.path.dirname(os.path.abspath(config.fd_socket))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(
                f"--fd-socket {config.fd_socket}: {parent} is not a writable directory"
            )
    if config.listen.startswith("unix:"):
        parent = os.path.dirname(os.path.abspath(config.listen.removeprefix("unix:")))
        if not os.path.isdir(parent):
            raise ConfigError(f"--listen {config.listen}: no such directory {parent}")
    if config.device == "cuda":
        import torch  # only here: importing it costs a second or two

        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device cuda: CUDA is not available to this torch ({torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu or auto"
            )


def check_security(config: ServerConfig) -> None:
    """Secure by default: plaintext without authentication only where nobody else
    can connect (loopback, a unix socket); TLS files must come in working pairs."""
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS first)")
    for flag, path in (
        ("--tls-cert", config.tls_cert),
        ("--tls-key", config.tls_key),
        ("--tls-client-ca", config.tls_client_ca),
        ("--auth-token-file", config.auth_token_file),
    ):
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{flag} {path}: not a readable file")
    if config.tls_cert or config.auth_token_file or config.allow_insecure:
        return
    if not is_local_address(config.listen):
        raise ConfigError(
            f"refusing to serve plaintext without authentication on {config.listen}: "
            "give --tls-cert/--tls-key and/or --auth-token-file, listen on loopback or "
            "unix:PATH, or pass --allow-insecure"
        )


def is_local_address(listen: str) -> bool:
    """Whether only this host can connect: a unix socket, or a host that resolves to
    loopback addresses only (a wildcard such as 0.0.0.0 or [::] is not)."""
    if listen.startswith("unix:"):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


#: A client's bearer token comes from a file (never argv, never a log line).
TOKEN_FILE_ENV = "KVSVC_TOKEN_FILE"


def read_token_file(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped). The message
    names the file, never its content."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file {path}: cannot read it ({type(exc).__name__})") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"--token-file {path}: must hold one token, without spaces")
    return token


def check_shm_dir(path: str, flag: str) -> None:
    if not os.path.isdir(path):
        what = "not a directory" if os.path.exists(path) else "no such directory"
        raise ConfigError(f"{flag} {path}: {what}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: not writable by this user")


def check_listen(config: ServerConfig) -> None:
    """Bind what the server will bind, and let go: a port in use or a host that does
    not resolve becomes one clear line (grpc says only 'Failed to bind', after a
    C-core log line), before anything is created."""
    if config.listen.startswith("unix:"):
        host = "127.0.0.1"  # where the server puts metrics then
    else:
        host, _, port = config.listen.rpartition(":")
        host = host.strip("[]")
        _check_bindable(config.listen, host, int(port))
    if config.metrics_port:
        _check_bindable(f"{host}:{config.metrics_port} (--metrics-port)", host, config.metrics_port)
    if config.health_listen and not config.health_listen.startswith("unix:"):
        h_host, _, h_port = config.health_listen.rpartition(":")
        _check_bindable(
            f"{config.health_listen} (--health-listen)", h_host.strip("[]"), int(h_port)
        )


def _check_bindable(what: str, host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"cannot listen on {what}: host {host!r} does not resolve ({exc.strerror})"
        ) from None
    bound, first_error = 0, None
    for family, type_, proto, _, addr in infos:
        try:
            with socket.socket(family, type_, proto) as s:
                # As grpc does: a port in TIME_WAIT is free, a listening one is not.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
            bound += 1
        except OSError as exc:
            # An address family this host lacks (no IPv6) is skipped, as grpc does.
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise ConfigError(f"cannot listen on {what}: {exc.strerror}") from None
            first_error = first_error or exc
    if not bound:
        reason = first_error.strerror if first_error else "no address"
        raise ConfigError(f"cannot listen on {what}: {reason}")
