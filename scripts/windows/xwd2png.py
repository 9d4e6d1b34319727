"""Turns an X window dump (`xwd -root`, on stdin) of a TrueColor screen (24 or 32 bits a pixel) into a PNG file; standard library
only, so that scripts/windows-check.sh needs no image package for the desktop screenshot.

    xwd -root -silent | python3 xwd2png.py OUT.png
"""

from __future__ import annotations

import struct
import sys
import zlib


def xwd_to_rgb(data: bytes) -> tuple[int, int, bytes]:
    fields = struct.unpack(">25I", data[:100])
    header_size, _version, pixmap_format, _depth, width, height = fields[:6]
    byte_order, bits_per_pixel, bytes_per_line = fields[7], fields[11], fields[12]
    red_mask, green_mask, blue_mask, ncolors = fields[14], fields[15], fields[16], fields[19]
    if pixmap_format != 2 or bits_per_pixel not in (24, 32):
        raise SystemExit(f"xwd2png: only 24/32-bit ZPixmap dumps (got format {pixmap_format}, {bits_per_pixel} bpp)")
    step = bits_per_pixel // 8
    pixels = data[header_size + 12 * ncolors:]
    shifts = [(m & -m).bit_length() - 1 for m in (red_mask, green_mask, blue_mask)]
    order = "<" if byte_order == 0 else ">"
    rows = []
    for y in range(height):
        row = pixels[y * bytes_per_line:y * bytes_per_line + step * width]
        if step == 4:
            values = struct.unpack(f"{order}{width}I", row)
        else:  # three bytes a pixel
            values = [int.from_bytes(row[i:i + 3], "little" if byte_order == 0 else "big") for i in range(0, 3 * width, 3)]
        out = bytearray(3 * width)
        for x, v in enumerate(values):
            out[3 * x] = (v >> shifts[0]) & 0xFF
            out[3 * x + 1] = (v >> shifts[1]) & 0xFF
            out[3 * x + 2] = (v >> shifts[2]) & 0xFF
        rows.append(b"\0" + bytes(out))
    return width, height, b"".join(rows)


def png(width: int, height: int, raw: bytes) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


if __name__ == "__main__":
    w, h, rgb = xwd_to_rgb(sys.stdin.buffer.read())
    with open(sys.argv[1], "wb") as f:
        f.write(png(w, h, rgb))
