"""A hostile ImageFolder: every awkward mode, name and broken file `prepare` must survive.

`make_hostile_dataset(root)` writes small files (8-300 px, about 0.3 MB in
all) into three class folders and returns a `HostileDataset` that says, for
every file, what must become of it: accepted with a label, an upright size
and colours that can be checked after prepare, or rejected with words the
reason must contain. The expectations are written down independently of the
pipeline code (orientation from the EXIF definition, colours from how each
file was painted), so they can catch the pipeline being wrong.

Colours are checked on boxes given as fractions of the *upright* picture,
so a wrong rotation, a wrong alpha background or a clipped 16-bit range all
show up as a wrong mean colour.

The end of the file builds hostile tars byte by byte (`tar_header`, `base256`,
`pax_header`): a header with exactly one thing wrong, for the tar reader's tests.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

RGB = tuple[int, int, int]
Box = tuple[float, float, float, float]

RED: RGB = (255, 0, 0)
GREEN: RGB = (0, 160, 0)
BLUE: RGB = (0, 0, 255)
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
YELLOW: RGB = (255, 220, 0)
GREY: RGB = (128, 128, 128)

LEFT: Box = (0.05, 0.15, 0.35, 0.85)
RIGHT: Box = (0.65, 0.15, 0.95, 0.85)
# The orientation marker: red in the top-left corner, blue in the top-right.
MARK_TOP_LEFT: Box = (0.03, 0.06, 0.22, 0.28)
MARK_TOP_RIGHT: Box = (0.78, 0.06, 0.97, 0.28)
MARK_BOTTOM: Box = (0.1, 0.62, 0.9, 0.94)

# What a viewer does to the stored pixels for each EXIF orientation is fixed by
# the EXIF standard; the file must store the *inverse* of that applied to the
# upright picture. E.g. 6: "row 0 is the visual right side, column 0 the visual
# top", so the stored picture is the upright one turned 90 degrees counter-clockwise.
_STORE_FOR_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}
EXIF_ORIENTATION = 0x0112


@dataclasses.dataclass(frozen=True)
class Region:
    """The expected mean colour of a box (fractions left, top, right, bottom of the upright picture)."""

    box: Box
    rgb: RGB
    tolerance: int = 40


@dataclasses.dataclass(frozen=True)
class HostileFile:
    """One listed file and what prepare must make of it.

    Attributes:
        rel: path relative to the dataset root, with "/" separators.
        label: the class folder it is in.
        accept: True if it must become a sample, False if it must be rejected.
        what: what the file exercises, for failure messages.
        reason: words (lower case) that a reject reason must all contain.
        size: upright (width, height) of the original picture.
        regions: colours that must survive into the prepared sample.
        orientation: the EXIF orientation stored in the file, if any.
    """

    rel: str
    label: str
    accept: bool
    what: str
    reason: tuple[str, ...] = ()
    size: tuple[int, int] | None = None
    regions: tuple[Region, ...] = ()
    orientation: int | None = None


@dataclasses.dataclass
class HostileDataset:
    """The files written by make_hostile_dataset and what must become of them.

    Attributes:
        root: the dataset folder (the SRC of prepare).
        classes: class folder names in ImageFolder order (label index = position).
        files: every file that must be listed.
        ignored: entries that must not be listed and count as ignored (non-image
            names, files beside the class folders, special files, symlink loops).
        hidden: hidden entries, neither listed nor counted.
    """

    root: Path
    classes: list[str]
    files: list[HostileFile]
    ignored: list[str]
    hidden: list[str]

    @property
    def accepted(self) -> list[HostileFile]:
        return [f for f in self.files if f.accept]

    @property
    def rejected(self) -> list[HostileFile]:
        return [f for f in self.files if not f.accept]

    def file(self, rel: str) -> HostileFile:
        for item in self.files:
            if item.rel == rel:
                return item
        raise KeyError(rel)

    def rel_of(self, source: str) -> str:
        """The dataset-relative path of a `source` recorded by prepare (local path or file:// URL)."""
        if source.startswith("file://"):
            source = source[len("file://") :]
        return os.path.relpath(source, self.root).replace(os.sep, "/")


# ---------------------------------------------------------------------------
# Pictures


def halves(size: tuple[int, int], left: RGB, right: RGB, mode: str = "RGB") -> Image.Image:
    """Left half one colour, right half another."""
    img = Image.new("RGB", size, left)
    img.paste(right, (size[0] // 2, 0, size[0], size[1]))
    return img if mode == "RGB" else img.convert(mode)


def halves_regions(left: RGB, right: RGB, tolerance: int = 40) -> tuple[Region, ...]:
    return (Region(LEFT, left, tolerance), Region(RIGHT, right, tolerance))


def marker(size: tuple[int, int] = (160, 96)) -> Image.Image:
    """Green, with a red block in the top-left corner and a blue one in the top-right."""
    width, height = size
    img = Image.new("RGB", size, GREEN)
    img.paste(RED, (0, 0, int(width * 0.3), int(height * 0.38)))
    img.paste(BLUE, (int(width * 0.7), 0, width, int(height * 0.38)))
    return img


MARKER_REGIONS = (
    Region(MARK_TOP_LEFT, RED),
    Region(MARK_TOP_RIGHT, BLUE),
    Region(MARK_BOTTOM, GREEN),
)


def stored_for_orientation(upright: Image.Image, orientation: int) -> Image.Image:
    """The pixels a camera stores for `upright` when it writes EXIF `orientation`."""
    return upright if orientation == 1 else upright.transpose(_STORE_FOR_ORIENTATION[orientation])


def exif_with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return exif.tobytes()


def encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise_jpeg(size: tuple[int, int] = (256, 192), seed: int = 0) -> bytes:
    """A JPEG whose bytes are mostly entropy-coded data, so cutting it lands mid-scan."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", quality=90)


def gradient16(size: tuple[int, int], high: int = 65535) -> Image.Image:
    """16-bit grey, 0 at the left edge rising to `high` at the right edge (mode I;16)."""
    row = np.linspace(0, high, size[0]).round().astype(np.uint16)
    return Image.fromarray(np.tile(row, (size[1], 1)))


def gradient_regions(high_fraction: float = 1.0) -> tuple[Region, ...]:
    """Mean grey of a left, middle and right band of a horizontal 0..high gradient."""
    regions = []
    for left, right in ((0.02, 0.12), (0.45, 0.55), (0.88, 0.98)):
        grey = round(255 * high_fraction * (left + right) / 2)
        regions.append(Region((left, 0.1, right, 0.9), (grey, grey, grey), 14))
    return tuple(regions)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid, all-black 1-bit PNG of width x height: ~50 KB on disk, 400 MP decoded."""
    compressor = zlib.compressobj(6)
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height followed by an empty IDAT: no pixel data at all."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", b"")


def jpeg_claiming(width: int, height: int) -> bytes:
    """A small baseline JPEG whose frame header (SOF0) is patched to claim width x height."""
    data = bytearray(encode(Image.new("RGB", (16, 16), GREY), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def gif_claiming(width: int, height: int) -> bytes:
    """A 10x10 GIF whose logical screen is patched to width x height (PIL's image size)."""
    data = bytearray(encode(Image.new("1", (10, 10)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


FAKE_HEIC = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(range(256)) * 2
EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n%%EndComments\n"
    b"newpath 0 0 moveto 64 64 lineto stroke\nshowpage\n%%EOF\n"
)
HTML = b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>Not Found</body></html>\n"
TEXT = b"These are my notes about the photos, saved with the wrong name.\n"


# ---------------------------------------------------------------------------
# The dataset


class _Writer:
    """Writes files under root and records what must become of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: list[HostileFile] = []
        self.ignored: list[str] = []
        self.hidden: list[str] = []

    def _path(self, rel: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def accept(
        self,
        rel: str,
        data: bytes,
        what: str,
        size: tuple[int, int],
        regions: tuple[Region, ...] = (),
        orientation: int | None = None,
    ) -> None:
        self._path(rel).write_bytes(data)
        self.files.append(HostileFile(rel, rel.split("/", 1)[0], True, what, (), size, regions, orientation))

    def reject(self, rel: str, data: bytes, what: str, *reason: str) -> None:
        self._path(rel).write_bytes(data)
        self.files.append(HostileFile(rel, rel.split("/", 1)[0], False, what, tuple(reason)))

    def ignore(self, rel: str, data: bytes) -> None:
        self._path(rel).write_bytes(data)
        self.ignored.append(rel)

    def hide(self, rel: str, data: bytes) -> None:
        self._path(rel).write_bytes(data)
        self.hidden.append(rel)


def _oriented(w: _Writer) -> None:
    upright = marker()
    plain = encode(upright, "JPEG", quality=92)
    w.accept("cats/upright.jpg", plain, "plain JPEG, no EXIF", upright.size, MARKER_REGIONS)
    for orientation in range(2, 9):
        stored = stored_for_orientation(upright, orientation)
        w.accept(
            f"cats/rot{orientation}.jpg",
            encode(stored, "JPEG", quality=92, exif=exif_with_orientation(orientation)),
            f"JPEG with EXIF orientation {orientation}",
            upright.size,
            MARKER_REGIONS,
            orientation,
        )
    for rel, orientation, fmt, options in (
        ("cats/rot6.png", 6, "PNG", {}),
        ("cats/rot8.webp", 8, "WEBP", {"lossless": True}),
        ("cats/rot3.tif", 3, "TIFF", {}),
        ("cats/rot6_lzw.tif", 6, "TIFF", {"compression": "tiff_lzw"}),
    ):
        stored = stored_for_orientation(upright, orientation)
        data = encode(stored, fmt, exif=exif_with_orientation(orientation), **options)
        w.accept(rel, data, f"{fmt} with EXIF orientation {orientation}", upright.size, MARKER_REGIONS, orientation)


def _names(w: _Writer) -> None:
    def jpeg(left: RGB, right: RGB, size: tuple[int, int] = (120, 80), fmt: str = "JPEG") -> bytes:
        return encode(halves(size, left, right), fmt)

    w.accept("cats/big.jpg", jpeg(RED, BLUE, (300, 225)), "JPEG larger than the target (DCT-scaled decode)",
             (300, 225), halves_regions(RED, BLUE))
    w.accept("cats/a.b.c.jpg", jpeg(YELLOW, BLACK), "several dots in the name", (120, 80),
             halves_regions(YELLOW, BLACK))
    w.accept("cats/a_b_c.jpg", jpeg(BLACK, YELLOW), "same readable key as a.b.c.jpg", (120, 80),
             halves_regions(BLACK, YELLOW))
    w.accept("cats/x.jpg", jpeg(RED, GREEN), "same stem as x.png", (120, 80), halves_regions(RED, GREEN))
    w.accept("cats/x.png", jpeg(BLUE, WHITE, fmt="PNG"), "same stem as x.jpg", (120, 80), halves_regions(BLUE, WHITE))
    w.accept("cats/UPPER.JPG", jpeg(GREEN, RED), "upper-case .JPG", (120, 80), halves_regions(GREEN, RED))
    w.accept("cats/Shout.PNG", jpeg(WHITE, BLUE, fmt="PNG"), "upper-case .PNG", (120, 80), halves_regions(WHITE, BLUE))
    w.accept("cats/été.jpg", jpeg(BLUE, YELLOW), "non-ASCII name (accents)", (120, 80), halves_regions(BLUE, YELLOW))
    w.accept("cats/my photo (1) #%&+.jpeg", jpeg(YELLOW, GREEN), "spaces and punctuation", (120, 80),
             halves_regions(YELLOW, GREEN))
    long_name = "cats/" + "very-long-file-name-" * 9 + "end.jpg"
    w.accept(long_name, jpeg(GREEN, BLUE), "184-character name", (120, 80), halves_regions(GREEN, BLUE))
    w.accept("cats/folder.jpg/inside.png", jpeg(RED, WHITE, fmt="PNG"), "a folder whose name ends in .jpg",
             (120, 80), halves_regions(RED, WHITE))
    w.accept("cats/nested/deeper/deep.jpg", jpeg(WHITE, RED), "two folders deep inside a class", (120, 80),
             halves_regions(WHITE, RED))
    w.accept("vögel/日本.png", jpeg(RED, YELLOW, fmt="PNG"), "non-ASCII name (CJK) in a non-ASCII class",
             (120, 80), halves_regions(RED, YELLOW))
    w.accept("vögel/Bird.JPEG", jpeg(BLUE, RED), "upper-case .JPEG in a non-ASCII class", (120, 80),
             halves_regions(BLUE, RED))


def _modes(w: _Writer) -> None:
    size = (128, 72)
    w.accept("dogs/cmyk.jpg", encode(halves(size, RED, BLUE, "CMYK"), "JPEG", quality=92), "CMYK JPEG", size,
             halves_regions(RED, BLUE))
    w.accept("dogs/gray.jpg", encode(halves(size, (40, 40, 40), (210, 210, 210), "L"), "JPEG"), "greyscale JPEG",
             size, halves_regions((40, 40, 40), (210, 210, 210)))

    palette = Image.new("P", size, 0)
    palette.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    palette.paste(1, (size[0] // 2, 0, size[0], size[1]))
    w.accept("dogs/palette.png", encode(palette, "PNG", transparency=0),
             "palette PNG, index 0 transparent (black underneath)", size, halves_regions(WHITE, BLUE))
    palette_alpha = palette.copy()
    palette_alpha.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    w.accept("dogs/palette_alpha.png", encode(palette_alpha, "PNG", transparency=bytes([0, 255])),
             "palette PNG with per-index alpha (tRNS table)", size, halves_regions(WHITE, RED))

    la = Image.new("LA", size, (0, 0))
    la.paste((90, 255), (size[0] // 2, 0, size[0], size[1]))
    w.accept("dogs/la.png", encode(la, "PNG"), "LA PNG, left half transparent black", size,
             halves_regions(WHITE, (90, 90, 90)))

    rgba = Image.new("RGBA", (150, 72), (0, 0, 0, 0))
    rgba.paste((0, 0, 0, 128), (50, 0, 100, 72))
    rgba.paste((255, 0, 0, 255), (100, 0, 150, 72))
    thirds = (
        Region((0.04, 0.15, 0.29, 0.85), WHITE),
        Region((0.38, 0.15, 0.62, 0.85), (127, 127, 127), 24),
        Region((0.71, 0.15, 0.96, 0.85), RED),
    )
    w.accept("dogs/rgba.png", encode(rgba, "PNG"), "RGBA PNG: transparent, half-transparent, opaque", (150, 72), thirds)
    webp = Image.new("RGBA", size, (0, 0, 0, 0))
    webp.paste((0, 160, 0, 255), (size[0] // 2, 0, size[0], size[1]))
    w.accept("dogs/alpha.webp", encode(webp, "WEBP", lossless=True), "WebP with alpha", size,
             halves_regions(WHITE, GREEN))

    w.accept("dogs/gray16.png", encode(gradient16((200, 64)), "PNG"), "16-bit grey gradient 0..65535",
             (200, 64), gradient_regions())
    w.accept("dogs/gray16_dark.png", encode(gradient16((200, 64), high=4096), "PNG"),
             "16-bit grey gradient 0..4096: must stay dark, not be stretched", (200, 64),
             gradient_regions(4096 / 65535))
    w.accept("dogs/bit1.png", encode(halves(size, BLACK, WHITE, "1"), "PNG"), "1-bit PNG", size,
             halves_regions(BLACK, WHITE))

    first = halves(size, RED, BLUE, "P")
    second = Image.new("RGB", size, GREEN).convert("P")
    gif = encode(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    w.accept("dogs/anim.gif", gif, "animated GIF: the first frame counts", size, halves_regions(RED, BLUE))

    for rel, compression, left, right in (
        ("dogs/plain.tif", None, YELLOW, BLUE),
        ("dogs/lzw.tif", "tiff_lzw", GREEN, YELLOW),
        ("dogs/deflate.tiff", "tiff_adobe_deflate", BLUE, GREEN),
    ):
        options = {"compression": compression} if compression else {}
        w.accept(rel, encode(halves(size, left, right), "TIFF", **options), f"TIFF ({compression or 'raw'})", size,
                 halves_regions(left, right))

    w.accept("dogs/tiny.png", encode(Image.new("RGB", (8, 8), BLUE), "PNG"), "8x8: smaller than the target",
             (8, 8), (Region((0.25, 0.25, 0.75, 0.75), BLUE),))
    w.accept("dogs/line.gif", encode(Image.new("RGB", (300, 4), RED).convert("P"), "GIF"), "300x4 sliver",
             (300, 4), (Region((0.1, 0.0, 0.9, 1.0), RED, 60),))


def _broken(w: _Writer) -> None:
    good = noise_jpeg()
    w.reject("vögel/empty.jpg", b"", "zero-byte file", "empty")
    w.reject("vögel/truncated.jpg", good[: len(good) // 2], "JPEG cut in half", "truncated")
    png = encode(Image.fromarray(np.random.default_rng(1).integers(0, 256, (96, 128, 3), dtype=np.uint8)), "PNG")
    w.reject("vögel/truncated.png", png[: len(png) // 2], "PNG cut in half", "truncated")
    tif = encode(halves((128, 96), RED, BLUE), "TIFF", compression="tiff_lzw")
    w.reject("vögel/cut.tif", tif[: len(tif) // 2], "TIFF cut before its directory", "tiff", "truncated")
    w.reject("vögel/notes.jpg", TEXT, "text with an image name", "not an image")
    w.reject("vögel/page.png", HTML, "HTML error page saved as .png", "not an image", "html")
    w.reject("vögel/bomb.png", png_bomb(), "20000x20000 PNG (decompression bomb)", "pixel", "limit", "20000x20000")
    w.reject("vögel/bomb.jpg", jpeg_claiming(30000, 30000), "JPEG header claiming 30000x30000",
             "pixel", "limit", "30000x30000")
    w.reject("vögel/photo.heic", FAKE_HEIC, "HEIC (no decoder)", "unsupported", "heic")
    w.reject("vögel/drawing.jpg", EPS, "EPS named .jpg (must never reach Ghostscript)", "unsupported")
    w.reject("vögel/nopixels.png", png_header_only(0, 0), "PNG header claiming 0x0", "png")


def _not_listed(w: _Writer) -> None:
    w.ignore("readme.txt", b"A hostile dataset; this file sits beside the class folders.\n")
    w.ignore("dogs/readme.txt", b"not an image\n")
    w.ignore("vögel/labels.csv", b"path,label\n")
    w.hide("cats/.hidden.jpg", encode(marker(), "JPEG"))
    w.hide("cats/._rot6.jpg", b"\x00\x05\x16\x07AppleDouble junk")
    w.hide("dogs/.thumbs/thumb.jpg", encode(marker(), "JPEG"))


def _filesystem_tricks(w: _Writer) -> None:
    """Entries only a real POSIX file system has: links, a FIFO, a name that is not UTF-8."""
    os.symlink("..", w.root / "cats" / "loop")  # cats/loop/cats/loop/... never ends
    w.ignored.append("cats/loop")
    os.symlink("missing.jpg", w.root / "cats" / "dangling.jpg")
    w.files.append(HostileFile("cats/dangling.jpg", "cats", False, "dangling symlink", ("no such file",)))
    os.mkfifo(w.root / "dogs" / "pipe.jpg")  # reading it would block forever
    w.ignored.append("dogs/pipe.jpg")
    raw = os.path.join(os.fsencode(w.root / "vögel"), b"caf\xe9-latin1.jpg")  # Latin-1 é: not UTF-8
    with open(raw, "wb") as handle:
        handle.write(encode(marker(), "JPEG", quality=92))
    rel = "vögel/" + os.fsdecode(os.path.basename(raw))  # Python's surrogate-escaped form of the name
    w.files.append(HostileFile(rel, "vögel", True, "file name that is not UTF-8", (), (160, 96), MARKER_REGIONS))


def make_hostile_dataset(root: Path, *, filesystem_tricks: bool = True) -> HostileDataset:
    """Write the hostile ImageFolder under `root` (created if missing).

    Args:
        root: the folder to fill; it becomes the SRC of prepare.
        filesystem_tricks: also write a symlink loop, a dangling symlink, a
            FIFO and a file name that is not valid UTF-8 (POSIX only; turn off
            to copy the dataset elsewhere, e.g. into an fsspec memory://).

    Returns:
        The HostileDataset describing what must become of every entry.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    writer = _Writer(root)
    _oriented(writer)
    _names(writer)
    _modes(writer)
    _broken(writer)
    _not_listed(writer)
    if filesystem_tricks:
        _filesystem_tricks(writer)
    classes = sorted({f.label for f in writer.files})
    return HostileDataset(root, classes, writer.files, writer.ignored, writer.hidden)


# ---------------------------------------------------------------------------
# Hostile tars and manifests: headers, sizes, PAX records and JSON as an attacker writes them


def tar_header(
    name: str = "a.jpg", size: int = 0, *, kind: bytes = b"0", size_field: bytes | None = None, checksum_off: int = 0
) -> bytes:
    """One ustar header, its checksum right (or off by `checksum_off`): only what is asked for is wrong.

    `size_field` replaces the 12-byte size field as it is (e.g. GNU base-256 bytes).
    """
    header = bytearray(512)
    encoded = name.encode()
    header[: len(encoded)] = encoded
    header[100:108] = b"0000644\0"
    header[108:116] = b"0000000\0"
    header[116:124] = b"0000000\0"
    header[124:136] = size_field if size_field is not None else b"%011o\0" % size
    header[136:148] = b"%011o\0" % 946684800
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % (sum(header) + checksum_off)
    return bytes(header)


def base256(value: int, width: int = 12) -> bytes:
    """A GNU base-256 number field: 0x80 then the value (0xff then two's complement when negative)."""
    if value < 0:
        return b"\xff" + (value + (1 << (8 * (width - 1)))).to_bytes(width - 1, "big")
    return b"\x80" + value.to_bytes(width - 1, "big")


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def tar_file(name: str, data: bytes) -> bytes:
    """A regular member: header, data, padding."""
    return tar_header(name, len(data)) + padded(data)


def pax_header(records: dict[str, str], kind: bytes = b"x") -> bytes:
    """A PAX header member (`x`: for the next member, `g`: global) holding `records`."""
    body = b""
    for keyword, value in records.items():
        record = f" {keyword}={value}\n".encode()
        length = len(record) + 1
        while len(str(length)) + len(record) != length:
            length += 1
        body += str(length).encode() + record
    return tar_header("././@PaxHeader", len(body), kind=kind) + padded(body)


END_OF_ARCHIVE = bytes(1024)
