"""The identity of a model's weights, for the namespace fingerprints of every plug-in:
two deployments share KV only when they run the same weights, not merely a model of
the same name (a local path whose files were replaced, a hub name at another
revision). Engine-free: stdlib only.

What identifies the weights, strongest first:
- ``model_identity`` set by the operator (a release tag, a digest they trust):
  taken as given, so hosts whose copies differ in mtime can still share;
- a local directory or file: a digest of its config (``config.json``, the weight
  index, quantization configs: their bytes) and of each weight file's name, size and
  mtime (reading gigabytes of weights at start is not an option; a replaced file
  has a new mtime);
- a hub name: the commit its revision resolves to in the local hub cache (the
  revision itself when it is already a commit hash);
- else only the name and revision, and ``Identity.weak`` says so: the plug-in logs
  once that different weights under that name would share KV.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Identity", "fingerprint_weights", "weights_identity"]

_COMMIT = re.compile(r"[0-9a-f]{40}")
# The files whose bytes define the model's arithmetic (small: read whole).
_CONFIG_FILES = re.compile(r"config\.json|.*\.index\.json|.*quant.*\.json")
# The files that hold weights (large: identified by name, size and mtime).
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|npz|msgpack|h5)")


@dataclass(frozen=True)
class Identity:
    """``value`` goes into a namespace fingerprint; ``weak`` when it is only a name."""

    value: str
    weak: bool = False
    why: str = ""


@functools.lru_cache(maxsize=16)
def weights_identity(
    model: str, revision: str | None = None, override: str = "", *, revision_known: bool = True
) -> Identity:
    """The identity of ``model``'s weights (see the module docstring). ``revision``
    None is the hub's ``main``; ``revision_known=False`` says the engine did not
    tell (vLLM's offloading config has no revision): then a hub name resolves only
    when the cache holds one revision of it. Memoised: every half of a plug-in in
    one process gets the same answer at no cost."""
    if override:
        return Identity(f"set:{override}")
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            return Identity(f"files:{_directory_digest(path)}")
        if path.is_file():
            return Identity(f"files:{_digest([_stat_line(path)])}")
    except OSError as exc:
        return Identity(
            f"name:{model}@{revision}", weak=True, why=f"cannot read {model}: {exc.strerror}"
        )
    commit = _hub_commit(model, revision, revision_known)
    if commit:
        return Identity(f"hub:{commit}")
    return Identity(
        f"name:{model}@{revision}",
        weak=True,
        why=f"{model!r} is neither a local path nor a hub revision in the local hub cache",
    )


def _directory_digest(path: Path) -> str:
    lines: list[str] = []
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        if not entry.is_file():
            continue
        if _CONFIG_FILES.fullmatch(entry.name):
            content = hashlib.sha256(entry.read_bytes()).hexdigest()
            lines.append(f"{entry.name} sha256 {content}")
        elif _WEIGHT_FILES.fullmatch(entry.name):
            lines.append(_stat_line(entry))
    return _digest(lines)


def _stat_line(path: Path) -> str:
    st = path.stat()
    return f"{path.name} {st.st_size} {st.st_mtime_ns}"


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _hub_commit(model: str, revision: str | None, revision_known: bool) -> str:
    """The commit ``revision`` (default ``main``) of hub model ``model`` resolves to in
    the local hub cache, or ""."""
    if revision and _COMMIT.fullmatch(revision):
        return revision
    if model.count("/") != 1:
        return ""
    refs = _hub_cache() / f"models--{model.replace('/', '--')}" / "refs"
    if revision_known:
        ref = refs / (revision or "main")
    else:
        try:
            names = sorted(p for p in refs.iterdir() if p.is_file())
        except OSError:
            return ""
        if len(names) != 1:  # another revision may be the one running: unprovable
            return ""
        ref = names[0]
    try:
        commit = ref.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return commit if _COMMIT.fullmatch(commit) else ""


def _hub_cache() -> Path:
    """The hub cache as huggingface_hub resolves it (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


_warned: set[str] = set()


def fingerprint_weights(
    model: str,
    revision: str | None,
    override: str,
    log: logging.Logger,
    *,
    revision_known: bool = True,
) -> str:
    """``weights_identity(...).value`` for a namespace fingerprint; when it is only a
    name, one warning per model and process says so and what to set."""
    ident = weights_identity(model, revision, override, revision_known=revision_known)
    if ident.weak and model not in _warned:
        _warned.add(model)
        log.warning(
            "kvsvc: %s: the KV namespace is keyed by the model's name only, so different "
            "weights under that name would share KV; set model_identity (e.g. the weights' "
            "commit hash) to tell them apart",
            ident.why,
        )
    return ident.value
