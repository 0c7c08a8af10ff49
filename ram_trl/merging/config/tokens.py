"""The merged model's tokenizer and chat template: ``tokenizer_source``, the union's rows and donors, token rules."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError
from ram_trl.io.vocabulary import UnionRows
from ram_trl.merging.config.schema import DTYPES, MergeConfig, resolve_model_ref


def _model_chat_template(path: Path) -> str | None:
    """A checkpoint's chat template (``chat_template.jinja``, else its ``tokenizer_config.json`` entry)."""
    directory = path if path.is_dir() else path.parent
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # transformers' named templates: [{name, template}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def resolve_chat_template(value: str, models: list[Path], where: str) -> str | None:
    """The template text of a config's ``chat_template``, as mergekit 0.1.5 picks it: ``auto`` (the most common
    template among the input models), one of mergekit's named templates (read from the installed mergekit
    package), or literal Jinja."""
    from ram_trl.io.chat_template import check_chat_template

    if value == "auto":
        found = [(t.strip(), p) for p, t in ((p, _model_chat_template(p)) for p in models) if t]
        if not found:
            return None  # as mergekit: the tokenizer's template is left as it is
        chosen = Counter(t for t, _ in found).most_common(1)[0][0]
        return check_chat_template(chosen, f"'auto' ({next(p for t, p in found if t == chosen)})", where)
    if len(value) < 256 and "\n" not in value and "{" not in value:
        try:
            from importlib.resources import files

            named = files("mergekit._data.chat_templates").joinpath(value + ".jinja")
            if named.is_file():
                return check_chat_template(named.read_text(), f"mergekit's {value!r}", where)
        except ModuleNotFoundError:
            raise ConfigError(
                f"{where}: {value!r} names one of mergekit's templates, which are read from the mergekit package: "
                "install it (pip install mergekit) or give the Jinja text"
            ) from None
    if len(value) < 20 or "{" not in value:
        raise ConfigError(f"{where}: {value!r} is neither a known template name nor a Jinja template")
    return check_chat_template(value, "the config's text", where)


def tokenizer_vocabulary(path: Path) -> dict[str, int] | None:
    """Token to id of a checkpoint's ``tokenizer.json`` (vocabulary and added tokens), ``None`` if unreadable."""
    directory = path if path.is_dir() else path.parent
    try:
        data = json.loads((directory / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        if isinstance(vocab, dict):  # BPE, WordLevel, WordPiece
            ids = {str(token): int(i) for token, i in vocab.items()}
        else:  # Unigram: [[token, score], ...] in id order
            ids = {str(entry[0]): i for i, entry in enumerate(vocab)}
        for added in data.get("added_tokens") or []:
            ids[str(added["content"])] = int(added["id"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return ids


def shares_numbering(tokenizer_source: Path, models: list[Path]) -> bool:
    """Whether every model's tokenizer gives each token of ``tokenizer_source``'s the same id, all within the
    first model's (the base's) ``vocab_size`` rows (mergekit's re-indexing of embedding rows is then the identity on
    the rows the output keeps)."""
    output, rows = tokenizer_vocabulary(tokenizer_source), _rows(models[0])
    if output is None or rows is None or max(output.values(), default=0) >= rows:
        return False  # the tokenizer has tokens past the base's rows: mergekit would add rows for them
    for model in models:
        vocab = tokenizer_vocabulary(model)
        if vocab is None or any(vocab.get(token) != i for token, i in output.items()):
            return False
    return True


def _rows(path: Path) -> int | None:
    """The ``vocab_size`` a checkpoint's ``config.json`` declares (its embedding rows)."""
    directory = path if path.is_dir() else path.parent
    try:
        rows = json.loads((directory / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def union_donor(models: list[Path]) -> tuple[Path | None, str]:
    """mergekit's ``tokenizer_source: union`` without re-indexing: ``(the model whose tokenizer holds exactly the
    union of the used tokens, "")`` when all number them alike with no holes from 0; else ``(None, why)``, naming the
    first model, token or id that needs re-indexing."""
    union: dict[str, int] = {}
    holder: dict[str, Path] = {}
    used_by: list[tuple[Path, dict[str, int], dict[str, int]]] = []
    for model in models:
        vocab, rows = tokenizer_vocabulary(model), _rows(model)
        if vocab is None or rows is None:
            missing = "readable tokenizer.json" if vocab is None else "config.json with vocab_size"
            return None, f"{model} has no {missing}"
        used = {token: i for token, i in vocab.items() if i < rows}
        for token, i in used.items():
            if union.setdefault(token, i) != i:
                return None, (
                    f"token {token!r} is id {union[token]} in {holder[token]} and id {i} in {model} (the union "
                    "numbers it once: every other model's rows would move)"
                )
            holder.setdefault(token, model)
        used_by.append((model, vocab, used))
    ids = Counter(union.values())
    shared = next((i for i, n in ids.items() if n > 1), None)
    if shared is not None:
        tokens = sorted(t for t, i in union.items() if i == shared)
        return None, (
            f"id {shared} is {' and '.join(repr(t) for t in tokens[:2])} in different models (the union appends one "
            "of them after the others)"
        )
    hole = next((i for i in range(len(union)) if i not in ids), None)
    if hole is not None:
        return None, f"no model has a token with id {hole} below the union's {len(union)} tokens"
    donor = next((model for model, vocab, used in used_by if vocab == used == union), None)
    if donor is None:
        return None, "no model's tokenizer is exactly the union (each model adds tokens the others lack)"
    return donor, ""


def _check_rule(rule: Any, label: str) -> None:
    """One ``tokenizer.tokens`` rule's shape: ``{source: ..., force: BOOL}``."""
    if not isinstance(rule, dict) or set(rule) - {"source", "force"}:
        raise ConfigError(f"{label}: a rule is {{source: MODEL, force: BOOL}}, got {rule!r}")


def check_token_rules(rules: dict[str, Any], tokenizer_source: Path, models: list[Path], where: str) -> None:
    """mergekit's ``tokenizer.tokens`` rules, accepted where mergekit never applies them: a rule without ``force``
    for a token that every model (the base included) and the output tokenizer hold with one id, inside every model's
    embedding rows (mergekit builds a row from a rule only for a token some model lacks, or a forced one)."""
    vocabularies = {model: (tokenizer_vocabulary(model), _rows(model)) for model in [tokenizer_source, *models]}
    for token, rule in rules.items():
        label = f"{where}: tokenizer.tokens[{token!r}]"
        _check_rule(rule, label)
        if rule.get("force"):
            raise ConfigError(
                f"{label}: force replaces the token's row in every model by {rule.get('source')!r}'s before merging; "
                "rules that build rows are supported with tokenizer source 'union' only"
            )
        ids = {}
        for model, (vocab, rows) in vocabularies.items():
            i = None if vocab is None else vocab.get(token)
            if i is None or (rows is not None and i >= rows):
                raise ConfigError(
                    f"{label}: {model} has no row for the token, so mergekit would build it from the rule "
                    f"({rule.get('source')!r}) or add it; rules that build rows are supported with tokenizer source "
                    "'union' only"
                )
            ids[model] = i
        if len(set(ids.values())) > 1:
            raise ConfigError(
                f"{label}: the models number the token differently ({', '.join(f'{m}: {i}' for m, i in ids.items())})"
                "; re-numbered rows are not implemented"
            )


def token_sources(
    rules: dict[str, Any], union: UnionRows, donor: Path, models: list[Path], where: str, config_dir: Path | None
) -> tuple[dict[int, tuple], frozenset[int]]:
    """mergekit's ``tokenizer.tokens`` rules over a union: ``(sources, forced)`` of :class:`UnionRows` for the
    rules mergekit applies (a forced one, or one for a token some model lacks); the others change nothing."""
    vocab = tokenizer_vocabulary(donor) or {}
    sources: dict[int, tuple] = {}
    forced: set[int] = set()
    for token, rule in rules.items():
        label = f"{where}: tokenizer.tokens[{token!r}]"
        _check_rule(rule, label)
        token_id = vocab.get(token)
        if token_id is None or token_id >= union.rows:
            raise ConfigError(
                f"{label}: no model has the token, so mergekit would add it to the tokenizer with a new row; adding "
                "tokens is not implemented"
            )
        if not rule.get("force") and token_id not in union.holders:
            continue  # every model has it: mergekit keeps each model's own row
        source = rule.get("source")
        if isinstance(source, dict) and source.get("kind") == "zero" and set(source) == {"kind"}:
            sources[token_id] = ("zero",)
        elif isinstance(source, dict) and source.get("kind") == "model_token":
            if set(source) - {"kind", "model", "token", "token_id"} or ("token" in source) == ("token_id" in source):
                raise ConfigError(
                    f"{label}: a model_token source takes model and one of token, token_id; got {source}"
                )
            position = _model_position(source.get("model"), models, label, config_dir)
            row = source.get("token_id")
            if row is None:
                row = (tokenizer_vocabulary(models[position]) or {}).get(source["token"])
            rows = _rows(models[position])
            if not isinstance(row, int) or row < 0 or (rows is not None and row >= rows):
                raise ConfigError(f"{label}: {models[position]} has no row for {source}")
            sources[token_id] = ("model", position, row)
        elif isinstance(source, str):
            position = _model_position(source, models, label, config_dir)
            if token_id in union.holders and position not in union.holders[token_id]:
                raise ConfigError(f"{label}: its source {source!r} lacks the token")
            sources[token_id] = ("model", position, token_id)
        else:
            raise ConfigError(
                f"{label}: mergekit builds this token's row from the rule's source, which must be a model of the "
                f"merge, {{kind: zero}} or {{kind: model_token, model: M, token: T}}; got {source!r}"
            )
        if rule.get("force"):
            forced.add(token_id)
    return sources, frozenset(forced)


def _model_position(reference: Any, models: list[Path], label: str, config_dir: Path | None) -> int:
    """The position (0: the base, ``t + 1``: agent ``t``) of the model a token rule names."""
    if isinstance(reference, str):
        path = resolve_model_ref(reference, config_dir, label).resolve()
        for position, model in enumerate(models):
            if model.resolve() == path:
                return position
    raise ConfigError(f"{label}: the source {reference!r} is not the base or one of the models merged")


def padded_rows(config: MergeConfig, rows: int) -> int | None:
    """The row count mergekit's ``tokenizer.pad_to_multiple_of`` pads ``rows`` to (``None``: no padding)."""
    multiple = config.tokenizer.pad_to_multiple_of if config.tokenizer is not None else None
    if not multiple or rows % multiple == 0:
        return None  # mergekit pads only a count that is not a multiple
    return -(-rows // multiple) * multiple


def spare_rows(models: list[Path]) -> str:
    """``""`` when every model's embedding rows are rows of tokens its tokenizer holds; else the first model with a
    row that is no token's (padding past its tokenizer, or a gap), named with its row count. mergekit's union
    leaves such rows out (a model lacking a token gets the default row), so the union's rows are then built."""
    for model in models:
        vocab, rows = tokenizer_vocabulary(model), _rows(model)
        if vocab is None or rows is None:
            continue
        held = set(vocab.values())
        spare = [i for i in range(rows) if i not in held]
        if spare:
            return f"{model} has {len(spare)} embedding row(s) that are no token of its tokenizer (first: {spare[0]})"
    return ""


def build_union_rows(models: list[Path], dtype: str | None, size: int | None = None) -> UnionRows:
    """The union's rows (models numbering their tokens alike, :func:`union_donor`): its size (the highest used id
    plus one, unless ``size`` gives it) and, for each token some model (the base first) lacks, the models that have
    it."""
    used = []
    for model in models:
        vocab, rows = tokenizer_vocabulary(model) or {}, _rows(model)
        used.append({i for i in vocab.values() if rows is None or i < rows})
    if size is None:
        size = max((max(ids, default=-1) for ids in used), default=-1) + 1
    holders = {
        token: tuple(k for k, ids in enumerate(used) if token in ids)
        for token in range(size)
        if any(token not in ids for ids in used)
    }
    return UnionRows(size, holders, DTYPES[dtype.lower()] if dtype else None)
