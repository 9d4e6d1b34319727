"""The text encoding of a JSON request body: UTF-8, UTF-16 or UTF-32, the encodings JSON may be written in
(RFC 8259 asks for UTF-8 between systems; RFC 4627 and 7159 allowed the other two, and some clients send them).

Every route parses its body as UTF-8 bytes (pydantic's JSON parser, `json.loads`), so `BodyGuard` hands them
UTF-8: a body in another encoding is decoded here and encoded again, and a UTF-8 byte order mark is dropped.
The encoding is the Content-Type's charset, else the byte order mark, else what the first bytes show (JSON text
starts with an ASCII character, so the zero bytes around it tell UTF-16 and UTF-32 apart: RFC 4627, section 3),
else UTF-8. A charset JSON cannot be written in is a 415 naming it, before the body is read; bytes that are not
valid in the encoding, or a byte order mark that contradicts the declared charset, a 400.
"""

from __future__ import annotations

import codecs

from engine.errors import ApiError

# Declared charset (lower case) -> encoding; a bare UTF-16 / UTF-32 leaves the byte order to the mark or the bytes.
CHARSETS = {
    "utf-8": "UTF-8", "utf8": "UTF-8",
    "utf-16": "UTF-16", "utf-16le": "UTF-16LE", "utf-16be": "UTF-16BE",
    "utf-32": "UTF-32", "utf-32le": "UTF-32LE", "utf-32be": "UTF-32BE",
}
# UTF-32LE's mark first: it begins with UTF-16LE's.
MARKS = (
    (codecs.BOM_UTF32_LE, "UTF-32LE"), (codecs.BOM_UTF32_BE, "UTF-32BE"), (codecs.BOM_UTF8, "UTF-8"),
    (codecs.BOM_UTF16_LE, "UTF-16LE"), (codecs.BOM_UTF16_BE, "UTF-16BE"),
)
_CODECS = {"UTF-16LE": "utf-16-le", "UTF-16BE": "utf-16-be", "UTF-32LE": "utf-32-le", "UTF-32BE": "utf-32-be"}


def declared_charset(content_type: str | None) -> tuple[str, str] | None:
    """(encoding, the charset as written) of a Content-Type's charset, None when it has none; a 415 for a charset
    JSON cannot use."""
    if content_type is None:
        return None
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() != "charset":
            continue
        given = value.strip().strip('"').strip()
        encoding = CHARSETS.get(given.lower())
        if encoding is None:
            raise ApiError(415, f"Content-Type declares charset={given[:40]!r}, which JSON cannot be written in: "
                           "send the body as UTF-8 (or UTF-16 or UTF-32) and say so, e.g. "
                           "'Content-Type: application/json; charset=utf-8'", param="Content-Type")
        return encoding, given
    return None


def to_utf8(body: bytes, charset: tuple[str, str] | None) -> bytes:
    """`body` as UTF-8 bytes (the same object when it already is, less any byte order mark); `charset` is
    `declared_charset`'s answer. Raises a 400."""
    mark = next(((bom, name) for bom, name in MARKS if body.startswith(bom)), None)
    declared, given = charset if charset is not None else (None, "")
    encoding = declared
    if mark is not None:
        bom, name = mark
        if declared is not None and not name.startswith(declared):
            raise ApiError(400, f"the request body starts with a {name} byte order mark but Content-Type declares "
                           f"charset={given}: send the body in the declared charset, or drop the mark "
                           "or the charset")
        encoding, body = name, body[len(bom):]
    elif encoding in (None, "UTF-16", "UTF-32"):
        encoding = _sniff(body, encoding)
    if encoding == "UTF-8":
        return body  # invalid UTF-8 is the parser's to report, with where it is
    try:
        return body.decode(_CODECS[encoding]).encode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start + (len(mark[0]) if mark else 0)
        raise ApiError(400, f"the request body is not valid {encoding}: {exc.reason} at byte {at}; expected JSON "
                       f"text in {encoding}, as its Content-Type or byte order mark says") from None


def _sniff(body: bytes, unmarked: str | None) -> str:
    """The encoding the zero bytes around the body's first (ASCII) character show; UTF-8 when none, and big-endian
    for an unmarked UTF-16 or UTF-32 that does not show (RFC 2781's rule)."""
    head = body[:4]
    if len(head) == 4 and head[:3] == b"\x00\x00\x00" and unmarked != "UTF-16":
        return "UTF-32BE"
    if len(head) == 4 and head[1:] == b"\x00\x00\x00" and unmarked != "UTF-16":
        return "UTF-32LE"
    if len(head) >= 2 and head[0] == 0 and head[1] != 0 and unmarked != "UTF-32":
        return "UTF-16BE"
    if len(head) >= 2 and head[0] != 0 and head[1] == 0 and unmarked != "UTF-32":
        return "UTF-16LE"
    return f"{unmarked}BE" if unmarked else "UTF-8"
