"""The NSA paper's 2-D regression: a grayscale image as a function y(X) on [0, 1]² (§6 Setup)."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._paths import is_url, read_bytes, regular_file

__all__ = ["image2d", "load_image", "image_function"]

log = logging.getLogger(__name__)


LUMINANCE = np.array([0.2125, 0.7154, 0.0721])  # ITU-R BT.709, as skimage.color.rgb2gray; sums to 1

# PIL modes whose stored values are not gray or RGB intensities (palette indices, ink amounts,
# chroma, …): converted to RGB by PIL, as every viewer shows them.  A plain decoder hands the raw
# channels on: CMYK read as RGB(A) inverts the image, a palette TIFF gives its indices.
_TO_RGB = frozenset({"P", "PA", "CMYK", "YCbCr", "LAB", "HSV"})
_GRAY_ALPHA = frozenset({"LA", "La"})  # gray + alpha: the gray channel (alpha is dropped, as for RGBA)
_ORIENTATION = 0x0112  # the EXIF orientation tag (phone photos store the sensor's rows and this tag)


def _orient(img: np.ndarray, orientation: int) -> np.ndarray:
    """The decoded rows / columns turned as EXIF ``orientation`` (1..8) says they are shown
    (PIL's ``ImageOps.exif_transpose``): the image a viewer displays, not the sensor's."""
    turns = {
        2: lambda a: a[:, ::-1],
        3: lambda a: a[::-1, ::-1],
        4: lambda a: a[::-1],
        5: lambda a: a.swapaxes(0, 1),
        6: lambda a: np.rot90(a, -1),
        7: lambda a: a[::-1, ::-1].swapaxes(0, 1),
        8: lambda a: np.rot90(a, 1),
    }
    return np.ascontiguousarray(turns[orientation](img)) if orientation in turns else img


def _decode(p: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """The image at ``p`` as its pixel array (H, W) or (H, W, C), upright as shown, and the alpha
    channel where a conversion below drops it (gray + alpha, a palette's transparency, a PNG's
    tRNS colour key), else None (an alpha channel the decoder keeps is the array's last channel).

    PIL reads the header (mode, frames, EXIF orientation); the pixels come from scikit-image's
    ``imread`` (full 16-bit TIFF precision) except for modes that must be converted (``_TO_RGB``,
    gray + alpha), which PIL converts.  One frame only: an animation or a multi-page TIFF is refused.
    """
    from PIL import Image

    raw = read_bytes(p) if is_url(p) else None
    src = (lambda: io.BytesIO(raw)) if raw is not None else (lambda: p)
    if str(p).lower().endswith(".npy"):  # a NumPy array of intensities, rows first (never unpickled)
        _npy_size_checked(raw, p)
        try:
            arr = np.load(src(), allow_pickle=False)
        except ValueError as exc:  # an object array (it would need unpickling), a damaged header
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"image2d: {str(p)!r} is not a readable .npy array of intensities ({cause})") from exc
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"image2d: {str(p)!r} holds a {arr.dtype} array, expected real intensities")
        if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4))):
            raise ValueError(
                f"image2d: {str(p)!r} holds an array of shape {arr.shape}; expected (H, W) intensities or "
                "(H, W, 3|4) RGB(A), rows first (a channels-first (C, H, W) array needs moveaxis(0, -1))"
            )
        return arr, None
    try:
        im = Image.open(src())
    except Image.DecompressionBombError as exc:  # imread (PIL again underneath) would say it in PIL's words
        px = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(px.group(1)) / 1e6:,.0f} Mpx" if px else "too large"
        limit = int(Image.MAX_IMAGE_PIXELS or 0) * 2 / 1e6
        raise ValueError(
            f"image2d: {str(p)!r} is {size}, above the {limit:,.0f} Mpx PIL decodes (its guard against "
            "decompression bombs); downscale it first — the task samples data.n pixels of it"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - not a format PIL knows: imread below decides (and names the cause)
        log.debug("image2d: PIL cannot identify %r (%s)", str(p), exc)
        im = None
    arr, orientation, alpha = None, 1, None
    if im is not None:
        with im:
            depth = _png_depth(im) if im.format == "PNG" else 8  # before anything loads the pixels
            frames = int(getattr(im, "n_frames", 1)) if im.format != "MPO" else 1  # MPO: a JPEG + previews
            if frames > 1:
                raise ValueError(
                    f"image2d: {str(p)!r} holds {frames} frames (an animation or a multi-page file); "
                    "expected one image — save the frame you mean as its own PNG"
                )
            exif_error = None
            try:
                orientation = int(im.getexif().get(_ORIENTATION, 1) or 1)
            except Exception as exc:  # noqa: BLE001 - a damaged EXIF block: the pixels are still the image
                exif_error = exc  # said once the pixels decode (a truncated file's own error comes first)
            # transparency the conversions below (or the decoder, for a PNG's tRNS colour key on
            # an L / RGB image) drop: only counted (_say_alpha), so its orientation does not matter
            if im.mode in ("LA", "La", "PA") or (im.mode in ("P", "L", "RGB") and "transparency" in im.info):
                try:
                    alpha = np.asarray(im.convert("LA" if im.mode in _GRAY_ALPHA else "RGBA").getchannel("A"))
                except Exception as exc:  # noqa: BLE001 - the pixels below still decode
                    log.warning("image2d: %r: its alpha channel cannot be read (%s); it is dropped", str(p), exc)
            if im.mode in _TO_RGB or im.mode in _GRAY_ALPHA:
                if im.format == "TIFF":  # PIL turns an oriented TIFF's pixels itself, scrambling these modes
                    import tifffile  # scikit-image's TIFF reader; imread would move a 2-channel axis of 3 or 4 rows

                    arr = _tiff_converted(np.asarray(tifffile.imread(src())), im)
                else:
                    arr = np.asarray(im.convert("L" if im.mode in _GRAY_ALPHA else "RGB"))
            elif depth == 16 and im.mode in ("RGB", "RGBA"):
                log.warning(
                    "image2d: %r is a 16-bit %s PNG; PIL (and so this reader) keeps 8 bits per channel "
                    "(pixels within 1/255 of the file's); save it as 16-bit grayscale or TIFF to keep all 16",
                    str(p),
                    im.mode,
                )
            if exif_error is not None:
                if arr is None:
                    im.load()  # the pixels decode (imread below reads them), else their error, not the EXIF's
                log.warning(
                    "image2d: %r has an unreadable EXIF block (%s); read as stored, not turned", str(p), exif_error
                )
    if arr is None:
        from skimage.io import imread

        with io.BytesIO(raw) if raw is not None else open(p, "rb") as f:
            zipped = f.read(4) == _ZIP_MAGIC
        # imread (imageio) would take an .npz's first array as the pixels
        if im is None and (zipped or str(p).lower().endswith(".npz")):
            raise ValueError(_zip_refused(p))
        arr = imread(src())
    return _orient(np.asarray(arr), orientation), alpha


_ZIP_MAGIC = b"PK\x03\x04"


def _zip_refused(p: str | Path) -> str:
    return (
        f"image2d: {str(p)!r} is a zip archive (a NumPy .npz?), not an image: image2d takes one picture "
        "(PNG, JPEG, TIFF …) or one .npy array of intensities — np.save the array you mean"
    )


def refuse_zip(path: str | Path) -> None:
    """ValueError for a local .npz (a zip archive) given as an image, before a run makes anything (its
    store's folders were made first, then the load refused it)."""
    p = Path(path)
    if p.suffix.lower() == ".npz":
        raise ValueError(_zip_refused(p))
    with open(p, "rb") as f:
        if f.read(4) == _ZIP_MAGIC:
            raise ValueError(_zip_refused(p))


def _npy_size_checked(raw: bytes | None, p: str | Path) -> None:
    """Refuse a .npy whose header promises more (or fewer) bytes than the file holds, before
    allocating what the header claims ("Unable to allocate 74.5 GiB" for a 928-byte file)."""
    fmt = np.lib.format
    with io.BytesIO(raw) if raw is not None else open(p, "rb") as f:
        try:
            version = fmt.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                return  # np.load reads (or names) it
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
        except ValueError as exc:
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"image2d: {str(p)!r} is not a readable .npy array of intensities ({cause})") from exc
        start = f.tell()
        have = f.seek(0, io.SEEK_END) - start
    if dtype.hasobject:
        return  # np.load names it (an object array would need unpickling)
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if have < want:  # more is np.load's business (a second array np.save'd into the same file)
        raise ValueError(
            f"image2d: {str(p)!r} is a damaged .npy: its header says {dtype} {tuple(shape)} ({want:,} bytes), "
            f"the file holds {have:,}"
        )


def _tiff_converted(raw: np.ndarray, im: object) -> np.ndarray:
    """A TIFF's stored pixels ``raw`` (tifffile's reading, as stored) converted as PIL converts
    mode ``im.mode``: gray + alpha → gray, palette indices → RGB, CMYK / YCbCr / … → RGB."""
    from PIL import Image

    mode = im.mode  # type: ignore[attr-defined]
    first = raw[..., 0] if raw.ndim == 3 else raw
    if mode in _GRAY_ALPHA:
        return first
    if mode in ("P", "PA"):
        palette = np.asarray(im.getpalette("RGB"), dtype=np.uint8).reshape(-1, 3)  # type: ignore[attr-defined]
        return palette[first]
    H, W = raw.shape[:2]
    return np.asarray(Image.frombytes(mode, (W, H), np.ascontiguousarray(raw, dtype=np.uint8).tobytes()).convert("RGB"))


def _png_depth(im: object) -> int:
    """A PNG's bit depth per channel from its decoder's raw mode (``RGB;16B`` → 16), else 8."""
    tile = getattr(im, "tile", None) or []
    rawmode = tile[0][3] if tile and len(tile[0]) > 3 else ""
    rawmode = rawmode[0] if isinstance(rawmode, tuple) else rawmode
    return 16 if isinstance(rawmode, str) and ";16" in rawmode else 8


def load_image(path: str | Path | None = None) -> np.ndarray:
    """A grayscale image as float64 (H, W) in [0, 1]: min-max scaled, row 0 the top row as shown.

    Colour becomes BT.709 luminance 0.2125 R + 0.7154 G + 0.0721 B; alpha is dropped (a warning
    counts the pixels that are not fully opaque: their targets are the colours stored under them);
    palette, CMYK and YCbCr images are converted to RGB first; a photo's EXIF orientation is
    applied.  A float array spanning more than float64's range (±1e308) is scaled before min-max.

    Args:
        path: a PNG/JPEG file (or TIFF, BMP, GIF …, or a ``.npy`` array (H, W) or (H, W, 3|4),
            row 0 the top), a local path or an fsspec URL
            (``s3://bucket/mona_lisa.png``); None → scikit-image's bundled ``camera`` photograph (a
            stand-in for the paper's Mona Lisa, which no package ships).

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it, URL included).
        ValueError: ``path`` is a directory, not a regular file, not a readable image, more than
            one frame, or has non-finite pixels.
    """
    if path is None:
        from skimage.data import camera

        img = camera()
    else:
        p = regular_file(path, "image2d", "an image file (PNG, JPEG, TIFF …) or a .npy array")
        try:
            img, alpha = _decode(p)
        except Exception as exc:  # noqa: BLE001 - any decoder failure means "not an image"
            if isinstance(exc, ValueError) and str(exc).startswith("image2d:"):
                raise
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # imageio's runs to 4 lines
            raise ValueError(f"image2d: {str(p)!r} is not a readable PNG/JPEG image ({cause})") from exc
    where = repr(str(path)) if path is not None else "the image"
    img = np.asarray(img)
    if path is not None:
        if alpha is None and img.ndim == 3 and img.shape[-1] in (2, 4):
            alpha = img[..., -1]
        _say_alpha(where, alpha)
    img = np.asarray(img, dtype=np.float64)
    if img.ndim == 3 and img.shape[-1] == 2:  # gray + alpha from a decoder other than PIL
        img = img[..., 0]
    elif img.ndim == 3 and img.shape[-1] in (3, 4):  # RGB(A) → luminance
        img = img[..., :3] @ LUMINANCE
    if img.ndim != 2 or min(img.shape) < 2:
        raise ValueError(
            f"image2d: {where} decodes to shape {img.shape}; expected a 2-D grayscale or RGB(A) image "
            "of at least 2×2 pixels"
        )
    bad = ~np.isfinite(img)
    if bad.any():  # a float TIFF/EXR-like decode: NaN or inf pixels would read as a constant image
        first = np.argwhere(bad)[0].tolist()
        raise ValueError(
            f"image2d: {where} has {int(bad.sum())} non-finite "
            f"pixel(s) (NaN/inf, the first at row {first[0]}, column {first[1]}); give an image "
            "whose pixels are numbers"
        )
    lo, hi = img.min(), img.max()
    if hi > 0 > lo and hi > np.finfo(np.float64).max + lo:  # hi − lo overflows (|values| ~1e308)
        scale = max(abs(lo), abs(hi))  # scaled first: hi − lo, and so (img − lo) / (hi − lo), is finite
        img, lo, hi = img / scale, lo / scale, hi / scale
    return (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)


def _say_alpha(where: str, alpha: np.ndarray | None) -> None:
    """Warn when the dropped alpha channel is not opaque everywhere: the targets are then the
    colours stored under the transparent pixels (often black, or anything), not what a viewer
    shows over its background."""
    if alpha is None or not alpha.size:
        return
    a = np.asarray(alpha)
    if a.dtype in (np.uint8, np.uint16):  # a decoder's: opaque is the type's maximum
        full = np.iinfo(a.dtype).max
    else:  # a .npy's: opaque on the smallest usual scale that holds its values (1, 255, 65535)
        top = float(np.nanmax(a)) if a.dtype.kind != "b" else 1.0
        full = next((c for c in (1.0, 255.0, 65535.0) if top <= c), top)
    seen = int(np.count_nonzero(a < full))
    if seen:
        log.warning(
            "image2d: %s has an alpha channel and %d of %d pixels are not fully opaque (%d fully "
            "transparent); alpha is dropped, so their targets are the colours stored under them, not "
            "what a viewer shows over a background — flatten the image onto the background you mean",
            where,
            seen,
            a.size,
            int(np.count_nonzero(a == 0)),
        )


def image_function(img: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Bilinear lookup y(X) of ``img`` (H, W) at X (N, 2) ∈ [0, 1]²; X[:, 0] is the column (x), X[:, 1] the row (y)."""
    H, W = img.shape
    rows = X[:, 1] * (H - 1)
    cols = X[:, 0] * (W - 1)
    from scipy.ndimage import map_coordinates  # here, not at import: scipy.ndimage costs every process 0.2 s

    return map_coordinates(img, [rows, cols], order=1, mode="nearest")  # (N,)


def image2d(
    n: int = 10_000, *, n_test: int = 0, image: str | Path | None = None, seed: int = 0, normalize: bool = True
) -> Dataset:
    """N points sampled uniformly on [0, 1]² with targets from the image (NSA §6).

    Inputs and targets are normalised to mean 0, std 1 with the TRAINING statistics
    (the test split uses the same constants, stored in ``meta``).

    Args:
        n: number of training points N.
        n_test: number of test points.
        image: image path, or None for the bundled ``camera`` photograph.
        seed: sampling seed.
        normalize: apply the normalisation above (needs n >= 2).

    Raises:
        ValueError: n < 1, n_test < 0, or n = 1 with ``normalize``; the image's errors (:func:`load_image`).
    """
    if n < 1 or n_test < 0:
        raise ValueError(f"image2d: need n >= 1 and n_test >= 0, got n={n}, n_test={n_test}")
    if normalize and n < 2:
        raise ValueError(
            f"image2d: n={n} training point cannot be normalised with the training statistics (its std "
            "is 0, so X and y would be 0/0); use n >= 2 (a spec's data.n), or normalize=False calling image2d()"
        )
    img = load_image(image)
    rng = np.random.default_rng(seed)
    U = rng.random((n + n_test, 2))  # (N+M, 2) in [0,1]²
    Y = image_function(img, U)
    meta = {
        "source": "image2d",
        "image": str(image) if image is not None else "skimage:camera",
        "image_shape": list(img.shape),
        "seed": seed,
    }
    if normalize:
        mx, sx = U[:n].mean(0), U[:n].std(0)
        my, sy = Y[:n].mean(), Y[:n].std() or 1.0
        U, Y = (U - mx) / sx, (Y - my) / sy
        meta.update(x_mean=mx.tolist(), x_std=sx.tolist(), y_mean=float(my), y_std=float(sy))
    return Dataset(U[:n], Y[:n], U[n:], Y[n:], meta)
