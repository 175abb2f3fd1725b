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

// Text for XML attributes and character data: & < > " ' escaped.
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
      default:
        out += ch;
    }
  }
  return out;
}

}  // namespace lossverify
