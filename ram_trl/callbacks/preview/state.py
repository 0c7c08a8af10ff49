"""The merge preview's state on disk: its scratch directory, the checkpoints it keeps (the best and the last
previewed), the user's ``OUTPUT/last`` and the preview state saved in each trainer checkpoint for a resumed run.
Details: docs/merge-preview.md."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError

logger = logging.getLogger(__name__)

#: Name of the scratch directory inside the output directory (removed at train end).
WORK_DIR = ".ram_preview"
#: The file marking a scratch directory as the preview's (the only kind it removes).
WORK_MARKER = ".ram_preview_scratch"
#: Where the last step's agent goes when an earlier step is kept.
LAST_DIR = "last"
#: The preview's state inside each trainer checkpoint (``checkpoint-N/ram_preview``): its history and the best and
#: last previewed checkpoints (hard links), so a resumed run keeps the argmax over the whole run.
CHECKPOINT_DIR = "ram_preview"
STATE_FILE = "state.json"

__all__ = [
    "CHECKPOINT_DIR",
    "LAST_DIR",
    "STATE_FILE",
    "WORK_DIR",
    "WORK_MARKER",
    "KeptCheckpoints",
    "check_last_dir",
    "check_work_dir",
    "kept_step",
    "link_tree",
    "open_work_dir",
    "read_state",
    "remove_work_dir",
    "restore_state",
    "save_state",
]


@dataclass
class KeptCheckpoints:
    """The previewed checkpoints kept on disk: the best (highest merged average, earliest of equals) and the last."""

    best: Path | None = None
    best_average: float = -math.inf
    last: Path | None = None

    def add(self, checkpoint: Path, average: float) -> None:
        """Keep ``checkpoint`` while it is the best or the last; delete the earlier ones that are neither."""
        previous_best, previous_last = self.best, self.last
        if previous_best is None or average > self.best_average:
            self.best, self.best_average = checkpoint, average
        self.last = checkpoint
        for old in {previous_best, previous_last} - {self.best, self.last, None}:
            shutil.rmtree(old, ignore_errors=True)

    def directories(self) -> set[Path]:
        """The kept directories (one when the best is the last)."""
        return {self.best, self.last} - {None}


def kept_step(history: list[dict[str, Any]], keep: str) -> int:
    """The step whose checkpoint the stage leaves: the highest merged average's (the earliest of equal averages)
    with ``keep="best"``, the last preview's with ``keep="last"``."""
    best = max(history, key=lambda r: r["average"])  # max keeps the earliest of equal averages
    return best["step"] if keep == "best" else history[-1]["step"]


def check_work_dir(work_dir: str | os.PathLike) -> None:
    """Refuse before training a scratch directory the preview did not create (it removes its own at start and end)."""
    work_dir = Path(work_dir)
    if not (work_dir.exists() or work_dir.is_symlink()):
        return
    ours = work_dir.is_dir() and not work_dir.is_symlink()
    if ours and ((work_dir / WORK_MARKER).is_file() or not any(work_dir.iterdir())):
        return
    raise ConfigError(
        f"{work_dir} exists and is not a merge preview's scratch directory; MergePreviewCallback writes its "
        "checkpoints there and removes it. Move it away or choose another output_dir"
    )


def open_work_dir(work_dir: str | os.PathLike) -> Path:
    """Start a fresh scratch directory (main process, after :func:`check_work_dir`): an earlier preview's is
    removed, the new one marked as the preview's."""
    work_dir = Path(work_dir)
    check_work_dir(work_dir)
    remove_work_dir(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / WORK_MARKER).write_text("scratch directory of ram_trl's merge preview; removed at train end\n")
    return work_dir


def remove_work_dir(work_dir: str | os.PathLike) -> None:
    """Remove the scratch directory if the preview created it (it holds :data:`WORK_MARKER`), else leave it."""
    work_dir = Path(work_dir)
    if work_dir.is_dir() and not work_dir.is_symlink() and (work_dir / WORK_MARKER).is_file():
        shutil.rmtree(work_dir, ignore_errors=True)


def check_last_dir(output_dir: str | os.PathLike) -> bool:
    """Whether ``OUTPUT/last`` exists as an earlier preview's (its ``ram_stage.json`` says so); refuse one that
    does not, before training: the preview would replace it."""
    from ram_trl.stage.manifest import MANIFEST_NAME, read_manifest

    last = Path(output_dir) / LAST_DIR
    if not (last.exists() or last.is_symlink()):
        return False
    try:
        record = read_manifest(Path(output_dir) / MANIFEST_NAME).extra.get("preview") or {}
    except ConfigError:
        record = {}
    if isinstance(record, dict) and record.get("last_checkpoint") == LAST_DIR and last.is_dir():
        return True
    raise ConfigError(
        f"{last} exists and is not an earlier merge preview's last step; MergePreviewCallback writes the last step's "
        "agent there. Move it away or choose another output_dir"
    )


def link_tree(source: Path, target: Path) -> None:
    """Hard-link the files of the flat directory ``source`` into ``target`` (created), copying where links fail."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        try:
            os.link(file, target / file.name)
        except OSError:
            shutil.copy2(file, target / file.name)


def save_state(checkpoint: Path, kept: KeptCheckpoints, saved: dict[str, Any]) -> None:
    """Keep the preview's state in a trainer checkpoint (``checkpoint-N/ram_preview``): ``saved`` as
    :data:`STATE_FILE` and hard links to the kept checkpoints."""
    target = checkpoint / CHECKPOINT_DIR
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for directory in kept.directories():
        link_tree(directory, target / directory.name)
    saved = {
        "settings": saved["settings"],
        "history": saved["history"],
        "best": kept.best.name if kept.best else None,
        "last": kept.last.name if kept.last else None,
        **{key: value for key, value in saved.items() if key not in ("settings", "history")},
    }
    (target / STATE_FILE).write_text(json.dumps(saved, indent=1) + "\n")


def read_state(checkpoint: Path, step: int, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The preview state of the trainer checkpoint a run resumes from (``None``, with a warning, when it has none)."""
    folder = checkpoint / CHECKPOINT_DIR
    file = folder / STATE_FILE
    if not file.is_file():
        logger.warning(
            "merge preview: the run resumes at step %d without a preview state in %s; the previews before it are "
            "unknown, and the step kept is chosen among the previews from now on",
            step,
            folder,
        )
        return None
    saved = json.loads(file.read_text())
    if saved["settings"] != json.loads(json.dumps(settings)):
        raise ConfigError(
            f"merge preview: the checkpoint {folder.parent} was previewed with other settings "
            f"({saved['settings']}) than this run's ({settings}); resume with the same method, "
            "parameters, seed, prior stages, prompts and evaluation"
        )
    saved["folder"] = str(folder)
    return saved


def restore_state(saved: dict[str, Any], work_dir: Path, link: bool) -> KeptCheckpoints:
    """The kept checkpoints of a saved state, in the scratch directory."""
    folder = Path(saved["folder"])
    if link:
        for name in {saved["best"], saved["last"]} - {None}:
            link_tree(folder / name, work_dir / name)
    kept = KeptCheckpoints()
    if saved["best"] is not None:
        kept.best = work_dir / saved["best"]
        kept.best_average = max(r["average"] for r in saved["history"])
    if saved["last"] is not None:
        kept.last = work_dir / saved["last"]
    return kept
