"""``import sglang.srt.mem_cache.pool_host`` (and the cache controller) reaches
``sglang.srt.configs``, whose multimodal configs import torchvision at module level.
PyPI's torchvision wheels are CUDA builds that fail to load against the CPU torch
(``operator torchvision::nms does not exist``), and torchvision plays no part in
host pools, the controller or storage. So, in the SGLang venv and only when
torchvision is absent, an empty ``torchvision`` package is registered whose every
name raises when used. No SGLang code is replaced."""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class _Absent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is not installed in the SGLang test venv")


def absent_torchvision() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    names = (
        "torchvision",
        "torchvision.io",
        "torchvision.ops",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    )
    mods: dict[str, types.ModuleType] = {}
    for name in names:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__path__ = []

        def attr(a: str) -> Any:
            if a.startswith("__"):
                raise AttributeError(a)
            return _Absent

        m.__getattr__ = attr  # type: ignore[method-assign]
        mods[name] = m

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    for name in ("torchvision.transforms", "torchvision.transforms.functional"):
        mods[name].InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    mods["torchvision"].__version__ = "0.0"  # type: ignore[attr-defined]
    for name, m in mods.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(mods[parent], child, m)
    sys.modules.update(mods)
