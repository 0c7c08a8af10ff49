"""The passes of a merge over this process's tensors, chunk by chunk, each taking the run's
:class:`~ram_trl.merging.context.RunContext`: statistics, per-tensor preparation, merge-and-write, the kernels'
epilogue. Every method-specific step is a method hook (docs/development.md, "The merge engine")."""
