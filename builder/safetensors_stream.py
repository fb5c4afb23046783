"""Write a safetensors file one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; converting a checkpoint that
way costs a second full copy of the weights. The format is simple enough to stream:

    [u64 little-endian header length][JSON header, space-padded to 8 bytes][tensor bytes ...]

The header (names, dtypes, shapes, byte offsets) is known before any data is read, so we write it
first and then append each tensor as it is converted. The result is read by the official library.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
          torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class StreamingSafetensorsWriter:
    def __init__(self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self._order = [name for name, _, _ in plan]
        self._expected = {name: (dtype, tuple(shape)) for name, dtype, shape in plan}
        header: dict[str, object] = {"__metadata__": metadata or {}}
        offset = 0
        for name, dtype, shape in plan:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `name`; tensors must come in plan order with the planned dtype and shape."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise RuntimeError(f"tensor {name!r} written out of plan order")
        dtype, shape = self._expected[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, planned {dtype}{list(shape)}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1

    def abort(self) -> None:
        """Close after a failure (the caller discards the file)."""
        self._file.close()

    def close(self) -> None:
        if self._next != len(self._order):
            self._file.close()
            raise RuntimeError(f"only {self._next} of {len(self._order)} planned tensors were written")
        self._file.close()
