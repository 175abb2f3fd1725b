"""lossverify.inputs: what export-inputs writes, read back exactly and validated."""

import json
import os
import shutil
import tempfile
import unittest

import torch

from lossverify import inputs, kinds, safetensors
from lossverify.errors import InputsError, UsageError
from lossverify.torch import implementations
from support import case_path


def _rows_by_token(rank_inputs, name):
    """{global token: row of `name`} of a rank (padding rows left out)."""
    t = rank_inputs.tensors
    return {int(token): t[name][i] for i, token in enumerate(t["tokens"]) if token >= 0}


class InputsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.tp2 = inputs.export(case_path("cp-zigzag-packed"), os.path.join(cls.tmp.name, "tp2"))
        cls.tp1 = inputs.export(case_path("cp-zigzag-packed"), os.path.join(cls.tmp.name, "tp1"), tp=1, cp=1)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_index_describes_every_rank(self):
        x = self.tp2
        self.assertEqual((x.layout.tp, x.layout.cp, x.layout.world_size), (2, 2, 4))
        self.assertEqual((x.tokens, x.vocab, x.dtype), (47, 300, "fp32"))
        self.assertEqual(x.cu_seqlens, [0, 13, 20, 42, 47])
        self.assertEqual([r.vocab for r in x.ranks], [(0, 150), (150, 300), (0, 150), (150, 300)])
        self.assertEqual([(r.tp, r.cp) for r in x.ranks], [(0, 0), (1, 0), (0, 1), (1, 1)])
        total_valid = sum(int(r.tensors["loss_mask"].sum()) for r in x.ranks if r.tp == 0)
        self.assertEqual(total_valid, x.valid_tokens)

    def test_padding_rows_are_masked(self):
        t = self.tp2.rank(0).tensors
        padding = t["tokens"] < 0
        self.assertTrue(padding.any())  # zigzag pads every sequence to a multiple of 2 CP
        self.assertFalse(t["loss_mask"][padding].any())
        self.assertTrue((t["labels"][padding] == -100).all())
        self.assertTrue((t["token_ids"][padding] == -1).all())
        self.assertTrue((t["upstream_weights"][padding] == 0).all())

    def test_shards_are_bit_identical_to_the_single_rank_export(self):
        full = _rows_by_token(self.tp1.rank(0), "logits")
        for cp in range(2):
            left = _rows_by_token(self.tp2.ranks[2 * cp], "logits")
            right = _rows_by_token(self.tp2.ranks[2 * cp + 1], "logits")
            for token, row in left.items():
                joined = torch.cat([row, right[token]])
                self.assertTrue(torch.equal(joined.view(torch.int32), full[token].view(torch.int32)), token)
        labels = _rows_by_token(self.tp1.rank(0), "labels")
        for r in self.tp2.ranks:
            for token, label in _rows_by_token(r, "labels").items():
                self.assertEqual(int(label), int(labels[token]))

    def test_a_second_export_is_identical(self):
        again = inputs.export(case_path("cp-zigzag-packed"), os.path.join(self.tmp.name, "again"))
        for a, b in zip(self.tp2.ranks, again.ranks):
            with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
                self.assertEqual(fa.read(), fb.read())

    def test_micro_batches_and_teacher(self):
        with inputs.exported(case_path("kd-tp4-temperature2"), tp=2, ga=2) as kd:
            rank = kd.rank(1)
            self.assertEqual(kd.kind, "kd")
            self.assertEqual(len(rank.micro_batches), 2)
            mb = rank.micro_batch(1)
            begin, end = rank.micro_batches[1]
            self.assertEqual(tuple(mb["teacher_logits"].shape), (end - begin, 500))
            directory = kd.directory
        self.assertFalse(os.path.exists(directory))

    def test_bad_case_is_a_usage_error(self):
        with self.assertRaises(UsageError) as caught:
            inputs.export(case_path("cp-zigzag-packed"), os.path.join(self.tmp.name, "bad"),
                          overrides=["loss.label_smoothing=1.5"])
        self.assertIn("label_smoothing", str(caught.exception))

    def test_malformed_folders_are_refused_naming_file_and_field(self):
        def corrupt(edit_index=None, edit_files=None):
            folder = tempfile.mkdtemp(dir=self.tmp.name)
            shutil.rmtree(folder)
            shutil.copytree(self.tp2.directory, folder)
            path = os.path.join(folder, "inputs.json")
            with open(path) as f:
                data = json.load(f)
            if edit_index:
                edit_index(data)
            with open(path, "w") as f:
                json.dump(data, f)
            if edit_files:
                edit_files(folder)
            return folder

        def wrong_format(d):
            d["format"] = "lossverify.inputs/9"

        def gap(d):
            d["ranks"][1]["micro_batches"] = [[0, 10]]

        def wrong_vocab(d):
            d["ranks"][1]["vocab"] = [140, 300]

        def unknown_kind(d):
            d["case"]["loss"]["kind"] = "no_such_kind"

        def truncated_logits(folder):
            path = os.path.join(folder, "rank3.safetensors")
            tensors = safetensors.load_file(path)
            tensors["logits"] = tensors["logits"][:, :10]
            safetensors.save_file(tensors, path)

        cases = {"$.format": (wrong_format, None, False), "micro_batches": (gap, None, False),
                 "vocab": (wrong_vocab, None, False), "'logits'": (None, truncated_logits, True),
                 "$.case.loss.kind": (unknown_kind, None, True)}
        for expected, (edit_index, edit_files, lazy) in cases.items():
            with self.subTest(expected):
                folder = corrupt(edit_index, edit_files)
                with self.assertRaises(InputsError) as caught:
                    loaded = inputs.load(folder)
                    if lazy:
                        loaded.rank(3).tensors
                self.assertIn(expected, str(caught.exception))
        with self.assertRaises(InputsError):
            inputs.load(self.tmp.name)  # no inputs.json


class KindsTest(unittest.TestCase):
    """The loss kinds' registries: the inputs each kind reads, and its correct per-token loss."""

    def test_built_in_kinds(self):
        self.assertEqual(kinds.kind_inputs("cross_entropy"), kinds.KindInputs(labels=True, teacher_logits=False))
        self.assertEqual(kinds.kind_inputs("kd"), kinds.KindInputs(labels=False, teacher_logits=True))
        self.assertEqual(kinds.kind_inputs("policy"), kinds.KindInputs(
            labels=True, teacher_logits=False, row_inputs=("old_logprob", "ref_logprob", "advantages"),
            logged_statistics=("clip_fraction", "dual_clip_fraction", "kl", "entropy"),
            token_quantities=("logprob", "entropy")))
        self.assertEqual(kinds.kind_inputs("router"), kinds.KindInputs(
            labels=False, teacher_logits=False, logged_statistics=("aux_loss", "z_loss"), whole_rows=True,
            column_axis="experts", row_blocks="layers", block_statistics=("aux_loss", "z_loss"), scope_values="counts"))
        self.assertEqual(kinds.kind_inputs("router").statistics({"layers": 2}),
                         ("aux_loss", "z_loss", "aux_loss.layer0", "z_loss.layer0", "aux_loss.layer1", "z_loss.layer1"))
        self.assertEqual(set(implementations.TOKEN_LOSS), set(kinds.known_kinds()) - {"router"})
        self.assertIs(implementations.correct_of("policy"), implementations.policy_loss)
        self.assertIs(implementations.correct_of("router"), implementations.router_losses)

    def test_unknown_and_duplicate_kinds_are_refused(self):
        with self.assertRaisesRegex(ValueError, "'mse'.*cross_entropy, kd, policy"):
            kinds.kind_inputs("mse")
        with self.assertRaisesRegex(ValueError, "'mse'"):
            implementations.token_loss_of("mse")
        with self.assertRaisesRegex(ValueError, "already"):
            kinds.register_kind("kd", kinds.KindInputs(labels=True, teacher_logits=False))
        with self.assertRaisesRegex(ValueError, "already"):
            implementations.register_token_loss("kd", implementations.correct)

    def test_every_catalogue_name_has_a_kind(self):
        self.assertEqual(set(implementations.KIND), set(implementations.CATALOGUE))
        for name, kind in implementations.KIND.items():
            with self.subTest(name):
                self.assertIn(kind, ["any", *kinds.known_kinds()])
                self.assertEqual(kind == "kd", name.startswith("kd_"))
                self.assertEqual(kind == "policy", name.startswith("rl_"))
                self.assertEqual(kind == "router", name.startswith("moe_"))


if __name__ == "__main__":
    unittest.main()
