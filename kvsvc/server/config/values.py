"""Value parsers of the settings: text (a flag or a KVSVC_* variable) to the value
the server uses, or ``argparse.ArgumentTypeError`` saying what was expected."""

from __future__ import annotations

import argparse
import math
import os
import pwd
from collections.abc import Callable
from urllib.parse import urlsplit

from kvsvc.limits import GiB, MiB, validate_deadline

REMOTE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
_SIZE_UNITS = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}
#: Words that leave an optional setting unset (empty: a variable set to nothing).
UNSET_WORDS = ("", "none", "off")


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1GiB', '64M' or '2G'."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if s and s[-1] in _SIZE_UNITS:
        mult, s = _SIZE_UNITS[s[-1]], s[:-1]
    try:
        number = float(s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    # float() reads 'inf', 'nan' and '1e400' too: no byte count.
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a finite number of bytes)")
    value = int(number)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def size_or_off(text: str) -> int:
    """A size, or 0 for '0' / 'off'."""
    return 0 if is_unset(text) or text.strip() == "0" else parse_size(text)


def format_size(n: int) -> str:
    """The shortest form parse_size reads back exactly: 1073741824 -> '1G'."""
    for unit in "TGMK":
        mult = _SIZE_UNITS[unit.lower()]
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def value_size(text: str) -> int:
    """A Redis value: room for a header, at most Redis' default proto-max-bulk-len."""
    value = parse_size(text)
    if not MiB <= value <= 512 * MiB:
        raise argparse.ArgumentTypeError(f"must be between 1M and 512M: {text!r}")
    return value


def positive_float(text: str) -> float:
    """Seconds: finite, > 0 and within kvsvc.limits' bound on deadlines."""
    try:
        return validate_deadline(float(text), "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction(text: str) -> float:
    """A share: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {'> 0' if least else '>= 0'}: {text!r}")
    return value


def positive_int(text: str) -> int:
    return _whole(text, 1)


def int_up_to(most: int) -> Callable[[str], int]:
    """A whole number 1..most (a bound below what the host refuses mid-start-up)."""

    def convert(text: str) -> int:
        value = _whole(text, 1)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}: {text!r}")
        return value

    return convert


def non_negative_int(text: str) -> int:
    return _whole(text, 0)


def port(text: str) -> int:
    """0 (pick a free port / off) or 1-65535; grpc would wrap 99999 to 34463."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535 (or 0), got {text!r}")
    return value


def listen_address(text: str) -> str:
    """HOST:PORT ([IPv6]:PORT) or unix:PATH; whether it can be bound is checked later."""
    if text.startswith("unix:"):
        if not text.removeprefix("unix:"):
            raise argparse.ArgumentTypeError("unix: needs a socket path, e.g. unix:/tmp/kvsvc.sock")
        return text
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or unix:PATH, got {text!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(
            f"an IPv6 host goes in brackets ([::1]:50051), got {text!r}"
        )
    port(port_text)
    return text


def target_address(text: str) -> str:
    """A server to dial: HOST:PORT ([IPv6]:PORT, port 1-65535) or unix:PATH. gRPC
    would dial a bare host on port 443, which no kvsvc serves."""
    if text.startswith("unix:"):
        return listen_address(text)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or (":" in host and not host.endswith("]")):
        bare = text.strip("[]")
        example = f"[{bare}]:50051" if ":" in bare else f"{bare}:50051"
        raise argparse.ArgumentTypeError(
            f"no port in {text!r}: give HOST:PORT (the server's default port is 50051: "
            f"{example}) or unix:PATH"
        )
    listen_address(text)
    if port(port_text) == 0:
        raise argparse.ArgumentTypeError(f"port 0 in {text!r}: give the port the server listens on")
    return text


def is_unset(text: str) -> bool:
    """An optional setting left unset: empty, 'none' or 'off'."""
    return text.strip().lower() in UNSET_WORDS


def optional(parse: Callable[[str], str] = str) -> Callable[[str], str]:
    """``parse``, or '' for an unset value (how --help and README write it: none)."""

    def convert(text: str) -> str:
        return "" if is_unset(text) else parse(text)

    return convert


def choice(*choices: str) -> Callable[[str], str]:
    """One of ``choices``, matched case-insensitively, kept as declared."""

    def convert(text: str) -> str:
        for c in choices:
            if text.strip().lower() == c.lower():
                return c
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}; got {text!r}")

    return convert


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false (1/0, yes/no, on/off); got {text!r}")


def remote_url(text: str) -> str:
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


def s3_url(text: str) -> str:
    """An S3 endpoint: http(s)://HOST[:PORT], without credentials in it."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an S3 endpoint: {text!r} (http(s)://HOST[:PORT])")
    if parts.username or parts.password:
        raise argparse.ArgumentTypeError(
            "S3 credentials go in --s3-credentials-file or the AWS environment, not in the URL"
        )
    return text.strip()


def redact_url(url: str) -> str:
    """A URL as logs may show it: any password replaced by ***."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.partition("@")
    if sep and at and ":" in userinfo:
        return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hostpart}"
    return url


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


def shm_uids(text: str) -> str:
    """--shm-uids as given (stripped), once every name in it resolves here."""
    shm_owner_uids(text)
    return text.strip()
