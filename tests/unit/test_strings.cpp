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

TEST_CASE("xml_escape_leaves_no_control_character_that_xml_forbids") {
  CHECK(lossverify::xml_escape("a<b>&\"'") == "a&lt;b&gt;&amp;&quot;&#39;");
  CHECK(lossverify::xml_escape("a\tb\nc\rd") == "a&#9;b&#10;c&#13;d");
  CHECK(lossverify::xml_escape(std::string("x\x01y\x1b\x7f", 5)) == "x\\x01y\\x1b\\x7f");
  const std::string all_bytes = [] {
    std::string s;
    for (int c = 1; c < 128; ++c) s += static_cast<char>(c);
    return s;
  }();
  for (const char ch : lossverify::xml_escape(all_bytes)) {
    const auto c = static_cast<unsigned char>(ch);
    CHECK((c >= 0x20 && c != 0x7f));
  }
}
