#pragma once
// Inputs are a pure function of (seed, stream, token, column) through Philox4x32-10 (Random123).
// Everything here is written with IEEE +, -, *, / and sqrt only, no library transcendental, so a CPU
// and a GPU produce bit-identical values (compile with FMA contraction off: -ffp-contract=off on the
// host, -fmad=false for the CUDA generator).
#include <cmath>
#include <cstdint>

#include <Random123/philox.h>

#include "lossverify/core/host_device.hpp"
#include "lossverify/core/logit_distribution.hpp"

namespace lossverify {

// Independent streams of one case; adding a stream never changes the values of another.
enum class InputStream : std::uint32_t {
  student_logits = 0,
  teacher_logits = 1,
  labels = 2,
  token_mask = 3,
  upstream_weights = 4,
  sequence_lengths = 5,
  pad_logits = 6,        // logits of CP padding positions (masked; any value is right)
  policy_ratio = 7,      // a policy loss's old log-probabilities: where each token's ratio is placed
  policy_reference = 8,  // a policy loss's reference log-probabilities: the gap to the current one
  policy_advantage = 9,  // a policy loss's advantages, one per sequence
  head_hidden = 10,      // an LM head's hidden states, a row per token
  head_weight = 11,      // an LM head's output weight, a row per vocabulary column
  head_bias = 12,        // an LM head's bias, one row
};

struct PhiloxBlock {
  std::uint32_t word[4];
};

LV_HOST_DEVICE PhiloxBlock philox_block(std::uint64_t seed, InputStream stream, std::uint64_t token,
                                        std::uint32_t block) {
  r123::Philox4x32 generator;
  r123::Philox4x32::ctr_type counter = {{block, static_cast<std::uint32_t>(token),
                                         static_cast<std::uint32_t>(token >> 32), static_cast<std::uint32_t>(stream)}};
  r123::Philox4x32::key_type key = {{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
  const auto out = generator(counter, key);
  return PhiloxBlock{{out.v[0], out.v[1], out.v[2], out.v[3]}};
}

// Uniform in the open interval (0, 1) from 52 random bits: (2k + 1) / 2^53, exact in float64.
LV_HOST_DEVICE double uniform_open01(std::uint32_t high, std::uint32_t low) {
  const std::uint64_t bits = (static_cast<std::uint64_t>(high & 0xfffffu) << 32) | low;  // 52 bits
  return static_cast<double>(2 * bits + 1) * 1.1102230246251565404e-16;                  // 2^-53
}

namespace detail {

// Natural logarithm of x in (0, 1]: exact scaling by 2 to [sqrt(1/2), sqrt(2)), then the atanh series
// log(m) = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m - 1)/(m + 1), s^2 <= 0.0295: 12 terms reach 4e-19.
// Coefficients are compile-time constants, so host and device evaluate the same operations.
LV_HOST_DEVICE double portable_log(double x) {
  int exponent = 0;
  while (x < 0.70710678118654752440) {
    x = x * 2.0;
    exponent = exponent - 1;
  }
  const double s = (x - 1.0) / (x + 1.0);
  const double z = s * s;
  double p = 1.0 / 23.0;
  p = 1.0 / 21.0 + z * p;
  p = 1.0 / 19.0 + z * p;
  p = 1.0 / 17.0 + z * p;
  p = 1.0 / 15.0 + z * p;
  p = 1.0 / 13.0 + z * p;
  p = 1.0 / 11.0 + z * p;
  p = 1.0 / 9.0 + z * p;
  p = 1.0 / 7.0 + z * p;
  p = 1.0 / 5.0 + z * p;
  p = 1.0 / 3.0 + z * p;
  p = 1.0 + z * p;
  const double ln2_high = 6.93147180369123816490e-01;  // ln 2 split so exponent * ln2_high is exact
  const double ln2_low = 1.90821492927058770002e-10;
  const double e = static_cast<double>(exponent);
  return (e * ln2_high + 2.0 * (s * p)) + e * ln2_low;
}

// sin and cos of 2*pi*turns for turns in [0, 1): exact quadrant reduction, Taylor series on [0, pi/2]
// in Horner form up to a^21 (sin) and a^22 (cos): truncation error < 1e-18.
LV_HOST_DEVICE void portable_sincos_turns(double turns, double* sine, double* cosine) {
  const double quarter_turns = turns * 4.0;  // exact
  const int quadrant = static_cast<int>(quarter_turns);
  const double fraction = quarter_turns - static_cast<double>(quadrant);  // exact, in [0, 1)
  const double a = fraction * 1.57079632679489661923;
  const double z = a * a;
  // sin(a)/a = sum_k (-1)^k z^k / (2k+1)!
  double sp = -1.0 / 51090942171709440000.0;  // -1/21!
  sp = 1.0 / 121645100408832000.0 + z * sp;   // 1/19!
  sp = -1.0 / 355687428096000.0 + z * sp;     // -1/17!
  sp = 1.0 / 1307674368000.0 + z * sp;        // 1/15!
  sp = -1.0 / 6227020800.0 + z * sp;          // -1/13!
  sp = 1.0 / 39916800.0 + z * sp;             // 1/11!
  sp = -1.0 / 362880.0 + z * sp;              // -1/9!
  sp = 1.0 / 5040.0 + z * sp;                 // 1/7!
  sp = -1.0 / 120.0 + z * sp;                 // -1/5!
  sp = 1.0 / 6.0 + z * sp;                    // 1/3!
  sp = 1.0 - z * sp;
  // cos(a) = sum_k (-1)^k z^k / (2k)!
  double cp = 1.0 / 1124000727777607680000.0;  // 1/22!
  cp = -1.0 / 2432902008176640000.0 + z * cp;  // -1/20!
  cp = 1.0 / 6402373705728000.0 + z * cp;      // 1/18!
  cp = -1.0 / 20922789888000.0 + z * cp;       // -1/16!
  cp = 1.0 / 87178291200.0 + z * cp;           // 1/14!
  cp = -1.0 / 479001600.0 + z * cp;            // -1/12!
  cp = 1.0 / 3628800.0 + z * cp;               // 1/10!
  cp = -1.0 / 40320.0 + z * cp;                // -1/8!
  cp = 1.0 / 720.0 + z * cp;                   // 1/6!
  cp = -1.0 / 24.0 + z * cp;                   // -1/4!
  cp = 1.0 / 2.0 + z * cp;                     // 1/2!
  const double c = 1.0 - z * cp;
  const double s = a * sp;
  switch (quadrant & 3) {
    case 0:
      *sine = s;
      *cosine = c;
      break;
    case 1:
      *sine = c;
      *cosine = -s;
      break;
    case 2:
      *sine = -s;
      *cosine = -c;
      break;
    default:
      *sine = -c;
      *cosine = s;
      break;
  }
}

}  // namespace detail

// Two consecutive logits (columns 2*block and 2*block + 1) of one token, in float64, before rounding.
LV_HOST_DEVICE void logit_pair(std::uint64_t seed, InputStream stream, std::uint64_t token, std::uint32_t block,
                               LogitDistribution distribution, double mean, double scale, double* even, double* odd) {
  const PhiloxBlock r = philox_block(seed, stream, token, block);
  const double u1 = uniform_open01(r.word[0], r.word[1]);
  const double u2 = uniform_open01(r.word[2], r.word[3]);
  if (distribution == LogitDistribution::uniform) {
    *even = mean + scale * (2.0 * u1 - 1.0);
    *odd = mean + scale * (2.0 * u2 - 1.0);
    return;
  }
  // Box-Muller.
  const double radius = sqrt(-2.0 * detail::portable_log(u1));
  double sine = 0.0;
  double cosine = 0.0;
  detail::portable_sincos_turns(u2, &sine, &cosine);
  *even = mean + scale * (radius * cosine);
  *odd = mean + scale * (radius * sine);
  if (distribution == LogitDistribution::separated && scale > 0.0) {
    // Columns c and c' of one 4096-column window: the same grid point leaves them (|c - c'| / 8192) steps apart,
    // different points at least half a step.
    const double step = scale / 4.0;
    const auto column = static_cast<std::uint64_t>(block) * 2;
    *even = mean + step * (rint((*even - mean) / step) + (static_cast<double>(column % 4096) + 0.5) / 8192.0);
    *odd = mean + step * (rint((*odd - mean) / step) + (static_cast<double>((column + 1) % 4096) + 0.5) / 8192.0);
  }
}

// Uniform label in [0, vocab): the high 64 bits of a 64x64-bit product (no modulo bias worth naming).
LV_HOST_DEVICE std::int64_t generated_label(std::uint64_t seed, std::uint64_t token, std::int64_t vocab) {
  const PhiloxBlock r = philox_block(seed, InputStream::labels, token, 0);
  const std::uint64_t bits = (static_cast<std::uint64_t>(r.word[1]) << 32) | r.word[0];
#if defined(__CUDA_ARCH__)
  return static_cast<std::int64_t>(__umul64hi(bits, static_cast<std::uint64_t>(vocab)));
#else
  __extension__ using uint128 = unsigned __int128;
  return static_cast<std::int64_t>((static_cast<uint128>(bits) * static_cast<std::uint64_t>(vocab)) >> 64);
#endif
}

// Uniform in (0, 1) per token of a stream: decides ignored tokens and draws upstream weights.
LV_HOST_DEVICE double token_uniform(std::uint64_t seed, InputStream stream, std::uint64_t token) {
  const PhiloxBlock r = philox_block(seed, stream, token, 0);
  return uniform_open01(r.word[0], r.word[1]);
}

}  // namespace lossverify
