"""Every message names the true cause: bad input refused in one line that says what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.cli import main


def test_non_finite_pixels_are_named_as_such(tmp_path) -> None:
    """A float image with a NaN pixel was refused as "every training target y is 0 (a constant image)"."""
    from skimage.io import imsave

    from nsa_dist.data.image2d import load_image

    img = np.random.default_rng(0).random((16, 16)).astype(np.float32)
    img[3, 4], img[5, 6] = np.nan, np.inf
    path = tmp_path / "nan.tif"
    imsave(path, img)
    with pytest.raises(ValueError, match=r"2 non-finite pixel\(s\) \(NaN/inf, the first at row 3, column 4\)"):
        load_image(path)


def test_yaml_nested_too_deeply_is_refused_naming_the_file(tmp_path, capsys) -> None:
    """50,000 levels of [ ] ended in "RecursionError … (unexpected)" without the file."""
    spec = tmp_path / "deep.yaml"
    spec.write_text("name: deep\ndata: " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert main(["run", str(spec), "--store", str(tmp_path / "s.zarr")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(spec) in err[0] and "nests too deeply" in err[0], err


def test_nsa_ls_shows_counts_as_integers_and_a_trackers_recorded_lr(tmp_path, capsys, monkeypatch) -> None:
    """Counts print as integers even when pandas made their column float, and a Tracker run's lr is
    the one it recorded, not the spec's default."""
    import torch

    from nsa_dist.cli import _int
    from nsa_dist.tracker import Tracker

    assert (_int(39.0), _int(float("nan")), _int(None), _int(7), _int(2.5)) == ("39", "-", "-", "7", "2.5")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    X, y = torch.randn(12, 2), torch.randn(12)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "tracked", model, X, y, steps=4, record={"every": 2}, spectrum={"k": 4}, optimizer="gd")
    opt = torch.optim.SGD(model.parameters(), lr=0.0371)
    for t in range(4):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).mean()
        if tr.due(t):
            tr.record(t, lr=0.0371, loss=loss.item())
        else:
            tr.log(t, loss.item())
        loss.backward()
        opt.step()
    tr.close()
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: Rich shortens cells to fit
    capsys.readouterr()
    assert main(["ls", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "0.0371" in out and ".0×" not in out, out


@pytest.mark.slow  # starts a Ray of its own
def test_the_embedded_ray_is_started_whatever_cluster_ray_address_names(tmp_path) -> None:
    """Ray's ``ray.init()`` joins the cluster RAY_ADDRESS (or the last ``ray start``) names: `nsa sweep`
    without --address met another session's head and failed ("num_cpus must not be provided")."""
    import os
    import subprocess
    import sys

    code = (
        "from nsa_dist.cluster import runtime; import ray\n"
        "r = runtime.connect(None, num_cpus=1)\n"
        "print('cpus', r.get('CPU'))\n"
        "ray.shutdown()\n"
    )
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9", "OMP_NUM_THREADS": "1"}  # nothing listens on port 9
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "cpus 1.0" in done.stdout, (done.stdout + done.stderr)[-2000:]


def test_an_embedded_ray_that_times_out_starting_is_started_again_then_named(monkeypatch) -> None:
    """Ray waits a fixed 30 s for its raylet; under load it raises a bare "timed out during
    startup".  Injected here (a loaded machine cannot be made on demand): started again, and after
    the last try one OutsideError line with the load and what to try."""
    import ray

    from nsa_dist.cluster import runtime
    from nsa_dist.errors import OutsideError

    calls = []

    def timing_out(**kw):
        calls.append(kw)
        if len(calls) < 3:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", timing_out)
    runtime._start_embedded({"num_cpus": 1}, tries=3, pause=0.0)
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(
        ray,
        "init",
        lambda **kw: timing_out(**kw) or (_ for _ in ()).throw(Exception("The current node timed out during startup.")),
    )
    with pytest.raises(OutsideError, match=r"did not start in 2 tries: .*load average .*ray start --head") as e:
        runtime._start_embedded({"num_cpus": 1}, tries=2, pause=0.0)
    assert "\n" not in str(e.value) and len(calls) == 2
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ValueError("another failure")))
    with pytest.raises(ValueError, match="another failure"):  # not a startup timeout: not retried
        runtime._start_embedded({}, tries=3, pause=0.0)
