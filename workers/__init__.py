"""What runs inside each training process: torch only (no fastapi, sqlalchemy or ray at import).

- ``workers.models``: model registry (GPT, MLP, user entrypoints), TP plans, pipeline splits, deterministic init
- ``workers.parallel_dims``: ``ParallelDims`` (the device mesh: pp, dp_replicate, dp_shard, tp)
- ``workers.parallelize``: TP -> activation checkpointing -> FSDP2/DDP; cross-mesh grad clipping
- ``workers.data``: per-step deterministic batches; ``workers.optim``: AdamW/ZeRO-1 + LR schedule
- ``workers.loop``: ``train(WorkerJob, sink=, on_checkpoint=, stop=, control=, on_state=, on_profile=)`` (the
  callbacks as one ``workers.hooks.Hooks``), the steps and their periodic work; ``workers.engine``: its setup;
  ``workers.step``: the loss, forward/backward and the optimizer step; ``python -m workers``: the launcher
- ``workers.pipeline`` / ``workers.checkpoint``: pipeline schedules and DCP checkpoints
- measurement: ``workers.timeline`` (a step's marks -> the step-time breakdown), ``workers.comm_hooks`` (where
  the communication time goes, from torch's own entry points), ``workers.reporting`` (per-step values kept
  local, one collective per report, rows), ``workers.metrics`` (peak memory, peak FLOP/s)
- diagnosis: ``workers.diagnostics`` ("where am I" per rank, stack dumps, hang summary, injected faults),
  ``workers.profiling`` (torch.profiler windows and the pipeline timeline)
"""
