"""lossverify.safetensors: round trips of every dtype, the exact byte layout, and refusal of bad files."""

import json
import os
import struct
import tempfile
import unittest

import torch

from lossverify import safetensors


def _raw_file(path, header, data=b""):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


class SafetensorsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "t.safetensors")

    def tearDown(self):
        self.tmp.cleanup()

    def test_every_dtype_round_trips_bit_for_bit(self):
        g = torch.Generator().manual_seed(0)
        floats = torch.randn(5, 3, generator=g, dtype=torch.float64)
        floats[0, 0] = float("nan")
        floats[0, 1] = float("-inf")
        tensors = {"f64": floats, "f32": floats.float(), "f16": floats.half(), "bf16": floats.bfloat16(),
                   "i64": torch.arange(-3, 4), "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
                   "i16": torch.tensor([-7, 9], dtype=torch.int16), "i8": torch.tensor([-1], dtype=torch.int8),
                   "u8": torch.tensor([0, 255], dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
                   "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": floats.float()[:, ::2]}
        safetensors.save_file(tensors, self.path, metadata={"who": "test"})
        back = safetensors.load_file(self.path)
        self.assertEqual(set(back), set(tensors))
        for name, tensor in tensors.items():
            with self.subTest(name=name):
                self.assertEqual(back[name].dtype, tensor.dtype)
                self.assertEqual(back[name].shape, tensor.shape)
                bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size())
                if tensor.is_floating_point():  # NaN != NaN: compare the bits
                    self.assertTrue(torch.equal(back[name].view(bits), tensor.contiguous().view(bits)))
                else:
                    self.assertTrue(torch.equal(back[name], tensor))
        self.assertEqual(safetensors.read_metadata(self.path), {"who": "test"})

    def test_layout_is_the_format_lossverify_reads(self):
        safetensors.save_file({"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([7], dtype=torch.int64)}, self.path)
        with open(self.path, "rb") as f:
            blob = f.read()
        (length,) = struct.unpack("<Q", blob[:8])
        self.assertEqual(length % 8, 0)
        header = json.loads(blob[8:8 + length])
        self.assertEqual(header["a"], {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]})
        self.assertEqual(header["b"], {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]})
        self.assertEqual(blob[8 + length:], struct.pack("<q", 7) + struct.pack("<2f", 1.0, 2.0))

    def test_reads_the_fixtures_written_by_pytorch(self):
        from support import DUMP_FIXTURES

        tensors = safetensors.load_file(os.path.join(DUMP_FIXTURES, "torch-vocab-parallel-ce-tp2-dp2-bf16",
                                                     "rank1.safetensors"))
        self.assertEqual(tensors["logits"].dtype, torch.bfloat16)
        self.assertEqual(tuple(tensors["logits"].shape), (32, 150))
        self.assertEqual(tensors["loss_mask"].dtype, torch.bool)

    def test_bad_files_are_refused_with_the_file_and_tensor_named(self):
        f32 = struct.pack("<2f", 1.0, 2.0)
        bad = {
            "short": (None, b"\x01\x02"),
            "header past the end": (None, struct.pack("<Q", 4096) + b"{}"),
            "not json": (None, struct.pack("<Q", 8) + b"{nope!!}"),
            "unknown dtype": ({"x": {"dtype": "F8", "shape": [2], "data_offsets": [0, 8]}}, f32),
            "size mismatch": ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, f32),
            "offsets outside": ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, f32),
            "negative shape": ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, f32),
            "overlap": ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32),
            "extra key": ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "z": 1}}, f32),
            "bool not 0 or 1": ({"x": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"),
        }
        for what, (header, data) in bad.items():
            with self.subTest(what):
                if header is None:
                    with open(self.path, "wb") as f:
                        f.write(data)
                else:
                    _raw_file(self.path, header, data)
                with self.assertRaises(safetensors.SafetensorsError) as caught:
                    safetensors.load_file(self.path)
                self.assertIn(self.path, str(caught.exception))
                if header and len(header) == 1:
                    self.assertIn("'x'", str(caught.exception))

    def test_unsupported_tensors_are_refused_on_write(self):
        with self.assertRaises(safetensors.SafetensorsError):
            safetensors.save_file({"c": torch.zeros(2, dtype=torch.complex64)}, self.path)
        with self.assertRaises(safetensors.SafetensorsError):
            safetensors.save_file({"__metadata__": torch.zeros(2)}, self.path)
        self.assertFalse(os.path.exists(self.path))


if __name__ == "__main__":
    unittest.main()
