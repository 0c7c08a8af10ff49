"""One rank of a 2-process DeepSpeed ZeRO-3 job on CPUs: what ram_trl.callbacks.deepspeed_adapter reads of real partitioned
parameters and engine. Writes ``result_rank<R>.json`` in its working directory (not stdout: the ranks share one pipe,
and two ranks' lines can interleave); run by tests/test_deepspeed_adapter.py."""

import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ram_trl.callbacks import deepspeed_adapter as adapter
from ram_trl.distributed import exit_distributed

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4},  # the 3-element bias persists
}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1, bias=False))  # 15, 3, 3 elements
    for index, param in enumerate(net.parameters()):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                param.copy_(torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape) + 100 * index)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=CONFIG)
    out: dict = {
        "rank": dist.get_rank(),
        "engine": adapter.is_engine(engine),
        "module": adapter.is_engine(net),
        "params": {},
    }
    for name, param in engine.module.named_parameters():
        part = adapter.partition_of(param)
        out["params"][name] = {
            "partitioned": adapter.is_partitioned(param),
            "size": part.size,
            "numel": part.numel,
            "shape": list(part.shape),
            "values": part.values.tolist(),
            "quantized": part.quantized,
            "group": dist.get_world_size(group=part.group),
        }
    release = adapter.release_gathered(engine)
    out["release"] = release is not None
    release()
    out["released"] = {n: p.numel() for n, p in engine.module.named_parameters()}
    adapter.regather_persistent(engine)
    out["regathered"] = {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
    out["plain"] = adapter.is_partitioned(torch.nn.Parameter(torch.ones(2)))
    target = Path(f"result_rank{out['rank']}.json")
    target.with_suffix(".tmp").write_text(json.dumps(out))
    os.replace(target.with_suffix(".tmp"), target)


if __name__ == "__main__":
    main()
    exit_distributed()
