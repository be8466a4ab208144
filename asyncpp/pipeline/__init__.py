"""One pipeline stage per rank: stage build, weight versions, p2p, the engine, the executor, the
Megatron front-end."""
