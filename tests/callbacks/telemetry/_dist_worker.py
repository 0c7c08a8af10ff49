"""One rank of a 2-process training job (DeepSpeed ZeRO-3 or ZeRO-2, FSDP2 or DDP on CPU with gloo) that trains a tiny model a
few steps, then measures its task vector on the local shards with every gathering collective forbidden: directly
(shard by shard, against the base on disk) and through :class:`~ram_trl.callbacks.telemetry.tracker.TaskVectorTracker` (base
on disk; under ZeRO-3 also the partitioned reference model).

Run by tests/callbacks/telemetry/test_distributed_shards.py:
``python -m deepspeed.launcher.runner --num_gpus 2 _dist_worker.py {zero3,zero2} BASE OUT`` or
``python -m torch.distributed.run --nproc_per_node 2 _dist_worker.py {fsdp2,ddp} BASE OUT``.
Writes ``OUT/rank{R}.json`` (shards, partial counts, the tracker's metrics, collectives used) and, on rank 0, the trained
weights gathered after the measurement to ``OUT/trained.safetensors``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ram_trl.callbacks.telemetry.base_weights import MappedCheckpointBase, ModelBase  # noqa: E402
from ram_trl.callbacks.telemetry.shards import iter_local_shards  # noqa: E402
from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker  # noqa: E402
from ram_trl.distributed import exit_distributed  # noqa: E402
from tests.callbacks.telemetry._counting import Counts  # noqa: E402

STEPS = 3
#: Token ids the training data uses: embedding rows from here on get no gradient and stay equal to the base.
USED_TOKENS = 40
#: A tracker whose magnitude statistics come from a systematic sample of windows (stride 20 on this model).
SAMPLED = {"save_dtype": "bfloat16", "chunk_elements": 16, "magnitude_sample": 64}


class OddNet(torch.nn.Module):
    """Parameter sizes chosen for the edge cases: odd element counts (ZeRO-3 padding), 101 and 3 rows (uneven FSDP2
    shards), a 1-element parameter (an empty shard on rank 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(101, 12)
        self.hidden = torch.nn.Linear(12, 7)
        self.out = torch.nn.Linear(7, 3)
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(ids)))) * self.gain


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, USED_TOKENS, (4, 5), generator=generator)
    return ids, torch.randn(4, 5, 3, generator=generator)


class Forbidden(RuntimeError):
    pass


@contextlib.contextmanager
def no_gathers(model: torch.nn.Module, calls: dict[str, int], allow: tuple[str, ...] = ()):
    """Make every way of gathering a parameter raise; count the all-reduces. ``allow`` names ``torch.distributed``
    collectives left alone (``all_gather_object`` for a few small Python objects)."""
    patches: list[tuple[object, str, object]] = []

    def forbid(owner: object, attribute: str) -> None:
        if not hasattr(owner, attribute):
            return

        def raiser(*args, **kwargs):
            raise Forbidden(f"{attribute} called during the measurement")

        patches.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, raiser)

    for attribute in (
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather_object",
        "gather",
        "broadcast",
        "all_to_all",
        "all_to_all_single",
        "reduce_scatter_tensor",
    ):
        if attribute not in allow:
            forbid(dist, attribute)
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls["all_reduce"] += 1
        calls["all_reduce_bytes"] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *args, **kwargs)

    patches.append((dist, "all_reduce", real_all_reduce))
    dist.all_reduce = counting_all_reduce
    with contextlib.suppress(ImportError):
        import deepspeed
        import deepspeed.comm

        forbid(deepspeed.zero.GatheredParameters, "__enter__")
        for attribute in ("all_gather", "all_gather_into_tensor", "allgather_fn", "broadcast"):
            forbid(deepspeed.comm, attribute)
        for param in model.parameters():
            forbid(param, "all_gather")
    from torch.distributed.tensor import DTensor

    forbid(DTensor, "full_tensor")
    forbid(DTensor, "redistribute")
    with contextlib.suppress(ImportError):
        from torch.distributed.fsdp import FSDPModule

        forbid(FSDPModule, "unshard")
    try:
        yield
    finally:
        for owner, attribute, original in reversed(patches):
            setattr(owner, attribute, original)


def load_base(model: torch.nn.Module, base: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(base[name])


def main() -> None:
    # the DeepSpeed launcher adds --local_rank=N in front of the script's arguments
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    mode, base_dir, out_dir = args[0], Path(args[1]), Path(args[2])
    base = load_file(str(base_dir / "model.safetensors"))
    torch.manual_seed(0)
    reference = None
    if mode == "zero2":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        net = OddNet()
        load_base(net, base)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 2},
        }
        model, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    elif mode == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            # parameters of at most 10 elements stay gathered on every rank (the persistent path), the others are
            # released after each use: both must be measured on their partitions
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
        }

        def partitioned() -> torch.nn.Module:
            with deepspeed.zero.Init(config_dict_or_path=config):
                net = OddNet()
            for name, param in net.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                    if dist.get_rank() == 0:
                        param.copy_(base[name])
            return net

        net = partitioned()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
        model, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
        reference, _, _, _ = deepspeed.initialize(model=partitioned(), config=config)
        reference.eval()
        assert hasattr(next(net.parameters()), "ds_tensor")
    else:
        dist.init_process_group("gloo")
        net = OddNet()
        load_base(net, base)
        if mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            fully_shard(net.hidden, mesh=mesh)
            fully_shard(net, mesh=mesh)
            model = net
        elif mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(net)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    rank = dist.get_rank()

    for step in range(STEPS):
        ids, target = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(ids), target)
        if mode.startswith("zero"):
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    source = MappedCheckpointBase(base_dir)
    trackers = {"disk": TaskVectorTracker(base_model=base_dir, save_dtype="bfloat16")}
    # magnitudes of a sample of windows of 16 elements (the model laid end to end), as in the test's single process
    trackers["sampled"] = TaskVectorTracker(base_model=base_dir, **SAMPLED)
    if reference is not None:
        trackers["reference"] = TaskVectorTracker(reference_model=reference, save_dtype="bfloat16")
    calls = {"all_reduce": 0, "all_reduce_bytes": 0}
    metrics: dict[str, dict[str, float]] = {}
    fingerprints: dict[str, str] = {}
    with no_gathers(net, calls):
        local = list(iter_local_shards(model))
        partial = Counts().add_all((s.name, s.values, source.read(s.name, s.offset, s.numel)) for s in local)
        reference_equal = None
        if reference is not None:
            held = ModelBase.from_model(reference)
            reference_equal = all(
                torch.equal(held.read(s.name, s.offset, s.numel), source.read(s.name, s.offset, s.numel))
                for s in local
            )
        for key, tracker in trackers.items():
            tracker.setup(model)
            fingerprints[key] = tracker.base_fingerprint.sha256
        for key, tracker in trackers.items():
            before = dict(calls)
            metrics[key] = tracker.measure(model, step=STEPS)
            calls[f"{key}_measure_all_reduces"] = calls["all_reduce"] - before["all_reduce"]
            calls[f"{key}_measure_bytes"] = calls["all_reduce_bytes"] - before["all_reduce_bytes"]
        # the guard is live: gathering now must fail
        gather_blocked = False
        try:
            if mode == "zero3":
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(net.parameters())):
                    pass
            elif mode == "fsdp2":
                net.hidden.weight.full_tensor()
            else:  # DDP, ZeRO-2: nothing to gather, the collectives are guarded
                dist.all_gather_object([None, None], 1)
        except Forbidden:
            gather_blocked = True

    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "shards": [
            {
                "name": s.name,
                "shape": list(s.shape),
                "offset": s.offset,
                "numel": s.numel,
                "partitioned": s.partitioned,
            }
            for s in local
        ],
        "partial": partial.as_json(),
        "metrics": metrics,
        "fingerprints": fingerprints,
        "reference_equal": reference_equal,
        "gather_blocked": gather_blocked,
        "calls": calls,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))

    # after the measurement: the full trained weights, for the single-process reference
    if mode == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(net.parameters())):
            state = {name: param.detach().clone() for name, param in net.named_parameters()}
    elif mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {name: param.detach().clone() for name, param in net.named_parameters()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "trained.safetensors"))


if __name__ == "__main__":
    main()
    exit_distributed()  # barrier, groups destroyed; exits without finalizing while gloo threads live on (docs/ci.md)
