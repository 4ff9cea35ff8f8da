"""Configuration without a server: value parsers, the declarations (one per setting)
and what is generated from them (flags, the KVSVC_* reader, docs/configuration.md's
tables), flags over KVSVC_* variables over defaults, one-line errors that name the setting, and the
host checks."""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import tomllib
from pathlib import Path

import pytest

from kvsvc.errors import InvalidDeadline, InvalidRequest
from kvsvc.limits import MAX_DEADLINE_S, GiB, MiB, validate_deadline
from kvsvc.server.config import (
    SETTINGS,
    ConfigError,
    Resolved,
    ServerConfig,
    add_server_arguments,
    check_disk_dir,
    check_listen,
    check_shm_dir,
    config_from_args,
    env_name,
    format_size,
    parse_server_config,
)
from kvsvc.server.config.docs import BEGIN, END, render_tables
from kvsvc.server.config.sources import (
    CONFIG_ENV,
    effective_toml,
    read_config_file,
    resolve_args,
)
from kvsvc.server.config.values import listen_address, parse_size, port, target_address

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_kvsvc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the KVSVC_* variables it sets."""
    for name in list(os.environ):
        if name.startswith("KVSVC_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1073741824", GiB),
        ("64M", 64 * MiB),
        ("64m", 64 * MiB),
        ("512MiB", 512 * MiB),
        ("1GiB", GiB),
        ("2G", 2 * GiB),
        ("1.5G", 3 * GiB // 2),
        ("4k", 4096),
        (" 8MB ", 8 * MiB),
    ],
)
def test_sizes_parse_with_units(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text", ["", "abc", "0", "-1G", "12X", "inf", "nan", "-inf", "1e400", "infG"]
)
def test_bad_sizes_are_argument_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


@pytest.mark.parametrize("n", [1, 4095, 4096, 64 * MiB, GiB, 3 * GiB, 1 << 40, GiB + 1])
def test_format_size_reads_back_exactly(n: int) -> None:
    assert parse_size(format_size(n)) == n
    assert format_size(GiB) == "1G"


@pytest.mark.parametrize(("text", "ok"), [("0", 0), ("1", 1), ("65535", 65535)])
def test_ports_in_range(text: str, ok: int) -> None:
    assert port(text) == ok


@pytest.mark.parametrize("text", ["-1", "65536", "99999", "http", ""])
def test_ports_out_of_range_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="port must be 1-65535"):
        port(text)


@pytest.mark.parametrize(
    "text", ["127.0.0.1:0", "localhost:50051", "[::1]:50051", "unix:/tmp/kvsvc.sock"]
)
def test_listen_addresses_accepted(text: str) -> None:
    assert listen_address(text) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("unix:", "needs a socket path"),
        ("50051", "expected HOST:PORT"),
        (":50051", "expected HOST:PORT"),
        ("::1:50051", "IPv6 host goes in brackets"),
        ("host:99999", "port must be"),
    ],
)
def test_listen_addresses_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        listen_address(text)


@pytest.mark.parametrize("value", [0.001, 1, 30.0, MAX_DEADLINE_S])
def test_valid_deadlines(value: float) -> None:
    assert validate_deadline(value, "timeout") == float(value)


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, MAX_DEADLINE_S * 2, "5", None, True])
def test_invalid_deadlines_are_typed_and_still_value_errors(value: object) -> None:
    with pytest.raises(InvalidDeadline) as ei:
        validate_deadline(value, "timeout")
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, InvalidRequest)
    assert ei.value.reason == "INVALID_DEADLINE"
    assert ei.value.metadata["setting"] == "timeout"
    assert ei.value.metadata["value"] == repr(value)


def test_defaults_without_flags_or_env() -> None:
    assert parse_server_config([]) == ServerConfig()


def test_flags_override_env_which_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSVC_STORE_BYTES", "2G")
    monkeypatch.setenv("KVSVC_TRANSFER_THREADS", "3")
    monkeypatch.setenv("KVSVC_EXIT_ON_FATAL", "yes")
    monkeypatch.setenv("KVSVC_LOG_FORMAT", "JSON")
    config = parse_server_config(["--transfer-threads", "5", "--device", "CPU"])
    assert config.data.store_bytes == 2 * GiB  # env
    assert config.data.transfer_threads == 5  # flag beats env
    assert config.limits.exit_on_fatal is True
    # choices are case-insensitive, stored canonically
    assert config.observability.log_format == "json"
    assert config.data.device == "cpu"
    assert config.limits.shutdown_grace == ServerConfig().limits.shutdown_grace  # default


def test_a_boolean_flag_can_turn_off_what_the_env_turned_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSVC_EXIT_ON_FATAL", "1")
    assert parse_server_config(["--no-exit-on-fatal"]).limits.exit_on_fatal is False


def test_a_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSVC_TRANSFER_THREADS", "many")
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)  # --help still builds, saying the variable is invalid
    assert "KVSVC_TRANSFER_THREADS is invalid" in parser.format_help()
    args = parser.parse_args([])
    with pytest.raises(ConfigError, match=r"^KVSVC_TRANSFER_THREADS='many': not a whole number"):
        config_from_args(args)
    # A flag given instead means the variable is never read.
    assert (
        config_from_args(parser.parse_args(["--transfer-threads", "2"])).data.transfer_threads == 2
    )


def test_a_bad_env_value_is_a_usage_error_with_a_parser(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSVC_EXIT_ON_FATAL", "maybe")
    with pytest.raises(SystemExit) as ei:
        parse_server_config([])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "KVSVC_EXIT_ON_FATAL='maybe': must be true or false" in err


def test_every_setting_has_a_flag_an_env_name_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    text = parser.format_help()
    for s in SETTINGS.values():
        assert s.flag in text
        assert env_name(s.name) in text
        assert s.help and "`" not in text


def test_each_setting_is_declared_once_with_a_unique_flag_and_variable() -> None:
    from kvsvc.server.config import GROUPS

    names = [s.name for g in GROUPS for s in g.settings]
    assert len(names) == len(set(names)) == len(SETTINGS) == 67
    assert len({s.env for s in SETTINGS.values()}) == len(SETTINGS)
    for g in GROUPS:  # a group's settings are its dataclass's fields, in order
        assert [s.group for s in g.settings] == [g.attr] * len(g.settings)
        assert getattr(ServerConfig(), g.attr) == g.cls()
        assert g.about, g.title


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_default_as_written_reads_back_as_the_default(name: str) -> None:
    s = SETTINGS[name]
    assert s.parse(s.show(s.default)) == s.default
    assert getattr(getattr(ServerConfig(), s.group), name) == s.default


def test_configs_are_made_and_changed_by_setting_name_in_their_groups() -> None:
    config = ServerConfig.from_settings(listen="unix:/tmp/x.sock", remote_ttl=5)
    assert config.network.listen == "unix:/tmp/x.sock" and config.tiers.remote_ttl == 5
    changed = config.replace(tls_client_ca="ca.pem", store_bytes=MiB)
    assert changed.security.authenticated and changed.data.store_bytes == MiB
    assert changed.network is config.network  # untouched groups are kept as they are
    assert config.security.tls_client_ca == ""  # frozen: replace made a new one
    with pytest.raises(TypeError, match="unknown settings \\['listen_port'\\]"):
        ServerConfig.from_settings(listen_port=1)


def test_the_variable_reader_takes_any_mapping() -> None:
    env = {"KVSVC_REMOTE": "redis://h:1", "KVSVC_TLS_CERT": "off", "KVSVC_SOCKET_DIR": "none"}
    config = parse_server_config([], environ=env)
    assert config.tiers.remote == "redis://h:1"
    assert (config.security.tls_cert, config.network.socket_dir) == ("", "")
    with pytest.raises(SystemExit):
        parse_server_config([], environ={"KVSVC_TRANSFER_THREADS": "2000"})  # at most 1024


def test_help_is_grouped_by_concern_and_says_what_a_default_means() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, environ={})
    text = parser.format_help()
    titles = ["network", "data plane", "tiers", "security", "limits", "observability"]
    at = [text.index(f"{t} settings:") for t in titles]
    assert at == sorted(at)
    assert "(env KVSVC_METRICS_PORT; default 0: off)" in " ".join(text.split())


def test_the_configuration_page_is_generated_from_the_declarations() -> None:
    """As scripts/gen_settings.py --check: docs/configuration.md's block is what the
    declarations make."""
    text = (REPO / "docs" / "configuration.md").read_text()
    assert BEGIN in text and END in text
    assert render_tables(text) == text, "run .venv/bin/python scripts/gen_settings.py"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    for s in SETTINGS.values():
        assert f"| `{s.flag}` | `{s.env}` | `{s.name}` |" in block


def test_show_writes_settings_as_the_docs_do() -> None:
    assert SETTINGS["store_bytes"].show(GiB) == "1G"
    assert SETTINGS["exit_on_fatal"].show(False) == "off"
    assert SETTINGS["shutdown_grace"].show(10.0) == "10"
    assert SETTINGS["listen"].show("127.0.0.1:50051") == "127.0.0.1:50051"
    assert SETTINGS["socket_dir"].show("") == "none"


def test_check_shm_dir_names_the_flag(tmp_path: Path) -> None:
    check_shm_dir(str(tmp_path), "--shm-dir")
    with pytest.raises(ConfigError, match=r"^--shm-dir .*: no such directory$"):
        check_shm_dir(str(tmp_path / "missing"), "--shm-dir")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--shm-dir .*: not a directory$"):
        check_shm_dir(str(tmp_path / "file"), "--shm-dir")


def test_check_listen_refuses_a_port_in_use_in_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^cannot listen on 127.0.0.1:{port}: "):
            check_listen(ServerConfig.from_settings(listen=f"127.0.0.1:{port}"))
        with pytest.raises(ConfigError, match=r"\(--metrics-port\)"):
            check_listen(ServerConfig.from_settings(listen="127.0.0.1:0", metrics_port=port))
    check_listen(ServerConfig.from_settings(listen="127.0.0.1:0"))  # a free port: nothing to say


def test_check_listen_refuses_one_port_for_two_listeners() -> None:
    """Each would bind alone; the server's second bind would fail after the first."""
    with pytest.raises(ConfigError, match=r"^--metrics-port: port 45999 is --listen's port too$"):
        check_listen(ServerConfig.from_settings(listen="127.0.0.1:45999", metrics_port=45999))
    with pytest.raises(ConfigError, match=r"^--health-listen: port 45998 is --listen's port"):
        check_listen(ServerConfig.from_settings(listen="[::1]:45998", health_listen="[::1]:45998"))


def test_tls_files_that_do_not_load_name_their_flags(tmp_path: Path) -> None:
    from certs import make_ca, make_cert

    from kvsvc.server.config import check_host

    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "ca", "server", "localhost")
    make_cert(tmp_path, "ca", "other", "localhost")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    base = {"shm_dir": str(tmp_path)}

    def check(**files: str) -> None:
        check_host(
            ServerConfig.from_settings(**base, **{k: str(tmp_path / v) for k, v in files.items()})
        )

    check(tls_cert="server.pem", tls_key="server.key", tls_client_ca="ca.pem")
    with pytest.raises(ConfigError, match=r"^--tls-cert .*server.pem with --tls-key .*other.key: "):
        check(tls_cert="server.pem", tls_key="other.key")  # not its key
    with pytest.raises(ConfigError, match=r"^--tls-client-ca .*junk.pem: not a usable PEM file"):
        check(tls_cert="server.pem", tls_key="server.key", tls_client_ca="junk.pem")
    with pytest.raises(ConfigError, match=r"^--remote-tls-ca .*junk.pem: not a usable PEM file"):
        check_host(
            ServerConfig.from_settings(
                **base, remote="rediss://h:6380", remote_tls_ca=str(tmp_path / "junk.pem")
            )
        )


def test_a_store_larger_than_the_host_is_refused(tmp_path: Path) -> None:
    from kvsvc.server.config import check_host

    with pytest.raises(ConfigError, match=r"^--store-bytes 1024T: more than this host's memory"):
        check_host(ServerConfig.from_settings(shm_dir=str(tmp_path), store_bytes=1 << 50))


def test_vllm_connector_config_keys_env_and_validation() -> None:
    """kv_connector_extra_config wins over KVSVC_VLLM_* env; a typo is an error."""
    from kvsvc.integrations.vllm.config import VllmConnectorConfig

    env = {"KVSVC_VLLM_TARGET": "10.0.0.1:1", "KVSVC_VLLM_LOOKUP_TIMEOUT_S": "0.02"}
    cfg = VllmConnectorConfig.parse({"blocks_per_chunk": 4}, env)
    assert (cfg.target, cfg.lookup_timeout_s, cfg.blocks_per_chunk) == ("10.0.0.1:1", 0.02, 4)
    assert VllmConnectorConfig.parse({"target": "h:2"}, env).target == "h:2"
    assert VllmConnectorConfig.parse(None, {}) == VllmConnectorConfig()
    with pytest.raises(ValueError, match="unknown keys \\['lookup_timeout'\\]"):
        VllmConnectorConfig.parse({"lookup_timeout": 1}, {})
    for bad in ({"load_timeout_s": 0}, {"fence_timeout_s": float("inf")}, {"blocks_per_chunk": 0}):
        with pytest.raises(ValueError):
            VllmConnectorConfig.parse(bad, {})


# --- where a server is dialled (demo, drop-namespace) --------------------------------
@pytest.mark.parametrize("text", ["localhost:50051", "[::1]:1", "10.0.0.1:65535", "unix:/x.sock"])
def test_targets_accepted(text: str) -> None:
    assert target_address(text) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("localhost", r"^no port in 'localhost': give HOST:PORT .*localhost:50051\) or unix:PATH$"),
        ("::1", r"\[::1\]:50051"),
        ("[::1]", r"\[::1\]:50051"),
        ("h:0", "port 0"),
        ("h:99999", "port must be"),
        ("unix:", "needs a socket path"),
    ],
)
def test_a_target_without_a_port_is_refused(text: str, message: str) -> None:
    """gRPC would dial a bare host on port 443."""
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        target_address(text)


# --- the disk tier's directory ---------------------------------------------------------
def test_check_disk_dir_names_what_is_in_the_way(tmp_path: Path) -> None:
    check_disk_dir(str(tmp_path))  # exists, writable
    check_disk_dir(str(tmp_path / "new" / "deeper"))  # can be made; nothing made here
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--disk-dir .*/file: exists and is not a directory$"):
        check_disk_dir(str(tmp_path / "file"))
    with pytest.raises(
        ConfigError, match=r"^--disk-dir .*/file/sub: cannot make it: .*/file is not a directory$"
    ):
        check_disk_dir(str(tmp_path / "file" / "sub"))
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=r"/ro is not writable by this user$"):
            check_disk_dir(str(tmp_path / "ro" / "sub"))


# --- the configuration file (--config) -------------------------------------------------
def resolve(
    argv: list[str], environ: dict[str, str] | None = None
) -> tuple[ServerConfig, dict[str, str]]:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, environ or {})
    r = resolve_args(parser.parse_args(argv), parser, environ or {})
    return r.config, dict(r.origins)


def write(tmp_path: Path, text: str, name: str = "kvsvc.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_file_sets_what_flags_and_variables_leave(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'store_bytes = "2G"\ntransfer_threads = 4\nremote_timeout = 1.5\n'
        'exit_on_fatal = true\nlog_format = "JSON"\ndisk_capacity = 1073741824\n'
        'device = "cpu"\n',
    )
    env = {"KVSVC_TRANSFER_THREADS": "6", "KVSVC_DEVICE": "auto"}
    config, origins = resolve(["--config", path, "--device", "cuda"], env)
    assert config.data.store_bytes == 2 * GiB and origins["store_bytes"] == f"file {path}"
    assert config.data.transfer_threads == 6 and origins["transfer_threads"] == (
        "env KVSVC_TRANSFER_THREADS"
    )  # the variable beats the file
    assert config.data.device == "cuda" and origins["device"] == "flag --device"  # the flag both
    assert config.tiers.remote_timeout == 1.5 and config.limits.exit_on_fatal is True
    assert config.observability.log_format == "json"  # parsed as the flag is: canonical
    assert config.tiers.disk_capacity == GiB
    assert origins["listen"] == "default" and config.network.listen == "127.0.0.1:50051"
    # KVSVC_CONFIG names the file when --config does not.
    assert resolve([], {CONFIG_ENV: path})[0].data.store_bytes == 2 * GiB


BAD_FILES = [
    ('store_bytes = "inf"', r"store_bytes: not a size: 'inf'"),
    ("store_bytes = inf", r"store_bytes: expected a number or a string such as \"256M\", not inf"),
    ("store_bytes = nan", r"store_bytes: expected .*, not nan"),
    ("remote_timeout = inf", r"remote_timeout: expected .*, not inf"),
    ('remote_timeout = "nan"', r"remote_timeout: value must be finite"),
    ('store_byte = "1G"', r"store_byte: unknown setting \(did you mean store_bytes\?\)$"),
    ('store-bytes = "1G"', r"store-bytes: unknown setting \(did you mean store_bytes\?\)$"),
    ("frobnicate = 1", r"frobnicate: unknown setting$"),
    ('[network]\nlisten = "h:1"', r"network: unknown table: settings are top-level keys"),
    ("exit_on_fatal = 1", r"exit_on_fatal: expected true or false, not an integer"),
    ("transfer_threads = true", r"transfer_threads: expected .*, not a boolean"),
    ("store_bytes = [1]", r"store_bytes: expected .*, not an array"),
    ("shm_dir = 1979-05-27", r"shm_dir: expected a string, not a TOML date"),
    ("transfer_threads = 2.5", r"transfer_threads: not a whole number: '2.5'"),
    ('listen = "h:99999"', r"listen: port must be 1-65535"),
    ("store_bytes = ", r"not valid TOML: .*line 1"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_a_bad_file_is_one_line_naming_the_file_the_key_and_why(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as ei:
        read_config_file(path)
    line = str(ei.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: ")
    assert re.search(message, line), line


def test_a_missing_file_is_named_with_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--config .*/none.toml: No such file or directory$"):
        resolve(["--config", str(tmp_path / "none.toml")])


def test_the_effective_configuration_reads_back_as_itself(tmp_path: Path) -> None:
    """--print-config's TOML is a file --config reads back to the same values, every
    setting once, each with its source."""
    path = write(tmp_path, 'store_bytes = "3G"\nremote = "redis://kv@h:6379/2"\n')
    env = {"KVSVC_REMOTE_TIMEOUT": "0.25", "KVSVC_SOCKET_GROUP": 'we"ird\\grp\x7f'}
    config, origins = resolve(["--config", path, "--exit-on-fatal", "--shm-dir", "/tmp/é"], env)
    text = effective_toml(Resolved(config, origins))
    data = tomllib.loads(text)
    assert sorted(data) == sorted(SETTINGS) and len(data) == len(SETTINGS)
    assert data["store_bytes"] == "3G" and data["exit_on_fatal"] is True
    back = write(tmp_path, text, "back.toml")
    assert resolve(["--config", back])[0] == config
    lines = {line.split(" = ")[0]: line for line in text.splitlines() if " = " in line}
    assert lines["store_bytes"].endswith(f"# file {path}")
    assert lines["remote_timeout"].endswith("# env KVSVC_REMOTE_TIMEOUT")
    assert lines["exit_on_fatal"].endswith("# flag --exit-on-fatal")
    assert lines["listen"].endswith("# default")


def test_the_printed_configuration_holds_no_secret(tmp_path: Path) -> None:
    """Secrets are only ever files a setting names (a password in --remote is refused);
    a setting that shows a value redacts it, and print-config shows values as that."""
    secret = "hunter2-do-not-print"
    (tmp_path / "pw").write_text(secret)
    config, origins = resolve(
        ["--remote", "rediss://kv@h:6380", "--remote-password-file", str(tmp_path / "pw")]
    )
    text = effective_toml(Resolved(config, origins))
    assert secret not in text and str(tmp_path / "pw") in text
    assert SETTINGS["remote"].show("redis://u:pw@h:1") == "redis://u:***@h:1"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_tenant_file_with_nan_or_infinity_is_refused(tmp_path: Path, constant: str) -> None:
    """Python's json reads them; a NaN expiry or limit would compare false with
    everything (never expire, never limit). `serve --check` reads the file so."""
    from kvsvc.server.security.auth import TenantFileError, load_tables

    path = tmp_path / "tenants.json"
    path.write_text(
        '{"tenants": {"a": {"namespaces": ["*"], "tokens": [{"sha256": "'
        + "0" * 64
        + f'", "expires": {constant}}}]}}}}}}'
    )
    with pytest.raises(TenantFileError, match=f"^{path}: {constant} is not a number"):
        load_tables(str(path))
