"""One image decoder for every reader (folders, shards, caption pairs): encoded bytes or a file path -> uint8
(3, H, W) RGB.

torchvision decodes png / jpeg / gif / webp (fast, libjpeg-turbo / libpng); anything it cannot read (bmp, ppm,
tiff, ... which ImageFolder lists) falls back to PIL. Whatever the source, the result is 8-bit RGB scaled by the
image's true range: 16-bit images (png or PIL's I;16 / I modes) are scaled to 0..255 as torchvision's
`to_dtype(..., scale=True)` does (the high byte), never clipped and never left as uint16 for a later /255. Grey,
grey + alpha, palette, RGBA and CMYK become RGB (alpha dropped, as PIL's convert("RGB") does, unless a `background`
grey level is given: then images with alpha are composited onto it, as drawings with transparent backgrounds need);
animated images give their first frame. EXIF orientation is not applied (the pixels as stored). Undecodable data raises
`BadSampleError` with the reason (and the file, when given a path).

Decoding is bounded: an image whose header states more than `max_pixels` pixels (data.max_pixels; by default PIL's
own bound, 89,478,485: 0.25 GiB as 8-bit RGB) is refused as a bad sample before its pixels are decoded, so a small
file that unpacks to gigabytes (a decompression bomb) costs nothing. PIL reads only the raster formats in
`PIL_FORMATS`: never EPS / PostScript (PIL hands those to Ghostscript, a program of its own) or the scientific
containers, whatever a file's name says.
"""

from __future__ import annotations

import functools
import io
import re
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from ssl_vit.data.errors import BadSampleError

DEFAULT_MAX_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS: 2^30 bytes of 24-bit pixels
# the raster formats PIL may read (those of a Pillow release that lacks one are left out when opening)
PIL_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "DIB", "PPM", "TIFF", "TGA", "ICO", "CUR", "JPEG2000", "PCX",
               "SGI", "QOI", "DDS", "AVIF", "PSD")
_BOMB_PIXELS = re.compile(r"Image size \((\d+) pixels\)")  # PIL's DecompressionBombError message
_IN_MEMORY = re.compile(r" <_io\.BytesIO object at 0x[0-9a-f]+>")  # PIL names the buffer it was given
_TORCHVISION_PREFIX = re.compile(r"^\w+, \S+\.cpp:\d+, ")  # "decode_jpeg, /path/decode_jpeg.cpp:171, <reason>"


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _IN_MEMORY.sub("", _TORCHVISION_PREFIX.sub("", text))


@functools.cache
def pil_formats() -> tuple[str, ...]:
    """PIL_FORMATS that this Pillow knows (Image.open refuses a format name it lacks)."""
    Image.init()
    return tuple(name for name in PIL_FORMATS if name in Image.OPEN)


def open_image(data: bytes) -> Image.Image:
    """PIL's lazy open (the header only) of encoded bytes, in the formats PIL may read here."""
    return Image.open(io.BytesIO(data), formats=pil_formats())


def check_size(data: bytes, max_pixels: int | None, where: str = "") -> None:
    """BadSampleError when the image's header states more than `max_pixels` pixels (every frame's, for an
    animation; None: no bound). A header PIL cannot read is left to the decoders, which report it."""
    if max_pixels is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the bound is ours
            with open_image(data) as image:
                width, height = image.size
                frames = getattr(image, "n_frames", 1)  # torchvision decodes every frame of an animation
        pixels = width * height * frames
        size = f"{frames} frames of " * (frames > 1) + f"{width} x {height} = {pixels:,}"
    except Image.DecompressionBombError as err:  # PIL's own bound (twice MAX_IMAGE_PIXELS) met while opening
        found = _BOMB_PIXELS.search(str(err))
        if found is None:
            raise BadSampleError(f"{where}{err}") from None
        pixels = int(found.group(1))
        size = f"{pixels:,}"
    except Exception:  # not a format PIL reads here (or damaged): decoding says why
        return
    if pixels > max_pixels:
        raise BadSampleError(f"{where}image is {size} pixels, over data.max_pixels={max_pixels:,} (decoded it "
                             f"would take {3 * pixels / 2**30:.1f} GiB; skipped before decoding)")


def to_uint8_rgb(image: torch.Tensor) -> torch.Tensor:
    """(C, H, W) or (frames, C, H, W) of any integer / float dtype -> uint8 (3, H, W): first frame, true-range
    scaling (uint16 by its 16 bits, floats from [0, 1]), grey repeated to 3 channels, alpha dropped."""
    if image.ndim == 4:
        image = image[0]
    if image.ndim == 2:
        image = image[None]
    if image.dtype != torch.uint8:
        image = F.to_dtype(image, torch.uint8, scale=True)
    channels = image.shape[0]
    if channels in (1, 2):
        image = image[:1].expand(3, -1, -1)
    elif channels == 4:
        image = image[:3]
    elif channels != 3:
        raise BadSampleError(f"image has {channels} channels; expected 1 (grey), 2, 3 (RGB) or 4")
    return image.contiguous()


def _pil_to_uint8_rgb(image: Image.Image) -> torch.Tensor:
    if image.mode.startswith("I;16"):  # 16-bit grey, either byte order
        return to_uint8_rgb(torch.from_numpy(np.asarray(image).astype(np.uint16)))
    if image.mode == "I":  # 32-bit signed ints: 16-bit data (old PIL png / tiff) unless it goes beyond
        array = np.asarray(image).astype(np.int64)
        bits = 16 if array.max(initial=0) <= 0xFFFF else 32
        scaled = (np.clip(array, 0, 2**bits - 1) >> (bits - 8)).astype(np.uint8)
        return to_uint8_rgb(torch.from_numpy(scaled))
    if image.mode == "F":  # float: [0, 1] if it stays there, else 0..255
        array = np.nan_to_num(np.asarray(image, dtype=np.float32))
        scale = 255.0 if array.max(initial=0.0) <= 1.0 else 1.0
        return to_uint8_rgb(torch.from_numpy(np.clip(np.rint(array * scale), 0, 255).astype(np.uint8)))
    array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def composite(image: torch.Tensor, background: int) -> torch.Tensor:
    """uint8 (2 or 4, H, W) grey/RGB + alpha -> uint8 (3, H, W) over a uniform `background` grey level."""
    colour, alpha = image[:-1].float(), image[-1:].float() / 255
    mixed = colour * alpha + background * (1 - alpha)
    return mixed.round_().clamp_(0, 255).to(torch.uint8).expand(3, -1, -1).contiguous()


def _pil_with_alpha(data: torch.Tensor) -> torch.Tensor | None:
    """uint8 (4, H, W) RGBA of an image with an alpha channel or a transparent palette / colour key (PIL converts
    every such mode, 16-bit included); None for an opaque or unreadable one (decoded the usual way)."""
    try:
        with open_image(data.numpy().tobytes()) as image:
            if "A" not in image.getbands() and "transparency" not in image.info:
                return None
            image.load()
            return torch.from_numpy(np.asarray(image.convert("RGBA")).copy()).permute(2, 0, 1)
    except Exception:  # unreadable: the usual path reports why
        return None


def decode_rgb(source: bytes | bytearray | memoryview | torch.Tensor | str | Path,
               background: int | None = None, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """Encoded image bytes (or a uint8 tensor of them, or a file path) -> uint8 (3, H, W); with `background` (0-255),
    an image with an alpha channel is composited onto that grey level instead of having its alpha dropped.

    Raises BadSampleError naming the reason (and the path) when the data is empty, unreadable or undecodable, or
    states more than `max_pixels` pixels (None: no bound but PIL's own, twice its MAX_IMAGE_PIXELS)."""
    where = ""
    if isinstance(source, (str, Path)):
        where = f"{source}: "
        try:
            with open(source, "rb") as f:
                source = f.read()
        except OSError as err:
            raise BadSampleError(f"{where}cannot read the file ({err.strerror or err})") from err
    if len(source) == 0:
        raise BadSampleError(f"{where}empty file (0 bytes)")
    check_size(source.numpy().tobytes() if isinstance(source, torch.Tensor) else bytes(source), max_pixels, where)
    data = source.flatten() if isinstance(source, torch.Tensor) else torch.frombuffer(bytearray(source),
                                                                                    dtype=torch.uint8)
    if background is not None:
        with_alpha = _pil_with_alpha(data)
        if with_alpha is not None:
            return composite(with_alpha, background)
    try:
        return to_uint8_rgb(decode_image(data, mode=ImageReadMode.RGB))
    except RuntimeError as err:
        torchvision_reason = _reason(err)
    try:
        with open_image(data.numpy().tobytes()) as image:
            image.load()
            return _pil_to_uint8_rgb(image)
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        pil_reason = _reason(err)
    if "Unsupported image file" in torchvision_reason:
        raise BadSampleError(f"{where}cannot decode the image ({pil_reason})")
    raise BadSampleError(f"{where}cannot decode the image ({torchvision_reason}; PIL: {pil_reason})")
