"""The header scheme engram's table files share: a fixed little-endian part, a JSON part, a checksum.

Two kinds of file use it: the node-shared host tables and peer shards in a tmpfs
(:mod:`engram.table.host_memory.shm_files`, magic ``ENGRAMHT``) and the row files of the disk tier
(:mod:`engram.table.disk.row_file`, magic ``ENGRAMDK``). Each describes its bytes by a
:class:`HeaderFormat`::

    [ fixed part: struct, magic first, format version second ][ JSON part ][ 32-byte checksum ]

The checksum is BLAKE2b of the fixed and JSON parts. It is not keyed: it finds damage, not forgery,
so a header is parsed as untrusted input wherever it is read: reads are bounded, the JSON part's
length (:attr:`HeaderFormat.max_json_bytes`) and nesting depth (:attr:`HeaderFormat.max_json_depth`,
measured without parsing) are checked before it is parsed, and the caller checks every field's type
after (:func:`is_int`, :func:`check_stamps`). Whatever is wrong is one :class:`HeaderProblem`, a
phrase the caller puts into its error naming the file.

Also here, for both: the content fingerprint, the (path, size, mtime) stamps of the source files a
file was made from and the description of those that changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Callable

__all__ = ["HeaderProblem", "HeaderFormat", "CHECKSUM_BYTES", "header_checksum", "json_depth", "is_int",
           "check_stamps", "content_fingerprint", "Stamp", "source_stamps", "changed_sources", "sources_mismatch",
           "MAX_SOURCES"]

CHECKSUM_BYTES = 32
MAX_SOURCES = 4096
"""Most source files a header may list."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")

Stamp = tuple[str, int, int]   # (real path, size in bytes, mtime in ns)


class HeaderProblem(Exception):
    """What is wrong with a file's header, as a phrase for an error message."""


def header_checksum(data: bytes) -> bytes:
    """32 bytes: BLAKE2b of a header's fixed and JSON parts."""
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES, person=b"engram-header").digest()


def json_depth(meta: bytes) -> int:
    """How deep the brackets of the JSON text ``meta`` nest (outside its strings), found without
    parsing it (a parser recurses once per level)."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub(b'""', meta)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def is_int(value) -> bool:
    """An int that is not a bool (JSON's true/false arrive as bools)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_stamps(sources, what: str) -> tuple[Stamp, ...]:
    """``sources`` of a parsed JSON part as (path, size, mtime) stamps; HeaderProblem (``what``: "its
    header's sources") unless it is a list of at most :data:`MAX_SOURCES` ``[path, size, mtime]``."""
    if not isinstance(sources, list) or len(sources) > MAX_SOURCES:
        raise HeaderProblem(f"{what} are not a list of at most {MAX_SOURCES} files")
    for source in sources:
        if (not isinstance(source, list) or len(source) != 3 or not isinstance(source[0], str)
                or not is_int(source[1]) or not is_int(source[2])):
            raise HeaderProblem(f"{what} are not [path, size, mtime] entries")
    return tuple((p, s, m) for p, s, m in sources)


@dataclass(frozen=True)
class HeaderFormat:
    """One kind of header: its fixed part (``fixed``, a struct whose first two fields are the magic
    and the format version, and whose field ``json_length_field`` is the JSON part's length), its
    limits, and the phrases its problems are told in.

    ``not_ours``: why a file without the magic is refused ("it is not an engram table file (...)");
    ``json_name``: what the JSON part is called in a problem ("key data"); ``version_problem(found)``:
    the phrase for another format version."""

    magic: bytes
    version: int
    fixed: struct.Struct
    json_length_field: int
    max_json_bytes: int
    max_json_depth: int
    not_ours: str
    json_name: str
    version_problem: Callable[[int], str]

    def encode(self, fixed_fields: tuple, meta: dict, room: int, name_field: str = "header") -> bytes:
        """The header's bytes: the fixed part (the magic, then ``fixed_fields``: every other field but
        the JSON part's length, which is taken from ``meta``), the JSON part, the checksum. ValueError
        naming ``name_field`` when it would not fit ``room`` bytes or the JSON limit."""
        text = json.dumps(meta, separators=(",", ":")).encode("utf-8")
        if len(text) > self.max_json_bytes or self.fixed.size + len(text) + CHECKSUM_BYTES > room:
            raise ValueError(f"{name_field}: {len(text)} bytes of {self.json_name} do not fit the "
                             f"{min(self.max_json_bytes, room - self.fixed.size - CHECKSUM_BYTES)}-byte header; "
                             f"use a shorter {name_field.replace('_', ' ')} or path")
        values = [self.magic, *fixed_fields]
        values.insert(self.json_length_field, len(text))
        body = self.fixed.pack(*values) + text
        return body + header_checksum(body)

    def read(self, fd: int, file_bytes: int) -> tuple[tuple, dict]:
        """``(fixed fields, JSON object)`` of the header at offset 0 of the open file ``fd`` of
        ``file_bytes`` bytes, magic, version, limits and checksum checked; HeaderProblem otherwise
        (whatever the bytes)."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise HeaderProblem(f"it is not a regular file ({stat.filemode(info.st_mode)})")
            fixed = os.pread(fd, self.fixed.size, 0)
        except OSError as error:
            raise HeaderProblem(f"its header cannot be read ({error.strerror})") from None
        if len(fixed) < self.fixed.size:
            raise HeaderProblem(f"it holds only {file_bytes} bytes, too few for a header: {self.not_ours}")
        fields = self.fixed.unpack(fixed)
        if fields[0] != self.magic:
            raise HeaderProblem(f"it does not start with the magic {self.magic!r} (found {fields[0]!r}): "
                                f"{self.not_ours}")
        if fields[1] != self.version:
            raise HeaderProblem(self.version_problem(fields[1]))
        meta_bytes = fields[self.json_length_field]
        if meta_bytes > self.max_json_bytes:
            raise HeaderProblem(f"its header claims {meta_bytes} bytes of {self.json_name}, more than the limit "
                                f"{self.max_json_bytes}: the header is damaged")
        try:
            rest = os.pread(fd, meta_bytes + CHECKSUM_BYTES, self.fixed.size)
        except OSError as error:
            raise HeaderProblem(f"its header cannot be read ({error.strerror})") from None
        if len(rest) < meta_bytes + CHECKSUM_BYTES:
            raise HeaderProblem(f"it holds only {file_bytes} bytes, its header is cut short: the file is truncated")
        meta, checksum = rest[:meta_bytes], rest[meta_bytes:]
        if header_checksum(fixed + meta) != checksum:
            raise HeaderProblem("its header checksum does not match the header's fields (damaged or edited)")
        return fields, self.parse_json(meta)

    def parse_json(self, meta: bytes) -> dict:
        """The JSON part as a dict, its depth checked before it is parsed; HeaderProblem otherwise."""
        depth = json_depth(meta)
        if depth > self.max_json_depth:
            raise HeaderProblem(f"its header's {self.json_name} nests {depth} levels deep (at most "
                                f"{self.max_json_depth}): it is not what engram writes (planted or damaged)")
        try:
            parsed = json.loads(meta.decode("utf-8"))
        except (ValueError, RecursionError) as error:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise HeaderProblem(f"its header's {self.json_name} is not JSON ({type(error).__name__}: "
                                f"{str(error)[:200]})") from None
        if not isinstance(parsed, dict):
            raise HeaderProblem(f"its header's {self.json_name} is a JSON {type(parsed).__name__}, not an object")
        return parsed


def content_fingerprint(share_key: str, fingerprint: bytes = b"", person: bytes = b"engram-table") -> bytes:
    """32 bytes naming the content: BLAKE2b (personalized by ``person``) of the share key and the
    caller's fingerprint bytes."""
    digest = hashlib.blake2b(digest_size=32, person=person)
    digest.update(share_key.encode("utf-8"))
    digest.update(b"\0")
    digest.update(bytes(fingerprint))
    return digest.digest()


def source_stamps(sources) -> tuple[Stamp, ...]:
    """(real path, size, mtime ns) of each source file, each file once, in order."""
    stamps, seen = [], set()
    for source in sources:
        path = os.path.realpath(source)
        if path in seen:
            continue
        seen.add(path)
        try:
            info = os.stat(path)
        except OSError as error:
            raise ValueError(f"sources: {str(source)!r} cannot be read ({error.strerror})") from None
        stamps.append((path, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


def changed_sources(stamps: tuple[Stamp, ...]) -> list[str]:
    """Each recorded source that is gone or whose size or mtime changed, described."""
    changed = []
    for path, size, mtime_ns in stamps:
        try:
            info = os.stat(path)
        except OSError:
            changed.append(f"{path} is gone")
            continue
        if (info.st_size, info.st_mtime_ns) != (size, mtime_ns):
            changed.append(f"{path} was {size} B (mtime {mtime_ns} ns), now {info.st_size} B "
                           f"(mtime {info.st_mtime_ns} ns)")
    return changed


def sources_mismatch(recorded: tuple[Stamp, ...], expected_paths, verb: str) -> str | None:
    """Why a file made (``verb``: "filled", "written") from the ``recorded`` sources is not one made
    from ``expected_paths`` as they are now, or None: a source changed or is gone, or other files."""
    changed = changed_sources(recorded)
    if changed:
        return f"the files it was {verb} from changed since: " + "; ".join(changed)
    if [s[0] for s in recorded] != list(expected_paths):
        return f"it was {verb} from {[s[0] for s in recorded]}, this load reads {list(expected_paths)}"
    return None
