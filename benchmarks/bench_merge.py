"""Speed and peak memory of ram_trl against mergekit on the same synthetic RL-like checkpoints, same machine, same run.

For every size preset this script

1. generates (once; cached in ``WORKDIR/data/SIZE``) a Qwen2-shaped bf16 base and three "RL agents" with task-vector
   densities 3%, 46% and 54% and partly overlapping supports (:func:`ram_trl.synthetic.make_agent_set`);
2. runs, ``--repeats`` times and interleaved (floor, ours, theirs, ours, theirs, ... in every round), each tool as a
   separate process under ``/usr/bin/time -v`` (peak RSS, CPU time) and ``time.perf_counter`` (wall time), deleting
   the output directory before every run:

   - ``floor``: a process that reads every input tensor (base + agents) once and upcasts it to float32;
   - ``ram_trl ram_plus`` (the paper's global rho, r=0.1, alpha=2.0) against ``mergekit ram`` (tensor-local, one
     pass) and, as an extra row, ``mergekit ramplus_tl`` (r=0.1, alpha=2.0);
   - ``ram_trl ties`` against ``mergekit ties`` with the same YAML (weight 1/3 and density 0.3 per agent,
     ``dtype: bfloat16``);

3. checks once per size that both tools' TIES outputs are close (max abs difference after a float32 upcast; reported,
   not asserted: mergekit computes in bf16, ram_trl in float32) and that every ram_trl output has exactly the base's
   tensor names;
4. prints the tables and writes a Markdown report (``--report``, default ``BENCHMARKS.md`` at the repo root) and the
   raw measurements (``WORKDIR/results.json``).

Usage::

    python benchmarks/bench_merge.py --sizes 270m,540m --repeats 3 --workdir /tmp/bench_work
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Size presets: Qwen2-shaped, vocabulary 32000, untied embeddings. ``doubles`` names the preset with half the
#: layers (same everything else), used for the "doubling the number of layers" memory check.
PRESETS: dict[str, dict] = {
    "50m": {
        "hidden_size": 512,
        "num_layers": 8,
        "intermediate_size": 1408,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 32000,
    },
    "270m": {
        "hidden_size": 1024,
        "num_layers": 16,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    "540m": {
        "hidden_size": 1024,
        "num_layers": 32,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "doubles": "270m",
    },
    "1b": {
        "hidden_size": 2048,
        "num_layers": 16,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
}

DENSITIES = (0.03, 0.46, 0.54)
AGENTS = [f"agent_{i}" for i in range(len(DENSITIES))]
DATA_SEED = 0
#: Bump when the generated data would change, so cached sets are rebuilt.
DATA_VERSION = 1
SHARD_SIZE = "1GB"

#: One benchmarked job: (key, tool, method, config file stem). The key orders the rows.
JOBS = [
    ("floor", "floor", "read+upcast", None),
    ("ours_ram_plus", "ram_trl", "ram_plus", "ours_ram_plus"),
    ("mk_ram", "mergekit", "ram", "mk_ram"),
    ("mk_ramplus_tl", "mergekit", "ramplus_tl", "mk_ramplus_tl"),
    ("ours_ties", "ram_trl", "ties", "ties"),
    ("mk_ties", "mergekit", "ties", "ties"),
]
METHOD_JOBS = {"ram_plus": ["ours_ram_plus", "mk_ram", "mk_ramplus_tl"], "ties": ["ours_ties", "mk_ties"]}
#: (label, ours key, mergekit key, speed target or None).
COMPARISONS = [
    ("ram_trl ram_plus vs mergekit ram", "ours_ram_plus", "mk_ram", 3.0),
    ("ram_trl ram_plus vs mergekit ramplus_tl", "ours_ram_plus", "mk_ramplus_tl", None),
    ("ram_trl ties vs mergekit ties", "ours_ties", "mk_ties", 3.0),
]
TIES_DENSITY = 0.3
RSS_TARGET = 0.5  # ours peak RSS <= half of mergekit's
LAYER_GROWTH_TARGET = 0.20  # doubling the layers raises our peak RSS by less than 20%

FLOOR_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from safetensors import safe_open
    n = 0
    for path in sys.argv[1:]:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                n += handle.get_tensor(name).float().numel()
    print(n)
    """
)

GENERATE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from ram_trl.synthetic import make_agent_set, make_base_checkpoint
    root, preset, densities, seed, shard = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    base = make_base_checkpoint(root + "/base", materialize="stream", max_shard_size=shard, seed=seed, **preset)
    make_agent_set(base, root, densities=densities, overlap=0.5, seed=seed)
    """
)


# --------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint directory (from the index if there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def read_header(path: Path) -> dict:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` over all weight files of ``model_dir``, from the headers only."""
    out: dict[str, tuple[str, list[int]]] = {}
    for path in safetensors_files(model_dir):
        for name, info in read_header(path).items():
            out[name] = (info["dtype"], info["shape"])
    return out


def numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fmt_params(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count < 1e9 else f"{count / 1e9:.2f}B"


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict:
    cpu_model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_total = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = f"{int(line.split()[1]) / 1024**2:.1f} GiB"
                break
    except OSError:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        nproc = str(os.cpu_count())
    git = "unknown"
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "ram_trl"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        git = commit + (" + uncommitted changes in ram_trl/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "nproc": nproc,
        "memory": mem_total,
        "cpu": cpu_model,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "safetensors": version("safetensors"),
        "ram_trl": version("ram-trl"),
        "mergekit": version("mergekit"),
        "git": git,
    }


# --------------------------------------------------------------------------------------------------------------
# Data and configs
# --------------------------------------------------------------------------------------------------------------


def ensure_data(workdir: Path, size: str) -> tuple[Path, int]:
    """Generate (or reuse) the checkpoint set of ``size``; returns its directory and the real parameter count."""
    preset = {k: v for k, v in PRESETS[size].items() if k != "doubles"}
    root = workdir / "data" / size
    marker = root / "complete.json"
    wanted = {
        "preset": preset,
        "densities": list(DENSITIES),
        "seed": DATA_SEED,
        "version": DATA_VERSION,
        "shard": SHARD_SIZE,
    }
    if marker.is_file():
        done = json.loads(marker.read_text(encoding="utf-8"))
        if done.get("spec") == wanted:
            log(f"{size}: reusing {root} ({fmt_params(done['params'])} parameters per model)")
            return root, done["params"]
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    log(f"{size}: generating base + {len(DENSITIES)} agents in {root} ...")
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            GENERATE_SCRIPT,
            str(root),
            json.dumps(preset),
            json.dumps(list(DENSITIES)),
            str(DATA_SEED),
            SHARD_SIZE,
        ],
        check=True,
    )
    params = sum(numel(shape) for _, shape in checkpoint_tensors(root / "base").values())
    marker.write_text(json.dumps({"spec": wanted, "params": params}, indent=2) + "\n", encoding="utf-8")
    log(
        f"{size}: generated in {time.perf_counter() - start:.0f} s, {fmt_params(params)} parameters per model, "
        f"{dir_bytes(root) / 1e9:.2f} GB on disk"
    )
    return root, params


def write_configs(data: Path, config_dir: Path) -> dict[str, Path]:
    """The YAML files of every job (plain text, so they can be read in the report's working directory)."""
    config_dir.mkdir(parents=True, exist_ok=True)
    base = data / "base"
    agents = [data / name for name in AGENTS]

    def models(params: str | None) -> str:
        lines = []
        for agent in agents:
            lines.append(f"  - model: {agent}")
            if params:
                lines.append(f"    parameters: {params}")
        return "\n".join(lines)

    texts = {
        "ours_ram_plus": (
            f"merge_method: ram_plus\nbase_model: {base}\nmodels:\n{models(None)}\n"
            "parameters:\n  r: 0.1\n  alpha: 2.0\ndtype: bfloat16\n"
        ),
        "mk_ram": f"merge_method: ram\nbase_model: {base}\nmodels:\n{models(None)}\ndtype: bfloat16\n",
        "mk_ramplus_tl": (
            f"merge_method: ramplus_tl\nbase_model: {base}\nmodels:\n{models(None)}\n"
            "parameters:\n  r: 0.1\n  alpha: 2.0\ndtype: bfloat16\n"
        ),
        "ties": (
            f"merge_method: ties\nbase_model: {base}\nmodels:\n"
            f"{models(f'{{weight: 0.3333333333333333, density: {TIES_DENSITY}}}')}\ndtype: bfloat16\n"
        ),
    }
    paths = {}
    for stem, text in texts.items():
        path = config_dir / f"{stem}.yaml"
        path.write_text(text, encoding="utf-8")
        paths[stem] = path
    return paths


# --------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------


def mergekit_command() -> list[str]:
    """mergekit-yaml for the current interpreter: the module behind the console script."""
    return [sys.executable, "-m", "mergekit.scripts.run_yaml"]


def mergekit_options(nproc: int) -> list[str]:
    """mergekit's fastest CPU settings (see the report): all cores for torch, no progress bars.

    Defaults are kept for the rest: one output shard (``--out-shard-size 5B``; more shards only add flushes),
    synchronous writes (``--async-write`` only overlaps shard flushes, and there is one), tokenizer copy and model card
    (ram_trl writes both too). ``--lazy-unpickle`` only affects pickle inputs; ``--multi-gpu`` needs an accelerator.
    """
    return ["--quiet", "--num-threads", str(nproc)]


def job_command(key: str, config: Path | None, out: Path, data: Path, nproc: int) -> list[str]:
    if key == "floor":
        files = [str(p) for name in ["base", *AGENTS] for p in safetensors_files(data / name)]
        return [sys.executable, "-c", FLOOR_SCRIPT, *files]
    if key.startswith("ours_"):
        return [sys.executable, "-m", "ram_trl", "merge", str(config), str(out), "--overwrite", "--no-progress"]
    return [*mergekit_command(), str(config), str(out), *mergekit_options(nproc)]


@dataclass
class Run:
    wall: float
    elapsed: float | None
    user: float | None
    system: float | None
    rss_kb: int | None
    returncode: int
    load: float
    log: str
    load_after: float | None = None
    source: str | None = None


@dataclass
class JobResult:
    key: str
    tool: str
    method: str
    command: list[str]
    runs: list[Run] = field(default_factory=list)

    @property
    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.returncode == 0]

    @property
    def failed(self) -> bool:
        return not self.ok_runs

    def median(self) -> float | None:
        runs = self.ok_runs
        return statistics.median(r.wall for r in runs) if runs else None

    def min_max(self) -> tuple[float, float] | None:
        runs = self.ok_runs
        return (min(r.wall for r in runs), max(r.wall for r in runs)) if runs else None

    def cpu_median(self) -> float | None:
        vals = [r.user + r.system for r in self.ok_runs if r.user is not None and r.system is not None]
        return statistics.median(vals) if vals else None

    def peak_rss_mib(self) -> float | None:
        vals = [r.rss_kb for r in self.ok_runs if r.rss_kb is not None]
        return max(vals) / 1024 if vals else None

    @classmethod
    def from_dict(cls, data: dict) -> JobResult:
        runs = [Run(**run) for run in data["runs"]]
        return cls(data["key"], data["tool"], data["method"], data["command"], runs)

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "tool": self.tool,
            "method": self.method,
            "command": self.command,
            "median_s": self.median(),
            "cpu_median_s": self.cpu_median(),
            "peak_rss_mib": self.peak_rss_mib(),
            "runs": [r.__dict__ for r in self.runs],
        }


TIME_FIELDS = {
    "rss_kb": re.compile(r"Maximum resident set size \(kbytes\):\s*(\d+)"),
    "elapsed": re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\):\s*([\d:.]+)"),
    "user": re.compile(r"User time \(seconds\):\s*([\d.]+)"),
    "system": re.compile(r"System time \(seconds\):\s*([\d.]+)"),
}


def parse_time_v(text: str) -> dict:
    out: dict = {}
    for key, pattern in TIME_FIELDS.items():
        match = pattern.search(text)
        if not match:
            out[key] = None
            continue
        value = match.group(1)
        if key == "rss_kb":
            out[key] = int(value)
        elif key == "elapsed":
            seconds = 0.0
            for part in value.split(":"):
                seconds = seconds * 60 + float(part)
            out[key] = seconds
        else:
            out[key] = float(value)
    return out


def ram_trl_source_digest() -> str:
    """Short sha256 of the ram_trl package's Python sources, to notice edits between runs."""
    spec = importlib.util.find_spec("ram_trl")
    if spec is None or spec.origin is None:
        return "unknown"
    digest = hashlib.sha256()
    package = Path(spec.origin).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def run_once(command: list[str], out: Path | None, log_path: Path, env: dict, source: str | None = None) -> Run:
    if out is not None and out.exists():
        shutil.rmtree(out)
    time_file = log_path.with_suffix(".time")
    load = os.getloadavg()[0]
    with log_path.open("w", encoding="utf-8") as handle:
        start = time.perf_counter()
        proc = subprocess.run(
            ["/usr/bin/time", "-v", "-o", str(time_file), *command],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO_ROOT),
        )
        wall = time.perf_counter() - start
    parsed = parse_time_v(time_file.read_text(encoding="utf-8") if time_file.is_file() else "")
    return Run(
        wall=wall,
        returncode=proc.returncode,
        load=load,
        log=str(log_path),
        load_after=os.getloadavg()[0],
        source=source,
        **parsed,
    )


def tail(path: str, lines: int = 6) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


# --------------------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------------------


def open_tensors(model_dir: Path):
    """``{name: safe_open handle}`` for a checkpoint directory (handles stay open until garbage collected)."""
    from safetensors import safe_open

    out = {}
    for path in safetensors_files(model_dir):
        handle = safe_open(str(path), framework="pt")
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            out[name] = handle
    return out


def verify(size: str, data: Path, outs: dict[str, Path]) -> dict:
    """Compare the two TIES outputs and check every ram_trl output's tensor names against the base."""
    result: dict = {"names": {}, "ties": None}
    base_names = set(checkpoint_tensors(data / "base"))
    for key, out in outs.items():
        if not out.is_dir():
            result["names"][key] = "missing"
            continue
        names = set(open_tensors(out))
        if key.startswith("ours_"):
            result["names"][key] = (
                "identical to the base"
                if names == base_names
                else f"DIFFERENT: {len(names - base_names)} extra, {len(base_names - names)} missing"
            )
    ours, theirs = outs.get("ours_ties"), outs.get("mk_ties")
    if ours is None or theirs is None or not ours.is_dir() or not theirs.is_dir():
        return result
    a, b = open_tensors(ours), open_tensors(theirs)
    common = sorted(set(a) & set(b))
    max_diff, max_name, max_2d, max_2d_name, differing, total, sum_abs = 0.0, "", 0.0, "", 0, 0, 0.0
    for name in common:
        x = a[name].get_tensor(name).float()
        y = b[name].get_tensor(name).float()
        if x.shape != y.shape:
            result.setdefault("shape_mismatch", []).append(name)
            continue
        diff = (x - y).abs()
        m = float(diff.max()) if diff.numel() else 0.0
        if m > max_diff:
            max_diff, max_name = m, name
        if x.dim() >= 2 and m > max_2d:
            max_2d, max_2d_name = m, name
        differing += int((diff > 0).sum())
        sum_abs += float(diff.double().sum())
        total += diff.numel()
    # Scale and cause, on the tensor with the largest difference: the largest |merged - base| there, and for every
    # agent how many |tau| equal the TIES cut value (the k-th largest magnitude). Ties at the cut are broken
    # differently by the two tools (ram_trl: lowest indices; mergekit: unstable torch.argsort order), and bf16
    # task vectors are whole numbers of ulps, so such ties are common.
    delta, at_cut = 0.0, []
    if max_name:
        base = open_tensors(data / "base")[max_name].get_tensor(max_name).float()
        delta = float((a[max_name].get_tensor(max_name).float() - base).abs().max())
        for agent in AGENTS:
            tau = (open_tensors(data / agent)[max_name].get_tensor(max_name).float() - base).abs().flatten()
            k = max(1, int(TIES_DENSITY * tau.numel()))
            cut = float(tau.kthvalue(tau.numel() - k + 1).values)
            at_cut.append(
                {"k": k, "cut": cut, "above_cut": int((tau > cut).sum()), "equal_to_cut": int((tau == cut).sum())}
            )
    result["ties"] = {
        "common_tensors": len(common),
        "only_ours": len(set(a) - set(b)),
        "only_mergekit": len(set(b) - set(a)),
        "max_abs_diff": max_diff,
        "max_abs_diff_tensor": max_name,
        "max_abs_task_vector_there": delta,
        "ties_at_cut_there": at_cut,
        "max_abs_diff_2d": max_2d,
        "max_abs_diff_2d_tensor": max_2d_name,
        "mean_abs_diff": sum_abs / total if total else 0.0,
        "fraction_differing": differing / total if total else 0.0,
    }
    return result


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


def f2(value: float | None, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{suffix}"


def f0(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def size_table(results: dict[str, JobResult]) -> list[str]:
    lines = [
        "| tool | method | median wall s | min-max s | median CPU s (user+sys) | peak RSS MiB | runs ok |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results.values():
        mm = res.min_max()
        lines.append(
            f"| {res.tool} | {res.method} | {f2(res.median())} | "
            f"{'n/a' if mm is None else f'{mm[0]:.2f}-{mm[1]:.2f}'} | {f2(res.cpu_median())} | "
            f"{f0(res.peak_rss_mib())} | {len(res.ok_runs)}/{len(res.runs)} |"
        )
    return lines


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def comparisons(results: dict[str, JobResult]) -> list[dict]:
    rows = []
    for label, ours_key, mk_key, target in COMPARISONS:
        if ours_key not in results or mk_key not in results:
            continue
        ours, mk = results[ours_key], results[mk_key]
        speed = ratio(mk.median(), ours.median())
        cpu = ratio(mk.cpu_median(), ours.cpu_median())
        rss = ratio(ours.peak_rss_mib(), mk.peak_rss_mib())
        rows.append(
            {
                "label": label,
                "speedup": speed,
                "cpu_ratio": cpu,
                "rss_ratio": rss,
                "speed_target": target,
                "speed_met": None if target is None or speed is None else speed >= target,
                "rss_met": None if rss is None else rss <= RSS_TARGET,
            }
        )
    return rows


def met(flag: bool | None) -> str:
    return "n/a" if flag is None else ("**met**" if flag else "**NOT met**")


def comparison_table(rows: list[dict]) -> list[str]:
    lines = [
        "| comparison | speedup (mergekit median / ours median) | CPU-time ratio (mergekit / ours) | "
        "peak RSS ours / mergekit | speed target | RSS target (<= 0.5) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        target = "-" if row["speed_target"] is None else f">= {row['speed_target']:.0f}x: {met(row['speed_met'])}"
        lines.append(
            f"| {row['label']} | {f2(row['speedup'], 'x')} | {f2(row['cpu_ratio'], 'x')} | "
            f"{f2(row['rss_ratio'])} | {target} | {met(row['rss_met'])} |"
        )
    return lines


def growth_rows(all_results: dict[str, dict[str, JobResult]]) -> list[dict]:
    rows = []
    for size, results in all_results.items():
        small = PRESETS[size].get("doubles")
        if small is None or small not in all_results:
            continue
        for key, res in results.items():
            other = all_results[small].get(key)
            if other is None:
                continue
            g = ratio(res.peak_rss_mib(), other.peak_rss_mib())
            rows.append(
                {
                    "from": small,
                    "to": size,
                    "key": key,
                    "tool": res.tool,
                    "method": res.method,
                    "rss_from": other.peak_rss_mib(),
                    "rss_to": res.peak_rss_mib(),
                    "growth": None if g is None else g - 1.0,
                    "time_from": other.median(),
                    "time_to": res.median(),
                }
            )
    return rows


def growth_table(rows: list[dict]) -> list[str]:
    lines = [
        "| tool | method | peak RSS MiB (layers x1) | peak RSS MiB (layers x2) | RSS growth | median s x1 -> x2 | "
        "target (ours: < 20%) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        target = "-"
        if row["tool"] == "ram_trl" and row["growth"] is not None:
            target = met(row["growth"] < LAYER_GROWTH_TARGET)
        growth = "n/a" if row["growth"] is None else f"{row['growth'] * 100:+.1f}%"
        lines.append(
            f"| {row['tool']} | {row['method']} ({row['from']} -> {row['to']}) | {f0(row['rss_from'])} | "
            f"{f0(row['rss_to'])} | {growth} | {f2(row['time_from'])} -> {f2(row['time_to'])} | {target} |"
        )
    return lines


def marginal_rows(all_results: dict[str, dict[str, JobResult]], sizes: dict[str, dict]) -> list[dict]:
    """Fixed and per-parameter wall time of every job, from the smallest and the largest size of the run."""
    order = sorted(all_results, key=lambda size: sizes[size]["params"])
    if len(order) < 2:
        return []
    small, large = order[0], order[-1]
    p1, p2 = sizes[small]["params"], sizes[large]["params"]
    if p2 <= p1:
        return []
    rows = []
    for key, res in all_results[large].items():
        other = all_results[small].get(key)
        t1, t2 = (other.median() if other else None), res.median()
        if t1 is None or t2 is None:
            continue
        slope = (t2 - t1) / (p2 - p1)
        rows.append(
            {
                "key": key,
                "tool": res.tool,
                "method": res.method,
                "sizes": f"{small} -> {large}",
                "fixed_s": t1 - slope * p1,
                "ns_per_param": slope * 1e9,
            }
        )
    by_key = {row["key"]: row for row in rows}
    for row in rows:
        row["partners"] = {
            mk: ratio(by_key[mk]["ns_per_param"], row["ns_per_param"])
            for _, ours, mk, _ in COMPARISONS
            if ours == row["key"] and mk in by_key
        }
    return rows


def marginal_table(rows: list[dict]) -> list[str]:
    lines = [
        "| tool | method | sizes | fixed s | marginal ns per parameter | marginal speedup (mergekit / ours) |",
        "|---|---|---|---:|---:|---|",
    ]
    by_key = {row["key"]: row for row in rows}
    for row in rows:
        speed = (
            ", ".join(f"{f2(v, 'x')} vs mergekit {by_key[mk]['method']}" for mk, v in row["partners"].items()) or "-"
        )
        lines.append(
            f"| {row['tool']} | {row['method']} | {row['sizes']} | {row['fixed_s']:.2f} | "
            f"{row['ns_per_param']:.1f} | {speed} |"
        )
    return lines


NOTES_MARKER = "<!-- notes: everything below this line is kept when bench_merge.py rewrites the report -->"


def write_report(payload: dict, report_path: Path) -> None:
    """Build the report from ``payload`` (results.json), print the tables, write the Markdown file.

    Anything after :data:`NOTES_MARKER` in an existing report (hand-written analysis) is kept.
    """
    report, summary = build_report(payload)
    print()
    print(summary)
    if report_path.is_file():
        old = report_path.read_text(encoding="utf-8")
        if NOTES_MARKER in old:
            report = report.rstrip("\n") + "\n\n" + old[old.index(NOTES_MARKER) :]
    report_path.write_text(report, encoding="utf-8")


def build_report(payload: dict) -> tuple[str, str]:
    """(markdown report, terminal summary) from the contents of ``results.json``."""
    info, command_line, sizes, checks = (payload["machine"], payload["command"], payload["sizes"], payload["checks"])
    started, finished = payload.get("started", "unknown"), payload.get("finished", "unknown")
    nproc, executable = payload.get("nproc", 1), payload.get("executable", "python")
    all_results = {
        size: {key: JobResult.from_dict(job) for key, job in jobs.items()} for size, jobs in payload["results"].items()
    }
    gaps = [abs(r.wall - r.elapsed) for res in all_results.values() for j in res.values() for r in j.runs if r.elapsed]
    agreement = f"{max(gaps) * 1000:.0f} ms" if gaps else "n/a"
    md: list[str] = []
    term: list[str] = []
    md += [
        "# Benchmarks: ram_trl vs mergekit",
        "",
        "Speed and peak memory of `ram_trl` and `mergekit` merging the same synthetic RL-like checkpoints on the same "
        "machine in the same run, produced by `benchmarks/bench_merge.py` (see `benchmarks/README.md`).",
        "",
        f"- Date: {started} to {finished}",
        f"- Machine: {info['nproc']} CPUs (`nproc`), {info['memory']} memory, CPU `{info['cpu']}`, {info['os']}",
        f"- Software: Python {info['python']}, torch {info['torch']}, safetensors {info['safetensors']}, "
        f"ram_trl {info['ram_trl']} (git {info['git']}), mergekit {info['mergekit']}",
        f"- Command: `{command_line}`",
        f"- Repeats: {payload.get('repeats', '?')} per job, interleaved in every round (floor, ram_trl ram_plus, mergekit ram, "
        "mergekit ramplus_tl, ram_trl ties, mergekit ties), each a separate process under `/usr/bin/time -v`; the "
        "output directory is deleted before every run. Inputs are read once before the first round so every run "
        "sees a warm page cache.",
        f"- ram_trl: `{executable} -m ram_trl merge CONFIG OUT --overwrite --no-progress` (defaults otherwise: "
        "chunk budget 256MB, 5GB shards).",
        f"- mergekit: `{executable} -m mergekit.scripts.run_yaml CONFIG OUT "
        f"{' '.join(mergekit_options(nproc))}` (the module behind `mergekit-yaml`). These are its best CPU settings: "
        "`--num-threads` = all cores; `--multi-gpu` fails without an accelerator (`torch.accelerator."
        "current_accelerator()` is None); `--lazy-unpickle` only affects pickle inputs; `--async-write` only overlaps "
        "shard flushes and the default `--out-shard-size 5B` writes one shard (a smaller shard size adds flushes and "
        "showed no gain beyond noise in trial runs on 50m); tokenizer copy and model card are kept because ram_trl "
        "writes both as well.",
        "- Wall time is `time.perf_counter()` around `subprocess.run` (it exceeds `/usr/bin/time`'s Elapsed by at "
        f"most {agreement}); peak RSS is the largest `Maximum resident set size` over the repeats (MiB: /usr/bin/time reports KiB); CPU time is user + "
        "system from `/usr/bin/time`.",
        "- Configs: ram_plus `r: 0.1, alpha: 2.0` (global rho, the paper's method; two passes over the inputs); "
        "mergekit `ram` (tensor-local, one pass) and `ramplus_tl` with `r: 0.1, alpha: 2.0`; TIES with the same YAML "
        "for both tools (weight 1/3 and density 0.3 per agent); `dtype: bfloat16` everywhere (mergekit computes in "
        "bf16, ram_trl in float32 with bf16 output).",
        "- Floor: a process that opens every input file (base + 3 agents) with `safetensors.safe_open` and upcasts "
        "every tensor to float32 once (`get_tensor(name).float()`): the cost of reading the inputs at all.",
    ]
    runs = [r for res in all_results.values() for j in res.values() for r in j.runs]
    if runs:
        loads = [r.load for r in runs] + [r.load_after for r in runs if r.load_after is not None]
        md.append(
            f"- 1-minute load average before/after the runs: {min(loads):.2f} to {max(loads):.2f} on this "
            f"{info['nproc']}-CPU machine. The benchmarked process itself accounts for up to about 2; anything more "
            "is other processes competing for the CPUs, which makes wall times noisy. The interleaving spreads that "
            "noise over both tools, and CPU time is shown as a second measure."
        )
        sources = sorted({r.source for r in runs if r.source})
        if len(sources) == 1:
            md.append(f"- ram_trl sources (sha256 of `ram_trl/**/*.py`): `{sources[0]}`, the same for every run.")
        elif sources:
            md.append(
                f"- **ram_trl sources changed during the benchmark** ({len(sources)} versions: "
                f"{', '.join(sources)}); see `results.json` for which run used which."
            )
    md.append("")

    all_comparisons: dict[str, list[dict]] = {}
    for size, results in all_results.items():
        meta = sizes[size]
        preset = PRESETS[size]
        head = (
            f"## {size}: {fmt_params(meta['params'])} parameters per model (hidden {preset['hidden_size']}, "
            f"{preset['num_layers']} layers, intermediate {preset['intermediate_size']}, "
            f"{preset['num_attention_heads']} heads / {preset['num_key_value_heads']} kv heads, "
            f"vocab {preset['vocab_size']}), bf16"
        )
        md += [
            head,
            "",
            f"Inputs: base + 3 agents (task-vector densities {', '.join(f'{d:.0%}' for d in DENSITIES)}), "
            f"{meta['input_bytes'] / 1e9:.2f} GB read per merge; output {meta.get('output_bytes', 0) / 1e9:.2f} GB.",
            "",
        ]
        table = size_table(results)
        md += table + [""]
        rows = comparisons(results)
        all_comparisons[size] = rows
        md += comparison_table(rows) + [""]
        floor, ours_rp = results.get("floor"), results.get("ours_ram_plus")
        floor_multiple = ratio(ours_rp.median() if ours_rp else None, floor.median() if floor else None)
        ours_ties = results.get("ours_ties")
        ties_multiple = ratio(ours_ties.median() if ours_ties else None, floor.median() if floor else None)
        md.append(
            f"Floor (read + upcast every input once): {f2(floor.median() if floor else None)} s; ram_trl ram_plus "
            f"takes {f2(floor_multiple, 'x')} the floor, ram_trl ties {f2(ties_multiple, 'x')}."
        )
        md.append("")
        check = checks.get(size, {})
        ties = check.get("ties")
        if ties:
            md.append(
                f"Check, TIES outputs: max abs difference ram_trl vs mergekit after float32 upcast "
                f"{ties['max_abs_diff']:.3g} (in `{ties['max_abs_diff_tensor']}`, where the largest "
                f"|merged - base| is {ties['max_abs_task_vector_there']:.3g}; TIES keeps k = "
                f"{ties['ties_at_cut_there'][0]['k']} elements per agent there, and the agents have "
                + ", ".join(
                    f"{c['above_cut']} |tau| above and {c['equal_to_cut']} equal to the cut value {c['cut']:.3g}"
                    for c in ties["ties_at_cut_there"]
                )
                + "; the tools break ties at the cut differently: ram_trl keeps the lowest indices, mergekit "
                "the order of an unstable `torch.argsort(descending=True)`); "
                f"largest on a matrix {ties['max_abs_diff_2d']:.3g} (`{ties['max_abs_diff_2d_tensor']}`); mean abs difference "
                f"{ties['mean_abs_diff']:.3g}; {ties['fraction_differing']:.2%} of elements differ; "
                f"{ties['common_tensors']} common tensors, {ties['only_ours']} only in ram_trl's output, "
                f"{ties['only_mergekit']} only in mergekit's."
            )
        names = check.get("names", {})
        if names:
            md.append(
                "Check, ram_trl output tensor names: "
                + "; ".join(f"{k.removeprefix('ours_')}: {v}" for k, v in names.items() if k.startswith("ours_"))
                + "."
            )
        failures = [res for res in results.values() if any(r.returncode != 0 for r in res.runs)]
        for res in failures:
            bad = [r for r in res.runs if r.returncode != 0]
            md += [
                "",
                f"**{res.tool} {res.method} failed {len(bad)}/{len(res.runs)} times** (exit {bad[0].returncode}); "
                "last lines of its log:",
                "",
                "```",
                tail(bad[0].log, 12),
                "```",
            ]
        md.append("")
        term += [head, *table, "", *comparison_table(rows), ""]
        term.append(
            f"floor {f2(floor.median() if floor else None)} s; ours ram_plus = {f2(floor_multiple, 'x')} floor"
        )
        if ties:
            term.append(
                f"ties max abs diff ours vs mergekit: {ties['max_abs_diff']:.3g} "
                f"({ties['fraction_differing']:.2%} of elements differ)"
            )
        if names:
            term.append(f"ours tensor names: {names}")
        term.append("")

    grows = growth_rows(all_results)
    if grows:
        md += ["## Doubling the number of layers", ""] + growth_table(grows) + [""]
        term += ["Doubling the number of layers", *growth_table(grows), ""]

    marginal = marginal_rows(all_results, sizes)
    if marginal:
        md += [
            "## Fixed and marginal cost",
            "",
            "A straight line through the median wall times of the smallest and the largest size: time = fixed + "
            "marginal cost x parameters (per model). The fixed part is mostly start-up (interpreter, imports, "
            "config, planning, model card). The marginal cost also holds any per-tensor overhead (the sizes differ in "
            "their number of tensors): it describes going from one size to the other, not other shapes.",
            "",
            *marginal_table(marginal),
            "",
        ]
        term += ["Fixed and marginal cost", *marginal_table(marginal), ""]
    md += ["## Targets", "", "| target | size | measured | met |", "|---|---|---:|---|"]
    for size, rows in all_comparisons.items():
        for row in rows:
            if row["speed_target"] is not None:
                md.append(
                    f"| {row['label'].replace(' vs ', ' >= 3x faster than ')} | {size} | "
                    f"{f2(row['speedup'], 'x')} | {met(row['speed_met'])} |"
                )
        for row in rows:
            if row["speed_target"] is not None:
                md.append(
                    f"| peak RSS <= half of mergekit's ({row['label']}) | {size} | {f2(row['rss_ratio'])} | "
                    f"{met(row['rss_met'])} |"
                )
    for row in grows:
        if row["tool"] == "ram_trl":
            flag = None if row["growth"] is None else row["growth"] < LAYER_GROWTH_TARGET
            growth = "n/a" if row["growth"] is None else f"{row['growth'] * 100:+.1f}%"
            md.append(
                f"| doubling layers raises ram_trl {row['method']} peak RSS by < 20% | {row['from']} -> "
                f"{row['to']} | {growth} | {met(flag)} |"
            )
    for size, results in all_results.items():
        floor, ours_rp = results.get("floor"), results.get("ours_ram_plus")
        m = ratio(ours_rp.median() if ours_rp else None, floor.median() if floor else None)
        md.append(
            f"| floor: ram_trl ram_plus as a multiple of read + upcast (no target) | {size} | {f2(m, 'x')} | - |"
        )
    md.append("")
    return "\n".join(md) + "\n", "\n".join(term)


# --------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="270m,540m", help=f"comma-separated presets: {', '.join(PRESETS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every job (interleaved)")
    parser.add_argument("--workdir", default="bench_out", help="data (cached), configs, outputs and logs")
    parser.add_argument("--keep", action="store_true", help="keep the merge outputs of the last round")
    parser.add_argument(
        "--methods", default="ram_plus,ties", help=f"comma-separated comparisons: {', '.join(METHOD_JOBS)}"
    )
    parser.add_argument("--report", default=str(REPO_ROOT / "BENCHMARKS.md"), help="Markdown report to write")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild the report from WORKDIR/results.json (e.g. after editing the report code)",
    )
    args = parser.parse_args(argv)
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.size_list:
        parser.error("--sizes is empty")
    if not args.method_list:
        parser.error("--methods is empty")
    for size in args.size_list:
        if size not in PRESETS:
            parser.error(f"unknown size {size!r}; choose from {', '.join(PRESETS)}")
    for method in args.method_list:
        if method not in METHOD_JOBS:
            parser.error(f"unknown method {method!r}; choose from {', '.join(METHOD_JOBS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        results_path = Path(args.workdir).resolve() / "results.json"
        if not results_path.is_file():
            sys.exit(f"error: {results_path} does not exist; run the benchmark first")
        write_report(json.loads(results_path.read_text(encoding="utf-8")), Path(args.report))
        log(f"report rebuilt from {results_path} and written to {args.report}")
        return 0
    command_line = shlex.join(["python", *(sys.argv if argv is None else ["benchmarks/bench_merge.py", *argv])])
    if not Path("/usr/bin/time").is_file():
        sys.exit("error: /usr/bin/time (GNU time) is required: apt-get install time")
    try:
        importlib.metadata.version("mergekit")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("error: mergekit is not installed in this interpreter: pip install mergekit==0.1.5")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    nproc = os.cpu_count() or 1
    info = machine_info()
    started = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    keys = ["floor"] + [k for m in args.method_list for k in METHOD_JOBS[m]]
    jobs = [job for job in JOBS if job[0] in keys]
    log(f"machine: {info['nproc']} CPUs, {info['memory']}, {info['cpu']}; mergekit {info['mergekit']}")

    sizes: dict[str, dict] = {}
    all_results: dict[str, dict[str, JobResult]] = {}
    checks: dict[str, dict] = {}
    for size in args.size_list:
        data, params = ensure_data(workdir, size)
        inputs = [p for name in ["base", *AGENTS] for p in safetensors_files(data / name)]
        sizes[size] = {"params": params, "input_bytes": sum(p.stat().st_size for p in inputs)}
        log(f"{size}: {params:,} parameters per model ({fmt_params(params)})")
        configs = write_configs(data, workdir / "configs" / size)
        out_root = workdir / "out" / size
        log_root = workdir / "logs" / size
        out_root.mkdir(parents=True, exist_ok=True)
        log_root.mkdir(parents=True, exist_ok=True)
        # Warm the page cache so the first run is not penalised.
        for path in inputs:
            with path.open("rb") as handle:
                while handle.read(1 << 24):
                    pass
        results: dict[str, JobResult] = {}
        outs: dict[str, Path] = {}
        for key, tool, method, stem in jobs:
            out = out_root / key if stem else None
            if out is not None:
                outs[key] = out
            command = job_command(key, configs.get(stem) if stem else None, out or out_root, data, nproc)
            results[key] = JobResult(key, tool, method, command)
        for round_ in range(args.repeats):
            for key, _tool, _method, _stem in jobs:
                res = results[key]
                source = ram_trl_source_digest() if res.tool == "ram_trl" else None
                run = run_once(res.command, outs.get(key), log_root / f"{key}.{round_}.log", env, source)
                res.runs.append(run)
                status = "ok" if run.returncode == 0 else f"FAILED (exit {run.returncode}, see {run.log})"
                rss = "?" if run.rss_kb is None else f"{run.rss_kb / 1024:.0f} MiB"
                log(
                    f"{size} round {round_ + 1}/{args.repeats} {res.tool:8s} {res.method:11s} "
                    f"{run.wall:7.2f} s  peak RSS {rss:>8s}  load {run.load:.2f}  {status}"
                )
        output_sizes = [dir_bytes(outs[k]) for k in ("ours_ram_plus", "ours_ties") if k in outs and outs[k].is_dir()]
        if output_sizes:
            sizes[size]["output_bytes"] = output_sizes[0]
        log(f"{size}: verifying outputs ...")
        checks[size] = verify(size, data, outs)
        all_results[size] = results
        if not args.keep:
            shutil.rmtree(out_root, ignore_errors=True)
        payload = {
            "command": command_line,
            "executable": sys.executable,
            "nproc": nproc,
            "repeats": args.repeats,
            "started": started,
            "finished": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "machine": info,
            "sizes": sizes,
            "results": {name: {k: r.as_dict() for k, r in res.items()} for name, res in all_results.items()},
            "checks": checks,
        }
        (workdir / "results.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")

    write_report(payload, Path(args.report))
    log(f"report written to {args.report}; raw measurements in {workdir / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
