"""deploy/: every YAML parses, every entrypoint is a real `nsa` command line, versions agree."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from nsa_dist.cli import _parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ROOT = DEPLOY.parent
YAMLS = sorted(DEPLOY.rglob("*.yaml"))


def _strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def test_deploy_has_the_expected_files():
    names = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    assert {
        "docker/Dockerfile",
        "ray-cluster.yaml",
        "kuberay/raycluster.yaml",
        "kuberay/rayjob.yaml",
        "README.md",
    } <= names
    assert not [n for n in names if n.endswith(".py")], "deploy/ holds no Python"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} is empty"


def test_every_nsa_command_is_a_real_cli_call():
    found = []
    texts = [s for p in YAMLS for d in yaml.safe_load_all(p.read_text()) if d for s in _strings(d)]
    texts += (DEPLOY / "docker" / "Dockerfile").read_text().splitlines()
    for text in texts:
        for cmd in re.findall(r"\bnsa (?:sweep|run|submit|status|logs|cancel|ls|show|plot)\b[^\n\"\]]*", text):
            argv = shlex.split(cmd)[1:]
            _parser().parse_args(argv)  # exits (SystemExit) on an unknown command or option
            found.append(argv[0])
    assert "sweep" in found, "the RayJob must run an `nsa sweep`"
    rayjob = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    entry = shlex.split(rayjob["spec"]["entrypoint"])
    assert entry[:2] == ["nsa", "sweep"] and "--address" in entry


def test_ray_version_matches_the_package_pin():
    pin = re.search(r'"ray\[default\]>=([\d.]+),<', (ROOT / "pyproject.toml").read_text()).group(1)
    for p in (DEPLOY / "kuberay").glob("*.yaml"):
        for d in yaml.safe_load_all(p.read_text()):
            versions = re.findall(r"rayVersion: \"?([\d.]+)", yaml.safe_dump(d))
            assert versions and all(v.startswith(pin) for v in versions), (p, versions, pin)
    import ray

    assert ray.__version__.startswith(pin)


def test_sweep_examples_validate():
    from nsa_dist.specfile import load_sweep

    fig7 = load_sweep(ROOT / "examples" / "nsa_fig7_sweep.yaml")
    runs = fig7.expand()
    assert len(runs) == 12 and {(r.model.depth, r.model.width) for r in runs} == {
        (L, W) for L in (2, 4, 6, 8) for W in (64, 256, 1024)
    }
    assert len(load_sweep(ROOT / "examples" / "sweep_tiny.yaml").expand()) == 4
