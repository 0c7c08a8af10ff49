"""ram_trl: Reinforced Agent Merging for RL-trained LLM agents.

Telemetry during TRL training, streaming RAM / RAM+ / RAM+s merges (and the task arithmetic, TIES and DARE
baselines) over safetensors checkpoints, and specialize-then-merge recipes.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ram_trl.analysis import analyze
from ram_trl.config import MergeConfig
from ram_trl.engine import merge
from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError, RamTrlError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MergeConfig",
    "NonFiniteError",
    "RamTrlError",
    "__version__",
    "analyze",
    "merge",
]
