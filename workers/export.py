"""Export a meshrun checkpoint (any layout: dp, ZeRO/FSDP, tp(+sp), pp) as a Hugging Face model, in one process.

A checkpoint is a torch.distributed.checkpoint (DCP) directory whose ``model.*`` items hold each parameter under
its full name and global shape, whatever the layout that saved it; ``load_full_model_state`` reads exactly those
items (not the optimizer) into whole tensors with DCP's offline ``FileSystemReader`` (no process group), and
``export_hf`` maps them to Hugging Face names (``workers.models.hf``) and writes ``config.json`` +
``model.safetensors``, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from api.spec.hf import load_config_json
from workers.checkpoint import read_checkpoint_meta, verify_checkpoint
from workers.models import canonical_name
from workers.models.hf import write_hf_model

log = logging.getLogger(__name__)
_MODEL = "model."


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (``param`` names what to change)."""

    def __init__(self, message: str, param: str = "checkpoint"):
        super().__init__(message)
        self.param = param


def load_full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors of the DCP checkpoint at ``path``, by canonical parameter name."""
    reader = dcp.FileSystemReader(str(path))
    md = reader.read_metadata()
    state: dict[str, torch.Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        if key.startswith(_MODEL) and isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not state:
        raise ExportError(f"checkpoint {path} holds no model tensors")
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {canonical_name(k[len(_MODEL) :]): v for k, v in state.items()}


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, source_path: str | None = None) -> dict[str, Any]:
    """Write the checkpoint's model as a Hugging Face directory ``out_dir``; returns what was written.

    The architecture comes from the run's source model (``model.path`` of the spec the checkpoint records, or
    ``source_path``): only runs of ``model: {name: hf}`` export to Hugging Face."""
    ck = Path(checkpoint)
    why = verify_checkpoint(ck)
    if why is not None:
        raise ExportError(f"checkpoint {ck} cannot be read: {why}")
    meta = read_checkpoint_meta(ck)
    model = ((meta.get("spec") or {}).get("model")) or {}
    if source_path is None:
        if model.get("name") != "hf" or not model.get("path"):
            raise ExportError(
                f"the run trained model '{model.get('name')}', not a Hugging Face model; --format hf exports runs "
                "of model: {name: hf, path: DIR}",
                param="format",
            )
        source_path = str(model["path"])
    try:
        source_config = load_config_json(source_path)
    except ValueError as e:
        raise ExportError(f"the run's source model is not readable any more: {e}", param="model.path") from None
    state = load_full_model_state(ck)
    files = write_hf_model(out_dir, state, source_config=source_config)
    n_params = sum(t.numel() for t in state.values())
    log.info("exported %s (%d parameters) to %s", ck, n_params, out_dir)
    return {
        "checkpoint": str(ck),
        "step": int(meta.get("step", 0)),
        "out": str(out_dir),
        "files": [f.name for f in files],
        "n_params": n_params,
        "config": json.loads((Path(out_dir) / "config.json").read_text()).get("architectures"),
    }
