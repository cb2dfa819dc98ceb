"""Limits and the two base models of the spec family: request models forbid unknown fields, response models
tolerate them (older SDKs keep working against newer servers)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# ----------------------------------------------------------------------------------------------- limits
MAX_WORLD_SIZE = 131_072  # GPUs a layout (and a planned cluster) may span: 100k-GPU clusters plan
MAX_STEPS = 10_000_000
MAX_LAYERS = 1024
MAX_D_MODEL = 131_072
MAX_HEADS = 1024
MAX_VOCAB = 4_194_304
MAX_SEQ_LEN = 1_048_576
MAX_BATCH = 10_000_000
MAX_PRICE = 1e6  # US dollars per device-hour

# a price per device-hour, in plan requests and run specs (each field adds its own description)
PricePerDeviceHour = Annotated[float | None, Field(ge=0, le=MAX_PRICE, allow_inf_nan=False, strict=True)]

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


class _Spec(BaseModel):
    """Base for request models: unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Public(BaseModel):
    """Base for response models: tolerate fields added by newer servers."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), from_attributes=True)
