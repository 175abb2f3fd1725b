"""Writes malformed dumps for the check-dump robustness tests: OUT_DIR/<case>/manifest.json (+ tensor files).

usage: make_bad_dumps.py CASES_TXT OUT_DIR

Every case starts from one small valid dump (cross-entropy, N=8 tokens, V=10, fp32, tp=2) and breaks one
thing: a truncated file, a header length past the end, overlapping or out-of-range offsets, a dtype or shape
that does not match the manifest, a missing rank, NaN in a count, ... CASES_TXT lists the cases with the
message check-dump must print (exit code 2); every case named there must be made here and back. Pure Python
(struct + json): no NumPy or PyTorch needed. The base dump itself is written as OUT_DIR/valid (must pass).
"""
import copy
import json
import math
import os
import struct
import sys

N, V = 8, 10
FORMATS = {"F64": "d", "F32": "f", "I64": "q", "I32": "i", "U8": "B", "BOOL": "B", "F16": "e"}


def tensor(dtype, shape, values):
    return {"dtype": dtype, "shape": list(shape), "values": list(values)}


def encode(t):
    return struct.pack("<%d%s" % (len(t["values"]), FORMATS[t["dtype"]]), *t["values"])


def safetensors_bytes(tensors, header_patch=None, raw_header=None):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = encode(t)
        header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if header_patch:
        header_patch(header)
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def npy_bytes(descr, shape, values, fortran=False, fmt=None, version=1):
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': (%s), }" % (
        descr, "True" if fortran else "False", "".join("%d, " % d for d in shape))
    prefix = 10 if version == 1 else 12
    header += " " * (-(prefix + len(header) + 1) % 64) + "\n"
    length = struct.pack("<H", len(header)) if version == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + length + header.encode() + \
        struct.pack("<%d%s" % (len(values), fmt or "q"), *values)


def base():
    """A valid dump: two TP ranks, vocabulary [0, 5) and [5, 10), all 8 tokens on both."""
    logits = [[math.sin(1.3 * t + 0.7 * v) * 2.0 for v in range(V)] for t in range(N)]
    labels = [(3 * t + 1) % V for t in range(N)]
    labels[5] = -100
    valid = [t for t in range(N) if labels[t] != -100]
    files, ranks = {}, []
    token_loss, grads = [0.0] * N, [[0.0] * V for _ in range(N)]
    for t in valid:
        m = max(logits[t])
        s = sum(math.exp(x - m) for x in logits[t])
        token_loss[t] = m + math.log(s) - logits[t][labels[t]]
        for v in range(V):
            grads[t][v] = (math.exp(logits[t][v] - m) / s - (1.0 if v == labels[t] else 0.0)) / len(valid)
    loss = sum(token_loss) / len(valid)
    for r, (b, e) in enumerate([(0, 5), (5, 10)]):
        files[f"rank{r}.safetensors"] = {
            "logits": tensor("F32", (N, e - b), [x for row in logits for x in row[b:e]]),
            "grad_logits": tensor("F32", (N, e - b), [x for row in grads for x in row[b:e]]),
            "labels": tensor("I64", (N,), labels),
            "token_loss": tensor("F32", (N,), token_loss),
            "loss": tensor("F32", (), [loss]),
            "num_tokens": tensor("I64", (), [len(valid)]),
        }
        ranks.append({"rank": r, "vocab": [b, e], "file": f"rank{r}.safetensors", "rows": [[0, N]],
                      "tensors": {"logits": "logits", "grad_logits": "grad_logits", "labels": "labels",
                                  "token_loss": "token_loss"},
                      "stats": {"loss": "loss", "num_tokens": "num_tokens"}})
    manifest = {"format": "lossverify.dump/1", "shape": {"tokens": N, "vocab": V}, "dtype": "fp32",
                "loss": {"kind": "cross_entropy", "reduction": "mean"}, "layout": {"tp": 2},
                "ranks": ranks}
    return manifest, files


H = 4


def head_base():
    """A valid dump of an LM head (H = 4, a bias) in front of cross-entropy: two TP ranks, each with its vocabulary
    shard of W and b, every token's h, and dh (whole: the head's contract), dW and db of its shard, computed in
    float64 from the definitions (stored in float32, within the head's error model)."""
    m, f = base()
    labels = f["rank0.safetensors"]["labels"]["values"]
    h = [[math.cos(0.9 * t + 1.7 * k) for k in range(H)] for t in range(N)]
    w = [[0.6 * math.sin(0.4 * v + 1.1 * k + 0.3) for k in range(H)] for v in range(V)]
    b = [0.2 * math.cos(1.9 * v) for v in range(V)]
    valid = [t for t in range(N) if labels[t] != -100]
    g = [[0.0] * V for _ in range(N)]
    token_loss = [0.0] * N
    for t in valid:
        u = [sum(h[t][k] * w[v][k] for k in range(H)) + b[v] for v in range(V)]
        top = max(u)
        s = sum(math.exp(x - top) for x in u)
        token_loss[t] = top + math.log(s) - u[labels[t]]
        for v in range(V):
            g[t][v] = (math.exp(u[v] - top) / s - (1.0 if v == labels[t] else 0.0)) / len(valid)
    dh = [[sum(g[t][v] * w[v][k] for v in range(V)) for k in range(H)] for t in range(N)]
    loss = sum(token_loss) / len(valid)
    m["stage"] = {"kind": "lm_head", "hidden": H, "bias": True}
    for r, (lo, hi) in enumerate([(0, 5), (5, 10)]):
        file = f[f"rank{r}.safetensors"]
        del file["logits"], file["grad_logits"]
        file["h"] = tensor("F32", (N, H), [x for row in h for x in row])
        file["dh"] = tensor("F32", (N, H), [x for row in dh for x in row])
        file["token_loss"] = tensor("F32", (N,), token_loss)
        file["loss"] = tensor("F32", (), [loss])
        file["W"] = tensor("F32", (hi - lo, H), [x for row in w[lo:hi] for x in row])
        file["b"] = tensor("F32", (hi - lo,), b[lo:hi])
        file["dW"] = tensor("F32", (hi - lo, H),
                            [sum(g[t][v] * h[t][k] for t in range(N)) for v in range(lo, hi) for k in range(H)])
        file["db"] = tensor("F32", (hi - lo,), [sum(g[t][v] for t in range(N)) for v in range(lo, hi)])
        rank = m["ranks"][r]
        rank["tensors"] = {"h": "h", "dh": "dh", "labels": "labels", "token_loss": "token_loss"}
        rank["stage"] = {"W": "W", "b": "b", "dW": "dW", "db": "db"}
    return m, f


def as_policy(m, f, objective="policy_loss"):
    """The base dump's manifest read as a policy loss: its old and reference log-probabilities and advantages
    (values that only need to be well formed: these dumps test the reader, not the verdict)."""
    m["loss"] = {"kind": "policy", "objective": objective}
    if objective != "policy_loss":
        return
    for r, file in enumerate((f["rank0.safetensors"], f["rank1.safetensors"])):
        file["old_logprob"] = tensor("F32", (N,), [-1.0 - 0.1 * t for t in range(N)])
        file["ref_logprob"] = tensor("F32", (N,), [-1.2 - 0.1 * t for t in range(N)])
        file["advantages"] = tensor("F32", (N,), [1.0 if t < 4 else -0.5 for t in range(N)])
        for key in ("old_logprob", "ref_logprob", "advantages"):
            m["ranks"][r]["tensors"][key] = key


def case(name):
    """(manifest, files, raw): raw maps file names to bytes that replace the encoded files."""
    m, f = head_base() if name.startswith("head_") else base()
    if name.startswith("policy_"):
        as_policy(m, f, "logprob" if name == "policy_inputs_for_logprob" else "policy_loss")
    raw = {}
    r0, r1 = f["rank0.safetensors"], f["rank1.safetensors"]
    full = safetensors_bytes(r1)
    if name == "valid":
        pass
    elif name == "good_no_token_loss":  # logged loss only: per-token comparisons are "not dumped"
        for r in m["ranks"]:
            del r["tensors"]["token_loss"]
    elif name == "good_no_stats":  # per-token losses only: the logged loss and count are "not dumped"
        for r in m["ranks"]:
            del r["stats"]
    elif name == "good_wrong_logged_loss":  # logged loss off by 1%, no per-token losses: the loss check fails
        for r, file in ((0, r0), (1, r1)):
            del m["ranks"][r]["tensors"]["token_loss"]
            file["loss"]["values"][0] *= 1.01
    elif name == "good_wrong_grad":  # rank 1's gradient doubled: the grad check fails
        r1["grad_logits"]["values"] = [2.0 * x for x in r1["grad_logits"]["values"]]
    elif name == "good_npy_and_inline":  # .npy labels (v2 header), inline logged values, F16-free mix
        raw["labels0.npy"] = npy_bytes("<i8", (N,), r0["labels"]["values"], version=2)
        m["ranks"][0]["tensors"]["labels"] = {"file": "labels0.npy"}
        for r, file in ((0, r0), (1, r1)):
            m["ranks"][r]["stats"] = {"loss": file["loss"]["values"][0], "num_tokens": file["num_tokens"]["values"][0]}
    elif name == "truncated_file":
        raw["rank1.safetensors"] = full[:-40]
    elif name == "truncated_header":
        raw["rank1.safetensors"] = full[:5]
    elif name == "header_length_past_end":
        raw["rank1.safetensors"] = struct.pack("<Q", 1 << 40) + full[8:]
    elif name == "header_not_json":
        raw["rank1.safetensors"] = safetensors_bytes(r1, raw_header=b'{"logits": {"dtype": "F32",')
    elif name == "duplicate_tensor_name":
        text = json.dumps({"logits": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})
        raw["rank1.safetensors"] = safetensors_bytes(r1, raw_header=(text[:-1] + ", " + text[1:]).encode())
    elif name == "overlapping_offsets":
        def patch(h):
            h["token_loss"]["data_offsets"] = [h["labels"]["data_offsets"][0] + 8,
                                               h["labels"]["data_offsets"][0] + 8 + 4 * N]
        raw["rank1.safetensors"] = safetensors_bytes(r1, header_patch=patch)
    elif name == "offsets_out_of_range":
        def patch(h):
            b = h["num_tokens"]["data_offsets"][0] + 4096
            h["num_tokens"]["data_offsets"] = [b, b + 8]
        raw["rank1.safetensors"] = safetensors_bytes(r1, header_patch=patch)
    elif name == "offsets_size_mismatch":
        def patch(h):
            h["logits"]["shape"] = [N, 6]
        raw["rank1.safetensors"] = safetensors_bytes(r1, header_patch=patch)
    elif name == "unknown_dtype":
        def patch(h):
            h["logits"]["dtype"] = "F8_E4M3"
        raw["rank1.safetensors"] = safetensors_bytes(r1, header_patch=patch)
    elif name == "dtype_mismatch":
        r1["logits"]["dtype"] = "F64"
    elif name == "shape_mismatch":
        r1["grad_logits"] = tensor("F32", (N, 4), [0.0] * (N * 4))
    elif name == "labels_wrong_length":
        r0["labels"] = tensor("I64", (N - 1,), r0["labels"]["values"][:-1])
    elif name == "float_labels":
        r0["labels"] = tensor("F32", (N,), [float(x) for x in r0["labels"]["values"]])
    elif name == "missing_rank":
        m["ranks"] = m["ranks"][:1]
    elif name == "duplicate_rank":
        m["ranks"][1]["rank"] = 0
    elif name == "nan_count":
        r1["num_tokens"] = tensor("F32", (), [float("nan")])
    elif name == "fractional_count":
        r0["num_tokens"] = tensor("F64", (), [6.5])
    elif name == "negative_inline_count":
        for r in m["ranks"]:
            r["stats"]["num_tokens"] = -3
    elif name == "scalar_wrong_shape":
        r1["loss"] = tensor("F32", (2,), [1.0, 2.0])
    elif name == "missing_tensor":
        m["ranks"][1]["tensors"]["labels"] = "label"
    elif name == "missing_file":
        m["ranks"][1]["tensors"]["labels"] = {"file": "absent.safetensors", "name": "labels"}
    elif name == "missing_grad":
        del m["ranks"][0]["tensors"]["grad_logits"]
    elif name == "no_loss":
        for r in m["ranks"]:
            del r["tensors"]["token_loss"]
            del r["stats"]["loss"]
    elif name == "labels_disagree":
        r1["labels"]["values"][3] = 9
    elif name == "label_out_of_range":
        r0["labels"]["values"][2] = 99
    elif name == "mask_not_binary":
        for r, file in ((0, r0), (1, r1)):
            file["loss_mask"] = tensor("F32", (N,), [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0])
            m["ranks"][r]["tensors"]["loss_mask"] = "loss_mask"
    elif name == "nonfinite_logits":
        r0["logits"]["values"][7] = float("nan")
    elif name == "token_twice":
        for r in m["ranks"]:
            r["rows"] = [[0, N], 3]
        for file in (r0, r1):
            for key in ("logits", "grad_logits"):
                cols = file[key]["shape"][1]
                file[key] = tensor("F32", (N + 1, cols), file[key]["values"] + file[key]["values"][3 * cols:4 * cols])
            for key, t in (("labels", "I64"), ("token_loss", "F32")):
                file[key] = tensor(t, (N + 1,), file[key]["values"] + [file[key]["values"][3]])
    elif name == "token_missing":
        for r in m["ranks"]:
            r["rows"] = [[0, 3], -1, [4, N]]
    elif name == "token_out_of_range":
        for r in m["ranks"]:
            r["rows"] = [[0, N + 1]]
    elif name == "rows_differ_in_tp_group":
        m["ranks"][1]["rows"] = [[1, N], 0]
    elif name == "vocab_overlap":
        m["ranks"][1]["vocab"] = [4, 10]
    elif name == "vocab_gap":
        m["ranks"][1]["vocab"] = [6, 10]
    elif name == "unknown_key":
        m["ranks"][0]["tensor"] = {}
    elif name == "unknown_tensor_key":
        m["ranks"][0]["tensors"]["logit"] = "logits"
    elif name == "bad_format":
        m["format"] = "lossverify.dump/2"
    elif name == "loss_section_error":
        m["loss"]["label_smoothing"] = 1.5
    elif name == "smoothing_without_convention":
        m["loss"]["label_smoothing"] = 0.1
        m["loss"].pop("smoothing_convention", None)
    elif name == "manifest_not_json":
        raw["manifest.json"] = b'{"format": "lossverify.dump/1", "ranks": [}'
    elif name == "manifest_duplicate_key":
        raw["manifest.json"] = json.dumps(m).replace('"dtype": "fp32"', '"dtype": "fp32", "dtype": "bf16"').encode()
    elif name == "ga_without_micro_batches":
        m["layout"]["ga"] = 2
    elif name == "kd_without_teacher":
        m["loss"] = {"kind": "kd"}
    elif name == "npy_fortran":
        raw["labels0.npy"] = npy_bytes("<i8", (N,), r0["labels"]["values"], fortran=True)
        m["ranks"][0]["tensors"]["labels"] = {"file": "labels0.npy"}
    elif name == "npy_truncated":
        raw["labels0.npy"] = npy_bytes("<i8", (N,), r0["labels"]["values"])[:-12]
        m["ranks"][0]["tensors"]["labels"] = {"file": "labels0.npy"}
    elif name == "npy_big_endian":
        raw["labels0.npy"] = npy_bytes(">i8", (N,), r0["labels"]["values"], fmt="q")
        m["ranks"][0]["tensors"]["labels"] = {"file": "labels0.npy"}
    elif name == "npy_bad_magic":
        raw["labels0.npy"] = b"NOTNUMPY" + npy_bytes("<i8", (N,), r0["labels"]["values"])[8:]
        m["ranks"][0]["tensors"]["labels"] = {"file": "labels0.npy"}
    elif name == "npy_bad_header":
        raw["labels0.npy"] = npy_bytes("<i8", (N,), r0["labels"]["values"]).replace(b"'shape'", b"'shap' ")
        m["ranks"][0]["tensors"]["labels"] = {"file": "labels0.npy"}
    elif name == "cu_seqlens_bad":
        m["cu_seqlens"] = [0, 5, 3, N]
    elif name == "policy_nan_old_logprob":  # token 2 counts in the loss
        r0["old_logprob"]["values"][2] = float("nan")
        r1["old_logprob"]["values"][2] = float("nan")
    elif name == "policy_inf_advantage":
        r0["advantages"]["values"][6] = float("-inf")
        r1["advantages"]["values"][6] = float("-inf")
    elif name == "policy_missing_advantages":
        del m["ranks"][1]["tensors"]["advantages"]
    elif name == "policy_inputs_disagree":
        r1["ref_logprob"]["values"][3] = -3.25  # a log-probability, not rank 0's
    elif name == "policy_inputs_for_logprob":  # a log-prob pass reads no old log-probabilities
        r0["old_logprob"] = tensor("F32", (N,), [0.0] * N)
        m["ranks"][0]["tensors"]["old_logprob"] = "old_logprob"
    elif name == "head_valid":
        pass
    elif name == "head_wrong_db":  # rank 1's db doubled: the db check fails
        r1["db"]["values"] = [2.0 * x for x in r1["db"]["values"]]
    elif name == "head_h_hidden_differs":  # h of H = 3 where the stage's hidden size and W's are 4
        r1["h"] = tensor("F32", (N, H - 1), [0.5] * (N * (H - 1)))
    elif name == "head_w_hidden_differs":  # W of H = 3 where h's and the stage's are 4
        r0["W"] = tensor("F32", (5, H - 1), [0.5] * (5 * (H - 1)))
    elif name == "head_w_vocab_differs":  # rank 1's W holds 4 columns of its 5
        r1["W"] = tensor("F32", (4, H), r1["W"]["values"][:4 * H])
    elif name == "head_w_shards_gap":  # the shards of W leave column 5 out (rank 1 says [6, 10) and holds 4 rows)
        m["ranks"][1]["vocab"] = [6, 10]
        for key in ("W", "dW"):
            r1[key] = tensor("F32", (4, H), r1[key]["values"][H:])
        r1["b"] = tensor("F32", (4,), r1["b"]["values"][1:])
        r1["db"] = tensor("F32", (4,), r1["db"]["values"][1:])
    elif name == "head_h_nan":
        r0["h"]["values"][2 * H + 1] = float("nan")
    elif name == "head_w_inf":
        r1["W"]["values"][3 * H + 2] = float("inf")
    elif name == "head_b_nan":
        r0["b"]["values"][4] = float("nan")
    elif name == "head_h_disagree":  # the TP ranks of token 3 hold different h
        r1["h"]["values"][3 * H] += 0.25
    elif name == "head_truncated":
        raw["rank1.safetensors"] = safetensors_bytes(r1)[:-40]
    elif name == "head_logits_given":  # the head makes the logits: a dump of them is refused
        r0["logits"] = tensor("F32", (N, 5), [0.0] * (N * 5))
        m["ranks"][0]["tensors"]["logits"] = "logits"
    elif name == "head_missing_dw":
        del m["ranks"][0]["stage"]["dW"]
    elif name == "head_bias_not_in_case":  # the case's head has no bias, the dump gives b and db
        m["stage"]["bias"] = False
    elif name == "rank_disagrees_with_coordinates":
        m["ranks"][1]["tp"] = 0
    else:
        raise SystemExit(f"make_bad_dumps.py: unknown case {name}")
    return m, f, raw


def write(out_dir, name):
    m, files, raw = case(name)
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    for fname, tensors in files.items():
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(raw.pop(fname) if fname in raw else safetensors_bytes(tensors))
    manifest = raw.pop("manifest.json", None)
    with open(os.path.join(folder, "manifest.json"), "wb") as f:
        f.write(manifest if manifest is not None else json.dumps(m, indent=1).encode())
    for fname, data in raw.items():
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(data)


def main():
    cases_txt, out_dir = sys.argv[1], sys.argv[2]
    names = ["valid", "good_no_token_loss", "good_no_stats", "good_wrong_logged_loss", "good_wrong_grad",
             "good_npy_and_inline", "head_valid", "head_wrong_db"]
    with open(cases_txt) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                names.append(line.split("|", 1)[0].strip())
    for name in names:
        write(out_dir, name)
    print(f"make_bad_dumps.py: {len(names)} dumps in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
