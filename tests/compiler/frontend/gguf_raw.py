"""GGUF files written byte by byte, for the hostile-input tests: any count, type, nesting, offset or vocabulary,
which gguf.GGUFWriter (rightly) refuses to write.

    raw = RawGGUF.read(path)            # a valid file, as fields and tensors
    raw.set(names.BOS_ID, V.UINT32, 7)  # change it
    path.write_bytes(raw.to_bytes())    # write it back

A field's value is a Python value of its type; an ARRAY's is (item type, [items]), an item of an array of arrays
being (item type, [items]) again. Integers wrap to the type's width, strings may be bytes (invalid UTF-8), and
a Raw value is written as its bytes, whatever its type says.
"""

from __future__ import annotations

import dataclasses
import struct

import gguf
import numpy as np

from llmc.compiler.frontend import gguf_names as names

V = gguf.GGUFValueType
_SCALAR = {
    V.UINT8: "<B",
    V.INT8: "<B",
    V.UINT16: "<H",
    V.INT16: "<H",
    V.UINT32: "<I",
    V.INT32: "<I",
    V.UINT64: "<Q",
    V.INT64: "<Q",
    V.BOOL: "<B",
    V.FLOAT32: "<f",
    V.FLOAT64: "<d",
}


class Raw(bytes):
    """A field value written as these bytes."""


@dataclasses.dataclass
class Tensor:
    name: str | bytes
    dims: list[int]  # GGUF order: the row length first
    type: int  # GGMLQuantizationType
    data: bytes
    offset: int | None = None  # None: where to_bytes lays the data out; else written as is


@dataclasses.dataclass
class RawGGUF:
    fields: list[tuple[str | bytes, int, object]]  # (key, GGUFValueType, value), in file order
    tensors: list[Tensor]
    version: int = 3
    counts: tuple[int, int] | None = None  # (tensor count, key count) as written; None: the true ones

    @classmethod
    def read(cls, path) -> RawGGUF:
        reader = gguf.GGUFReader(path)
        fields = []
        for f in reader.fields.values():
            if f.name.startswith("GGUF."):
                continue
            value = (f.types[-1], f.contents()) if f.types[0] == V.ARRAY else f.contents()
            fields.append((f.name, f.types[0], value))
        tensors = [
            Tensor(t.name, [int(d) for d in t.shape], int(t.tensor_type), bytes(np.asarray(t.data).data))
            for t in reader.tensors
        ]
        return cls(fields, tensors)

    def get(self, key):
        return next((v for k, _, v in self.fields if k == key), None)

    def set(self, key, vtype, value) -> RawGGUF:
        """Replace key's value (in its place) or add it at the end."""
        for i, (k, _, _) in enumerate(self.fields):
            if k == key:
                self.fields[i] = (key, vtype, value)
                return self
        self.fields.append((key, vtype, value))
        return self

    def drop(self, key) -> RawGGUF:
        self.fields = [f for f in self.fields if f[0] != key]
        return self

    def tensor(self, name) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def alignment(self) -> int:
        """general.alignment where it is one to lay data out by (a power of 2 up to 4096), else the default 32."""
        a = self.get("general.alignment")
        return a if isinstance(a, int) and 0 < a <= 4096 and a & (a - 1) == 0 else 32

    def layout(self) -> list[int]:
        """Where to_bytes puts each tensor's data: back to back from the data section's start, each aligned."""
        align, laid, size = self.alignment(), [], 0
        for t in self.tensors:
            laid.append(size)
            size += len(t.data) + -len(t.data) % align
        return laid

    def to_bytes(self) -> bytes:
        align, laid = self.alignment(), self.layout()
        body = [t.data + b"\0" * (-len(t.data) % align) for t in self.tensors]
        n_tensors, n_kv = self.counts or (len(self.tensors), len(self.fields))
        out = [b"GGUF", struct.pack("<IQQ", self.version, n_tensors, n_kv)]
        for key, vtype, value in self.fields:
            out += [_string(key), struct.pack("<I", vtype), pack_value(vtype, value)]
        for t, at in zip(self.tensors, laid, strict=True):
            offset = at if t.offset is None else t.offset
            out += [_string(t.name), struct.pack("<I", len(t.dims))]
            out += [struct.pack("<Q", d % 2**64) for d in t.dims]
            out += [struct.pack("<IQ", t.type % 2**32, offset % 2**64)]
        header = b"".join(out)
        return header + b"\0" * (-len(header) % align) + b"".join(body)


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def pack_value(vtype: int, value) -> bytes:
    if isinstance(value, Raw):
        return value
    if vtype == V.STRING:
        return _string(value)
    if vtype == V.ARRAY:
        itype, items = value
        return struct.pack("<IQ", itype % 2**32, len(items)) + b"".join(pack_value(itype, x) for x in items)
    fmt = _SCALAR[vtype]
    if fmt in ("<f", "<d"):
        return struct.pack(fmt, float(value))
    return struct.pack(fmt, int(value) % 2 ** (8 * struct.calcsize(fmt)))


def tiny_llama(tokens, scores=None, types=None, model: str = "llama") -> RawGGUF:
    """A one-layer llama (hidden 8, 2 heads of 4, tied embeddings, zero F32 weights) whose vocabulary is
    `tokens`: SentencePiece (`model` "llama", with `scores`, no merges) by default."""
    n, hidden, inter, kv_dim = len(tokens), 8, 16, 4
    arch = "llama"
    k = {
        key: key.format(arch=arch)
        for key in (
            names.CONTEXT_LENGTH,
            names.EMBEDDING_LENGTH,
            names.BLOCK_COUNT,
            names.FEED_FORWARD_LENGTH,
            names.HEAD_COUNT,
            names.HEAD_COUNT_KV,
            names.RMS_EPS,
            names.VOCAB_SIZE,
        )
    }
    fields = [
        (names.ARCHITECTURE, V.STRING, arch),
        (k[names.CONTEXT_LENGTH], V.UINT32, 64),
        (k[names.EMBEDDING_LENGTH], V.UINT32, hidden),
        (k[names.BLOCK_COUNT], V.UINT32, 1),
        (k[names.FEED_FORWARD_LENGTH], V.UINT32, inter),
        (k[names.HEAD_COUNT], V.UINT32, 2),
        (k[names.HEAD_COUNT_KV], V.UINT32, 1),
        (k[names.RMS_EPS], V.FLOAT32, 1e-5),
        (k[names.VOCAB_SIZE], V.UINT32, n),
        (names.TOKENIZER_MODEL, V.STRING, model),
        (names.TOKENS, V.ARRAY, (V.STRING, list(tokens))),
        (names.TOKEN_TYPE, V.ARRAY, (V.INT32, list(types or [names.TOKEN_NORMAL] * n))),
    ]
    if scores is not None or model == "llama":
        fields.append(("tokenizer.ggml.scores", V.ARRAY, (V.FLOAT32, list(scores or [0.0] * n))))
    shapes = {"token_embd.weight": [hidden, n], "output_norm.weight": [hidden]}
    shapes.update(
        {
            f"blk.0.{p}.weight": s
            for p, s in (
                ("attn_norm", [hidden]),
                ("ffn_norm", [hidden]),
                ("attn_q", [hidden, hidden]),
                ("attn_k", [hidden, kv_dim]),
                ("attn_v", [hidden, kv_dim]),
                ("attn_output", [hidden, hidden]),
                ("ffn_gate", [hidden, inter]),
                ("ffn_up", [hidden, inter]),
                ("ffn_down", [inter, hidden]),
            )
        }
    )
    tensors = [
        Tensor(name, dims, int(gguf.GGMLQuantizationType.F32), bytes(4 * int(np.prod(dims))))
        for name, dims in shapes.items()
    ]
    return RawGGUF(fields, tensors)
