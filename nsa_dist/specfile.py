"""Reading an experiment spec from YAML, with errors that name the file, the field and the value."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from nsa_dist.config import ExperimentSpec, SweepSpec

if TYPE_CHECKING:
    from nsa_dist.data._paths import Location

__all__ = ["SpecError", "load_spec", "load_sweep", "format_validation_error", "check_data"]


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


def check_data(specs: Iterable[ExperimentSpec], source: str | Path, *, urls: bool = True) -> dict[str, list["Location"]]:
    """Cheap checks of every run's data files — each exists, is a regular file, a local one is
    readable — before anything starts (no Ray, no store); nothing is loaded.

    Args:
        specs: the runs (one spec, or a sweep's expanded runs).
        source: the spec file, for messages.
        urls: also check ``data.path`` URLs (``s3://`` …); False checks local paths only (``nsa
            submit``: the cluster, not the submitting machine, may hold the bucket's keys).

    Returns:
        each checked ``data.path`` → the files its runs read (test files when some run has n_test > 0).

    Raises:
        SpecError: one line naming the spec file, the run and the missing / wrong file.
        MissingDependencyError: a URL whose filesystem package (s3fs, gcsfs) is not installed.
    """
    from nsa_dist.data._paths import is_url
    from nsa_dist.data.registry import data_files

    files: dict[str, list[Location]] = {}
    seen: set[tuple] = set()
    for spec in specs:
        data = spec.data
        key = (getattr(data.name, "value", data.name), data.path, data.n_test > 0)
        if key in seen or (data.path is not None and is_url(data.path) and not urls):
            continue
        seen.add(key)
        try:
            found = data_files(data)
        except (OSError, ValueError) as exc:
            raise SpecError(f"{source}: run {spec.name!r}: {exc}") from exc
        if data.path is not None:
            files[data.path] = list(dict.fromkeys(files.get(data.path, []) + found))
    return files
