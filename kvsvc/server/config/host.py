"""Checks of a ServerConfig against this host, made before serving: what a setting
names must exist and be usable here, else a ConfigError naming the flag (one line,
exit 2), before the server creates anything. Without them a server could report
SERVING and then time out every Map, or die with a traceback on its first bind."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import ssl
import stat

from kvsvc.limits import FD_SOCKET_NAME, GRPC_SOCKET_NAME
from kvsvc.server.config.memory import check_store_fits
from kvsvc.server.config.setting import ConfigError
from kvsvc.server.config.settings import ServerConfig

#: A client's bearer token comes from a file (never argv, never a log line).
TOKEN_FILE_ENV = "KVSVC_TOKEN_FILE"
# sockaddr_un.sun_path minus its NUL: a longer unix socket path cannot be bound
# (the fd socket's too: kvsvc.server.data.fdsocket).
MAX_UNIX_PATH = 107


def remote_password(config: ServerConfig) -> str | None:
    """The Redis password from --remote-password-file (one line; the newline dropped)."""
    tiers = config.tiers
    if not tiers.remote_password_file:
        return None
    try:
        with open(tiers.remote_password_file, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(
            f"--remote-password-file {tiers.remote_password_file}: {exc.strerror}"
        ) from None


def check_remote_tls(config: ServerConfig) -> None:
    """TLS files for Redis: only with rediss://, cert and key together, readable."""
    tiers = config.tiers
    files = (
        ("--remote-tls-ca", tiers.remote_tls_ca),
        ("--remote-tls-cert", tiers.remote_tls_cert),
        ("--remote-tls-key", tiers.remote_tls_key),
    )
    if tiers.remote == "off" or not any(path for _, path in files):
        return
    if not tiers.remote.startswith("rediss"):
        raise ConfigError("--remote-tls-* need a rediss:// (or rediss+cluster://) --remote")
    if bool(tiers.remote_tls_cert) != bool(tiers.remote_tls_key):
        raise ConfigError("--remote-tls-cert and --remote-tls-key go together")
    for flag, path in files:
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{flag} {path}: not a readable file")
    check_pem(
        ("--remote-tls-cert", tiers.remote_tls_cert), ("--remote-tls-key", tiers.remote_tls_key)
    )
    check_pem(ca=("--remote-tls-ca", tiers.remote_tls_ca))


def check_pem(
    cert: tuple[str, str] = ("", ""),
    key: tuple[str, str] = ("", ""),
    ca: tuple[str, str] = ("", ""),
) -> None:
    """PEM files (each a (flag, path); an empty path is skipped) that TLS can load: a
    certificate chain with its private key, a CA bundle. Else grpc fails at bind
    with only 'could not bind' (and redis-py on every connect), after serving began."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        if cert[1]:
            # password: an encrypted key fails here (as in grpc) instead of prompting
            context.load_cert_chain(cert[1], key[1] or None, password=b"")
        if ca[1]:
            context.load_verify_locations(cafile=ca[1])
    except (ssl.SSLError, OSError) as exc:
        flags = " with ".join(f"{f} {p}" for f, p in (cert, key) if p) if cert[1] else ""
        what = flags or f"{ca[0]} {ca[1]}"
        reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
        raise ConfigError(f"{what}: not a usable PEM file ({reason})") from None


def grpc_socket(config: ServerConfig) -> str | None:
    """The gRPC unix socket the server also listens on (``unix:PATH``), if any."""
    if not config.network.socket_dir:
        return None
    return "unix:" + os.path.join(config.network.socket_dir, GRPC_SOCKET_NAME)


def socket_gid(config: ServerConfig) -> int:
    """The gid of --socket-group (-1: keep the server's)."""
    group = config.network.socket_group.strip()
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
    """What the flags name must exist here: a ConfigError naming the flag if not."""
    net, data = config.network, config.data
    check_shm_dir(data.shm_dir, "--shm-dir")
    gid = socket_gid(config)
    if net.socket_dir:
        _check_socket_dir(net.socket_dir, gid)
    if config.tiers.remote_password_file and config.tiers.remote != "off":
        remote_password(config)  # readable, or a ConfigError naming the flag
    check_remote_tls(config)
    _check_tls_files(config)
    if data.fd_socket not in ("auto", "off"):
        check_unix_socket("--fd-socket", data.fd_socket, gid)
    if net.listen.startswith("unix:"):
        path = net.listen.removeprefix("unix:")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(f"--listen {net.listen}: no such directory {parent}")
        _check_path_length("--listen", path)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"--listen {net.listen}: {path} exists and is not a socket")
    if config.tiers.disk_dir:
        check_disk_dir(config.tiers.disk_dir)
    check_store_fits(data.store_bytes)
    if data.device == "cuda":
        import torch  # only here: importing it costs a second or two

        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device cuda: CUDA is not available to this torch ({torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu or auto"
            )


def _check_tls_files(config: ServerConfig) -> None:
    """--tls-* that TLS can load (check_security judges their pairing and access)."""
    sec = config.security
    readable = [p for p in (sec.tls_cert, sec.tls_key) if p and os.access(p, os.R_OK)]
    if sec.tls_cert and sec.tls_key and len(readable) == 2:
        check_pem(("--tls-cert", sec.tls_cert), ("--tls-key", sec.tls_key))
    if sec.tls_client_ca and os.access(sec.tls_client_ca, os.R_OK):
        check_pem(ca=("--tls-client-ca", sec.tls_client_ca))


def _check_socket_dir(d: str, gid: int) -> None:
    if os.path.exists(d) and not os.path.isdir(d):
        raise ConfigError(f"--socket-dir {d}: not a directory")
    parent = d if os.path.isdir(d) else os.path.dirname(os.path.abspath(d))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--socket-dir {d}: {parent} is not a writable directory")
    for name in (FD_SOCKET_NAME, GRPC_SOCKET_NAME):
        _check_path_length("--socket-dir", os.path.join(d, name))
    if os.path.isdir(d):  # else the server makes it, with the group
        check_unix_socket("--socket-dir", os.path.join(d, FD_SOCKET_NAME), gid)


def _check_path_length(flag: str, path: str) -> None:
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise ConfigError(
            f"{flag}: {path} is longer than a unix socket path may be ({MAX_UNIX_PATH} bytes)"
        )


def check_unix_socket(flag: str, path: str, gid: int) -> None:
    """Whether the server can make its unix socket at ``path`` and give it ``gid``
    (-1: keep), as kvsvc.server.data.fdsocket will: tried on a probe socket beside
    it (at ``path`` itself, when free, if the probe's name would be too long), then
    removed. A socket left there by a server that died is replaced then; a file, a
    directory or a live server there are refused here."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not a writable directory")
    _check_path_length(flag, path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{flag} {path}: exists and is not a socket")
    if st is not None and _answers(path):
        raise ConfigError(f"{flag} {path}: another server is listening on this socket")
    probe = os.path.join(parent, f".kvsvc-probe-{os.getpid()}")
    if len(os.fsencode(probe)) > MAX_UNIX_PATH:
        probe = path if st is None else ""  # the real path is free: probe there
    if not probe:
        return
    if probe != path and os.path.lexists(probe):  # left by a check that was killed
        os.unlink(probe)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        try:
            s.bind(probe)
            if gid >= 0:
                os.chown(probe, -1, gid)
        except OSError as exc:
            what = f"cannot give it group {gid}" if exc.errno == errno.EPERM else "cannot bind it"
            raise ConfigError(f"{flag} {path}: {what} ({exc.strerror})") from None
        finally:
            if os.path.exists(probe):
                os.unlink(probe)


def _answers(path: str) -> bool:
    """Whether a server accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def check_security(config: ServerConfig) -> None:
    """Secure by default: plaintext without authentication only where nobody else
    can connect (loopback, a unix socket); TLS files must come in working pairs."""
    sec, listen = config.security, config.network.listen
    if bool(sec.tls_cert) != bool(sec.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    if sec.tls_client_ca and not sec.tls_cert:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS first)")
    for flag, path in (
        ("--tls-cert", sec.tls_cert),
        ("--tls-key", sec.tls_key),
        ("--tls-client-ca", sec.tls_client_ca),
        ("--auth-token-file", sec.auth_token_file),
    ):
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{flag} {path}: not a readable file")
    if sec.tls_cert or sec.auth_token_file or sec.allow_insecure:
        return
    if not is_local_address(listen):
        raise ConfigError(
            f"refusing to serve plaintext without authentication on {listen}: "
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


def check_disk_dir(path: str) -> None:
    """--disk-dir: a directory this user may write in, or one it may make (the tier
    makes it at start; nothing is made here)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"--disk-dir {path}: exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"--disk-dir {path}: not writable by this user")
        return
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"--disk-dir {path}: cannot make it: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--disk-dir {path}: cannot make it: {ancestor} is not writable by this user"
        )


def check_listen(config: ServerConfig) -> None:
    """Bind what the server will bind, and let go: a port in use or a host that does
    not resolve becomes one clear line (grpc says only 'Failed to bind', after a
    C-core log line), before anything is created."""
    net = config.network
    _check_distinct_ports(config)
    if net.listen.startswith("unix:"):
        host = "127.0.0.1"  # where the server puts metrics then
    else:
        host, _, port = net.listen.rpartition(":")
        host = host.strip("[]")
        _check_bindable(net.listen, host, int(port))
    metrics_at = metrics_address(config)
    if metrics_at is not None:
        m_host, m_port = metrics_at
        flag = "--metrics-listen" if config.observability.metrics_listen else "--metrics-port"
        _check_bindable(f"{_joined(m_host, m_port)} ({flag})", m_host, m_port)
    if net.health_listen and not net.health_listen.startswith("unix:"):
        h_host, _, h_port = net.health_listen.rpartition(":")
        _check_bindable(f"{net.health_listen} (--health-listen)", h_host.strip("[]"), int(h_port))


def _check_distinct_ports(config: ServerConfig) -> None:
    """--listen, --health-listen and --metrics-port (on --listen's host) each need
    their own port: each binds alone in the checks, but the server's second bind
    of one port would fail after the first had started."""
    net = config.network
    listen_host = "127.0.0.1" if net.listen.startswith("unix:") else _host_port(net.listen)[0]
    seen: dict[tuple[str, int], str] = {}
    for flag, (host, port) in (
        ("--listen", _host_port(net.listen)),
        ("--health-listen", _host_port(net.health_listen)),
        ("--metrics-port", (listen_host, config.observability.metrics_port)),
        ("--metrics-listen", _host_port(config.observability.metrics_listen)),
    ):
        if port and (host, port) in seen:
            raise ConfigError(f"{flag}: port {port} is {seen[host, port]}'s port too")
        seen[host, port] = flag


def metrics_address(config: ServerConfig) -> tuple[str, int] | None:
    """(host, port) of the Prometheus endpoint, or None when off: --metrics-listen
    as given, else --metrics-port on --listen's host (127.0.0.1 for a unix socket)."""
    obs = config.observability
    if obs.metrics_listen and obs.metrics_port:
        raise ConfigError(
            "--metrics-listen and --metrics-port both set: give one "
            "(--metrics-listen HOST:PORT, or --metrics-port on --listen's host)"
        )
    if obs.metrics_listen:
        host, port = _host_port(obs.metrics_listen)
        if not port:  # a unix socket, or port 0: Prometheus needs a TCP port it knows
            raise ConfigError(
                f"--metrics-listen {obs.metrics_listen}: expected HOST:PORT with a TCP port"
            )
        return host, port
    if not obs.metrics_port:
        return None
    listen = config.network.listen
    host = "127.0.0.1" if listen.startswith("unix:") else _host_port(listen)[0]
    return host, obs.metrics_port


def _joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_port(address: str) -> tuple[str, int]:
    """('', 0) for none or a unix socket."""
    if not address or address.startswith("unix:"):
        return "", 0
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


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
