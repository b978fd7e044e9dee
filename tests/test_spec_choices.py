"""The spec's algorithm choices are the numerics' enums; its precision gives the compute dtype once."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from pydantic import ValidationError

from nsa_dist import linalg, ntk
from nsa_dist.config import EigMethod, ExperimentSpec, NTKMethod
from nsa_dist.specfile import SpecError, load_spec


def test_method_fields_are_the_numerics_enums() -> None:
    assert ntk.NTKMethod is NTKMethod and linalg.EigMethod is EigMethod
    s = ExperimentSpec(spectrum={"eig_method": "lanczos", "ntk_method": "per_layer"}).spectrum
    assert s.eig_method is EigMethod.LANCZOS and s.ntk_method is NTKMethod.PER_LAYER
    stored = json.loads(ExperimentSpec(spectrum={"ntk_method": "per_layer"}).model_dump_json())["spectrum"]
    assert (stored["eig_method"], stored["ntk_method"]) == ("auto", "per_layer")  # the stored spec keeps the strings


@pytest.mark.parametrize(
    "field, bad, allowed",
    [
        ("eig_method", "qr", "'auto', 'dense', 'lanczos' or 'arpack'"),
        ("ntk_method", "fast", "'auto', 'structured', 'jacobian', 'per_layer' or 'batch'"),
    ],
)
def test_a_bad_method_is_one_line_naming_the_allowed_values(tmp_path, field: str, bad: str, allowed: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "spectrum": {field: bad}}))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    lines = str(err.value).splitlines()
    assert lines[1:] == [f"  spectrum.{field}: Input should be {allowed} (got '{bad}')"], lines


def test_precision_gives_the_torch_dtype() -> None:
    assert ExperimentSpec().spectrum.torch_dtype() is torch.float64
    assert ExperimentSpec(spectrum={"dtype": "float32"}).spectrum.torch_dtype() is torch.float32


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (
            {"name": "digits", "path": "mine.npy"},
            "data.path='mine.npy' applies to image2d, density2d, mnist, cifar10, cifar100, arrays only",
        ),
        ({"name": "image2d", "pool": True}, "data.pool=True applies to mnist only"),
        ({"name": "mnist", "grayscale": False}, "data.grayscale=False applies to cifar10, cifar100 only"),
        ({"name": "image2d", "noise_ratio": 3}, "data.noise_ratio=3 applies to density2d, gaussian_mixture only"),
        ({"name": "digits", "dim": 3}, "data.dim=3 applies to gaussian_mixture only"),
        ({"name": "mnist", "positive_class": 3}, "data.positive_class=3 applies with target: one_vs_rest only"),
    ],
)
def test_a_data_setting_the_data_would_ignore_is_refused(data, said):
    """A trial's data.path on digits trained on the bundled digits without a word."""
    with pytest.raises(ValidationError, match=re.escape(said)):
        ExperimentSpec(name="x", data=data)
    # the same values where they apply, and a stored spec (every field) as it was written
    ok = {
        **data,
        "name": {
            "path": "image2d",
            "pool": "mnist",
            "grayscale": "cifar10",
            "noise_ratio": "density2d",
            "dim": "gaussian_mixture",
            "positive_class": "mnist",
        }[next(k for k in data if k != "name")],
    }
    if ok["name"] == "mnist" and "positive_class" in ok:
        ok["target"] = "one_vs_rest"
    spec = ExperimentSpec(
        name="x", data=ok, **({"loss": "nce"} if ok["name"] in ("density2d", "gaussian_mixture") else {})
    )
    ExperimentSpec.model_validate(spec.model_dump(), context={"stored": True})


def test_arrays_name_a_trackers_data_and_no_spec_loads_them(tmp_path):
    """``data: {name: arrays, path: my.npz}`` passed validation and trained on the bundled digits
    (the loader's last line took every name it did not know), the file never read."""
    from nsa_dist.data import load_dataset

    for path in ("my.npz", None):
        with pytest.raises(ValidationError, match=r"data.name='arrays' is what a Tracker calls the arrays"):
            ExperimentSpec(name="x", data={"name": "arrays", "path": path}, model={"input_dim": 3})
    # a Tracker's own spec (its path the arrays' digest) is valid, and read back; loading it is refused
    tracked = ExperimentSpec(name="x", data={"name": "arrays", "path": "sha1:ab12"}, model={"input_dim": 3})
    with pytest.raises(ValueError, match=r"a Tracker's arrays, handed to it in memory, cannot be loaded from a spec"):
        load_dataset(tracked.data)
