#pragma once
#include <string>
#include <string_view>

namespace lossverify {

// Appends item to a separated list: "a" -> "a, b".
inline void append_to_list(std::string& list, std::string_view item, std::string_view separator = ", ") {
  if (!list.empty()) list += separator;
  list += item;
}

// Whether text is well-formed UTF-8 (RFC 3629).
bool is_valid_utf8(std::string_view text);

// Text safe to print on a terminal and to store in JSON: control characters, backslashes and bytes that
// are not well-formed UTF-8 become escapes (\n, \t, \r, \\, \xHH); everything else is kept as is.
std::string printable(std::string_view text);

// A message for the terminal: as printable(), but its line breaks and backslashes are kept.
std::string printable_message(std::string_view text);

// Text for XML attributes and character data: & < > " ' escaped, tab and line breaks as references, every other
// control character as \\xNN text (XML 1.0 admits none of them).
inline std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      case '\t':
        out += "&#9;";
        break;
      case '\n':
        out += "&#10;";
        break;
      case '\r':
        out += "&#13;";
        break;
      default:
        // XML 1.0 admits no other control character, not even as a reference: shown as \xNN text instead.
        if ((static_cast<unsigned char>(ch) < 0x20) || ch == 0x7f) {
          static const char* const hex = "0123456789abcdef";
          const auto c = static_cast<unsigned char>(ch);
          out += "\\x";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  return out;
}

}  // namespace lossverify
