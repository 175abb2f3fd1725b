"""Minimal safetensors reader and writer for torch tensors, with no dependency beyond torch.

Why not the `safetensors` package: Debian ships none, and lossverify must work in a bare training image.
The format (https://github.com/huggingface/safetensors): an unsigned little-endian 64-bit header length,
a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {str: str}} padded
with spaces to a multiple of 8 bytes, then the raw little-endian data. `save_file` and `load_file` have
the signatures of `safetensors.torch`, so either can replace the other.

Reading validates everything before it trusts it (header length, JSON, dtypes, shapes, offsets inside the
data and not overlapping, sizes equal to shape x item size, booleans 0 or 1): a bad file raises
`SafetensorsError` naming the file and the tensor, never a crash or a tensor reading past the buffer.
"""

import ctypes
import json
import math
import os
import struct
import sys

import torch

__all__ = ["SafetensorsError", "load_file", "save_file", "DTYPE_CODES"]

# The codes lossverify reads (torch 1.13 has no unsigned types wider than 8 bits).
DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit too

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("lossverify.safetensors supports little-endian machines only")


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor that cannot be written; names file and tensor."""


def _item_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _tensor_bytes(tensor):
    """The raw bytes of a contiguous CPU tensor (no numpy needed)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return b""
    return ctypes.string_at(tensor.data_ptr(), nbytes)


def save_file(tensors, filename, metadata=None):
    """Write `tensors` ({name: torch.Tensor}) to `filename`, atomically (a temporary file, then a rename).

    Tensors may live on any device and be non-contiguous; they are copied to the CPU. `metadata` is an
    optional {str: str} stored as `__metadata__`.
    """
    if not isinstance(tensors, dict):
        raise TypeError(f"{filename}: save_file expects a dict of name -> tensor, got {type(tensors).__name__}")
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise SafetensorsError(f"{filename}: invalid tensor name {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise SafetensorsError(f"{filename}: tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dtype not in DTYPE_CODES:
            raise SafetensorsError(f"{filename}: tensor {name!r} has dtype {tensor.dtype}, which is not one of "
                                   f"{', '.join(str(d) for d in DTYPE_CODES)}")
        data = _tensor_bytes(tensor.detach().to("cpu").contiguous())
        header[name] = {"dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError(f"{filename}: metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    temporary = f"{filename}.tmp.{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)
        os.replace(temporary, filename)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def load_file(filename, device="cpu"):
    """Read every tensor of a safetensors file into {name: torch.Tensor} (on `device`), validating first."""
    with open(filename, "rb") as f:
        buffer = bytearray(f.read())
    header, data_start = _parse_header(buffer, filename)
    tensors = {}
    for name, (dtype, shape, begin, end) in header.items():
        count = math.prod(shape)
        if count == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
            if dtype == torch.bool and int(raw.max()) > 1:
                raise SafetensorsError(f"{filename}: tensor {name!r}: BOOL values must be 0 or 1")
            tensor = raw.clone().view(dtype).reshape(shape)
        tensors[name] = tensor.to(device)
    return tensors


def read_metadata(filename):
    """The `__metadata__` of a file ({} when absent)."""
    with open(filename, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{filename}: {len(head)} bytes: too short for the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            raise SafetensorsError(f"{filename}: header length {length} is larger than {_MAX_HEADER}")
        text = f.read(length)
    return _header_json(text, length, filename).get("__metadata__", {})


def _header_json(text, length, filename):
    if len(text) < length:
        raise SafetensorsError(f"{filename}: header length {length} runs past the end of the file")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{filename}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{filename}: header must be a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{filename}: __metadata__ must map strings to strings")
    return header


def _parse_header(buffer, filename):
    """{name: (dtype, shape, begin, end)} with offsets relative to the data, and where the data starts."""
    if len(buffer) < 8:
        raise SafetensorsError(f"{filename}: {len(buffer)} bytes: too short for the 8-byte header length")
    (length,) = struct.unpack_from("<Q", buffer, 0)
    if length > _MAX_HEADER:
        raise SafetensorsError(f"{filename}: header length {length} is larger than {_MAX_HEADER}")
    if 8 + length > len(buffer):
        raise SafetensorsError(f"{filename}: header length {length} runs past the end of the file "
                               f"({len(buffer)} bytes)")
    header = _header_json(bytes(buffer[8:8 + length]), length, filename)
    data_size = len(buffer) - 8 - length
    entries, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{filename}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{where}: expected exactly the keys dtype, shape, data_offsets")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if code not in _DTYPES:
            raise SafetensorsError(f"{where}: dtype {code!r} is not one of {', '.join(_DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SafetensorsError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise SafetensorsError(f"{where}: data_offsets {offsets!r} outside the {data_size} data bytes")
        dtype = _DTYPES[code]
        expected = math.prod(shape) * _item_size(dtype)
        if offsets[1] - offsets[0] != expected:
            raise SafetensorsError(f"{where}: {offsets[1] - offsets[0]} bytes, but shape {shape} of {code} "
                                   f"needs {expected}")
        entries[name] = (dtype, shape, offsets[0], offsets[1])
        if expected:
            spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise SafetensorsError(f"{filename}: tensors {name_a!r} and {name_b!r} overlap")
    return entries, 8 + length
