"""ram_trl: Reinforced Agent Merging for RL-trained LLM agents.

Telemetry during TRL training, streaming RAM / RAM+ / RAM+s merges (and the task arithmetic, TIES and DARE
baselines) over safetensors checkpoints, and specialize-then-merge recipes.
"""

from __future__ import annotations

__version__ = "0.1.0"

import gc as _gc

# Importing torch creates about a million objects; the cyclic collector would walk them over and over (about 0.3 s of
# every command's start-up) and find nothing to free. Paused during these imports only, then restored.
_gc_enabled = _gc.isenabled()
_gc.disable()
try:
    from ram_trl.analysis import analyze
    from ram_trl.config import MergeConfig
    from ram_trl.engine import merge
    from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError, RamTrlError
finally:
    if _gc_enabled:
        _gc.enable()

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
