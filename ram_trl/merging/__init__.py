"""The merge engine: the configuration, the plan, the passes, the output (model or LoRA adapter)."""
