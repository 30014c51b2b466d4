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


def replace_file(path: str, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so that a reader never sees half a file and a failed write (a full
    disk) leaves the old one whole: a temporary file beside it, then an atomic rename. A symlink is
    followed (its target is replaced); an existing file keeps its permissions, a new one gets the
    umask's. In a folder we may not create files in, a writable file is written in place."""
    import shutil
    import tempfile

    target = os.path.realpath(path)
    folder = os.path.dirname(target) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
    except OSError:
        with open(target, "wb") as fh:
            fh.write(payload)
        return
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        if os.path.exists(target):
            shutil.copymode(target, tmp)
        else:
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
