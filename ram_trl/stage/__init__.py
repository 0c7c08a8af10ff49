"""The stage contract: what an RL run leaves behind for the merge (the agent and ``ram_stage.json``)."""
