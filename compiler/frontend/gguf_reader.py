"""Reading a GGUF file's structure: reads bounded by the file's size, its big arrays (the vocabulary, the
merges) parsed in bulk, and typed reads of its key/value metadata, where a missing or mistyped key is a
CheckpointError.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from llmc.errors import CheckpointError


class GGUFFileReader(gguf.GGUFReader):
    """GGUFReader, with its one read primitive replaced:
    - a read past the end of the file raises instead of returning fewer items, so a truncated file fails at
      the field or tensor that runs off the end (and a corrupt count cannot loop long);
    - it slices the mapped bytes as a plain ndarray: the metadata is read a field at a time (~5 reads per
      token string and merge), and np.memmap's per-slice overhead made a 150k-token vocabulary take a minute;
    and two checks added: arrays nest at most MAX_NESTING deep (GGUFReader recurses, llama.cpp reads no array
    of arrays), and each tensor's data is checked before it is mapped (_check_tensors).
    Each failure is a ValueError, which load_gguf reports as one line.
    """

    _depth = 0

    def _get(self, offset, dtype, count=1, override_order=None):
        if "_bytes" not in self.__dict__:
            self._bytes = self.data.view(np.ndarray)  # the same mapping, without the memmap subclass
        count, dtype = int(count), np.dtype(dtype)
        raw = self._bytes[offset : offset + dtype.itemsize * count]
        if len(raw) < dtype.itemsize * count:
            raise ValueError(
                f"{count} x {dtype.name} at byte {offset} run past the end of the file "
                f"({len(self._bytes)} bytes): truncated"
            )
        arr = raw.view(dtype)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        """The parts of a field, made directly for an array (the vocabulary, its merges and token types: 100k+
        entries each) where GGUFReader parses each entry as a field of its own: a loop of slices for strings,
        one part for all the numbers (ReaderField.contents() flattens its parts)."""
        item = self._get(orig_offs, np.uint32)[0] if raw_type == _ARRAY else None
        if item == _ARRAY:
            if self._depth >= MAX_NESTING:
                raise ValueError(f"an array at byte {orig_offs} is nested over {MAX_NESTING} deep")
            self._depth += 1
            try:
                return super()._get_field_parts(orig_offs, raw_type)
            finally:
                self._depth -= 1
        if item is None or self.byte_order != "I" or (item != _STRING and item not in self.gguf_scalar_to_np):
            return super()._get_field_parts(orig_offs, raw_type)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        count, offs = int(parts[1][0]), orig_offs + 12
        if item != _STRING:
            parts.append(self._get(offs, self.gguf_scalar_to_np[gguf.GGUFValueType(item)], count))
            return 12 + parts[-1].nbytes, parts, [2] if count else [], [_ARRAY, gguf.GGUFValueType(item)]
        data, view, idxs = self._bytes, memoryview(self._bytes), []
        for _ in range(count):
            end = offs + 8 + int.from_bytes(view[offs : offs + 8], "little")
            if end > len(data):
                raise ValueError(f"a string at byte {offs} runs past the end of the file: truncated")
            parts += [data[offs : offs + 8].view(np.uint64), data[offs + 8 : end]]
            idxs.append(len(parts) - 1)
            offs = end
        return offs - orig_offs, parts, idxs, [_ARRAY, _STRING]

    def _build_tensors(self, start_offs, fields):
        self._check_tensors(start_offs, fields)
        super()._build_tensors(start_offs, fields)

    def _check_tensors(self, start_offs: int, fields) -> None:
        """What GGUFReader takes on trust, in Python ints (its uint64 sums wrap: an offset of 2^64 - 1 read the
        byte before the data): at most 4 dimensions, a known type, rows of whole blocks, each tensor's data at a
        multiple of the alignment (as llama.cpp requires), inside the file, and no two tensors' data overlapping."""
        size, align, spans = len(self._bytes) - int(start_offs), int(self.alignment), []
        for field in fields:
            _, name_data, _, dims, raw_type, raw_offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")[:100]
            dims, offset = [int(d) for d in dims], int(raw_offset[0])
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name!r} has unknown type {int(raw_type[0])}") from None
            if len(dims) > 4 or any(d >= 2**63 for d in dims) or (dims and dims[0] % block):
                raise ValueError(
                    f"tensor {name!r} has shape {dims}: not up to 4 dimensions of rows of whole {block}-value blocks"
                )
            nbytes = math.prod(dims) // block * type_size
            if offset % align:
                raise ValueError(f"tensor {name!r} is at offset {offset}, not a multiple of {align}")
            if offset + nbytes > size:
                raise ValueError(
                    f"tensor {name!r} ({nbytes} bytes at offset {offset}) runs past the end of the "
                    f"{size}-byte data section: truncated"
                )
            if nbytes:
                spans.append((offset, offset + nbytes, name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ValueError(f"the data of tensors {a!r} and {b!r} overlap")


_ARRAY, _STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
MAX_NESTING = 8  # arrays of arrays: gguf-py writes lists of lists so; nothing llmc reads nests at all


class GGUFMetadata:
    """Typed reads of the file's key/value metadata; a missing or mistyped key is a CheckpointError."""

    def __init__(self, reader: gguf.GGUFReader, path: Path, arch: str = ""):
        self.reader, self.path, self.arch = reader, path, arch

    def get(self, key: str, kind: type, default=...):
        key = key.format(arch=self.arch)
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is missing", "re-convert the model")
            return default
        try:
            value = field.contents()
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is unreadable ({e})", "re-convert it") from None
        ok = {
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            str: lambda v: isinstance(v, str),
            bool: lambda v: isinstance(v, bool),
            list: lambda v: isinstance(v, list),
        }[kind]
        if not ok(value):
            raise CheckpointError(
                f"{self.path}: GGUF metadata {key!r} is {str(value)[:80]!r}, not a {kind.__name__}",
                "re-convert the model",
            )
        # GGUF stores float32: the shortest decimal that rounds to it is the config.json value it came from
        return float(str(np.float32(value))) if kind is float else value
