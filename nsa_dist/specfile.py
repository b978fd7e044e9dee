"""Reading an experiment spec from YAML, with errors that name the file, the field and the value.

A spec file is small: one over ``MAX_SPEC_BYTES`` is refused unread, and one whose YAML aliases
expand to more than ``MAX_SPEC_NODES`` values ("billion laughs") is refused before validation.
Error messages are bounded too (``MAX_ERRORS`` problems, each value shown shortened).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from nsa_dist.config import ExperimentSpec, SweepSpec, _clip, format_validation_error

if TYPE_CHECKING:
    from nsa_dist.data import Location

__all__ = ["SpecError", "load_spec", "load_sweep", "format_validation_error", "check_data"]

MAX_SPEC_BYTES = 16 << 20  # a spec or sweep file larger than this is refused unread
MAX_SPEC_NODES = 1_000_000  # values of a spec once its YAML aliases are expanded


class SpecError(ValueError):
    """A spec file is missing, not YAML, or not a valid experiment spec."""


def _check_expanded_size(obj: object, path: Path) -> None:
    """Count the values of ``obj`` with every shared (aliased) node counted at each use; refuse
    past ``MAX_SPEC_NODES``.  Iterative, so deep nesting and cyclic aliases cannot hang or recurse."""
    stack, n = [obj], 0
    while stack:
        x = stack.pop()
        n += 1
        if n > MAX_SPEC_NODES:
            raise SpecError(
                f"{path}: the YAML expands to more than {MAX_SPEC_NODES:,} values (nested aliases "
                "'&a' / '*a'?); a spec file lists its values"
            )
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def _read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        found = sorted(q.name for q in p.iterdir() if q.suffix in (".yaml", ".yml"))[:5]
        raise SpecError(
            f"spec file {str(p)!r} is a directory; give a YAML spec file"
            + (f" (it holds {', '.join(found)})" if found else "")
        )
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} does not exist")
    if p.stat().st_size > MAX_SPEC_BYTES:
        raise SpecError(
            f"{p}: {p.stat().st_size:,} bytes, more than a spec file's {MAX_SPEC_BYTES:,}; is it the right file?"
        )
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from exc
    except RecursionError as exc:  # the parser recurses per level: [[[[…]]]] 50,000 deep
        raise SpecError(
            f"{p}: the YAML nests too deeply to read (thousands of levels of [ or {{); a spec file is a few levels deep"
        ) from exc
    _check_expanded_size(raw, p)
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


def load_sweep(path: str | Path, max_runs: int | None = None) -> SweepSpec:
    """A :class:`SweepSpec` from YAML; a plain experiment file becomes a one-run sweep.

    Args:
        path: the YAML file.
        max_runs: the most runs accepted (default ``config.MAX_SWEEP_RUNS``); the grid's size is
            counted before it is expanded.

    Raises:
        SpecError: missing file, bad YAML, too many runs, or an invalid sweep / run spec.
    """
    raw = _read_yaml(path)
    if not {"base", "grid", "variants", "cluster"} & set(raw):
        raw = {"name": raw.get("name", "sweep"), "base": raw}
    try:
        return SweepSpec.model_validate(raw, context={"max_runs": max_runs})
    except ValidationError as exc:
        raise SpecError(f"{path}: invalid sweep spec\n{format_validation_error(exc)}") from exc


def check_data(specs: Iterable[ExperimentSpec], source: str | Path, *, urls: bool = True) -> dict[str, list[Location]]:
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
    from nsa_dist.data import is_url
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


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where and what, e.g. "line 3, column 6: expected ',' or '}', but got ':' (while
    parsing a flow mapping at line 2, column 7)" — PyYAML's own text spans several lines and names
    "<unicode string>" instead of the file."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return _clip(" ".join(str(exc).split()), 500)
    out = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, at = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        out += f" ({context}" + (f" at line {at.line + 1}, column {at.column + 1}" if at is not None else "") + ")"
    if "'\\t'" in problem:  # PyYAML writes the character as '\t'
        out += "; YAML indents with spaces, not tabs"
    return _clip(out, 500)
