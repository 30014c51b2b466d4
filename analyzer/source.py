"""Stage 2: read a file and decode it as Python does (PEP 263 coding cookie, BOM), or say why not."""
from __future__ import annotations

import io
import os
import tokenize
from typing import Optional, Tuple

from synccheck.analyzer.ftypes import FileError


def read_source(path: str) -> Tuple[Optional[str], Optional[FileError]]:
    data, error = read_bytes(path)
    return (None, error) if data is None else decode_source(path, data)


def read_bytes(path: str) -> Tuple[Optional[bytes], Optional[FileError]]:
    try:
        with open(path, "rb") as fh:
            return fh.read(), None
    except OSError as exc:
        if os.path.islink(path) and not os.path.exists(path):
            return None, FileError(path, f"broken symbolic link (to {os.readlink(path)})")
        return None, FileError(path, f"cannot read: {exc.strerror or exc}")


def decode_source(path: str, data: bytes) -> Tuple[Optional[str], Optional[FileError]]:
    if b"\0" in data[:8192]:
        return None, FileError(path, "binary file, not Python source")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        return None, FileError(path, f"cannot decode: {exc.msg}")
    try:
        return data.decode(encoding), None
    except (UnicodeDecodeError, LookupError) as exc:
        where = f" (byte 0x{data[exc.start]:02x} at offset {exc.start})" if isinstance(exc, UnicodeDecodeError) else ""
        return None, FileError(path, f"cannot decode as {encoding}{where}; declare the file's encoding "
                                     f"with a `# -*- coding: ... -*-` line")
