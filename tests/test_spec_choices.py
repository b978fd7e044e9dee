"""The spec's algorithm choices are the numerics' enums; its precision gives the compute dtype once."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

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
