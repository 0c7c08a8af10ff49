"""Every default shared by more than one entry point (command line, API, methods, telemetry, recipes, reports), in
one place, so a default changes in one line. Imports nothing."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------------------
# The RAM method (the paper's defaults)

EPS: float = 1e-5  #: Activity threshold: an element of a task vector is active when ``|tau| > EPS`` (strict).
R: float = 0.1  #: RAM+ / RAM+s rescale strength r of ``lambda_t = 1 + r * f(rho_t)``.
ALPHA: float = 2.0  #: RAM+ clip bound alpha of rho_t.
MERGEKIT_TL_ALPHA: float = 0.2  #: mergekit's default alpha for its tensor-local RAM+ (``ramplus_tl``).

# ---------------------------------------------------------------------------------------------------------------
# Baselines

LAMBDA: float = 1.0  #: Global scaling of the merged task vector (task arithmetic, TIES, DARE, Fisher).
WEIGHT: float = 1.0  #: Per-agent weight w_t.
DENSITY: float = 1.0  #: Fraction of each task vector kept (TIES: by magnitude; DARE: at random, 1 - p).
FISHER_FLOOR: float = 1e-6  #: Fisher merging: values below it are raised to it (Matena & Raffel's ``fisher_floor``).

# ---------------------------------------------------------------------------------------------------------------
# Streaming and output

MAX_SHARD_SIZE: str = "5GB"  #: Largest output safetensors file (decimal units: 5 * 10**9 bytes).
CHUNK_BUDGET: str = "256MB"  #: Memory for one chunk's buffers; bounds peak memory (decimal units: 256 * 10**6 bytes).

# ---------------------------------------------------------------------------------------------------------------
# Telemetry

MAGNITUDE_SAMPLE: int = 1 << 25  #: Magnitude statistics of larger models: a systematic sample of about this many.
METRIC_PREFIX: str = "task_vector/"  #: Prefix of the metrics the telemetry logs.
#: dtype an agent is saved in at the end of an RL run: "auto" is the dtype the trainer holds the trained parameters
#: in, so the saved agent is the trained one (a bf16 save of float32 training rounds most small RL steps away:
#: docs/telemetry.md, "Which save dtype").
SAVE_DTYPE: str = "auto"

# ---------------------------------------------------------------------------------------------------------------
# Merge preview

#: Merge previews per run at the default interval: every ``ceil(max_steps / PREVIEW_COUNT)`` optimizer steps (the
#: final step is always previewed), so a run's preview cost does not grow with its length.
PREVIEW_COUNT: int = 4
#: Validation prompts per stage a merge preview scores (a seeded subset of the validation split, recorded in the
#: manifest); ``None`` in the callback scores all of them.
PREVIEW_PROMPTS: int = 24
PREVIEW_METHOD: str = "ram_plus"  #: Merge method of the preview: RAM+ at the paper's settings.
