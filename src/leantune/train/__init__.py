"""``leantune train``: config, data (read, template, mask, pack), loop, checkpoints, metrics and plots."""

from .config import LeantuneError, TrainConfig, make_config
from .loop import export, train

__all__ = ["LeantuneError", "TrainConfig", "export", "make_config", "train"]
