"""lossverify's Philox input streams in pure Python, bit for bit those of inputs/philox_stream.hpp: Philox4x32-10
(Random123) of (seed, stream, row, block), a uniform in (0, 1) from 52 bits, and normal pairs by Box-Muller with the
same portable log, sine and cosine (IEEE +, -, *, / and sqrt only, in the same order: Python floats are float64 and
never fused). `stage_values` gives what InputSource::stage_values gives before its rounding to the dtype;
`head_inputs` an LM head case's h, W and b of a rank, rounded to the case's dtype (through float32, as the C++ does).
"""

import math

__all__ = ["HEAD_HIDDEN", "HEAD_WEIGHT", "HEAD_BIAS", "philox4x32", "stage_values", "head_scales", "head_inputs"]

# InputStream (inputs/philox_stream.hpp)
HEAD_HIDDEN, HEAD_WEIGHT, HEAD_BIAS = 10, 11, 12

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32(counter, key):
    """Philox4x32-10 of a counter of four 32-bit words under a key of two: four 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c3 ^ k1) & _MASK, p0 & _MASK
    return c0, c1, c2, c3


def _block(seed, stream, row, block):
    return philox4x32((block & _MASK, row & _MASK, (row >> 32) & _MASK, stream), (seed & _MASK, (seed >> 32) & _MASK))


def _uniform_open01(high, low):
    bits = ((high & 0xFFFFF) << 32) | low
    return float(2 * bits + 1) * 1.1102230246251565404e-16


def _portable_log(x):
    exponent = 0
    while x < 0.70710678118654752440:
        x = x * 2.0
        exponent = exponent - 1
    s = (x - 1.0) / (x + 1.0)
    z = s * s
    p = 1.0 / 23.0
    for d in (21.0, 19.0, 17.0, 15.0, 13.0, 11.0, 9.0, 7.0, 5.0, 3.0):
        p = 1.0 / d + z * p
    p = 1.0 + z * p
    e = float(exponent)
    return (e * 6.93147180369123816490e-01 + 2.0 * (s * p)) + e * 1.90821492927058770002e-10


_SIN = (-1.0 / 51090942171709440000.0, 1.0 / 121645100408832000.0, -1.0 / 355687428096000.0,
        1.0 / 1307674368000.0, -1.0 / 6227020800.0, 1.0 / 39916800.0, -1.0 / 362880.0, 1.0 / 5040.0, -1.0 / 120.0,
        1.0 / 6.0)
_COS = (1.0 / 1124000727777607680000.0, -1.0 / 2432902008176640000.0, 1.0 / 6402373705728000.0,
        -1.0 / 20922789888000.0, 1.0 / 87178291200.0, -1.0 / 479001600.0, 1.0 / 3628800.0, -1.0 / 40320.0,
        1.0 / 720.0, -1.0 / 24.0, 1.0 / 2.0)


def _sincos_turns(turns):
    quarter_turns = turns * 4.0
    quadrant = int(quarter_turns)
    fraction = quarter_turns - float(quadrant)
    a = fraction * 1.57079632679489661923
    z = a * a
    sp = _SIN[0]
    for coefficient in _SIN[1:]:
        sp = coefficient + z * sp
    sp = 1.0 - z * sp
    cp = _COS[0]
    for coefficient in _COS[1:]:
        cp = coefficient + z * cp
    c = 1.0 - z * cp
    s = a * sp
    return ((s, c), (c, -s), (-s, -c), (-c, s))[quadrant & 3]


def _normal_pair(seed, stream, row, block, scale):
    w = _block(seed, stream, row, block)
    u1, u2 = _uniform_open01(w[0], w[1]), _uniform_open01(w[2], w[3])
    radius = math.sqrt(-2.0 * _portable_log(u1))
    sine, cosine = _sincos_turns(u2)
    return 0.0 + scale * (radius * cosine), 0.0 + scale * (radius * sine)


def stage_values(seed, stream, row, begin, end, scale):
    """Columns [begin, end) of row `row` of a stage's stream: normal(0, scale) in float64, before any rounding."""
    out = []
    for v in range(begin, end):
        even, odd = _normal_pair(seed, stream, row, v >> 1, scale)
        out.append(odd if v & 1 else even)
    return out


def head_scales(case):
    """(hidden_scale, W's, b's) of a resolved case with an LM head (kinds/lm_head/lm_head_options.hpp)."""
    stage, scale = case["stage"], case["inputs"]["scale"]
    hidden_scale = stage["hidden_scale"]
    weight_scale = stage["weight_scale"] or scale / (math.sqrt(float(stage["hidden"])) * hidden_scale)
    return hidden_scale, weight_scale, 0.5 * scale


def head_inputs(case, tokens, vocab):
    """An LM head case's inputs of one rank: h of its rows `tokens` (global tokens; -1: CP padding, zeros),
    W and b of its columns `vocab` = (begin, end), torch tensors in the case's dtype (b None without a bias)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["inputs"]["dtype"]]
    seed, hidden = case["inputs"]["seed"], case["stage"]["hidden"]
    hidden_scale, weight_scale, bias_scale = head_scales(case)

    def rounded(rows):
        return torch.tensor(rows, dtype=torch.float64).to(torch.float32).to(dtype)

    h = rounded([stage_values(seed, HEAD_HIDDEN, t, 0, hidden, hidden_scale) if t >= 0 else [0.0] * hidden
                 for t in tokens]).reshape(len(tokens), hidden)
    w = rounded([stage_values(seed, HEAD_WEIGHT, v, 0, hidden, weight_scale) for v in range(*vocab)])
    b = rounded(stage_values(seed, HEAD_BIAS, 0, vocab[0], vocab[1], bias_scale)) if case["stage"]["bias"] else None
    return h, w.reshape(vocab[1] - vocab[0], hidden), b
