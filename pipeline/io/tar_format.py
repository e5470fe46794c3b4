"""The tar format both sides of a shard share: the one key rule, the block size, and the header parser.

`split_key` is the key rule: the writer names members with it (`member_name`)
and the reader groups them by it. The rest reads one 512-byte header exactly
as tar does: octal or GNU base-256 numbers, an unsigned or signed checksum,
ustar prefixes, GNU long names and PAX records (per member and global).
A header that is not exactly right raises `TarFormatError`.
"""

from __future__ import annotations

import re
from zlib import adler32

from ..errors import GpufeedError

TAR_BLOCK = 512
ZERO_BLOCK = bytes(TAR_BLOCK)  # two of them end an archive

# ---------------------------------------------------------------------------
# The key rule


def split_key(name: str) -> tuple[str, str]:
    """Split a member name into (sample key, extension), the WebDataset way.

    The key is the member path up to the first dot of its base name, folders
    included; the extension is the rest, lower-cased: `a/b.seg.PNG` is
    (`a/b`, `seg.png`). A name without a dot in its base name is all key,
    with the extension "".
    """
    dot = name.find(".", name.rfind("/") + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :].lower()


def member_name(key: str, extension: str) -> str:
    """The tar member name of one field of a sample: `key.extension`.

    Raises:
        ValueError: when the key is empty, has an empty base name or contains a
            dot, or when `split_key` would not give back (key, extension), e.g.
            for an upper-case extension or one with a slash.
    """
    name = f"{key}.{extension}"
    if "." in key or not key or key.endswith("/") or split_key(name) != (key, extension):
        raise ValueError(
            f"cannot store sample {key!r} field {extension!r}: a key needs a base name and no dots, "
            "an extension no slashes or upper-case letters"
        )
    return name


class TarFormatError(GpufeedError, ValueError):
    """A shard is not a well-formed tar (a corrupt header, a member cut short): the rest of it cannot be trusted.

    Attributes:
        url: the shard, as the caller named it ("" when not given).
        reason: what is wrong, without the shard's name.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.url}: {self.reason}" if self.url else self.reason


# ---------------------------------------------------------------------------
# Headers

REGULAR_KINDS = (b"0", b"\0", b"7")  # regular files: the members yielded
META_KINDS = (b"x", b"g", b"L", b"K")  # PAX headers and GNU long names: read, applied to what follows
# mode, uid, gid (8 bytes each), size, mtime (12 each); devmajor, devminor (8 each): octal text
# ended by NUL or space, or GNU base-256 (first byte 0x80, or 0xff for a negative number).
_NUMBER_FIELD8 = rb"(?:[0-7 \0]{8}|[\x80\xff].{7})"
_NUMBER_FIELDS = re.compile(rb"%s{3}(?:[0-7 \0]{12}|[\x80\xff].{11}){2}.{181}%s{2}" % (_NUMBER_FIELD8, _NUMBER_FIELD8), re.DOTALL)
OCTAL_TEXT = b"01234567 \0"
_HIGH_BYTES = bytes(range(128, 256))
_DECIMAL_TEXT = re.compile(r"[0-9]{1,20}")


def parse_header(header: bytes, url: str) -> int:
    """The size field of a header whose numbers and checksum are exactly right.

    Three parts of the header (148, 248 and 108 bytes around the checksum
    field) each sum to under 65521, so zlib's Adler-32, whose low half is
    1 + the byte sum mod 65521, gives each part's exact sum in C: the
    checksum is their sum plus the field as 8 spaces (256), -3 for the three
    ones. The reader (`pipeline.io.tar`) checks the usual header inline: octal
    text in every number field, ASCII only (so one Adler-32 over the whole header is exact).
    """
    try:
        checksum_ok = _header_checksum_ok(header, _octal_number(header[148:156]))
    except ValueError:
        checksum_ok = False
    if not checksum_ok:
        raise TarFormatError(url, "corrupt tar header (checksum mismatch)")
    try:
        if _NUMBER_FIELDS.fullmatch(header, 100, 345) is None:
            raise ValueError("not a number")
        size = _header_number(header[124:136])
    except ValueError:
        raise TarFormatError(url, "corrupt tar header (a number field is not a number)") from None
    if size < 0:
        raise TarFormatError(url, "corrupt tar header (negative size)")
    return size


def member_path(header: bytes, pax: dict[str, str], global_pax: dict[str, str], long_name: str | None) -> str:
    """A member's name: its PAX path, else its GNU long name, else a global PAX path, else the header's."""
    path = pax.get("path")
    if path is None:
        path = long_name if long_name is not None else global_pax.get("path")
    if path:  # an empty PAX path deletes it: the header's name holds
        return path.rstrip("/")  # as tarfile reads it
    return header_name(header)


def header_name(header: bytes) -> str:
    """The name a ustar header holds: its prefix field, a slash and its name field (or the name alone)."""
    name = _name_text(header[:100])
    if header[345] and header[257:262] == b"ustar":
        name = _name_text(header[345:500]) + "/" + name
    return name


def pax_size(pax: dict[str, str], global_pax: dict[str, str], url: str, size: int) -> int:
    """A member's size: its PAX `size` record (or a global one) where there is one, else its header's."""
    value = pax.get("size", global_pax.get("size"))
    if not value:
        return size
    if not _DECIMAL_TEXT.fullmatch(value):
        raise TarFormatError(url, f"corrupt PAX header (size {value[:40]!r} is not a number)")
    return int(value)


def take_meta(
    kind: bytes, data: bytes, pax: dict[str, str], global_pax: dict[str, str], url: str, long_name: str | None
) -> str | None:
    """A metadata member read: a GNU long name (returned), PAX records for the next member, or global ones."""
    if kind == b"L":
        return _name_text(data)
    if kind == b"x":
        pax.update(_pax_records(data, url))
    elif kind == b"g":
        for keyword, value in _pax_records(data, url).items():
            if value:
                global_pax[keyword] = value
            else:  # POSIX: an empty value deletes the keyword
                global_pax.pop(keyword, None)
    return long_name


def _pax_records(data: bytes, url: str) -> dict[str, str]:
    """The records of a PAX header: `LENGTH KEYWORD=VALUE\\n`, LENGTH counting the whole record.

    Raises:
        TarFormatError: a record that is not one (NUL padding after the last is allowed).
    """
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        if data[position] == 0 and not data[position:].strip(b"\0"):
            break
        space = data.find(b" ", position, position + 21)
        digits = data[position:space] if space > position else b""
        length = int(digits) if digits.isdigit() else 0
        stop = position + length
        keyword, equals, value = data[space + 1 : stop - 1].partition(b"=")
        if not length or stop > len(data) or data[stop - 1] != 0x0A or not equals or not keyword:
            raise TarFormatError(url, "corrupt PAX header (a record is not LENGTH KEYWORD=VALUE)")
        records[keyword.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        position = stop
    return records


def _header_number(field: bytes) -> int:
    """A numeric header field: octal text, or GNU base-256 (0x80: positive, 0xff: negative, two's complement).

    Raises:
        ValueError: when the field is neither.
    """
    if not field[0] & 0x80:
        return _octal_number(field)
    if field[0] not in (0x80, 0xFF):
        raise ValueError("not base-256")
    value = int.from_bytes(field[1:], "big")
    return value - (1 << (8 * (len(field) - 1))) if field[0] == 0xFF else value


def _octal_number(field: bytes) -> int:
    """Octal text up to the first NUL, spaces around it (as tar writes it); empty is 0.

    Raises:
        ValueError: anything else (a sign, an underscore, a non-octal digit).
    """
    text = field.partition(b"\0")[0]
    if text.translate(None, OCTAL_TEXT):  # a sign, an underscore: what int() would take, tar not
        raise ValueError("not octal")
    return int(text, 8) if text.strip(b" ") else 0  # int() refuses a space between digits


def _header_checksum_ok(header: bytes, stored: int) -> bool:
    """The tar checksum, exactly: the header's byte sum with the checksum field as spaces, unsigned or signed.

    POSIX sums the bytes unsigned; some old tars summed them signed, and tar
    accepts either (see `parse_header` for the sum).
    """
    unsigned = (adler32(header[:148]) & 0xFFFF) + (adler32(header[156:404]) & 0xFFFF) + (adler32(header[404:]) & 0xFFFF) + 253
    if stored == unsigned:
        return True
    field = header[148:156]
    high = len(header) - len(header.translate(None, _HIGH_BYTES)) - (len(field) - len(field.translate(None, _HIGH_BYTES)))
    return stored == unsigned - 256 * high


def _name_text(field: bytes) -> str:
    """A NUL-terminated name field, as tarfile reads it (up to the first NUL)."""
    return field.partition(b"\0")[0].decode("utf-8", "replace")
