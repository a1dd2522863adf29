"""``leantune train``: config, data (read, template, mask, pack), model loading, the run folder, signals, the loop,
checkpoints, metrics and plots, and ``leantune export`` (merge).

``train``, ``export``, ``TrainConfig`` and ``make_config`` are loaded on first use, so that importing the package
(as the command line does to build ``--help``) does not import torch, transformers or peft.
"""

from __future__ import annotations

import importlib

_LAZY = {"train": ".loop", "export": ".merge", "TrainConfig": ".config", "make_config": ".config"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TrainConfig", "export", "make_config", "train"]
