#include <doctest/doctest.h>

#include "lossverify/core/strings.hpp"

using lossverify::is_valid_utf8;
using lossverify::printable;

TEST_CASE("printable keeps UTF-8 text and escapes control characters and invalid bytes") {
  CHECK(printable("cases/smoothing-π.json") == "cases/smoothing-π.json");
  CHECK(printable("a\nb\tc\x1b[31m") == "a\\nb\\tc\\x1B[31m");
  CHECK(printable("back\\slash") == "back\\\\slash");
  CHECK(printable(std::string("bad\xff\xfe")) == "bad\\xFF\\xFE");
  CHECK(printable(std::string("\xc3")) == "\\xC3");                    // truncated two-byte sequence
  CHECK(printable(std::string("\xc0\xaf")) == "\\xC0\\xAF");           // overlong '/'
  CHECK(printable(std::string("\xed\xa0\x80")) == "\\xED\\xA0\\x80");  // a UTF-16 surrogate
  CHECK(printable(std::string("\x7f")) == "\\x7F");
}

TEST_CASE("is_valid_utf8 follows RFC 3629") {
  CHECK(is_valid_utf8("plain"));
  CHECK(is_valid_utf8("\xf0\x9f\x98\x80"));        // U+1F600
  CHECK_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  CHECK_FALSE(is_valid_utf8("\xe2\x82"));
  CHECK_FALSE(is_valid_utf8("\x80"));
}

TEST_CASE("printable_message keeps line breaks and backslashes but not other control characters") {
  CHECK(lossverify::printable_message("line one\nline two \\ \x1b[2J") == "line one\nline two \\ \\x1B[2J");
}
