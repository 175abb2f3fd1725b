#pragma once
// Strict reading of a JSON object: typed accessors that name the JSON path on error, and a final
// check that rejects keys nobody asked for (a misspelt key must not silently become a default).
#include <array>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"

namespace lossverify::detail {

class ObjectReader {
 public:
  ObjectReader(const nlohmann::json& object, std::string path, std::string source);

  bool has(const std::string& key) const;
  void allow(const std::string& key) { known_.insert(key); }  // an optional key that is absent
  const nlohmann::json& raw(const std::string& key);          // marks the key as known; must exist
  std::string path_of(const std::string& key) const { return path_ + "." + key; }
  const std::string& path() const { return path_; }
  const std::string& source() const { return source_; }

  std::int64_t integer(const std::string& key);
  std::int64_t integer(const std::string& key, std::int64_t fallback);
  double number(const std::string& key);
  double number(const std::string& key, double fallback);
  std::string string(const std::string& key);
  std::string string(const std::string& key, const std::string& fallback);
  bool boolean(const std::string& key, bool fallback);
  ObjectReader object(const std::string& key);

  // Throws for every key present in the object but never read.
  void reject_unknown_keys() const;

  [[noreturn]] void fail(const std::string& key, const std::string& message) const;
  [[noreturn]] void fail_here(const std::string& message) const;

 private:
  const nlohmann::json& object_;
  std::string path_;
  std::string source_;
  std::set<std::string> known_;
};

std::string json_type_name(const nlohmann::json& value);
std::int64_t as_integer(const nlohmann::json& value, const std::string& path, const std::string& source);
double as_number(const nlohmann::json& value, const std::string& path, const std::string& source);
[[noreturn]] void fail_at(const std::string& source, const std::string& path, const std::string& message);

// One of `choices` by its name (to_string(Enum)), or `fallback` when the key is absent; another name fails
// listing the allowed ones.
template <class Enum, std::size_t N>
Enum parse_choice(ObjectReader& reader, const std::string& key, const std::array<Enum, N>& choices, Enum fallback) {
  if (!reader.has(key)) {
    reader.allow(key);
    return fallback;
  }
  const std::string value = reader.string(key);
  std::string allowed;
  for (Enum e : choices) {
    if (to_string(e) == value) return e;
    append_to_list(allowed, to_string(e), "|");
  }
  reader.fail(key, "expected one of " + allowed + ", got \"" + value + "\"");
}

// JSON parsed strictly: a key repeated in one object, or a number outside the range of a double (1e400), is
// an error, not a silent choice. Either `document` is set, or one of the two reasons.
struct StrictJson {
  nlohmann::json document;
  std::string parse_error;   // the parser's message (it quotes the text near the error)
  std::string repeated_key;  // the first key found twice in one object
};
StrictJson parse_json_checked(std::string_view text);

// parse_json_checked, or CaseError "<source>: <what> is not valid JSON: ..." / "... repeats the key ...".
nlohmann::json parse_json_strictly(std::string_view text, const std::string& source, const std::string& what);

// Reads a regular file (not a FIFO, a device or a folder) and parses it with parse_json_strictly; CaseError
// "<path>: cannot open <what>: ..." otherwise.
nlohmann::json read_json_file(const std::string& path, const std::string& what);

}  // namespace lossverify::detail
