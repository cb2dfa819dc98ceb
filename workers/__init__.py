"""What runs inside each training process: torch only (no fastapi, sqlalchemy or ray at import).

- ``workers.models``: model registry (GPT, MLP, user entrypoints), TP plans, pipeline splits, deterministic init
- ``workers.parallel_dims``: ``ParallelDims`` (the device mesh: pp, dp_replicate, dp_shard, tp)
- ``workers.parallelize``: TP -> activation checkpointing -> FSDP2/DDP; cross-mesh grad clipping
- ``workers.data``: per-step deterministic batches; ``workers.optim``: AdamW/ZeRO-1 + LR schedule
- ``workers.loop``: ``train(WorkerJob, sink=, on_checkpoint=, stop=)``; ``python -m workers``: the launcher
- ``workers.pipeline`` / ``workers.checkpoint``: pipeline schedules and DCP checkpoints
"""
