#pragma once
#include <string>
#include <string_view>

namespace lossverify {

// Appends item to a separated list: "a" -> "a, b".
inline void append_to_list(std::string& list, std::string_view item, std::string_view separator = ", ") {
  if (!list.empty()) list += separator;
  list += item;
}

}  // namespace lossverify
