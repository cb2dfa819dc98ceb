"""meshrun quickstart: the Python SDK in a few cells (run it as a script, or paste the cells in a notebook).

    meshrun serve &              # or: meshrun demo --keep-serving
    python examples/quickstart.py

The SDK needs only httpx + pydantic (pyyaml for YAML specs, rich for progress bars, pandas for DataFrames).
"""

# %% connect (MESHRUN_URL / MESHRUN_TOKEN, default http://127.0.0.1:8000)
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent if "__file__" in globals() else Path("examples").resolve()
try:
    import api  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

from api.client import Client, NotFoundError, ValidationError

client = Client()
print(client.health())
print(client.cluster.get().model_dump(include={"cpus_total", "cpus_free", "dashboard_url"}))

# %% a spec the service rejects says which field is wrong and what to use instead
try:
    client.runs.create(HERE / "dp.yaml", overrides=["layout.tp=3"])
except ValidationError as e:
    print(f"rejected: {e.message}  (field {e.param})")

# %% submit a data-parallel run and watch it (step/total, loss, tokens/s, ETA)
run = client.runs.create(HERE / "dp.yaml", overrides=["train.steps=20"])
print(run.id, run.status.value, run.plan.world_size if run.plan else None)
run.wait(progress=True)
print(run.status.value, run.summary)

# %% per-step metrics: rows, or a pandas DataFrame indexed by step
rows = run.metrics()
print(rows[-1])
try:
    df = run.metrics_df()
    print(df[["loss", "tokens_per_s", "mfu"]].tail())
except ImportError:
    pass

# %% plan before you buy: the best layouts for a 7B GPT on 4 x 8 H100 (predicted, nothing runs)
plan = client.plans.create(model={"name": "gpt", "preset": "7b"},
                           cluster={"device": "H100", "gpus_per_node": 8, "nodes": 4},
                           global_batch_size=512, top_k=5)
for c in plan.candidates:
    print(c.layout.dp, c.layout.tp, c.layout.pp, c.micro_batch_size, f"{c.memory_bytes.total / 2**30:.1f} GiB",
          f"{c.tokens_per_s:,.0f} tok/s", f"MFU {c.mfu:.0%}")

# %% sweep a few layouts on the live cluster and run the winner
try:
    sweep = client.sweeps.create(HERE / "sweep.yaml", overrides=["budget.max_trials=3", "budget.steps_per_trial=6"])
except NotFoundError:
    print("this service has no sweeps endpoint yet")
else:
    sweep.wait(progress=True)
    if sweep.best_trial is not None:
        best = client.runs.create(sweep.best_run_spec())
        print("best layout:", best.spec.layout, "->", best.wait(progress=True).status.value)

# %% stop a run after its first checkpoint, then resume it on another layout (the checkpoint is resharded)
ck = client.runs.create(HERE / "zero3.yaml", overrides=["train.steps=400", "checkpoint.every_steps=5"])
while not ck.checkpoints() and not ck.refresh().done:
    time.sleep(0.5)
ck.cancel()
last = max(c.step for c in ck.checkpoints())  # the run may have saved more than one before the cancel landed
resumed = ck.resume(layout="dp=1,tp=2", steps=last + 10).wait(progress=True)
print(resumed.id, resumed.status.value, "attempts:", resumed.attempts, "summary:", resumed.summary)
client.close()
