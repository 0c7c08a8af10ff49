"""Merge reports: the JSON report and model cards (merged model, LoRA adapter), written with :func:`write_report`
inside the output's temporary directory, and the terminal tables of plans and results."""

from __future__ import annotations

import json
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import yaml

import ram_trl
from ram_trl import defaults
from ram_trl.io.hub import cached_revision, describe, parse_reference
from ram_trl.merging.planner import PROCESS_BASELINE_BYTES, MergePlan
from ram_trl.messages import processes_phrase, shown
from ram_trl.methods import resolve_method
from ram_trl.sizes import format_bytes
from ram_trl.statistics.effect import effect_line, effect_report

if TYPE_CHECKING:
    from ram_trl.merging.config.settings import ResolvedConfig
    from ram_trl.merging.context import MergeState

REPORT_FILE = "ram_merge_report.json"  #: The report of a merged model or adapter (also marks a previous output).
CARD_FILE = "README.md"  #: The model card.


def json_default(value: Any) -> Any:
    """``json.dumps(default=...)`` for reports: paths as strings, infinities as ``"inf"``, dtypes by name."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"cannot serialise {type(value).__name__}")


def _finite(value: float) -> float | str:
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def _lambda_summary(resolved: ResolvedConfig, state: MergeState, t: int) -> dict[str, Any]:
    """Per-agent lambda_t: one number (global scope) or its spread over tensors (tensor scope)."""
    if not resolved.method.needs_statistics:
        return {"lambda": None}
    if not resolved.method.tensor_local_statistics(resolved.params):
        assert state.lambdas is not None
        return {"lambda": state.lambdas[t]}
    factors = resolved.method.factors
    assert factors is not None
    values, weights = [], []
    for _, stats in sorted(state.tensor_stats.items()):  # a fixed order: the same sum on any number of ranks
        if stats.unique(t) == 0:
            continue
        values.append(factors(stats, resolved.params)[t])
        weights.append(stats.unique(t))
    if not values:
        return {"lambda": None, "lambda_scope": "tensor"}
    mean = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    return {
        "lambda": mean,
        "lambda_scope": "tensor",
        "lambda_min": min(values),
        "lambda_max": max(values),
        "lambda_note": "tensor-local: lambda_t varies per tensor; 'lambda' is the mean over unique elements",
    }


def build_report(
    resolved: ResolvedConfig, plan: MergePlan, state: MergeState, timings: dict[str, float], output_dir: Path
) -> dict[str, Any]:
    """Assemble the merge report (the content of ``ram_merge_report.json``)."""
    agents = []
    for t, agent in enumerate(resolved.agents):
        entry: dict[str, Any] = {
            "index": agent.index,
            "name": agent.name,
            "path": str(agent.path),
            "kind": agent.kind,
            "parameters": agent.parameters,
        }
        if agent.stage is not None:
            entry["stage"] = agent.stage
        hub = describe(agent.path, agent.reference)
        if hub:
            entry["hub"] = hub
        stats = state.stats.as_dict(t)
        stats["rho"] = _finite(stats["rho"])
        entry.update(stats)
        entry.update(_lambda_summary(resolved, state, t))
        agents.append(entry)
    params = dict(resolved.params)
    base_hub = describe(resolved.base_path, resolved.base_reference)
    effect = effect_report(state.effect, resolved.method, [t.out_dtype for t in plan.tasks if t.floating])
    return {
        "ram_trl_version": ram_trl.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "merge_method": resolved.method.name,
        "merge_method_as_written": resolved.method_alias,
        "method_pretty_name": resolved.method.pretty_name,
        "reference": resolved.method.reference,
        "parameters": params,
        "base_model": str(resolved.base_path),
        **({"base_hub": base_hub} if base_hub else {}),
        "card_inputs": card_inputs(resolved),
        "output_dir": str(output_dir),
        "num_agents": len(agents),
        "total_elements": state.stats.numel,
        "agents": agents,
        "output": {
            "dtype": str(resolved.out_dtype).removeprefix("torch.") if resolved.out_dtype else "base",
            "files": [s.file_name for s in plan.shards],
            "bytes": plan.output_bytes,
            "tensors": len(plan.tasks),
            "resized_tensors": plan.resized,
        },
        "arithmetic_dtype": "float32",
        "seed": resolved.seed,
        "timings": timings,
        "bytes_read": state.read.bytes,
        "input_cache": None if state.cache is None else state.cache.summary(),
        "effect": effect,
        "warnings": list(state.warnings) + list(resolved.notes) + ([effect["warning"]] if effect["warning"] else []),
        "config": resolved.raw,
        "environment": {"python": sys.version.split()[0], "platform": platform.platform()},
    }


def write_report(out_dir: Path, report: dict[str, Any], card: str) -> None:
    """Write the report (``ram_merge_report.json``) and the model card (``README.md``) into an output directory."""
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=json_default) + "\n")
    (out_dir / CARD_FILE).write_text(card)


def front_matter(front: dict[str, Any]) -> str:
    return "---\n" + yaml.safe_dump(front, sort_keys=False).strip() + "\n---\n"


def hub_name(reference: str | None, path: str | Path) -> str:
    """How a card names an input: a Hub id as written (without ``@revision``), a local path by its folder's name."""
    hub = parse_reference(reference) if reference and not Path(reference).expanduser().exists() else None
    if hub is not None:
        return hub.repo_id
    cached = cached_revision(path)
    return cached.repo_id if cached is not None else Path(reference or path).name


def card_inputs(resolved: ResolvedConfig) -> list[str]:
    """Every input model as a card's ``base_model`` lists it: the base, then each agent (stages by their checkpoint's
    folder, a ``MODEL+ADAPTER`` by its adapter), without repeats."""
    names = [hub_name(resolved.base_reference, resolved.base_path)]
    for agent in resolved.agents:
        reference = (
            agent.reference.rsplit("+", 1)[-1] if agent.reference and "+" in agent.reference else agent.reference
        )
        names.append(hub_name(reference, agent.path))
    return list(dict.fromkeys(names))


def model_card(report: dict[str, Any]) -> str:
    """A Hugging Face model card (README.md) for a merged model: the Hub's merge convention (``base_model`` lists
    every input, ``base_model_relation: merge``, tags)."""
    front = {
        "base_model": report.get("card_inputs") or [report["base_model"]],
        "base_model_relation": "merge",
        "library_name": "transformers",
        "tags": ["merge", "ram_trl", report["merge_method"]],
    }
    return front_matter(front) + "\n" + card_body(report) + upload_lines()


def warnings_and_config_lines(report: dict[str, Any]) -> list[str]:
    """A card's "Warnings" (when any) and "Configuration" sections, as lines."""
    lines = ["", "## Warnings", "", *(f"- {w}" for w in report["warnings"])] if report["warnings"] else []
    config = yaml.safe_dump(report["config"], sort_keys=False).strip()
    return [*lines, "", "## Configuration", "", "```yaml", config, "```"]


def upload_lines() -> str:
    """The card's closing section: how to upload the folder to the Hub."""
    return (
        "\n## Upload\n\n```bash\nhf upload YOUR_ORG/YOUR_MODEL PATH/TO/THIS/FOLDER .\n```\n\n"
        "(`hf auth login` first; the folder holds everything the Hub needs.)\n"
    )


def card_body(report: dict[str, Any], title: str = "Merged model") -> str:
    """The body of a merged model's card (no front matter): method, parameters, agents, stages, warnings, config."""
    lines = [f"# {title}: {report['method_pretty_name']}", ""]
    lines.append(
        f"This model was merged with ram_trl {report['ram_trl_version']} "
        f"from the base model `{report['base_model']}` and {report['num_agents']} agents using "
        f"**{report['merge_method']}**"
        + (f" ([paper]({report['reference']}))" if report["reference"] else "")
        + ". All arithmetic ran in float32 from the stored weights."
    )
    lines += ["", "## Parameters", ""]
    for key, value in report["parameters"].items():
        lines.append(f"- `{key}`: {value}")
    lines += ["", "## Agents", ""]
    lines.append("| # | agent | kind | density | active | unique | shared | rho | lambda_t |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for agent in report["agents"]:
        lam = agent.get("lambda")
        lam_text = "-" if lam is None else f"{lam:.4f}"
        if agent.get("lambda_scope") == "tensor" and lam is not None:
            lam_text += f" (per tensor, {agent['lambda_min']:.4f}-{agent['lambda_max']:.4f})"
        rho = agent["rho"]
        rho_text = rho if isinstance(rho, str) else f"{rho:.4f}"
        lines.append(
            f"| {agent['index']} | `{agent['name']}` | {agent['kind']} | {agent['density']:.4%} | "
            f"{agent['active']:,} | {agent['unique']:,} | {agent['shared']:,} | {rho_text} | {lam_text} |"
        )
    lines.append("")
    lines.append(
        f"Counts are over {report['total_elements']:,} elements of the floating-point tensors; an element is active "
        f"when |tau| > eps = {report['parameters'].get('eps', defaults.EPS):g}. Unique: updated by this agent only; shared: "
        "by two or more agents."
    )
    if any(agent["kind"] == "lora" for agent in report["agents"]):
        lines.append("")
        lines.append(
            "LoRA agents contribute the dense delta B @ A * scaling of their target modules (plus any modules they "
            "save in full): their density is close to 100% on those modules and 0 elsewhere, so for them 'unique' "
            "means 'in a module no other agent touches' rather than 'an element RL changed alone'."
        )
    method, _ = resolve_method(report["merge_method"])
    if method.needs_fisher:
        lines += ["", "Each agent's task vector is weighted by its diagonal Fisher, read from:", ""]
        lines += [f"- `{agent['name']}`: `{agent['parameters'].get('fisher')}`" for agent in report["agents"]]
    staged = [agent for agent in report["agents"] if agent.get("stage")]
    if staged:
        lines += ["", "## Stages", ""]
        lines.append("| agent | domain | trainer | steps | saved as | final rewards | manifest |")
        lines.append("|---|---|---|---|---|---|---|")
        for agent in staged:
            stage = agent["stage"]
            rewards = ", ".join(f"{k} {v:.4g}" for k, v in stage.get("rewards", {}).items()) or "-"
            lines.append(
                f"| `{agent['name']}` | {stage.get('domain') or '-'} | {stage.get('trainer') or '-'} | "
                f"{stage.get('steps', 0)} | {stage.get('save_dtype') or '-'} | {rewards} | `{stage['manifest']}` |"
            )
    lines += warnings_and_config_lines(report)
    lines += [
        "",
        f"Output: {len(report['output']['files'])} safetensors file(s), {format_bytes(report['output']['bytes'])}.",
    ]
    lines.append("")
    return "\n".join(lines)


def adapter_card(report: dict[str, Any]) -> str:
    """The model card of an exported adapter: the merge's card (method, parameters, agents) plus the export."""
    base = (report.get("card_inputs") or [report.get("base_model")])[0]
    tags = {"lora", "transformers", f"base_model:adapter:{base}", "merge", "ram_trl"}
    front = {
        "base_model": base,
        "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": sorted(tags | ({report["merge_method"]} if "merge_method" in report else set())),
    }
    body = _merge_card_body(report) or "# LoRA adapter exported by ram_trl\n"
    export = "\n".join(_export_lines(report, report["lora_export"]))
    head, marker, tail = body.partition("\n## Configuration")
    card = front_matter(front) + "\n" + head.strip("\n") + "\n" + export + (marker + tail if marker else "")
    return card + upload_lines()


def _merge_card_body(report: dict[str, Any]) -> str:
    """The merge's model card without its front matter, titled as an adapter ("" without a merge report)."""
    try:
        return card_body(report, "Merged model as a LoRA adapter")
    except (KeyError, TypeError):
        return ""


def _export_lines(report: dict[str, Any], section: dict[str, Any]) -> list[str]:
    if section["mode"] == "rank":
        how = f"rank {section['rank']} for every module (capped by the weight's smaller dimension)"
    else:
        how = (
            f"per module the smallest rank keeping {section['energy']:g} of the delta's squared singular values, at "
            f"most {section['max_rank']}"
        )
    lines = ["", "## LoRA export", ""]
    lines.append(
        f"The merged weights are stored as a PEFT LoRA adapter on `{report.get('base_model')}`: the delta of each "
        f"nn.Linear weight is its truncated SVD (float64), B = U sqrt(S), A = sqrt(S) Vh, lora_alpha = r (scaling "
        f"1), with {how}."
    )
    if section["lora_modules"]:
        lines.append(
            f"{section['lora_modules']} LoRA modules, ranks {section['rank_min']}-{section['rank_max']}; relative "
            f"reconstruction error ||delta - B A||_F / ||delta||_F: max {section['relative_error_max']:.3g}, mean "
            f"{section['relative_error_mean']:.3g}."
        )
    saved = section["modules_to_save"]
    if saved or section["biases"]:
        lines.append(
            f"Stored in full (exact): {len(saved)} module(s) in modules_to_save"
            + (
                f" ({', '.join('`' + s['module'] + '`' for s in saved[:8])}{', ...' if len(saved) > 8 else ''})"
                if saved
                else ""
            )
            + f" and {len(section['biases'])} Linear bias(es)."
        )
    worst = sorted(section["tensors"], key=lambda item: -item["relative_error"])[:10]
    if worst:
        lines += ["", "| tensor | shape | rank | sigma^2 kept | relative error |", "|---|---|---|---|---|"]
        lines += [
            f"| `{item['tensor']}` | {item['shape'][0]}x{item['shape'][1]} | {item['rank']} | "
            f"{item['energy_kept']:.6f} | {item['relative_error']:.3g} |"
            for item in worst
        ]
        if len(section["tensors"]) > len(worst):
            lines.append(f"\nThe {len(worst)} largest errors; every tensor is in `ram_merge_report.json`.")
    if section["not_exported"]:
        lines += ["", "**Not exported** (the adapter does not reproduce these merged tensors):", ""]
        lines += [f"- `{item['tensor']}`: {item['reason']}" for item in section["not_exported"]]
    lines += [
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{report.get("base_model")}")',
        'model = PeftModel.from_pretrained(base, "PATH/TO/THIS/ADAPTER")',
        "```",
        "",
    ]
    return lines


def plan_summary(resolved: ResolvedConfig, plan: MergePlan, input_cache: int = 0) -> dict[str, Any]:
    """The dry-run result: what the merge would read, write and hold in memory (``input_cache``: the input bytes the
    statistics pass may keep for the merge pass, read once instead of twice and held meanwhile)."""
    return {
        "dry_run": True,
        "merge_method": resolved.method.name,
        "parameters": dict(resolved.params),
        **({"base_hub": hub} if (hub := describe(resolved.base_path, resolved.base_reference)) else {}),
        "agents": [
            {"name": a.name, "path": str(a.path), "parameters": a.parameters}
            | ({"hub": hub} if (hub := describe(a.path, a.reference)) else {})
            for a in resolved.agents
        ],
        "tensors": len(plan.tasks),
        "merged_tensors": sum(1 for t in plan.tasks if t.floating),
        "chunked_tensors": sum(1 for t in plan.tasks if len(t.chunks()) > 1),
        "passes": plan.passes,
        "bytes_read": plan.bytes_read - input_cache,
        "bytes_written": plan.output_bytes,
        "output_files": [s.file_name for s in plan.shards],
        "chunk_budget": plan.chunk_budget,
        "peak_memory_estimate": plan.peak_memory_estimate() + input_cache,
        "peak_memory_fixed": PROCESS_BASELINE_BYTES,
        "input_cache": input_cache,
        "resized_tensors": plan.resized,
        "notes": list(resolved.notes),
    }


def print_plan(resolved: ResolvedConfig, plan: MergePlan, input_cache: int = 0) -> None:
    """Print the dry-run plan as a table."""
    from rich.console import Console
    from rich.table import Table

    summary = plan_summary(resolved, plan, input_cache)
    table = Table(title=f"Merge plan: {resolved.method.pretty_name} (dry run)", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("base model", str(resolved.base_path))
    for agent in resolved.agents:
        table.add_row(f"agent {agent.index}", f"{agent.name}  {agent.path}")
    table.add_row("parameters", ", ".join(f"{k}={v}" for k, v in resolved.params.items()) or "-")
    table.add_row(
        "tensors", f"{summary['tensors']} ({summary['merged_tensors']} merged, {summary['chunked_tensors']} chunked)"
    )
    table.add_row("passes over inputs", str(plan.passes))
    table.add_row("bytes to read", format_bytes(summary["bytes_read"]))
    table.add_row("bytes to write", f"{format_bytes(plan.output_bytes)} in {len(plan.shards)} file(s)")
    table.add_row("chunk budget", format_bytes(plan.chunk_budget))
    if input_cache:
        table.add_row("input cache", f"up to {format_bytes(input_cache)} of inputs kept for the merge pass")
    peak = summary["peak_memory_estimate"]
    cache = " (with the input cache)" if input_cache else ""
    table.add_row(
        "peak memory estimate",
        f"{format_bytes(peak)}: {format_bytes(PROCESS_BASELINE_BYTES)} fixed (Python, torch, libraries) + "
        f"{format_bytes(peak - PROCESS_BASELINE_BYTES)} for this merge's buffers{cache}",
    )
    for note in resolved.notes:
        table.add_row("note", note)
    Console(stderr=True).print(table)


def print_summary(report: dict[str, Any], file: TextIO | None = None) -> None:
    """Print the per-agent summary table after a merge."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['method_pretty_name']} -> {report['output_dir']}")
    for column in ("agent", "density", "unique", "shared", "rho", "lambda_t"):
        table.add_column(column, justify="left" if column == "agent" else "right")
    for agent in report["agents"]:
        rho = agent["rho"]
        lam = agent.get("lambda")
        table.add_row(
            agent["name"],
            f"{agent['density']:.2%}",
            f"{agent['unique']:,}",
            f"{agent['shared']:,}",
            rho if isinstance(rho, str) else f"{rho:.3f}",
            "-" if lam is None else f"{lam:.4f}",
        )
    console = Console(stderr=True) if file is None else Console(file=file)
    console.print(table)
    seconds = report["timings"].get("total_seconds", 0.0)
    console.print(
        f"wrote {format_bytes(report['output']['bytes'])} in {len(report['output']['files'])} file(s) "
        f"in {seconds:.1f} s on {processes_phrase(report.get('processes', 1))}"
    )
    if report.get("effect"):
        console.print(effect_line(report["effect"]))
    for warning in report["warnings"]:
        if file is not None or not shown(warning):  # the command line printed it when it was raised
            console.print(f"[yellow]warning:[/yellow] {warning}")
