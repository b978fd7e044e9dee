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


def test_the_cluster_launchers_docker_line_carries_the_token_as_a_mounted_file():
    """deploy/ray-cluster.yaml through Ray's own ``docker run`` builder: Ray runs that line through
    the node's shell, so a ``$VAR`` in it would be the node's (unset there) and not the launching
    machine's; the token must arrive as a file from ``file_mounts``, named by RAY_AUTH_TOKEN_PATH
    (``ray start`` reading it there: ``test_ray_token``'s head is started so)."""
    from ray.autoscaler._private.docker import docker_start_cmds

    c = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    d = c["docker"]
    for role in ("head", "worker"):
        options = d.get("run_options", []) + d.get(f"{role}_run_options", [])
        cmd = docker_start_cmds(
            "ubuntu", d["image"], c["file_mounts"], d["container_name"], options, c["cluster_name"], "/root", "docker"
        )
        assert "$" not in cmd, f"the {role}'s docker line expands a variable on the node: {cmd}"
        argv = shlex.split(cmd)
        env = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a in ("--env", "-e"))
        mounts = [argv[i + 1].split(":")[1] for i, a in enumerate(argv) if a == "-v"]
        assert env.get("RAY_AUTH_MODE") == "token", (role, env)
        path = env.get("RAY_AUTH_TOKEN_PATH", "")
        assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (role, path, mounts)


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
