"""Checks of the fields of a plan's JSON (:meth:`autoparallel.plan.Plan.from_json`): each raises
``ValueError`` naming the object and the field."""

from __future__ import annotations

import math


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check(ok: bool, where: str, field_name: str, expected: str, found) -> None:
    if not ok:
        raise ValueError(f"{where}: {field_name} must be {expected}, not {found!r}")


def _fields(d, names, where: str, optional=()) -> None:
    """``d`` is an object with exactly the fields ``names`` (those in ``optional`` may be absent)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, not {d!r}")
    missing = [k for k in names if k not in d and k not in optional]
    unknown = sorted(set(d) - set(names))
    problems = [f"missing field(s) {missing}"] if missing else []
    problems += [f"unknown field(s) {unknown}"] if unknown else []
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
