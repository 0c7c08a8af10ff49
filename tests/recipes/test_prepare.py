"""The preparation of a run (ram_trl/recipes/prepare.py): the base converted from GGUF once into RUN/base_init."""

from __future__ import annotations

import json
from pathlib import Path

from ram_trl.recipes.runner import RunOptions


def test_gguf_base_is_converted_once_into_base_init(tmp_path, monkeypatch):
    """``base: {gguf: ...}``: the run converts into RUN/base_init through convert_gguf, reuses a conversion of the
    same bytes and dtype, converts again when either changes, and every stage trains from RUN/base_init."""
    import hashlib

    from ram_trl.io import gguf as gguf_module
    from ram_trl.recipes.runner import Run
    from ram_trl.recipes.schema import load_recipe
    from tests.helpers import recipe_dict

    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 60)
    calls = []

    def fake_convert(path, out, *, member=None, dtype="bfloat16", replace_previous=False, **kwargs):
        calls.append((Path(path), member, dtype, replace_previous))
        out.mkdir(parents=True, exist_ok=True)
        record = {"sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "dtype": dtype}
        (out / gguf_module.RECORD_NAME).write_text(json.dumps(record))
        return {"gguf_file": Path(path).name, "parameters": 1, "dtype": dtype}

    monkeypatch.setattr(gguf_module, "convert_gguf", fake_convert)

    def run(dtype: str) -> Run:
        recipe, root = load_recipe(recipe_dict(base={"build": None, "gguf": str(source), "gguf_dtype": dtype}))
        return Run(recipe, root, tmp_path / "run", RunOptions())

    first = run("bfloat16")
    assert first.layout.base == first.layout.initial_base == tmp_path / "run" / "base_init"
    assert first.launcher.stage_command(first.layout.recipe.stages[0])[
        first.launcher.stage_command(first.layout.recipe.stages[0]).index("--base") + 1
    ] == str(tmp_path / "run" / "base_init")
    first.preparation.convert_base()
    first.preparation.convert_base()
    assert calls == [(source, None, "bfloat16", True)]
    run("float32").preparation.convert_base()
    assert calls[-1] == (source, None, "float32", True) and len(calls) == 2
    source.write_bytes(b"GGUF" + b"\1" * 60)
    run("float32").preparation.convert_base()
    assert len(calls) == 3
