"""Every setting of ``kvsvc serve``, declared once each and grouped by concern;
``ServerConfig`` is one process's settings, a frozen dataclass of the groups.

Each field below is the whole declaration of one setting: its name (the flag
``--name-with-dashes`` and the variable ``KVSVC_NAME``), default, parser and help.
kvsvc.server.config.sources makes the flags and reads the variables from them, and
scripts/gen_settings.py writes docs/configuration.md's tables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvsvc.limits import DEFAULT_TRANSFER_DEADLINE_S, GiB, MiB
from kvsvc.server.config.setting import Setting, declared, setting
from kvsvc.server.config.values import (
    boolean,
    choice,
    format_size,
    fraction,
    int_up_to,
    listen_address,
    non_negative_int,
    optional,
    parse_size,
    port,
    positive_float,
    positive_int,
    redact_url,
    remote_url,
    s3_url,
    shm_uids,
    size_or_off,
    target_address,
    value_size,
)


@dataclass(frozen=True)
class NetworkSettings:
    """Where the server listens, and the sockets it shares with engines."""

    listen: str = setting(
        "127.0.0.1:50051",
        listen_address,
        "address to listen on: `HOST:PORT` (port 1-65535; 0 picks a free one) or `unix:PATH`",
    )
    health_listen: str = setting(
        "",
        optional(listen_address),
        "`HOST:PORT` of a plaintext listener serving only grpc.health.v1, for probes that "
        "cannot present credentials",
        note="off",
    )
    socket_dir: str = setting(
        "",
        optional(),
        "directory shared with engines in other containers or pods (a volume or hostPath, "
        "e.g. `/run/kvsvc`): the fd socket (`fd.sock`) and a gRPC unix socket (`grpc.sock`) "
        "live there, mode 0660; made 0750 if missing",
    )
    socket_group: str = setting(
        "",
        optional(),
        "group (name or gid) given the sockets in `--socket-dir` and, when the server owns "
        "it, the directory: engines in that group may connect",
        note="the server's",
    )


@dataclass(frozen=True)
class DataPlaneSettings:
    """The chunk store, the regions clients map, and the copies between them."""

    store_bytes: int = setting(
        256 * MiB,
        parse_size,
        "chunk store capacity (suffixes K, M, G; MiB/GiB accepted); least recently used "
        "chunks are evicted beyond it. Allocated and touched whole at start (no page "
        "faults in the copies); refused at start if it and the server's own 256 MiB do not "
        "fit in host RAM or the cgroup's memory limit. The default suits a laptop demo "
        "(~0.5 GB resident); size it for a deployment",
        shows=format_size,
    )
    namespace_share: float = setting(
        1.0,
        fraction,
        "fraction of its tenant's share of the store (of the store for the default tenant) "
        "that any one namespace may hold before eviction takes from that namespace first, "
        "so one namespace's burst (e.g. one cache salt's, see docs/vllm.md) evicts its own "
        "chunks before its neighbours'; a tenant's `namespace_share` quota overrides it",
        note="off",
    )
    shm_dir: str = setting(
        "/dev/shm",
        str,
        "existing, writable directory holding clients' shared-memory regions; names cannot "
        "escape it",
    )
    fd_socket: str = setting(
        "auto",
        str,
        "unix socket that takes clients' sealed memfds (the fast CPU region kind): a path, "
        "`auto` (`fd.sock` in `--socket-dir`, else a per-server name in the shm dir) or `off`",
    )
    device: str = setting(
        "auto",
        choice("auto", "cpu", "cuda"),
        "where mapped regions live: `cpu`, `cuda` (refused at start-up without CUDA), or "
        "`auto` (cuda when available)",
    )
    transfer_threads: int = setting(
        2, int_up_to(1024), "worker threads that run copies off the event loop (1-1024)"
    )
    inline_copy_bytes: int = setting(
        4 * MiB,
        size_or_off,
        "a Store/Retrieve of at most this many bytes between sealed memfds (or the message) "
        "and the store copies on the event loop's thread, sparing two thread hand-offs (GIL "
        "released while it copies); of a larger one the loop copies one share (up to 16 MiB) "
        "beside the copy threads; `0`: every copy on the worker threads",
        shows=format_size,
    )
    inline_budget_bytes: int = setting(
        512 * MiB,
        size_or_off,
        "bytes that requests of 1 MiB and more (inline data) may hold at once, counted from "
        "their size before they are parsed: one beyond it is refused at once "
        "(`INLINE_BUDGET_EXHAUSTED`, retryable; one request is always taken when none is "
        "held), and an inline Store larger than the store is refused unparsed "
        "(`REQUEST_EXCEEDS_CAPACITY`); `0`: no bound",
        shows=format_size,
    )


@dataclass(frozen=True)
class TierSettings:
    """The tiers behind the memory store: local disk, then the shared ones (Redis, Mooncake, S3)."""

    remote: str = setting(
        "off",
        remote_url,
        "shared remote tier: `redis://[USER@]HOST:PORT[/DB]`, `rediss://` (TLS), "
        "`redis+cluster://` or `rediss+cluster://` (Redis Cluster, any node), or `off`; "
        "best-effort: a Redis failure is a miss",
        shows=redact_url,  # a password never shows (the URL refuses one; kept if that changes)
    )
    remote_password_file: str = setting(
        "",
        optional(),
        "file holding the Redis password (never on the command line: a password in the URL "
        "is refused)",
    )
    remote_prefix: str = setting("kvsvc", str, "first part of every Redis key kvsvc writes")
    remote_timeout: float = setting(
        0.5, positive_float, "seconds each Redis connect/read/write may take (no retries)"
    )
    remote_lookup_budget: float = setting(
        0.005, positive_float, "seconds a Lookup may wait for Redis beyond the local store"
    )
    remote_queue_bytes: int = setting(
        256 * MiB,
        parse_size,
        "bytes of stored chunks waiting to be written to Redis (at most a quarter of the "
        "store); beyond, writes are dropped and counted",
        shows=format_size,
    )
    remote_ttl: int = setting(0, non_negative_int, "seconds Redis keeps a value", note="no expiry")
    remote_value_bytes: int = setting(
        64 * MiB,
        value_size,
        "largest Redis value (1M-512M); larger chunks are split into parts",
        shows=format_size,
    )
    remote_tls_ca: str = setting(
        "",
        optional(),
        "PEM CA bundle that signed Redis' certificate (`rediss://`)",
        note="the system's CAs",
    )
    remote_tls_cert: str = setting(
        "",
        optional(),
        "PEM client certificate for Redis (`rediss://`, with `--remote-tls-key`; Redis asks "
        "for one unless `tls-auth-clients no`)",
    )
    remote_tls_key: str = setting("", optional(), "PEM private key of `--remote-tls-cert`")
    s3_endpoint: str = setting(
        "",
        optional(s3_url),
        "shared S3-compatible object tier: the endpoint's `http://HOST:PORT` or `https://...` "
        "(credentials never in the URL: `--s3-credentials-file` or the standard AWS "
        "environment); best-effort: an S3 failure is a miss",
        note="off",
    )
    s3_bucket: str = setting("kvsvc", str, "bucket of the S3 tier (made by the operator)")
    s3_prefix: str = setting(
        "kvsvc",
        str,
        "first part of every object name kvsvc writes (`PREFIX/NAMESPACE/...`: one prefix "
        "per namespace, for lifecycle rules)",
    )
    s3_region: str = setting("us-east-1", str, "region the S3 tier signs its requests for")
    s3_credentials_file: str = setting(
        "",
        optional(),
        "AWS shared-credentials file (`[default]` `aws_access_key_id`, "
        "`aws_secret_access_key`) for the S3 tier",
        note="the standard AWS environment",
    )
    s3_timeout: float = setting(
        5.0, positive_float, "seconds each S3 connect or read may take (no retries)"
    )
    s3_lookup_budget: float = setting(
        0.02,
        positive_float,
        "seconds a Lookup may wait for S3 HEADs of keys this server has not seen written or read",
    )
    s3_queue_bytes: int = setting(
        256 * MiB,
        parse_size,
        "bytes of stored chunks waiting to be written to S3 (at most a quarter of the "
        "store); beyond, writes are skipped and counted",
        shows=format_size,
    )
    mooncake_master: str = setting(
        "",
        optional(target_address),
        "shared Mooncake Store tier: `HOST:PORT` of `mooncake_master`'s RPC port (with "
        "`--mooncake-metadata`); best-effort: a Mooncake failure is a miss",
        note="off",
    )
    mooncake_metadata: str = setting(
        "",
        optional(),
        "Mooncake's metadata server: `http://HOST:PORT/metadata` (e.g. the master's "
        "`--enable_http_metadata_server`), `etcd://...`, or `P2PHANDSHAKE`",
    )
    mooncake_local_hostname: str = setting(
        "",
        optional(),
        "address this server's Mooncake transfer engine advertises to its peers (an "
        "interface other than loopback: Mooncake does not use loopback)",
        note="Mooncake picks the first non-loopback interface",
    )
    mooncake_protocol: str = setting(
        "tcp", choice("tcp", "rdma"), "transport between Mooncake peers"
    )
    mooncake_rdma_devices: str = setting(
        "", optional(), "RDMA devices for `--mooncake-protocol rdma` (e.g. `mlx5_0,mlx5_1`)"
    )
    mooncake_segment_bytes: int = setting(
        1 * GiB,
        parse_size,
        "memory this server adds to the Mooncake pool (every peer may place values there; "
        "this server's own writes go there first)",
        shows=format_size,
    )
    mooncake_buffer_bytes: int = setting(
        16 * MiB,
        parse_size,
        "Mooncake's own transfer buffer in this server (chunks move straight from and into "
        "the store's memory, registered with Mooncake, so it stays small)",
        shows=format_size,
    )
    mooncake_prefix: str = setting(
        "kvsvc",
        str,
        "first part of every Mooncake key kvsvc writes (`PREFIX/NAMESPACE/...`)",
    )
    mooncake_timeout: float = setting(
        2.0,
        positive_float,
        "seconds any one Mooncake call may take before kvsvc gives up on it (a miss or a "
        "skipped write; the call is left to end on its own thread)",
    )
    mooncake_lookup_budget: float = setting(
        0.02,
        positive_float,
        "seconds a Lookup may wait for Mooncake's answer on keys this server has not seen "
        "written or read",
    )
    mooncake_queue_bytes: int = setting(
        256 * MiB,
        parse_size,
        "bytes of stored chunks waiting to be written to Mooncake (at most a quarter of "
        "the store); beyond, writes are skipped and counted",
        shows=format_size,
    )
    disk_dir: str = setting(
        "",
        optional(),
        "directory of the local disk tier below memory (made if missing; must be writable): "
        "chunks kept there survive restarts, and a memory miss it holds is loaded back",
        note="off",
    )
    disk_capacity: int = setting(
        10 * GiB,
        parse_size,
        "bytes of chunk files `--disk-dir` may hold; least recently used files are removed "
        "beyond it",
        shows=format_size,
    )
    disk_write: str = setting(
        "through",
        choice("through", "evict"),
        "which chunks go to disk: `through` (every stored chunk, written behind the reply) "
        "or `evict` (those memory evicts, copied out as they are evicted)",
    )
    disk_sync: bool = setting(
        False,
        boolean,
        "fsync each chunk file and its directory before it counts as on disk; with "
        "`--disk-write through` a Store's reply then waits (within its deadline) until its "
        "chunks are durable",
    )
    disk_wait_index: bool = setting(
        True,
        boolean,
        "readiness (health of `kvsvc.v1.KVCacheService`) stays NOT_SERVING until the index "
        'of `--disk-dir` is rebuilt at start, liveness (`""`) is SERVING meanwhile; off: '
        "serve at once, disk hits growing as the index loads",
    )
    disk_queue_bytes: int = setting(
        256 * MiB,
        parse_size,
        "bytes of chunks waiting to be written to disk (at most a quarter of the store); "
        "beyond, writes are skipped and counted",
        shows=format_size,
    )


@dataclass(frozen=True)
class SecuritySettings:
    """Who may call, over what, and whose memory the server maps."""

    tls_cert: str = setting(
        "",
        optional(),
        "PEM certificate chain: serve TLS on `--listen` (with `--tls-key`)",
        note="plaintext",
    )
    tls_key: str = setting("", optional(), "PEM private key of `--tls-cert`")
    tls_client_ca: str = setting(
        "",
        optional(),
        "PEM CA bundle: require client certificates it signed (mTLS); a certificate's name "
        "picks its tenant in the tenant file",
    )
    auth_token_file: str = setting(
        "",
        optional(),
        "JSON tenant file: each tenant's bearer tokens (or their SHA-256), client "
        "certificate names, namespaces and quotas; every call must then carry a token (or "
        "a listed client certificate). Re-read on SIGHUP",
        note="one default tenant",
    )
    allow_insecure: bool = setting(
        False,
        boolean,
        "allow plaintext without authentication on an address other than loopback or a "
        "unix socket (anyone who reaches it can read every cached prompt)",
    )
    shm_uids: str = setting(
        "self",
        shm_uids,
        "whose files under the shm dir the server maps by name, with its own rights: "
        "comma-separated uids or user names (`self`: the server's uid), or `off` (memfd "
        "passing only, where the client hands over an fd it opened itself). Every client "
        "that can call Map is trusted with every listed uid's regular, single-link, "
        "owner-writable files there; see docs/security.md",
    )

    @property
    def authenticated(self) -> bool:
        """Calls on the main port must carry credentials (a token or a client cert)."""
        return bool(self.auth_token_file or self.tls_client_ca)


@dataclass(frozen=True)
class LimitSettings:
    """How long things may take, and what a fatal failure does."""

    default_deadline: float = setting(
        DEFAULT_TRANSFER_DEADLINE_S,
        positive_float,
        "seconds a call that carries no gRPC deadline may take here: queueing, copying and "
        "the handler alike",
    )
    stall_timeout: float = setting(
        10.0,
        positive_float,
        "seconds a copy may run before the server declares itself stalled (health NOT_SERVING)",
    )
    shutdown_grace: float = setting(
        10.0, positive_float, "seconds that SIGTERM/SIGINT lets in-flight calls finish"
    )
    exit_on_fatal: bool = setting(
        False,
        boolean,
        "exit non-zero after a fatal failure once in-flight copies are fenced",
    )
    events_ring: int = setting(
        65536,
        positive_int,
        "most recent events the WatchEvents ring keeps for watchers to resume from; a "
        "cursor older than the ring gets `lost` and a snapshot",
    )
    events_ring_bytes: int = setting(
        64 * MiB,
        parse_size,
        "most bytes of server memory the WatchEvents ring holds (keys included)",
        shows=format_size,
    )
    events_linger_ms: int = setting(
        0,
        non_negative_int,
        "milliseconds a WatchEvents stream waits after a batch before it sends the next, "
        "so one write carries what was published meanwhile: each watcher costs the server "
        "at most one write per linger, at the cost of that much visibility delay; 0 sends "
        "every turn of the loop",
    )
    events_snapshot_page: int = setting(
        4096,
        int_up_to(65536),
        "keys in one WatchEvents snapshot batch (a request may ask for up to 16 times as "
        "many); also the most keys in one live batch",
    )
    events_remote_keys: int = setting(
        1_000_000,
        positive_int,
        "remote-tier keys this server remembers having announced as stored (what a "
        "snapshot says of that tier); beyond, the oldest are announced removed",
    )


@dataclass(frozen=True)
class ObservabilitySettings:
    """What the server tells its operator: logs and metrics."""

    log_format: str = setting(
        "text",
        choice("text", "json"),
        "`text` or `json` (one JSON object per line, with request ids)",
    )
    log_level: str = setting(
        "INFO",
        choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        "logging level: `DEBUG`, `INFO`, `WARNING` or `ERROR`",
    )
    metrics_port: int = setting(
        0, port, "Prometheus metrics HTTP port, on `--listen`'s host", note="off"
    )
    metrics_listen: str = setting(
        "",
        optional(listen_address),
        "`HOST:PORT` of the Prometheus metrics HTTP endpoint (e.g. `0.0.0.0:9400`, so a "
        "sidecar bound to loopback can be scraped); instead of `--metrics-port`",
        note="off",
    )


@dataclass(frozen=True)
class Group:
    """One concern: its attribute on ServerConfig, a title, and its settings."""

    attr: str
    title: str
    cls: type
    settings: tuple[Setting, ...]

    @property
    def about(self) -> str:
        return (self.cls.__doc__ or "").strip()


def _group(attr: str, title: str, cls: type) -> Group:
    return Group(attr, title, cls, declared(cls, attr))


GROUPS = (
    _group("network", "Network", NetworkSettings),
    _group("data", "Data plane", DataPlaneSettings),
    _group("tiers", "Tiers", TierSettings),
    _group("security", "Security", SecuritySettings),
    _group("limits", "Limits", LimitSettings),
    _group("observability", "Observability", ObservabilitySettings),
)
#: Every setting by name (names are unique across groups: they are the flags).
SETTINGS: dict[str, Setting] = {s.name: s for g in GROUPS for s in g.settings}


def env_name(name: str) -> str:
    """The KVSVC_* variable of setting ``name``."""
    return SETTINGS[name].env


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one ``kvsvc serve`` process (flags, else KVSVC_* env, else default),
    read as ``config.<group>.<setting>``."""

    network: NetworkSettings = field(default_factory=NetworkSettings)
    data: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    tiers: TierSettings = field(default_factory=TierSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)

    @classmethod
    def from_settings(cls, **values: Any) -> ServerConfig:
        """A config from settings by name (``listen=..., store_bytes=...``), the rest
        at their defaults: how flags, tests and the demo make one."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> ServerConfig:
        """This config with the named settings changed, each in its own group."""
        unknown = sorted(set(values) - set(SETTINGS))
        if unknown:
            raise TypeError(f"unknown settings {unknown}")
        changes = {}
        for g in GROUPS:
            mine = {s.name: values[s.name] for s in g.settings if s.name in values}
            if mine:
                changes[g.attr] = dataclasses.replace(getattr(self, g.attr), **mine)
        return dataclasses.replace(self, **changes)
