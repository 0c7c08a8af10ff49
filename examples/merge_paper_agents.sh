#!/usr/bin/env bash
# Merge the RAM paper's public agents with RAM+ (r = 0.1, alpha = 2) over several processes with accelerate launch.
#
#   bash examples/merge_paper_agents.sh MODELS_DIR OUT_DIR [NUM_PROCESSES]
#
# MODELS_DIR holds the four models downloaded beforehand (ram_trl never downloads):
#   huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir MODELS_DIR/Qwen2.5-7B-Instruct
#   huggingface-cli download Gen-Verse/ReasonFlux-Coder-7B --local-dir MODELS_DIR/ReasonFlux-Coder-7B
#   huggingface-cli download emrecanacikgoz/Qwen2.5-7B-Instruct-ToolRL-grpo-cold \
#       --local-dir MODELS_DIR/Qwen2.5-7B-Instruct-ToolRL-grpo-cold
#   huggingface-cli download BytedTsinghua-SIA/RL-MemoryAgent-7B --local-dir MODELS_DIR/RL-MemoryAgent-7B
# Try it on the synthetic example first:  ram-trl example ex && MODELS=ex bash examples/merge_paper_agents.sh ex out 2
set -euo pipefail
models=${1:?usage: merge_paper_agents.sh MODELS_DIR OUT_DIR [NUM_PROCESSES]}
out=${2:?usage: merge_paper_agents.sh MODELS_DIR OUT_DIR [NUM_PROCESSES]}
nproc=${3:-2}
config="$(mktemp -d)/merge.yaml"
if [[ -d "$models/agent_0" ]]; then   # the synthetic example of `ram-trl example`
  base="$models/base"; agents=("$models/agent_0" "$models/agent_1" "$models/agent_2")
else
  base="$models/Qwen2.5-7B-Instruct"
  agents=("$models/ReasonFlux-Coder-7B" "$models/Qwen2.5-7B-Instruct-ToolRL-grpo-cold" "$models/RL-MemoryAgent-7B")
fi
{
  echo "merge_method: ram_plus"
  echo "base_model: $base"
  echo "parameters: {r: 0.1, alpha: 2.0}"
  echo "models:"
  for agent in "${agents[@]}"; do echo "  - model: $agent"; done
} > "$config"
ram-trl merge "$config" "$out" --dry-run
# --multi_gpu is accelerate's name for its torchrun launcher; on CPU-only machines the ranks use gloo.
accelerate launch --multi_gpu --num_processes "$nproc" -m ram_trl merge "$config" "$out" --overwrite
ram-trl analyze --config "$config" --out "$out/analysis"
