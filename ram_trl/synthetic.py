"""Synthetic, RL-like checkpoints without a model hub: a random ``Qwen2ForCausalLM`` with a character tokenizer, and
agents as sparse perturbations of it. A product module (``ram-trl example``, a recipe's ``base.build``, examples,
benchmarks); seeded per tensor name (byte-identical files for the same arguments), one tensor in memory at a time."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ram_trl.digest import text_digest
from ram_trl.io.model_dir import SAFE_INDEX, SAFE_SINGLE
from ram_trl.sizes import parse_size

__all__ = [
    "DEFAULT_ALPHABET",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "generate_example",
    "make_agent_set",
    "make_base_checkpoint",
    "make_rl_agent",
    "write_synthetic_base",
]

DEFAULT_ALPHABET: str = "".join(chr(c) for c in range(32, 127)) + "\n"  #: Printable ASCII (space to ~) plus newline.

#: Special tokens of the character tokenizer, in id order (``<pad>`` is 0).
SPECIAL_TOKENS: dict[str, str] = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


#: Shard size of the streaming base writer when none is given (transformers' own default is "50GB", which would
#: put a 1B-parameter model in one file and so in memory at once).
STREAM_DEFAULT_SHARD_SIZE = "1GB"

_CHUNK = 1 << 22  #: Elements per step when generating or perturbing a tensor; fixed so results never depend on memory.
_INIT_STD = 0.02
_STEP_EXPONENT = 0.7  #: Steps are ``floor(u ** -_STEP_EXPONENT)``: P(k >= m) = m ** (-1 / _STEP_EXPONENT), Pareto.
_BF16_MAX_FINITE_BITS = 0x7F7F
_FP16_MAX_FINITE_BITS = 0x7BFF
_PERTURBED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# Seeding helpers


def _derive_seed(*parts: object) -> int:
    """A 63-bit seed from a stable digest of ``parts``; independent of Python's hash randomisation."""
    digest = bytes.fromhex(text_digest("\x1f".join(str(p) for p in parts)))
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _generator(*parts: object) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_derive_seed(*parts))
    return generator


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and base model


def _byte_level_tokens(text: str) -> list[str]:
    """Byte-level images (GPT-2 byte-to-unicode map) of the UTF-8 bytes of ``text``, deduplicated in order."""
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return list(dict.fromkeys("".join(piece for piece, _ in pre_tokenizer.pre_tokenize_str(text))))


def build_char_tokenizer(output_dir: str | Path, alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """Build, save and return a character-level tokenizer."""
    text = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not text:
        raise ValueError("alphabet is empty: the character tokenizer needs at least one character")
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS.values(), *_byte_level_tokens(text)):
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(output_dir))
    return tokenizer


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unique_state_dict_shapes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` (on any device) without tied duplicates, in module order."""
    seen: set[int] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        unique[name] = tensor
    return unique


def _synthetic_init(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seeded values for one tensor: N(0, 0.02) for matrices, zeros for biases, ones for other vectors (norms)."""
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) < 2:
        return torch.ones(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    generator = _generator("init", seed, name)
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        flat[start:stop] = (torch.randn(stop - start, generator=generator) * _INIT_STD).to(dtype)
    return out


def write_synthetic_base(
    output_dir: str | Path,
    config: PretrainedConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write the weights and ``config.json`` of a randomly initialised causal LM without building the model."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype)
    metas = _unique_state_dict_shapes(model)
    split = split_torch_state_dict_into_shards(
        metas,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=parse_size(
            max_shard_size if max_shard_size is not None else STREAM_DEFAULT_SHARD_SIZE, lowercase_b_is_bits=True
        ),
    )
    for filename, names in split.filename_to_tensors.items():
        shard = {name: _synthetic_init(name, tuple(metas[name].shape), dtype, seed) for name in names}
        save_file(shard, str(output_dir / filename), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {
            "metadata": {
                "total_parameters": sum(t.numel() for t in metas.values()),
                "total_size": sum(t.numel() * t.element_size() for t in metas.values()),
            },
            "weight_map": dict(split.tensor_to_filename),
        }
        (output_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(str(output_dir))
    return output_dir


def make_base_checkpoint(
    output_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    materialize: str = "eager",
) -> Path:
    """Write a randomly initialised Qwen2 causal LM with a character tokenizer and a generation config."""
    if materialize not in ("eager", "stream"):
        raise ValueError(f"materialize={materialize!r}: use 'eager' (build the model) or 'stream' (write shards)")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(output_dir)
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens); "
            f"use vocab_size >= {len(tokenizer)} or leave it unset"
        )
    ids = _special_ids(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    if materialize == "stream":
        write_synthetic_base(output_dir, config, dtype=dtype, seed=seed, max_shard_size=max_shard_size)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config)
        model = model.to(dtype)
        model.save_pretrained(str(output_dir), max_shard_size=max_shard_size if max_shard_size is not None else "50GB")
        del model
    GenerationConfig(**ids).save_pretrained(str(output_dir))
    return output_dir


# ---------------------------------------------------------------------------------------------------------------
# RL-like agents


def _checkpoint_shards(base_dir: Path) -> tuple[list[str], dict | None]:
    """The safetensors files of ``base_dir`` (in order) and its index (``None`` for a single file)."""
    index_path = base_dir / SAFE_INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        files = sorted(set(index["weight_map"].values()))
        for file in files:
            if not (base_dir / file).is_file():
                raise FileNotFoundError(f"{base_dir}: shard {file} listed in {SAFE_INDEX} is missing")
        return files, index
    if (base_dir / SAFE_SINGLE).is_file():
        return [SAFE_SINGLE], None
    raise FileNotFoundError(f"{base_dir}: no {SAFE_SINGLE} or {SAFE_INDEX}; pass a safetensors checkpoint directory")


def _steps(count: int, generator: torch.Generator, max_ulps: int) -> torch.Tensor:
    """``count`` signed heavy-tailed steps in [-max_ulps, -1] U [1, max_ulps] (int32)."""
    u = 1.0 - torch.rand(count, generator=generator, dtype=torch.float64)  # in (0, 1]
    magnitude = torch.floor(u.pow(-_STEP_EXPONENT)).clamp_(1, max_ulps).to(torch.int32)
    sign = torch.randint(0, 2, (count,), generator=generator, dtype=torch.int32) * 2 - 1
    return magnitude * sign


def _perturb_16bit(values: torch.Tensor, steps: torch.Tensor, max_finite_bits: int) -> torch.Tensor:
    """Move the magnitude bits of 16-bit floats by ``steps`` units in the last place, keeping the sign bit."""
    bits = values.view(torch.int16).to(torch.int32)
    negative = bits < 0
    mag = bits & 0x7FFF
    new = (mag + steps).clamp_(1, max_finite_bits)
    same = new == mag
    new = torch.where(same, torch.where(mag < max_finite_bits, mag + 1, mag - 1), new)
    new = torch.where(mag > max_finite_bits, mag, new)  # inf / nan in the base: leave as is
    new = torch.where(negative, new - 0x8000, new)
    return new.to(torch.int16).view(values.dtype)


def _perturb_float(values: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Relative perturbation ``k * 2**-8 * max(|w|, 1e-3)`` of the magnitude, for float32/float16/float64 storage."""
    dtype = values.dtype
    work = torch.promote_types(dtype, torch.float32)
    w = values.to(work)
    step = steps.abs().to(work) * 2.0**-8 * w.abs().clamp(min=1e-3)
    grown = w.abs() + step
    new_abs = torch.where(steps < 0, w.abs() - step, grown)
    new_abs = torch.where(new_abs <= 0, grown, new_abs).clamp_(max=torch.finfo(dtype).max)
    new = torch.copysign(new_abs, w).to(dtype)
    unchanged = new == values
    if bool(unchanged.any()):
        if dtype == torch.float16:
            fixed = _perturb_16bit(values, torch.ones_like(steps), _FP16_MAX_FINITE_BITS)
        else:
            at_max = values.abs() == torch.finfo(dtype).max
            direction = torch.where(values < 0, -math.inf, math.inf).to(dtype)
            direction = torch.where(at_max, torch.zeros_like(values), direction)
            fixed = torch.nextafter(values, direction)
        new = torch.where(unchanged, fixed, new)
    return torch.where(torch.isfinite(values), new, values)


def _perturb_tensor(
    tensor: torch.Tensor, name: str, *, density: float, seed: int, overlap: float, support_seed: int, max_ulps: int
) -> torch.Tensor:
    """Perturb the active elements of one floating tensor (see :func:`make_rl_agent`); returns a new tensor."""
    out = tensor.contiguous().clone()
    flat = out.view(-1)
    pick = _generator("pick", support_seed, name)
    shared = _generator("shared", support_seed, name)
    own = _generator("own", seed, name)
    step_gen = _generator("step", seed, name)
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        count = stop - start
        use_shared = torch.rand(count, generator=pick) < overlap
        u_shared = torch.rand(count, generator=shared)
        u_own = torch.rand(count, generator=own)
        active = torch.where(use_shared, u_shared, u_own) < density
        index = active.nonzero().squeeze(1) + start
        if index.numel() == 0:
            continue
        steps = _steps(index.numel(), step_gen, max_ulps)
        values = flat[index]
        if out.dtype == torch.bfloat16:
            flat[index] = _perturb_16bit(values, steps, _BF16_MAX_FINITE_BITS)
        else:
            flat[index] = _perturb_float(values, steps)
    return out


def make_rl_agent(
    base_dir: str | Path,
    output_dir: str | Path,
    *,
    density: float,
    seed: int,
    overlap: float = 0.5,
    support_seed: int = 1234,
    max_ulps: int = 64,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an "RL agent": the base with a sparse, heavy-tailed perturbation of its floating tensors, like RL's small
    Adam steps. About ``density`` of each tensor's elements change; agents with one ``support_seed`` share ``overlap``
    of that support (unique and shared elements, what RAM reacts to); on 16-bit storage each change is a heavy-tailed
    number of ulps that never rounds back to the base, flips the sign or becomes inf/NaN."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density={density} must be in [0, 1]")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be in [0, 1]")
    if max_ulps < 1:
        raise ValueError(f"max_ulps={max_ulps} must be at least 1")
    if dtype is not None and dtype not in _PERTURBED_DTYPES:
        raise ValueError(f"dtype={dtype}: use torch.bfloat16, torch.float16, torch.float32 or torch.float64")
    base_dir = Path(base_dir)
    output_dir = Path(output_dir)
    if output_dir.resolve() == base_dir.resolve():
        raise ValueError(f"output_dir {output_dir} is the base directory; write the agent elsewhere")
    files, index = _checkpoint_shards(base_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    total_size = 0
    for file in files:
        shard: dict[str, torch.Tensor] = {}
        with safe_open(str(base_dir / file), framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and dtype is not None:
                    tensor = tensor.to(dtype)
                if tensor.dtype in _PERTURBED_DTYPES:
                    tensor = _perturb_tensor(
                        tensor,
                        name,
                        density=density,
                        seed=seed,
                        overlap=overlap,
                        support_seed=support_seed,
                        max_ulps=max_ulps,
                    )
                total_size += tensor.numel() * tensor.element_size()
                shard[name] = tensor
        save_file(shard, str(output_dir / file), metadata=metadata)
        del shard

    if index is not None:
        index = json.loads(json.dumps(index))
        index.setdefault("metadata", {})["total_size"] = total_size
        (output_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    weight_files = set(files) | {SAFE_INDEX}
    for path in sorted(base_dir.iterdir()):
        if path.is_file() and path.name not in weight_files and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, output_dir / path.name)
    if dtype is not None and (output_dir / "config.json").is_file():
        config = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = _dtype_name(dtype)
        (output_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return output_dir


def make_agent_set(
    base_dir: str | Path,
    output_root: str | Path,
    densities: Sequence[float] = (0.03, 0.46, 0.54),
    *,
    overlap: float = 0.5,
    seed: int = 0,
    names: Sequence[str] | None = None,
    support_seed: int = 1234,
    max_ulps: int = 64,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write one agent per density, with distinct seeds and a common ``support_seed`` (partly shared supports)."""
    densities = list(densities)
    names = [f"agent_{i}" for i in range(len(densities))] if names is None else list(names)
    if len(names) != len(densities):
        raise ValueError(f"{len(names)} names given for {len(densities)} densities; give one name per agent")
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must be distinct, got {names}")
    output_root = Path(output_root)
    return [
        make_rl_agent(
            base_dir,
            output_root / name,
            density=density,
            seed=_derive_seed("agent", seed, i),
            overlap=overlap,
            support_seed=support_seed,
            max_ulps=max_ulps,
            dtype=dtype,
        )
        for i, (name, density) in enumerate(zip(names, densities, strict=True))
    ]


def generate_example(
    output_root: str | Path,
    *,
    num_agents: int = 3,
    densities: Sequence[float] = (0.03, 0.46, 0.54),
    seed: int = 0,
    overlap: float = 0.5,
    **base_kwargs: object,
) -> dict:
    """Write a base model, ``num_agents`` RL-like agents and a ready-to-run ``merge.yaml`` (RAM+, paper defaults)."""
    if num_agents < 1:
        raise ValueError(f"num_agents={num_agents} must be at least 1")
    if not densities:
        raise ValueError("densities is empty; give at least one agent density")
    output_root = Path(output_root).resolve()
    output_root.mkdir(parents=True, exist_ok=True)
    base_kwargs.setdefault("seed", seed)
    base = make_base_checkpoint(output_root / "base", **base_kwargs)  # type: ignore[arg-type]
    agent_densities = [densities[i % len(densities)] for i in range(num_agents)]
    agents = make_agent_set(base, output_root, agent_densities, overlap=overlap, seed=seed)
    config = {
        "merge_method": "ram_plus",
        "base_model": str(base),
        "models": [{"model": str(agent)} for agent in agents],
        "parameters": {"r": 0.1, "alpha": 2.0},
    }
    config_path = output_root / "merge.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return {"base": base, "agents": agents, "config": config_path}
