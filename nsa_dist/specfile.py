"""Reading an experiment spec from YAML, with errors that name the file, the field and the value."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from nsa_dist.config import ExperimentSpec, SweepSpec

__all__ = ["SpecError", "load_spec", "load_sweep", "format_validation_error"]


class SpecError(ValueError):
    """A spec file is missing, not YAML, or not a valid experiment spec."""


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = []
    for e in exc.errors():
        loc = tuple(e["loc"])
        if len(loc) > 1 and loc[0] == "model" and loc[1] in ("fc", "factory"):
            loc = loc[:1] + loc[2:]  # drop the tag of the model block's union (a net or a factory)
        where = ".".join(str(p) for p in loc) or "(spec)"
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        got = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {where}: {msg}{got}")
    return "\n".join(lines)


def _read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} does not exist")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise SpecError(f"{p}: expected a mapping of spec fields at the top level, got {type(raw).__name__}")
    return raw


def load_spec(path: str | Path) -> ExperimentSpec:
    """The :class:`ExperimentSpec` in a YAML file.

    Raises:
        SpecError: the file is missing, is not YAML, or fails validation (every problem listed).
    """
    raw = _read_yaml(path)
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(f"{path}: invalid experiment spec\n{format_validation_error(exc)}") from exc


def load_sweep(path: str | Path) -> SweepSpec:
    """A :class:`SweepSpec` from YAML; a plain experiment file becomes a one-run sweep.

    Raises:
        SpecError: missing file, bad YAML, or an invalid sweep / run spec.
    """
    raw = _read_yaml(path)
    if not {"base", "grid", "variants", "cluster"} & set(raw):
        raw = {"name": raw.get("name", "sweep"), "base": raw}
    try:
        return SweepSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(f"{path}: invalid sweep spec\n{format_validation_error(exc)}") from exc
