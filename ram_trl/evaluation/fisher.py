"""The diagonal empirical Fisher of an agent on its stage's prompts, for Fisher merging (docs/fisher.md)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import RamTrlError
from ram_trl.io.checkpoint import FISHER_FILE
from ram_trl.io.hub import describe, ensure_weights, resolve_model
from ram_trl.io.json_files import read_json_object
from ram_trl.io.lora import ADAPTER_CONFIG, is_adapter_dir
from ram_trl.output import atomic_file
from ram_trl.sizes import check_optional_number

__all__ = [
    "Completion",
    "estimate_fisher",
    "fisher_from_completions",
    "generate_completions",
    "load_agent",
    "read_prompts",
    "save_fisher",
]


@dataclass(frozen=True)
class Completion:
    """One sample: the prompt's token ids and the model's completion (1-d ``int64`` tensors)."""

    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor


def _check_plain_model(model: torch.nn.Module) -> None:
    if getattr(model, "peft_config", None) or any("lora_" in name for name, _ in model.named_parameters()):
        raise RamTrlError(
            "estimate_fisher: the model carries PEFT/LoRA adapters; merge them in first "
            "(peft_model.merge_and_unload(), or ram_trl.evaluation.fisher.load_agent(ADAPTER_DIR)) so that the "
            "Fisher is keyed by the base model's tensor names"
        )


def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    num_samples: int | None = None,
    max_new_tokens: int = 64,
    *,
    sample: bool = False,
    seed: int = 0,
) -> list[Completion]:
    """The model's own completions of ``num_samples`` prompts, taken in order (cycling when sampling)."""
    from transformers import GenerationConfig

    if not prompts:
        raise ValueError("no prompts: the Fisher is estimated on at least one prompt")
    num_samples = len(prompts) if num_samples is None else num_samples
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: estimate on at least one sample")
    if num_samples > len(prompts) and not sample:
        raise ValueError(
            f"num_samples={num_samples} > {len(prompts)} prompts with greedy decoding would repeat identical "
            "samples; give more prompts or sample=True"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: a completion has at least one token")
    defaults = getattr(model, "generation_config", None)
    eos = getattr(defaults, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = getattr(defaults, "pad_token_id", None)
    pad = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    # sampling draws from the full distribution: set explicitly, so a checkpoint's own defaults cannot narrow it
    warpers = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=eos, pad_token_id=pad, **warpers
    )
    device = next(model.parameters()).device
    completions = []
    was_training = model.training
    model.eval()
    try:
        # reseeding below also reseeds every CUDA device (torch.manual_seed): fork and restore their states too
        cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
            torch.manual_seed(seed)
            for i in range(num_samples):
                prompt = prompts[i % len(prompts)]
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
                if ids.shape[1] == 0:
                    raise ValueError(f"prompt {i % len(prompts)} ({prompt!r}) has no tokens")
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                completion = out[0, ids.shape[1] :]
                stop = _completion_length(completion, eos)
                completions.append(Completion(ids[0].cpu(), completion[:stop].cpu()))
    finally:
        model.train(was_training)
    return completions


def _completion_length(completion: torch.Tensor, eos: int | list[int] | None) -> int:
    """Tokens up to and including the first end-of-sequence token (padding after it is not the model's)."""
    if eos is None:
        return completion.numel()
    ids = torch.tensor(eos if isinstance(eos, list) else [eos])  # host
    hits = torch.isin(completion.cpu(), ids).nonzero()
    return int(hits[0]) + 1 if hits.numel() else completion.numel()


def fisher_from_completions(
    model: torch.nn.Module, completions: Sequence[Completion], *, progress: bool = False
) -> dict[str, torch.Tensor]:
    """Mean over samples of the squared gradient of ``log p(completion | prompt)``, per parameter, in float32."""
    if not completions:
        raise ValueError("no completions: the Fisher is a mean over at least one sample")
    _check_plain_model(model)
    params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
    fisher = {name: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for name, p in params}
    flags = [p.requires_grad for _, p in params]
    was_training = model.training
    model.eval()
    iterator = completions
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(completions, desc="fisher", unit="sample", dynamic_ncols=True)
    device = params[0][1].device if params else torch.device("cpu")
    # transformers models: no KV cache in the scoring pass
    extra = {"use_cache": False} if hasattr(model, "config") else {}
    try:
        for _, p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            for item in iterator:
                if item.completion_ids.numel() == 0 or item.prompt_ids.numel() == 0:
                    raise ValueError("a sample has an empty prompt or completion: nothing to condition or score")
                ids = torch.cat([item.prompt_ids, item.completion_ids]).unsqueeze(0).to(device)
                start = item.prompt_ids.numel()
                logits = model(input_ids=ids, **extra).logits[0, start - 1 : -1].float()
                log_likelihood = (
                    torch.log_softmax(logits, dim=-1).gather(-1, item.completion_ids.to(device).unsqueeze(-1)).sum()
                )
                gradients = torch.autograd.grad(log_likelihood, [p for _, p in params], allow_unused=True)
                for (name, _), gradient in zip(params, gradients, strict=True):
                    if gradient is not None:
                        fisher[name].add_(gradient.float().square())
    finally:
        for (_, p), flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
    for value in fisher.values():
        value.div_(len(completions))
    return {name: value.cpu() for name, value in fisher.items()}


def estimate_fisher(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    num_samples: int | None = None,
    max_new_tokens: int = 64,
    *,
    sample: bool = False,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """The diagonal empirical Fisher of ``model`` on ``prompts`` (see the module docstring for the definition)."""
    _check_plain_model(model)
    completions = generate_completions(
        model, tokenizer, prompts, num_samples, max_new_tokens, sample=sample, seed=seed
    )
    return fisher_from_completions(model, completions, progress=progress)


def save_fisher(
    fisher: dict[str, torch.Tensor], agent_dir: str | os.PathLike, metadata: dict[str, Any] | None = None
) -> Path:
    """Write ``agent_dir/fisher.safetensors`` atomically (temporary sibling, then rename); nothing else is touched."""
    from safetensors.torch import save_file

    agent_dir = Path(agent_dir)
    if not agent_dir.is_dir():
        raise RamTrlError(f"save_fisher: agent directory {agent_dir} does not exist")
    if not fisher:
        raise RamTrlError("save_fisher: the Fisher holds no tensors")
    tensors = {}
    for name, value in fisher.items():
        value = value.detach().to("cpu", torch.float32).contiguous()
        if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
            raise RamTrlError(f"save_fisher: tensor {name!r} holds negative or NaN/Inf values; a Fisher cannot")
        tensors[name] = value
    meta = {"format": "pt", "content": "ram_trl diagonal Fisher"}
    meta.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
    target = agent_dir / FISHER_FILE
    with atomic_file(target, "Fisher file") as temp:
        save_file(tensors, str(temp), metadata=meta)
    return target


def read_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts from a file: JSONL with a ``prompt`` field (``.jsonl``/``.json`` or ``{`` lines), else one per line."""
    path = Path(path)
    if not path.is_file():
        raise RamTrlError(f"prompts file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RamTrlError(f"prompts file {path} cannot be read as UTF-8 text ({exc})") from None
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise RamTrlError(f"prompts file {path} holds no prompts")
    jsonl = path.suffix in (".jsonl", ".json") or lines[0][1].lstrip().startswith("{")
    if not jsonl:
        return [line for _, line in lines]
    prompts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RamTrlError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise RamTrlError(f"{path}:{number}: a JSONL prompts file needs a string 'prompt' field on every line")
        prompts.append(record["prompt"])
    return prompts


def _check_weights_format(directory: Path, role: str, allow_pickle: bool) -> None:
    """Refuse a directory whose weights exist only as pickles (``*.bin``) unless ``allow_pickle``."""
    safe = [p for p in directory.glob("*.safetensors") if p.name != FISHER_FILE]
    pickles = list(directory.glob("*.bin"))
    if pickles and not safe and not allow_pickle:
        raise RamTrlError(
            f"{role} {directory} holds only pickle weights ({pickles[0].name}); pickle files can run arbitrary code "
            "when loaded: convert it to safetensors (save_pretrained(..., safe_serialization=True)) or pass "
            "--allow-pickle (allow_pickle=True)"
        )


def _stage_checkpoint(directory: Path) -> tuple[Path, Path | None]:
    """A stage directory's checkpoint, verified against its manifest, and the base it names (resolved beside it);
    without a manifest, or with one that describes no saved agent, the directory as it is (no base)."""
    from ram_trl.stage.manifest import MANIFEST_NAME, base_model_path, read_manifest, verify_stage

    if not (directory / MANIFEST_NAME).is_file():
        return directory, None
    manifest = read_manifest(directory)
    base = base_model_path(manifest, directory)
    if manifest.files is not None and not manifest.files:
        return directory, base  # save_agent=False: the manifest says nothing about the weights found here
    return verify_stage(manifest, directory), base


def load_agent(
    agent_dir: str | os.PathLike,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    allow_pickle: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """Load an agent for Fisher estimation: a model directory, or a LoRA adapter merged into its base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    agent_dir = resolve_model(agent_dir, what="agent")
    if not agent_dir.is_dir():
        raise RamTrlError(f"agent {agent_dir} does not exist")
    agent_dir, stage_base = _stage_checkpoint(agent_dir)
    from ram_trl.io.model_dir import check_one_model

    check_one_model(agent_dir, "agent")
    if not is_adapter_dir(agent_dir) and not (agent_dir / "config.json").is_file():
        raise RamTrlError(
            f"agent {agent_dir} holds no model: no config.json (a model saved with save_pretrained) and no "
            "adapter_config.json (a PEFT adapter)"
        )
    _check_weights_format(agent_dir, "agent", allow_pickle)
    if not is_adapter_dir(agent_dir):
        model = AutoModelForCausalLM.from_pretrained(agent_dir, dtype=dtype)
        return model, AutoTokenizer.from_pretrained(agent_dir)
    from peft import PeftModel

    claimed = read_json_object(agent_dir / ADAPTER_CONFIG, f"agent {agent_dir}").get("base_model_name_or_path")
    if claimed is not None and not isinstance(claimed, str):
        raise RamTrlError(f"agent {agent_dir}: base_model_name_or_path must be a path, got {claimed!r}")
    if base is not None:
        base_path: Path | None = resolve_model(base, what="base model")
    else:  # a stage's base (its manifest, read beside it) before the adapter config's own claim (a Hub id too)
        base_path = stage_base or (resolve_model(claimed, what="the adapter's base model") if claimed else None)
    if base_path is None or not base_path.is_dir():
        raise RamTrlError(
            f"agent {agent_dir} is a LoRA adapter whose base ({base_path}) is not a local directory; pass --base "
            "(base=) to estimate its Fisher on the base with the adapter merged in"
        )
    base_path = ensure_weights(base_path, "base model")  # a stage's Hub base: its weights, if not cached yet
    check_one_model(base_path, "base model")
    _check_weights_format(base_path, "base model", allow_pickle)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    model = PeftModel.from_pretrained(model, agent_dir).merge_and_unload()
    has_tokenizer = (agent_dir / "tokenizer_config.json").is_file()
    return model, AutoTokenizer.from_pretrained(agent_dir if has_tokenizer else base_path)


def run_fisher(
    agent_dir: str | os.PathLike,
    prompts_file: str | os.PathLike,
    *,
    num_samples: int | None = None,
    max_new_tokens: int = 64,
    sample: bool = False,
    seed: int = 0,
    base: str | os.PathLike | None = None,
    progress: bool = True,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """``ram-trl fisher``: load the agent, estimate its Fisher on the prompts, save it beside the agent."""
    started = time.perf_counter()
    check_optional_number(num_samples, "fisher", "--num-samples", minimum=1, integer=True)
    check_optional_number(max_new_tokens, "fisher", "--max-new-tokens", minimum=1, integer=True)
    prompts = read_prompts(prompts_file)
    agent_dir = resolve_model(agent_dir, what="agent")  # a Hub id: its snapshot, where its Fisher is written
    model, tokenizer = load_agent(agent_dir, base, allow_pickle=allow_pickle)
    completions = generate_completions(
        model, tokenizer, prompts, num_samples, max_new_tokens, sample=sample, seed=seed
    )
    fisher = fisher_from_completions(model, completions, progress=progress)
    tokens = sum(c.completion_ids.numel() for c in completions)
    metadata = {
        "prompts_file": str(Path(prompts_file).resolve()),
        "num_samples": len(completions),
        "max_new_tokens": max_new_tokens,
        "decoding": "sampled (temperature 1)" if sample else "greedy",
        "seed": seed,
        "completion_tokens": tokens,
    }
    if hub := describe(agent_dir):
        metadata["hub"] = hub
    path = save_fisher(fisher, agent_dir, metadata)
    total = sum(float(v.double().sum()) for v in fisher.values())
    return {
        "file": str(path),
        **metadata,
        "tensors": len(fisher),
        "elements": sum(v.numel() for v in fisher.values()),
        "total": total,
        "largest": max(float(v.max()) for v in fisher.values() if v.numel()),
        "zero_share": sum(int((v == 0).sum()) for v in fisher.values())
        / max(1, sum(v.numel() for v in fisher.values())),
        "seconds": time.perf_counter() - started,
    }
