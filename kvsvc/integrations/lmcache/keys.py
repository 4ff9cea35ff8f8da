"""LMCache's object keys as kvsvc keys and namespaces. Engine-free (an
``ObjectKey`` is read by its attribute names), so the main venv's unit tests run it.

An ``ObjectKey`` names a chunk by model, KV rank, object group, chunk hash and cache
salt. The model (with its weights' identity) and the salt choose the namespace,
``<prefix>/<digest>``: two models, two weights under one name, or two salts never
share a chunk, and kvsvc's tenants own namespaces by prefix. Rank, group and hash
make the key inside it. The object's byte size is not in the key: kvsvc keeps a
chunk with its layout (the staging region's block size), and a Retrieve through a
mapping of another layout is a miss."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Protocol

from kvsvc.integrations.identity import fingerprint_weights


class ObjectKeyLike(Protocol):
    """The fields of LMCache's ``ObjectKey`` this module reads."""

    @property
    def chunk_hash(self) -> bytes: ...
    @property
    def model_name(self) -> str: ...
    @property
    def kv_rank(self) -> int: ...
    @property
    def object_group_id(self) -> int: ...
    @property
    def cache_salt(self) -> str: ...


class Namespaces:
    """Namespace of each (model, salt), computed once per pair; ``model_identity``
    (a plug-in key) stands for the weights' identity, else identity.py finds it
    from the model's name (a local path or a hub name in the local hub cache)."""

    def __init__(self, prefix: str, model_identity: str, log: logging.Logger) -> None:
        self.prefix = prefix
        self.model_identity = model_identity
        self.log = log
        self._known: dict[tuple[str, str], str] = {}

    def of(self, key: ObjectKeyLike) -> str:
        pair = (str(key.model_name), str(getattr(key, "cache_salt", "") or ""))
        ns = self._known.get(pair)
        if ns is None:
            ns = self._known[pair] = self._make(*pair)
        return ns

    def _make(self, model: str, salt: str) -> str:
        weights = fingerprint_weights(
            model, None, self.model_identity, self.log, revision_known=False
        )
        fingerprint = {"engine": "lmcache", "model": model, "weights": weights, "salt": salt}
        digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
        return f"{self.prefix}/{digest[:32]}"

    def staging(self) -> str:
        """The namespace the staging regions are mapped under (transfers name their own)."""
        return f"{self.prefix}/staging"


def chunk_key(key: ObjectKeyLike) -> bytes:
    """The kvsvc key of an object inside its namespace."""
    return b"r%d.g%d|" % (int(key.kv_rank), int(key.object_group_id)) + bytes(key.chunk_hash)


def group_by_namespace(keys: list[Any], namespaces: Namespaces) -> dict[str, list[int]]:
    """Positions of ``keys`` per namespace, in order."""
    out: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(namespaces.of(k), []).append(i)
    return out
