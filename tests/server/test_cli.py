"""The `kvsvc` command as a newcomer meets it: every invalid `serve` configuration
is one clear line and exit 2 before serving, leaving nothing behind; `demo` says
what to do when there is no server; docs/configuration.md, `--help` and the defaults
agree."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch

from kvsvc.errors import FatalServerError
from kvsvc.server.config import (
    SETTINGS,
    ConfigError,
    ServerConfig,
    env_name,
    parse_server_config,
)
from kvsvc.server.ops.lifecycle import Server

pytestmark = pytest.mark.slow  # starts servers or subprocesses

REPO = Path(__file__).resolve().parents[2]
# Every run below fails fast or serves; this only bounds a run that wrongly serves.
RUN_TIMEOUT_S = 60


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without KVSVC_* settings (a developer's own must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env.update(extra)
    return env


def kvsvc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", *args],
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- kvsvc serve: bad configurations ---------------------------------------------
NO_DIR = "/nonexistent/kvsvc-test"
USAGE_ERRORS = [
    (["--listen", "foo"], {}, "--listen"),
    (["--listen", "127.0.0.1:99999"], {}, "99999"),
    (["--listen", "127.0.0.1:-1"], {}, "-1"),
    (["--listen", "unix:/nonexistent/kvsvc.sock"], {}, "/nonexistent"),
    (["--metrics-port", "70000"], {}, "70000"),
    (["--shm-dir", NO_DIR], {}, NO_DIR),
    (["--fd-socket", "/nonexistent/kvsvc.fds"], {}, "--fd-socket"),
    (["--device", "foo"], {}, "--device"),
    (["--log-format", "xml"], {}, "--log-format"),
    (["--log-level", "loud"], {}, "--log-level"),
    (["--store-bytes", "lots"], {}, "--store-bytes"),
    # float() reads these: an OverflowError traceback once, now refused by the parser
    (["--store-bytes", "inf"], {}, "--store-bytes: not a size: 'inf'"),
    (["--store-bytes", "1e400"], {}, "--store-bytes: not a size: '1e400'"),
    (["--disk-capacity", "nan"], {}, "--disk-capacity: not a size: 'nan'"),
    (["--remote-timeout", "inf"], {}, "--remote-timeout: value must be finite"),
    (["--default-deadline", "nan"], {}, "--default-deadline: value must be finite"),
    ([], {"KVSVC_STORE_BYTES": "inf"}, "KVSVC_STORE_BYTES='inf': not a size"),
    ([], {"KVSVC_DEVICE": "foo"}, "KVSVC_DEVICE"),
    ([], {"KVSVC_LISTEN": "127.0.0.1:99999"}, "KVSVC_LISTEN"),
    ([], {"KVSVC_SHM_DIR": NO_DIR}, NO_DIR),
    ([], {"KVSVC_EXIT_ON_FATAL": "maybe"}, "KVSVC_EXIT_ON_FATAL"),
]


def assert_usage_error(
    done: subprocess.CompletedProcess[str], names: str, command: str = "serve"
) -> None:
    """Exit 2; stderr is one `kvsvc COMMAND: error:` line (no usage: serve's alone
    runs to forty lines, which buried the cause)."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvsvc {command}: error: "), done.stderr
    assert names in done.stderr, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(("args", "env", "names"), USAGE_ERRORS)
def test_bad_configuration_is_a_usage_error_before_serving(
    shm_dir: Path, args: list[str], env: dict[str, str], names: str
) -> None:
    # Flags win over KVSVC_*: pass only those the case does not set by env.
    base = {"--listen": "127.0.0.1:0", "--shm-dir": str(shm_dir)}
    base = {k: v for k, v in base.items() if env_name(k[2:].replace("-", "_")) not in env}
    done = kvsvc("serve", *[x for kv in base.items() for x in kv], *args, env=clean_env(**env))
    assert_usage_error(done, names)
    assert list(shm_dir.iterdir()) == []


def test_shm_dir_that_is_a_file_is_a_usage_error(shm_dir: Path) -> None:
    a_file = shm_dir.parent / "not-a-dir"
    a_file.write_text("")
    done = kvsvc("serve", "--listen", "127.0.0.1:0", "--shm-dir", str(a_file))
    assert_usage_error(done, "not a directory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_a_usage_error(shm_dir: Path) -> None:
    done = kvsvc("serve", "--listen", "127.0.0.1:0", "--shm-dir", str(shm_dir), "--device", "cuda")
    assert_usage_error(done, "--device cuda")
    assert "CUDA is not available" in done.stderr
    assert list(shm_dir.iterdir()) == []


# Settings that escaped `kvsvc serve` as a traceback (or a grpc C-core log line first)
# before kvsvc.server.config's checks knew them: now each is one line and exit 2.
HOST_CANNOT = [
    "fd socket is a directory",
    "fd socket is a file",
    "fd socket path too long",
    "fd socket of a live server",
    "tls key of another cert",
    "unix listen path is a directory",
    "store larger than the host",
    "too many transfer threads",
]


@pytest.fixture
def live_unix_socket(tmp_path: Path) -> Iterator[Path]:
    """A unix socket another server listens on."""
    path = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(path))
        s.listen()
        yield path


@pytest.mark.parametrize("case", HOST_CANNOT)
def test_a_setting_the_host_cannot_honour_is_a_usage_error_not_a_traceback(
    shm_dir: Path, tmp_path: Path, live_unix_socket: Path, case: str
) -> None:
    from certs import make_ca, make_cert

    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    if case.startswith("tls"):
        make_ca(tmp_path, "ca")
        make_cert(tmp_path, "ca", "one", "localhost")
        make_cert(tmp_path, "ca", "two", "localhost")
    args, names = {
        "fd socket is a directory": (["--fd-socket", str(tmp_path / "adir")], "not a socket"),
        "fd socket is a file": (["--fd-socket", str(tmp_path / "afile")], "not a socket"),
        "fd socket path too long": (["--fd-socket", str(tmp_path / ("x" * 120))], "longer"),
        "fd socket of a live server": (
            ["--fd-socket", str(live_unix_socket)],
            "another server is listening",
        ),
        "tls key of another cert": (
            ["--tls-cert", str(tmp_path / "one.pem"), "--tls-key", str(tmp_path / "two.key")],
            "not a usable PEM file",
        ),
        "unix listen path is a directory": (
            ["--listen", f"unix:{tmp_path / 'adir'}"],
            "exists and is not a socket",
        ),
        "store larger than the host": (["--store-bytes", "1024T"], "more than this host's memory"),
        "too many transfer threads": (["--transfer-threads", "100000"], "at most 1024"),
    }[case]
    done = kvsvc("serve", "--listen", "127.0.0.1:0", "--shm-dir", str(shm_dir), *args)
    assert_usage_error(done, names)
    assert list(shm_dir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".sock") == ["live.sock"]


@pytest.mark.parametrize("listener", ["--metrics-port", "--health-listen"])
def test_two_listeners_on_one_port_are_one_line_and_exit_2(shm_dir: Path, listener: str) -> None:
    """Each binds alone, so only the server's second bind failed: a traceback (metrics)
    or grpc's C-core log line (health) came first."""
    port = free_port()
    value = str(port) if listener == "--metrics-port" else f"127.0.0.1:{port}"
    done = kvsvc(
        "serve", "--listen", f"127.0.0.1:{port}", "--shm-dir", str(shm_dir), listener, value
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"kvsvc serve: {listener}: port {port} is --listen's port too\n"


def test_an_fd_socket_left_by_a_dead_server_is_reused(shm_dir: Path, tmp_path: Path) -> None:
    """The check probes beside the path and leaves a stale socket for the server to
    replace, as before; the server then serves memfds there."""
    from kvsvc.server.config import check_unix_socket

    path = tmp_path / "fd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(path))  # never listened on, closed: what a killed server leaves
    check_unix_socket("--fd-socket", str(path), -1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fd.sock", "shm"]  # no probe left
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=16 << 20, shm_dir=str(shm_dir), fd_socket=str(path)
    )

    async def make() -> None:
        server = Server(config)
        await server.start()
        assert server.servicer.fds is not None and server.servicer.fds.path == str(path)
        await server.stop(0)

    asyncio.run(make())


@pytest.mark.parametrize("what", ["port in use", "host unknown", "metrics port in use"])
def test_address_that_cannot_be_bound_is_one_line_and_exit_2(
    shm_dir: Path, busy_port: int, what: str
) -> None:
    listen = {
        "port in use": f"127.0.0.1:{busy_port}",
        "host unknown": "no-such-host.invalid:50051",
        "metrics port in use": "127.0.0.1:0",
    }[what]
    extra = ["--metrics-port", str(busy_port)] if what == "metrics port in use" else []
    done = kvsvc("serve", "--listen", listen, "--shm-dir", str(shm_dir), *extra)
    assert done.returncode == 2, (done.returncode, done.stderr)
    # One line: no traceback and no grpc C-core log line before it.
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("kvsvc serve: cannot listen on "), done.stderr
    shown = f"127.0.0.1:{busy_port}" if what != "host unknown" else "no-such-host.invalid"
    assert shown in done.stderr
    assert list(shm_dir.iterdir()) == [], "a socket was left in the shm dir"


def test_server_that_cannot_bind_closes_its_fd_socket(shm_dir: Path, busy_port: int) -> None:
    """Past the command's own check (the port can be taken between check and bind),
    Server itself fails with ConfigError and removes the fd socket it made."""
    config = ServerConfig.from_settings(
        listen=f"127.0.0.1:{busy_port}", store_bytes=16 << 20, shm_dir=str(shm_dir)
    )

    async def make() -> None:
        Server(config)

    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{busy_port}"):
        asyncio.run(make())
    assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:0", "127.0.0.1:1", "127.0.0.1:65535", "[::1]:50051", "unix:kvsvc.sock"]
)
def test_valid_listen_addresses_parse(listen: str) -> None:
    assert parse_server_config(["--listen", listen]).network.listen == listen


@pytest.mark.parametrize("listen", ["127.0.0.1:65536", "127.0.0.1:", ":50051", "::1:50051"])
def test_invalid_listen_addresses_are_rejected(listen: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_server_config(["--listen", listen])
    assert exc.value.code == 2


def test_a_disk_dir_that_is_a_file_says_so(shm_dir: Path, tmp_path: Path) -> None:
    """Not "not a writable directory (File exists)", from the tier after start-up began."""
    a_file = tmp_path / "passwd"
    a_file.write_text("")
    done = kvsvc("serve", "--listen", "127.0.0.1:0", "--shm-dir", str(shm_dir),
                 "--disk-dir", str(a_file))  # fmt: skip
    assert_usage_error(done, f"--disk-dir {a_file}: exists and is not a directory")
    done = kvsvc("serve", "--check", "--disk-dir", str(a_file / "sub"), "--shm-dir", str(shm_dir))
    assert_usage_error(done, f"--disk-dir {a_file / 'sub'}: cannot make it: {a_file} is not a")


# --- kvsvc serve --config, --check, --print-config ---------------------------------
def test_a_config_file_error_is_one_line_naming_the_file_and_key(
    shm_dir: Path, tmp_path: Path
) -> None:
    conf = tmp_path / "kvsvc.toml"
    for text, line in (
        ('store_bytes = "inf"\n', "store_bytes: not a size: 'inf' (a finite number of bytes)"),
        ('store_byte = "1G"\n', "store_byte: unknown setting (did you mean store_bytes?)"),
        ("remote_timeout = nan\n", "remote_timeout: expected a number or a string such as"),
    ):
        conf.write_text(text)
        for args, env in ((["--config", str(conf)], clean_env()),
                          ([], clean_env(KVSVC_CONFIG=str(conf)))):  # fmt: skip
            done = kvsvc("serve", "--shm-dir", str(shm_dir), *args, env=env)
            assert done.returncode == 2, done.stderr
            assert done.stderr.startswith(f"kvsvc serve: {conf}: {line}"), done.stderr
            assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert list(shm_dir.iterdir()) == []


def test_check_validates_everything_and_serves_nothing(
    shm_dir: Path, tmp_path: Path, busy_port: int
) -> None:
    conf = tmp_path / "kvsvc.toml"
    conf.write_text(f'listen = "127.0.0.1:{free_port()}"\nshm_dir = "{shm_dir}"\n')
    done = kvsvc("serve", "--config", str(conf), "--check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kvsvc serve --check: the configuration is valid here")
    assert list(shm_dir.iterdir()) == []  # no fd socket, no region
    # The host checks run: a port in use, a flag overriding the file, is refused.
    done = kvsvc("serve", "--config", str(conf), "--check", "--listen", f"127.0.0.1:{busy_port}")
    assert done.returncode == 2 and done.stderr.startswith("kvsvc serve: cannot listen on ")
    # What a start reads before serving: the tenant file, KVSVC_FAILPOINTS.
    (tmp_path / "tenants.json").write_text("{not json")
    done = kvsvc("serve", "--config", str(conf), "--check", "--auth-token-file",
                 str(tmp_path / "tenants.json"))  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvsvc serve: --auth-token-file: ") and "not JSON" in done.stderr
    done = kvsvc("serve", "--config", str(conf), "--check",
                 env=clean_env(KVSVC_FAILPOINTS="nonsense"))  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("kvsvc serve: KVSVC_FAILPOINTS: ")


def test_print_config_is_a_file_that_reads_back(shm_dir: Path, tmp_path: Path) -> None:
    conf = tmp_path / "kvsvc.toml"
    conf.write_text('store_bytes = "64M"\ntransfer_threads = 3\n')
    env = clean_env(KVSVC_TRANSFER_THREADS="5")
    done = kvsvc("serve", "--config", str(conf), "--print-config", "--log-format", "json", env=env)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert 'store_bytes = "64M"  # file ' + str(conf) in text
    assert "transfer_threads = 5  # env KVSVC_TRANSFER_THREADS" in text
    assert 'log_format = "json"  # flag --log-format' in text
    assert 'listen = "127.0.0.1:50051"  # default' in text
    again = tmp_path / "again.toml"
    again.write_text(text)
    back = kvsvc("serve", "--config", str(again), "--print-config")
    assert back.returncode == 0, back.stderr
    values = [line.split("  #")[0] for line in text.splitlines() if " = " in line]
    assert values == [line.split("  #")[0] for line in back.stdout.splitlines() if " = " in line]
    assert len(values) == len(SETTINGS)


# --- logs ------------------------------------------------------------------------
def test_json_log_timestamps_are_iso_8601_with_offset(spawn) -> None:
    srv = spawn("--log-format", "json")
    srv.signal(signal.SIGTERM)
    assert srv.wait(60) == 0
    records = [json.loads(line) for line in srv.output().splitlines() if line.startswith("{")]
    assert any("serving on" in r["msg"] for r in records), srv.output()
    for r in records:
        ts = datetime.fromisoformat(r["ts"])
        assert ts.utcoffset() is not None, r["ts"]
        assert "T" in r["ts"], r["ts"]


# --- kvsvc demo ------------------------------------------------------------------
def test_demo_without_a_server_says_what_to_do(shm_dir: Path) -> None:
    target = f"127.0.0.1:{free_port()}"
    done = kvsvc("demo", "--target", target, "--shm-dir", str(shm_dir))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvsvc demo: no kvsvc server answers at {target}")
    assert "make serve" in done.stderr
    assert list(shm_dir.iterdir()) == []


def test_demo_against_a_failed_server_says_so(make_server, shm_dir: Path) -> None:
    st = make_server()
    failure = FatalServerError("injected by the test", reason="TEST_FATAL")

    async def fail() -> None:
        st.server.servicer.fatal(failure)

    st.run(fail())
    done = kvsvc("demo", "--target", st.address, "--shm-dir", str(shm_dir))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "is not serving (TEST_FATAL)" in done.stderr
    assert [p.name for p in shm_dir.iterdir() if p.name.startswith("kvsvc-demo")] == []


def test_init_auth_writes_a_private_tenant_file_and_token_once(tmp_path: Path) -> None:
    from kvsvc.server.security.auth import load_tables

    tenants = tmp_path / "auth" / "tenants.json"
    tenants.parent.mkdir()
    done = kvsvc("init-auth", env=clean_env(KVSVC_AUTH_TOKEN_FILE=str(tenants)))
    assert done.returncode == 0, done.stderr
    token_file = tenants.with_name("token")
    token = token_file.read_text().strip()
    assert len(token) >= 43 and re.fullmatch(r"[A-Za-z0-9_-]+", token)  # >= 256 bits
    for f in (tenants, token_file):
        assert f.stat().st_mode & 0o777 == 0o600, oct(f.stat().st_mode)
        assert f.stat().st_uid == os.getuid()
    assert token not in tenants.read_text()  # only its SHA-256
    assert token not in done.stdout + done.stderr
    assert sorted(p.name for p in tenants.parent.iterdir()) == ["tenants.json", "token"]
    (tenant,) = load_tables(str(tenants)).tenants.values()
    tenant.check_namespace("any/namespace")
    # A restart keeps the token its clients hold.
    before = tenants.read_bytes()
    again = kvsvc("init-auth", "--tenant-file", str(tenants))
    assert again.returncode == 0 and "kept the existing" in again.stdout, again
    assert tenants.read_bytes() == before and token_file.read_text().strip() == token
    missing = kvsvc("init-auth")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr


def test_demo_takes_its_token_from_a_file_only(make_server, shm_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    assert kvsvc("init-auth", "--tenant-file", str(tenants)).returncode == 0
    token = tenants.with_name("token").read_text().strip()
    st = make_server(auth_token_file=str(tenants))
    # Without the token: one line that says what to give, no traceback.
    done = kvsvc("demo", "--target", st.address, "--shm-dir", str(shm_dir))
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "--token-file" in done.stderr, done.stderr
    # With it, from --token-file or KVSVC_TOKEN_FILE; the token is never printed.
    token_file = str(tenants.with_name("token"))
    for args, env in (
        (["--token-file", token_file], clean_env()),
        ([], clean_env(KVSVC_TOKEN_FILE=token_file)),
    ):
        done = kvsvc("demo", "--target", st.address, "--shm-dir", str(shm_dir), *args, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "demo: OK" in done.stdout
        assert token not in done.stdout + done.stderr
    unreadable = kvsvc(
        "demo", "--target", st.address, "--token-file", str(tmp_path / "none"), "--shm-dir",
        str(shm_dir),
    )  # fmt: skip
    assert unreadable.returncode == 2 and unreadable.stderr.count("\n") == 1, unreadable.stderr


def test_demo_and_drop_namespace_need_a_port_in_their_target() -> None:
    """A bare host once dialled port 443 and waited out the deadline."""
    for command in ("demo", "drop-namespace"):
        args = ["ns"] if command == "drop-namespace" else []
        done = kvsvc(command, "--target", "localhost", *args)
        assert_usage_error(
            done,
            "argument --target: no port in 'localhost': give HOST:PORT (the server's default "
            "port is 50051: localhost:50051) or unix:PATH",
            command,
        )
    done = kvsvc("drop-namespace", "ns", "--timeout", "inf")
    assert_usage_error(done, "argument --timeout: value must be finite", "drop-namespace")


def test_init_auth_names_the_missing_directory(tmp_path: Path) -> None:
    path = tmp_path / "missingdir" / "t.json"
    done = kvsvc("init-auth", "--tenant-file", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"kvsvc init-auth: --tenant-file {path}: {path.parent} does not exist\n")
    assert list(tmp_path.iterdir()) == []


def test_demo_with_a_missing_shm_dir_says_so() -> None:
    done = kvsvc("demo", "--shm-dir", NO_DIR)
    assert done.returncode != 0
    assert done.stderr == f"kvsvc demo: --shm-dir {NO_DIR}: no such directory\n"


# --- docs/configuration.md, --help and the defaults agree ------------------------
def doc_config_table() -> dict[str, tuple[str, str]]:
    """flag -> (env, default) from docs/configuration.md's tables."""
    section = (REPO / "docs" / "configuration.md").read_text()
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`--"):
            assert cells[2] == "`" + cells[0].strip("`-").replace("-", "_") + "`"  # file key
            default = re.findall(r"`([^`]*)`", cells[3])
            rows[cells[0].strip("`")] = (cells[1].strip("`"), default[0] if default else cells[3])
    return rows


def help_flags() -> dict[str, tuple[str, str]]:
    """flag -> (env, default) from `kvsvc serve --help`, run without KVSVC_* set."""
    done = kvsvc("serve", "--help", env=clean_env(COLUMNS="1000"))
    assert done.returncode == 0, done.stderr
    entries: list[str] = []
    for line in done.stdout.splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif entries and line.startswith("    "):  # help text under a long flag
            entries[-1] += " " + line.strip()
        else:  # a group's title or description ends the entry
            entries.append("")
    flags = {}
    for entry in entries:
        m = re.search(r"\(env (KVSVC_\w+); default ([^)]*)\)$", entry)
        if m:  # "default 0: off": the value, then what it means
            flags[entry.split()[0].rstrip(",")] = (m.group(1), m.group(2).split(": ")[0])
    return flags


def test_doc_table_help_and_defaults_agree() -> None:
    table, helped = doc_config_table(), help_flags()
    assert len(helped) == len(SETTINGS), helped
    assert table == helped  # same flags, env names and defaults, as written
    for flag, (env, shown) in table.items():
        name = flag.removeprefix("--").replace("-", "_")
        assert env == env_name(name)
        # The default as written reads back as the default the server uses.
        assert SETTINGS[name].parse(shown) == SETTINGS[name].default, flag


# --- the README's Python example ---------------------------------------------------
@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="the example uses /dev/shm")
def test_readme_python_example_runs_and_leaves_no_shm_file(make_server) -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2, "the README's two Python snippets"
    # The second snippet continues the first, inside its `with KVCacheClient(...)`.
    code = blocks[0] + blocks[1]
    st = make_server(shm_dir="/dev/shm")
    name = f"kvsvc-test-readme-{uuid.uuid4().hex[:8]}"
    code = code.replace('"127.0.0.1:50051"', repr(st.address)).replace('"engine0"', repr(name))
    assert name in code and st.address in code
    try:
        exec(compile(code, "README.md", "exec"), {})
        assert not os.path.exists(f"/dev/shm/{name}"), "the README example left its shm file"
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


# --- scripts ---------------------------------------------------------------------
def test_check_clients_suggests_a_make_target_that_exists() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "check_clients.sh")],
        env=clean_env(KVSVC_BIN="/nonexistent/kvsvc"),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1
    suggested = re.findall(r"'make (\w+)'", done.stderr)
    assert suggested, done.stderr
    makefile = (REPO / "Makefile").read_text()
    for target in suggested:
        assert re.search(rf"^{target}:", makefile, re.M), f"`make {target}` does not exist"
