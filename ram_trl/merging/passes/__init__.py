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
