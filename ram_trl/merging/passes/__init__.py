"""The passes of a merge over its inputs: the statistics pass and the merge-and-write pass, chunk by chunk.

Both take the run's :class:`~ram_trl.merging.context.RunContext` (config, inputs, plan, state, device, reader) and stream
this process's share of the tensors (``run.tasks``). The engine never names a method: every method-specific step is
one of the method's hooks.

- :mod:`ram_trl.merging.passes.statistics`: :func:`statistics_pass` counts, per agent, the active / unique / shared elements
  of every floating tensor (the global statistics of RAM+ and RAM+s) into ``run.state``;
- :mod:`ram_trl.merging.passes.tensors`: per-tensor preparation (parameters, factors, the method's ``prepare_tensor`` hook);
- :mod:`ram_trl.merging.passes.merge`: :func:`write_tensors` merges every tensor a row chunk at a time with the method's
  kernel and writes the rows into the output shards (one chunk in flight ahead, rows written in the background);
- :mod:`ram_trl.merging.passes.epilogue`: what follows every kernel (base added back, signed zeros, overflow, rounding).
"""

from ram_trl.merging.passes.epilogue import check_finite_output, keep_signed_zeros, kernel_output
from ram_trl.merging.passes.merge import extra_rows, merge_block, planned_tensors, start_chunk, write_tensors
from ram_trl.merging.passes.statistics import method_factors, progress_bar, statistics_pass
from ram_trl.merging.passes.tensors import (
    TensorContext,
    TensorInputs,
    agent_parameter_values,
    fill_magnitudes,
    tensor_context,
    tensor_factors,
)

__all__ = [
    "TensorContext",
    "TensorInputs",
    "agent_parameter_values",
    "check_finite_output",
    "extra_rows",
    "fill_magnitudes",
    "keep_signed_zeros",
    "kernel_output",
    "merge_block",
    "method_factors",
    "planned_tensors",
    "progress_bar",
    "start_chunk",
    "statistics_pass",
    "tensor_context",
    "tensor_factors",
    "write_tensors",
]
