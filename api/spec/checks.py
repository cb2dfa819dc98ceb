"""``POST /v1/runs/validate``: what the service checked of a run spec without storing it (``RunValidation``), the
same checks as ``POST /v1/runs`` runs before it stores a run; ``meshrun validate FILE --cluster live`` prints it."""

from __future__ import annotations

from pydantic import Field

from api.spec._base import _Public
from api.spec.plan import Plan


class RunValidation(_Public):
    valid: bool = Field(True, description="Always true in a 200: a spec that fails a check gets submit's 4xx error.")
    plan: Plan = Field(description="The resolved plan, with the planner's prediction on the service's cluster.")
    checked: list[str] = Field(description="The checks that ran (the same as a submission's).")
    not_checked: list[str] = Field(
        default_factory=list, description="Checks this service could not run, and why (no Ray runtime)."
    )
