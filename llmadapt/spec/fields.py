"""The checks of single fields that every section of the workload uses; each names the field and what it allows.

attrs validators: ``attrs.field(default=1, validator=at_least(1))``. Rules across fields are in
``llmadapt.spec.validation``."""

from __future__ import annotations

import math

from llmadapt.errors import WorkloadError


def choice(options: tuple):
    def check(inst, attribute, value):
        if value not in options:
            raise WorkloadError(attribute.name, value, f"allowed: {', '.join(map(str, options))}")

    return check


def at_least(low: int | float):
    def check(inst, attribute, value):
        if value is None:
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise WorkloadError(attribute.name, value, f"must be a finite number >= {low}")
        if value < low:
            raise WorkloadError(attribute.name, value, f"must be >= {low}")

    return check


def share(inst, attribute, value):
    """A fraction in [0, 1]."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
        raise WorkloadError(attribute.name, value, "must be a fraction from 0 to 1")


def above(low: float):
    """Optional and finite, strictly above ``low`` (durations, SLO limits)."""
    def check(inst, attribute, value):
        if value is not None and not (math.isfinite(value) and value > low):
            raise WorkloadError(attribute.name, value, f"must be a finite number > {low}")

    return check
