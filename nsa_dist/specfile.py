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


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader without its silent surprises (YAML 1.1): a key given twice in one mapping
    (PyYAML keeps the last value), an integer with a leading zero (``010`` is octal 8) and a
    base-60 number (``1:30`` is 90) are refused at their line instead of read as another value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, object], yaml.Mark] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<: *base' merges are overridden by the keys given beside them, by design
                if key_node.tag != "tag:yaml.org,2002:str":  # every key of a spec is a field or path name
                    kind = key_node.tag.rsplit(":", 1)[-1]
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key_node.value!r} is a YAML 1.1 {kind}, not a name (yes/no/on/off are booleans, "
                        "~ is null, digits a number); quote it if it is a name",
                        key_node.start_mark,
                    )
                key = (key_node.tag, key_node.value)
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key_node.value!r} is given twice in one mapping (first at line "
                        f"{first[key].line + 1}); YAML would keep only the last value: give it once",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        self._refuse_yaml11_number(node, "integer")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        self._refuse_yaml11_number(node, "number")
        return super().construct_yaml_float(node)

    def _refuse_yaml11_number(self, node: yaml.ScalarNode, what: str) -> None:
        text = str(node.value).replace("_", "")
        digits = text.lstrip("+-")
        if ":" in text:
            value = super().construct_yaml_int(node) if what == "integer" else super().construct_yaml_float(node)
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{node.value} is the base-60 {what} {value} in YAML 1.1; quote it if it is text, or "
                "write the number in decimal",
                node.start_mark,
            )
        if what == "integer" and len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{node.value} has a leading zero, which YAML 1.1 reads as the octal number "
                f"{super().construct_yaml_int(node)}; write {int(text, 10)} (or that number, if octal was meant)",
                node.start_mark,
            )


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_yaml_int)
_SpecLoader.add_constructor("tag:yaml.org,2002:float", _SpecLoader.construct_yaml_float)
_SpecLoader.add_constructor("tag:yaml.org,2002:map", _SpecLoader.construct_yaml_map)


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
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError(
            f"{p}: not UTF-8 text: byte 0x{data[exc.start]:02x} on line {line} ({exc.reason}); save the "
            "file as UTF-8 (a spec's names are ASCII; comments may be any UTF-8)"
        ) from None
    try:
        raw = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from exc
    except RecursionError as exc:  # the parser recurses per level: [[[[…]]]] 50,000 deep
        raise SpecError(
            f"{p}: the YAML nests too deeply to read (thousands of levels of [ or {{); a spec file is a few levels deep"
        ) from exc
    _check_expanded_size(raw, p)
    if raw is None:
        raise SpecError(f"{p}: the file holds no fields (empty, or only comments); write the spec's fields in it")
    if not isinstance(raw, dict):
        raise SpecError(f"{p}: expected a mapping of spec fields at the top level, got {type(raw).__name__}")
    return raw


def load_spec(path: str | Path) -> ExperimentSpec:
    """The :class:`ExperimentSpec` in a YAML file.

    Raises:
        SpecError: the file is missing, is not YAML, or fails validation (every problem listed).
    """
    raw = _read_yaml(path)
    sweep = sorted({"base", "grid", "variants", "cluster"} & set(raw))
    if sweep:
        raise SpecError(
            f"{path}: a sweep file (it has {', '.join(sweep)}), not one experiment: run it with "
            f"`nsa sweep {path}` (or give `nsa run` a file of one experiment's fields)"
        )
    _no_empty_hessian(raw, path, "hessian")
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
        _no_empty_hessian(raw, path, "hessian")
        raw = {"name": raw.get("name", "sweep"), "base": raw}
    else:
        stray = [k for k in raw if k in ExperimentSpec.model_fields and k not in SweepSpec.model_fields]
        if stray:
            one = len(stray) == 1
            raise SpecError(
                f"{path}: {', '.join(stray)} {'is an experiment field' if one else 'are experiment fields'} "
                f"beside the sweep's base / grid: put {'it' if one else 'them'} under `base:` (the experiment "
                "every run starts from)"
            )
        if isinstance(raw.get("base"), dict):
            _no_empty_hessian(raw["base"], path, "base.hessian")
    try:
        return SweepSpec.model_validate(raw, context={"max_runs": max_runs})
    except ValidationError as exc:
        raise SpecError(f"{path}: invalid sweep spec\n{format_validation_error(exc)}") from exc


def _no_empty_hessian(raw: dict, path: str | Path, where: str) -> None:
    """``hessian:`` with nothing under it (its lines commented out) is YAML null, which the spec reads
    as "no Hessian": refused, so that a block written to switch the measurement on never silently
    switches it off."""
    if "hessian" in raw and raw["hessian"] is None:
        raise SpecError(
            f"{path}: {where}: is empty (null), which would measure no Hessian; write `{where.split('.')[-1]}: {{}}` "
            "for the default measurements, or remove the key for none (a spec copied from a store's `hessian: null`: "
            "remove it)"
        )


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
