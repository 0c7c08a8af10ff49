"""ram_trl: Reinforced Agent Merging for RL-trained LLM agents: telemetry during TRL training, streaming RAM merges
(and baselines) over safetensors checkpoints, and specialize-then-merge recipes. :func:`merge`, :func:`analyze` and
:class:`MergeConfig` load the merge stack on first use (PEP 562), so importing the callbacks does not import it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError, RamTrlError
from ram_trl.lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ram_trl.analysis import analyze
    from ram_trl.merging.config.schema import MergeConfig
    from ram_trl.merging.engine import merge

#: Public names loaded on first access: name -> defining module.
_LAZY = {
    "analyze": "ram_trl.analysis",
    "MergeConfig": "ram_trl.merging.config.schema",
    "merge": "ram_trl.merging.engine",
}

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


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
