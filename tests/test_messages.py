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
