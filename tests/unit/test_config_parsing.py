"""Configuration without a server: value parsers, flags over KVSVC_* variables over
defaults, one-line errors that name the setting, and the host checks."""

from __future__ import annotations

import argparse
import math
import os
import socket
from dataclasses import fields
from pathlib import Path

import pytest

from kvsvc.errors import InvalidDeadline, InvalidRequest
from kvsvc.limits import MAX_DEADLINE_S, GiB, MiB, validate_deadline
from kvsvc.server.config import (
    ConfigError,
    ServerConfig,
    _listen_address,
    _parse_size,
    _port,
    add_server_arguments,
    check_listen,
    check_shm_dir,
    config_from_args,
    env_name,
    format_size,
    parse_server_config,
    show_value,
)


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
    assert _parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "0", "-1G", "12X"])
def test_bad_sizes_are_argument_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _parse_size(text)


@pytest.mark.parametrize("n", [1, 4095, 4096, 64 * MiB, GiB, 3 * GiB, 1 << 40, GiB + 1])
def test_format_size_reads_back_exactly(n: int) -> None:
    assert _parse_size(format_size(n)) == n
    assert format_size(GiB) == "1G"


@pytest.mark.parametrize(("text", "ok"), [("0", 0), ("1", 1), ("65535", 65535)])
def test_ports_in_range(text: str, ok: int) -> None:
    assert _port(text) == ok


@pytest.mark.parametrize("text", ["-1", "65536", "99999", "http", ""])
def test_ports_out_of_range_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="port must be 1-65535"):
        _port(text)


@pytest.mark.parametrize(
    "text", ["127.0.0.1:0", "localhost:50051", "[::1]:50051", "unix:/tmp/kvsvc.sock"]
)
def test_listen_addresses_accepted(text: str) -> None:
    assert _listen_address(text) == text


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
        _listen_address(text)


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
    assert config.store_bytes == 2 * GiB  # env
    assert config.transfer_threads == 5  # flag beats env
    assert config.exit_on_fatal is True
    assert config.log_format == "json"  # choices are case-insensitive, stored canonically
    assert config.device == "cpu"
    assert config.shutdown_grace == ServerConfig().shutdown_grace  # default


def test_a_boolean_flag_can_turn_off_what_the_env_turned_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSVC_EXIT_ON_FATAL", "1")
    assert parse_server_config(["--no-exit-on-fatal"]).exit_on_fatal is False


def test_a_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSVC_TRANSFER_THREADS", "many")
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)  # --help still builds, saying the variable is invalid
    assert "KVSVC_TRANSFER_THREADS is invalid" in parser.format_help()
    args = parser.parse_args([])
    with pytest.raises(ConfigError, match=r"^KVSVC_TRANSFER_THREADS='many': not a whole number"):
        config_from_args(args)
    # A flag given instead means the variable is never read.
    assert config_from_args(parser.parse_args(["--transfer-threads", "2"])).transfer_threads == 2


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
    for f in fields(ServerConfig):
        assert "--" + f.name.replace("_", "-") in text
        assert env_name(f.name) in text


def test_show_value_writes_settings_as_the_docs_do() -> None:
    assert show_value("store_bytes", GiB) == "1G"
    assert show_value("exit_on_fatal", False) == "off"
    assert show_value("shutdown_grace", 10.0) == "10"
    assert show_value("listen", "127.0.0.1:50051") == "127.0.0.1:50051"


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
            check_listen(ServerConfig(listen=f"127.0.0.1:{port}"))
        with pytest.raises(ConfigError, match=r"\(--metrics-port\)"):
            check_listen(ServerConfig(listen="127.0.0.1:0", metrics_port=port))
    check_listen(ServerConfig(listen="127.0.0.1:0"))  # a free port: nothing to say


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
