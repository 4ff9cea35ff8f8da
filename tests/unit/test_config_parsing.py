"""Configuration without a server: value parsers, the declarations (one per setting)
and what is generated from them (flags, the KVSVC_* reader, README's tables), flags
over KVSVC_* variables over defaults, one-line errors that name the setting, and the
host checks."""

from __future__ import annotations

import argparse
import math
import os
import socket
from pathlib import Path

import pytest

from kvsvc.errors import InvalidDeadline, InvalidRequest
from kvsvc.limits import MAX_DEADLINE_S, GiB, MiB, validate_deadline
from kvsvc.server.config import (
    SETTINGS,
    ConfigError,
    ServerConfig,
    add_server_arguments,
    check_listen,
    check_shm_dir,
    config_from_args,
    env_name,
    format_size,
    parse_server_config,
)
from kvsvc.server.config.docs import BEGIN, END, render_readme
from kvsvc.server.config.values import listen_address, parse_size, port

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


@pytest.mark.parametrize("text", ["", "abc", "0", "-1G", "12X"])
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
    assert len(names) == len(set(names)) == len(SETTINGS) == 48
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


def test_readme_tables_are_generated_from_the_declarations() -> None:
    """As scripts/gen_settings.py --check: README's block is what the declarations make."""
    text = (REPO / "README.md").read_text()
    assert BEGIN in text and END in text
    assert render_readme(text) == text, "run .venv/bin/python scripts/gen_settings.py"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    for s in SETTINGS.values():
        assert f"| `{s.flag}` | `{s.env}` |" in block


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
