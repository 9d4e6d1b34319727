"""What a slot file name (POST /slots/{id}?action=save|restore) may be, beyond `safe_session_path`'s rules:
short enough that its temporary name fits the file system's 255-byte limit too, and never a name Windows
reserves for a device, so a folder of slot files is usable on every platform."""

from __future__ import annotations

import os

from engine.atomic import temp_path
from engine.cache.session_file import MAX_NAME_BYTES
from engine.errors import ApiError

# The temporary name is ".NAME.tmp-PID-XXXXXXXX"; a PID has at most 10 digits (a 32-bit number).
_TEMP_OVERHEAD = len(".") + len(".tmp-") + 10 + len("-") + 8
MAX_SLOT_NAME_BYTES = MAX_NAME_BYTES - _TEMP_OVERHEAD
assert len(os.path.basename(temp_path(os.path.join("d", "n" * MAX_SLOT_NAME_BYTES)))) <= MAX_NAME_BYTES

# Device names on Windows, with any extension ("con.txt", "COM1.bin"); COM/LPT also take ¹²³.
_RESERVED = {"con", "prn", "aux", "nul"} | {f"{d}{n}" for d in ("com", "lpt") for n in "0123456789¹²³"}


def check_slot_file_name(filename: object) -> None:
    """Raise a 400 naming what is wrong with `filename` (the folder's path never appears in the message)."""
    if not isinstance(filename, str):
        return  # the engine's own check says a string is expected
    if any("\ud800" <= c <= "\udfff" for c in filename):  # half of a \u escaped pair: no file system takes it
        raise ApiError(400, f"filename: expected whole characters, got {filename[:40]!r}, which holds half of a "
                       "UTF-16 surrogate pair", param="filename")
    size = len(filename.encode("utf-8", "surrogatepass"))
    if size > MAX_SLOT_NAME_BYTES:
        raise ApiError(400, f"filename: expected at most {MAX_SLOT_NAME_BYTES} bytes (the file is written under a "
                       f"temporary name {_TEMP_OVERHEAD} bytes longer, and names end at {MAX_NAME_BYTES}), "
                       f"got {size}", param="filename")
    stem = filename.split(".", 1)[0].rstrip(" ").lower()
    if stem in _RESERVED:
        raise ApiError(400, f"filename: {filename[:40]!r} is a device name on Windows (CON, PRN, AUX, NUL, COM0-9, "
                       "LPT0-9, with any extension); choose another name", param="filename")
    if filename.endswith((".", " ")):
        raise ApiError(400, f"filename: expected a name that does not end with a dot or a space, got {filename!r}",
                       param="filename")
