"""Model references through a real Hugging Face cache layout, offline: ids, revisions, the cache's links."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import huggingface_hub
import pytest
import yaml
from huggingface_hub import constants as hub_constants

import ram_trl
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.io.hub import cached_revision, parse_reference, resolve_model
from tests.helpers import cache_repo, offline_cache, qwen_model

COMMITS = {"acme/base": "a" * 40, "acme/coder": "b" * 40, "acme/solver": "c" * 40}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1, and huggingface_hub's constants, read at its
    import, set to match) holding a sharded tiny Qwen2 base and two agents under their ids; the same models as
    plain local directories under ``tmp_path/local``."""
    cache = offline_cache(tmp_path / "cache", monkeypatch)
    local = {}
    for seed, repo_id in enumerate(COMMITS):
        model = qwen_model(0)
        if seed:
            import torch

            with torch.no_grad():
                for parameter in list(model.parameters())[seed::3]:
                    parameter[..., : 2 * seed] += 0.01 * seed
        path = tmp_path / "local" / repo_id.split("/")[1]
        model.save_pretrained(path, max_shard_size="40KB")  # several shards and an index
        local[repo_id] = path
        cache_repo(cache, repo_id, path, COMMITS[repo_id])
    assert (local["acme/base"] / "model.safetensors.index.json").is_file()
    return cache, local


def _merge(tmp_path: Path, name: str, base: str, models: list[str]) -> Path:
    config = {
        "merge_method": "ram_plus",
        "base_model": base,
        "models": [{"model": m} for m in models],
        "parameters": {"r": 0.1, "alpha": 2.0},
    }
    out = tmp_path / name
    ram_trl.merge(config, out, progress=False)
    return out


def test_the_cache_layout_is_what_huggingface_hub_and_transformers_read(hub):
    from transformers import AutoConfig

    cache, _ = hub
    snapshot = huggingface_hub.snapshot_download("acme/base", local_files_only=True)
    assert Path(snapshot) == cache / "models--acme--base" / "snapshots" / COMMITS["acme/base"]
    assert AutoConfig.from_pretrained("acme/base").hidden_size == 32
    assert resolve_model("acme/base") == Path(snapshot)


def test_merge_by_id_is_byte_identical_to_merge_by_path_and_records_the_revisions(hub, tmp_path):
    _, local = hub
    by_path = _merge(
        tmp_path, "by_path", str(local["acme/base"]), [str(local["acme/coder"]), str(local["acme/solver"])]
    )
    by_id = _merge(tmp_path, "by_id", "acme/base", ["acme/coder", f"acme/solver@{COMMITS['acme/solver']}"])
    written = sorted(p.name for p in by_path.iterdir())
    assert written == sorted(p.name for p in by_id.iterdir())
    for name in written:
        if name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json"):
            assert (by_id / name).read_bytes() == (by_path / name).read_bytes(), name
    report = json.loads((by_id / "ram_merge_report.json").read_text())
    assert report["base_hub"] == {"repo_id": "acme/base", "revision": COMMITS["acme/base"]}
    hubs = [agent["hub"] for agent in report["agents"]]
    assert hubs == [
        {"repo_id": "acme/coder", "revision": COMMITS["acme/coder"]},
        {"repo_id": "acme/solver", "revision": COMMITS["acme/solver"], "requested": COMMITS["acme/solver"]},
    ]
    assert "base_hub" not in json.loads((by_path / "ram_merge_report.json").read_text())
    # the card: every input under base_model (ids as written, paths by their folder's name), the merge relation
    front = yaml.safe_load((by_id / "README.md").read_text().split("---")[1])
    assert front["base_model"] == ["acme/base", "acme/coder", "acme/solver"]
    assert front["base_model_relation"] == "merge"
    assert front["tags"] == ["merge", "ram_trl", "ram_plus"]
    assert front["library_name"] == "transformers"
    assert yaml.safe_load((by_path / "README.md").read_text().split("---")[1])["base_model"] == [
        "base",
        "coder",
        "solver",
    ]
    assert "hf upload" in (by_id / "README.md").read_text()


def test_a_snapshot_folder_given_as_a_path_reads_its_links_into_the_repos_blobs(hub):
    cache, _ = hub
    snapshot = cache / "models--acme--base" / "snapshots" / COMMITS["acme/base"]
    checkpoint = open_checkpoint(snapshot, "base model")  # shards are links to ../../blobs: no external-shard flag
    assert len(checkpoint.files) > 1
    assert cached_revision(snapshot).revision == COMMITS["acme/base"]


def test_a_link_out_of_the_repos_blobs_is_refused(hub, tmp_path):
    cache, local = hub
    snapshot = cache / "models--acme--coder" / "snapshots" / COMMITS["acme/coder"]
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    for target in [local["acme/coder"] / shard.name, cache / "models--acme--base" / "blobs" / "x"]:
        shutil.copyfile(local["acme/coder"] / shard.name, target) if not target.exists() else None
        shard.unlink()
        shard.symlink_to(target)  # the same bytes, but outside this repository's blobs
        with pytest.raises(CheckpointError, match=r"outside the checkpoint directory"):
            open_checkpoint(snapshot, "agent 0")
        with pytest.raises(CheckpointError, match=r"outside the checkpoint directory"):
            _merge(tmp_path, "refused", "acme/base", ["acme/coder"])


def test_an_unresolvable_id_is_one_line_naming_it_and_the_fetch_command(hub, tmp_path):
    with pytest.raises(ConfigError) as info:
        _merge(tmp_path, "missing", "acme/base", ["acme/not-cached", "acme/coder"])
    message = str(info.value)
    assert "\n" not in message
    assert "models[0] (acme/not-cached)" in message
    assert message.endswith("fetch it with `hf download acme/not-cached`")
    with pytest.raises(ConfigError, match=r"fetch it with `hf download acme/base --revision v9`$"):
        resolve_model("acme/base@v9", what="base_model")
    assert not (tmp_path / "missing").exists()


def test_the_config_is_checked_from_metadata_before_any_weight_is_read(hub, tmp_path):
    # a cached repository holding only its config and index: the whole config resolves; opening it for the merge
    # asks for the weights at the resolved commit, offline a one-line refusal
    cache, local = hub
    cache_repo(
        cache,
        "acme/meta-only",
        local["acme/coder"],
        "d" * 40,
        skip=tuple(p.name for p in local["acme/coder"].glob("model-*.safetensors")),
    )
    from ram_trl.merging.config.resolve import resolve_config
    from ram_trl.merging.config.schema import load_config

    config = {"merge_method": "ram_plus", "base_model": "acme/base", "models": [{"model": "acme/meta-only"}]}
    resolved = resolve_config(load_config(config)[0])
    assert resolved.agents[0].path.name == "d" * 40
    with pytest.raises(
        ConfigError,
        match=r"headers of acme/meta-only's model-00001-of-.*fetch it with `hf download acme/meta-only --revision d{40}`$",
    ):
        ram_trl.merge(config, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org/name", ("org/name", None)),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("./org/name", None),
        ("/abs/path", None),
        ("name", None),
        ("org/name@", None),
        ("a/b/c", None),
    ],
)
def test_parse_reference(text, expected):
    reference = parse_reference(text)
    assert (None if reference is None else (reference.repo_id, reference.revision)) == expected


def test_local_paths_do_not_ask_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", None)  # any call would fail
    os.makedirs(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == Path("org/name")


class _Hub(http.server.BaseHTTPRequestHandler):
    """A Hub endpoint serving ``/ORG/NAME/resolve/REV/FILE`` from local folders, with HTTP range requests."""

    folders: dict[str, Path] = {}
    served: list[tuple[str, int]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        parts = self.path.split("?")[0].split("/", 5)
        if len(parts) < 6 or f"{parts[1]}/{parts[2]}" not in self.folders:
            self.send_response(404)  # huggingface_hub's other requests (its agent detection)
            self.end_headers()
            return
        data = (self.folders[f"{parts[1]}/{parts[2]}"] / parts[5]).read_bytes()
        file = parts[5]
        start, stop = 0, len(data) - 1
        if self.headers.get("range"):
            first, last = self.headers["range"].removeprefix("bytes=").split("-")
            start, stop = int(first), min(int(last), len(data) - 1)
        body = data[start : stop + 1]
        self.served.append((file, len(body)))
        self.send_response(206 if self.headers.get("range") else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{stop}/{len(data)}")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def online(hub, monkeypatch):
    """``hub``, online, its endpoint a local HTTP server holding the local folders under their ids."""
    cache, local = hub
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    _Hub.folders, _Hub.served = dict(local), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"  # as HF_ENDPOINT sets them at huggingface_hub's import
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    yield cache, local
    server.shutdown()
    server.server_close()


def _meta_only(cache: Path, repo_id: str, source: Path, commit: str) -> Path:
    skip = tuple(p.name for p in source.glob("*.safetensors"))
    return cache_repo(cache, repo_id, source, commit, skip=skip)


def test_a_dry_run_reads_missing_weights_headers_by_range_requests_only(online, tmp_path):
    cache, _ = online
    big = {}
    for seed, name in enumerate(["big-base", "big-agent"]):
        big[name] = tmp_path / name
        qwen_model(seed, vocab_size=4096).save_pretrained(big[name])  # one 1.1 MB model.safetensors
    cache_repo(cache, "acme/big-base", big["big-base"], "d" * 40)
    snapshot = _meta_only(cache, "acme/big-agent", big["big-agent"], "e" * 40)
    _Hub.folders["acme/big-agent"] = big["big-agent"]
    config = {"merge_method": "ram_plus", "base_model": "acme/big-base", "models": [{"model": "acme/big-agent"}]}
    plan = ram_trl.merge(config, tmp_path / "out", dry_run=True, progress=False)
    local = {**config, "base_model": str(big["big-base"]), "models": [{"model": str(big["big-agent"])}]}
    by_path = ram_trl.merge(local, tmp_path / "o", dry_run=True, progress=False)
    assert {k: v for k, v in plan.items() if k not in ("agents", "base_hub")} == {
        k: v for k, v in by_path.items() if k != "agents"
    }
    assert plan["base_hub"] == {"repo_id": "acme/big-base", "revision": "d" * 40}
    assert plan["agents"][0]["hub"] == {"repo_id": "acme/big-agent", "revision": "e" * 40}
    weights = (big["big-agent"] / "model.safetensors").stat().st_size
    assert [file for file, _ in _Hub.served] == ["model.safetensors"]  # one range request: the header
    assert _Hub.served[0][1] <= 100_001 < weights
    assert not list(snapshot.glob("*.safetensors"))  # nothing fetched into the cache


def test_shapes_are_checked_from_the_hubs_headers_before_any_weight_is_fetched(online, tmp_path):
    cache, local = online
    wider = qwen_model(0, intermediate_size=72)
    wider.save_pretrained(tmp_path / "wider", max_shard_size="40KB")
    _Hub.folders["acme/wider"] = tmp_path / "wider"
    _meta_only(cache, "acme/wider", tmp_path / "wider", "e" * 40)
    config = {"merge_method": "ram_plus", "base_model": "acme/base", "models": [{"model": "acme/wider"}]}
    with pytest.raises(CheckpointError, match=r"mlp.*shape"):
        ram_trl.merge(config, tmp_path / "out", progress=False)
    assert all(size <= 100_001 for _, size in _Hub.served)  # range requests of headers only
    assert not (tmp_path / "out").exists()


def test_a_stage_manifests_hub_base_resolves_at_its_recorded_commit(hub, tmp_path):
    from ram_trl.stage.manifest import StageManifest, base_model_path

    cache, local = hub
    newer = cache_repo(cache, "acme/moving", local["acme/coder"], "f" * 40)
    older = newer.parent / ("1" * 40)
    shutil.copytree(newer, older, symlinks=True)  # refs/main now names f..f; the run trained from 1..1
    manifest = StageManifest(stage="s", base_model="acme/moving", base_revision="1" * 40, checkpoint=".")
    assert base_model_path(manifest, tmp_path) == older
    assert base_model_path(manifest.model_copy(update={"base_revision": None}), tmp_path) == newer


def test_a_recipes_base_may_be_a_hub_id(hub, tmp_path):
    from ram_trl.recipes.layout import RunLayout
    from ram_trl.recipes.runner import RunOptions
    from ram_trl.recipes.schema import load_recipe
    from tests.helpers import check_recipe, recipe_dict

    data = recipe_dict(base={"path": "acme/base"})
    del data["base"]["build"]
    assert not [n for n in check_recipe(data) if "base" in n]
    recipe, root = load_recipe(data)
    layout = RunLayout(recipe, root, tmp_path / "run", RunOptions())
    assert layout.initial_base.name == COMMITS["acme/base"]
    assert layout.resolved_recipe()["base"]["path"] == "acme/base"  # the run's copy keeps the id
    data["base"]["path"] = "acme/not-cached"
    with pytest.raises(ConfigError, match=r"base.path: 'acme/not-cached' .*`hf download acme/not-cached`"):
        check_recipe(data)


def test_passthrough_by_id_is_byte_identical_to_passthrough_by_path(hub, tmp_path):
    _, local = hub

    def stack(first: str, second: str) -> dict:
        sources = [[{"model": first, "layer_range": [0, 2]}], [{"model": second, "layer_range": [1, 2]}]]
        return {"merge_method": "passthrough", "slices": [{"sources": s} for s in sources]}

    ram_trl.merge(stack(str(local["acme/base"]), str(local["acme/coder"])), tmp_path / "by_path", progress=False)
    report = ram_trl.merge(stack("acme/base", "acme/coder"), tmp_path / "by_id", progress=False)
    written = sorted(p.name for p in (tmp_path / "by_path").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "by_id").iterdir())
    for name in written:
        if name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json"):
            assert (tmp_path / "by_id" / name).read_bytes() == (tmp_path / "by_path" / name).read_bytes(), name
    assert json.loads((tmp_path / "by_id" / "config.json").read_text())["num_hidden_layers"] == 3
    assert report["slices"][1]["hub"] == {"repo_id": "acme/coder", "revision": COMMITS["acme/coder"]}
    front = yaml.safe_load((tmp_path / "by_id" / "README.md").read_text().split("---")[1])
    assert front["base_model"] == ["acme/base", "acme/coder"] and "passthrough" in front["tags"]
