"""Where and how a step runs: device and precision, the world of processes, FSDP2's shards, the sharded step and its checkpoints. Never changes the guarantee."""
