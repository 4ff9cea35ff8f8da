"""Run as a script by test_versions.py, under one vLLM (0.32 from .venv-vllm, or
0.33's wheel put first on PYTHONPATH): imports vLLM's base classes and kvsvc's
classes built on them, and prints, as JSON, the vLLM version and every way an
override fails its base: a missing abstract method, or a signature that refuses
a call the base's signature allows."""

from __future__ import annotations

import inspect
import json
from typing import Any

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
MARK = "kvsvc-seams: "


def refusals(base: Any, ours: Any) -> list[str]:
    """How ``ours`` refuses a call that ``base`` accepts (empty: it accepts them all):
    each of the base's parameters taken where the base takes it (by place, by name,
    or both), a default wherever the base has one, *args and **kwargs where the
    base has them; a parameter the base lacks needs a default."""
    b, o = inspect.signature(base), inspect.signature(ours)
    bp, op = list(b.parameters.values()), list(o.parameters.values())
    out: list[str] = []
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in op)
    var_kw = any(p.kind is P.VAR_KEYWORD for p in op)
    o_pos = [p for p in op if p.kind in POSITIONAL]
    by_name = {p.name: p for p in op if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    for i, p in enumerate(x for x in bp if x.kind in POSITIONAL):
        q = o_pos[i] if i < len(o_pos) else None
        if q is None and not var_pos:
            out.append(f"{p.name!r} is not taken at place {i}")
        if q is not None and p.default is not P.empty and q.default is P.empty:
            out.append(f"{q.name!r} (the base's {p.name!r}) has no default")
    for p in bp:
        by_kw = p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
        if by_kw and p.name not in by_name and not var_kw:
            out.append(f"{p.name!r} is not taken by name")
        elif by_kw and p.name in by_name:
            q = by_name[p.name]
            if p.default is not P.empty and q.default is P.empty:
                out.append(f"{p.name!r} has no default; the base's has")
        elif p.kind is P.VAR_POSITIONAL and not var_pos:
            out.append("no *args; the base takes them")
        elif p.kind is P.VAR_KEYWORD and not var_kw:
            out.append("no **kwargs; the base takes them")
    names = {p.name for p in bp}
    for q in op:
        extra = q.name not in names and q.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
        if extra and q.default is P.empty:
            out.append(f"{q.name!r} is not the base's and has no default")
    return out


def check(ours: type, base: type, built_by_vllm: bool = True) -> dict[str, Any]:
    """``ours``'s overrides of ``base`` (and of base's own bases) against it;
    ``__init__`` too where vLLM builds the class."""
    problems: list[str] = []
    if inspect.isabstract(ours):
        problems.append(f"abstract methods left: {sorted(ours.__abstractmethods__)}")
    checked = []
    for name, attr in vars(ours).items():
        if (name.startswith("__") and (name != "__init__" or not built_by_vllm)) or not callable(
            getattr(base, name, None)
        ):
            continue
        if isinstance(attr, property | type):
            continue
        theirs, mine = getattr(base, name), getattr(ours, name)
        checked.append(name)
        problems += [f"{name}: {p}" for p in refusals(theirs, mine)]
        static_b, static_o = inspect.getattr_static(base, name), attr
        if type(static_b) is not type(static_o) and isinstance(
            static_b, classmethod | staticmethod
        ):
            problems.append(f"{name}: a {type(static_b).__name__} in the base")
    return {"class": ours.__name__, "base": base.__name__, "checked": checked, "problems": problems}


def main() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_offload.base import OffloadingWorker
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvsvc.integrations.vllm.common import KvsvcConnectorStats
    from kvsvc.integrations.vllm.connector import KvsvcConnector
    from kvsvc.integrations.vllm.offload_spec import (
        HOST_COPY_SEAM,
        HostCopyWorker,
        KvsvcOffloadingSpec,
    )
    from kvsvc.integrations.vllm.tier import KvsvcTier

    pairs = [
        (KvsvcConnector, KVConnectorBase_V1),
        (KvsvcConnectorStats, KVConnectorStats),
        (KvsvcTier, SecondaryTierManager),
        (KvsvcOffloadingSpec, TieringOffloadingSpec),
    ]
    hooks = {
        n: n in vars(KVConnectorBase_V1)
        for n in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
    }
    report: dict[str, Any] = {
        "version": vllm.__version__,
        "vllm_file": vllm.__file__,
        "base_hooks": hooks,
        "classes": [check(o, b) for o, b in pairs]
        + [check(HostCopyWorker, OffloadingWorker, built_by_vllm=False)],  # our spec builds it
        "submit_load": str(inspect.signature(OffloadingWorker.submit_load)),
        "host_copy_seam": HOST_COPY_SEAM,
    }
    if hooks["supports_sleep_mode"]:
        # As vLLM's VllmConfig asks when enable_sleep_mode is set: through its factory.
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cfg = KVTransferConfig(
            kv_connector="KvsvcConnector",
            kv_connector_module_path="kvsvc.integrations.vllm",
            kv_role="kv_both",
        )
        cls = KVConnectorFactory.get_connector_class(cfg)
        report["factory_class"] = f"{cls.__module__}.{cls.__qualname__}"
        report["supports_sleep_mode"] = cls.supports_sleep_mode(cfg)
    # vLLM logs to stdout too: the report is the one line with this prefix.
    print(MARK + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
