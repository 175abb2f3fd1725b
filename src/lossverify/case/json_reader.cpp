#include "lossverify/case/json_reader.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "lossverify/core/strings.hpp"

namespace lossverify::detail {

void fail_at(const std::string& source, const std::string& path, const std::string& message) {
  throw CaseError(source + ": " + path + ": " + message);
}

std::string json_type_name(const nlohmann::json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

std::int64_t as_integer(const nlohmann::json& value, const std::string& path, const std::string& source) {
  if (value.is_number_unsigned()) {
    const auto u = value.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(INT64_MAX)) fail_at(source, path, "integer out of range");
    return static_cast<std::int64_t>(u);
  }
  if (!value.is_number_integer()) fail_at(source, path, "expected integer, got " + json_type_name(value));
  return value.get<std::int64_t>();
}

double as_number(const nlohmann::json& value, const std::string& path, const std::string& source) {
  if (!value.is_number()) fail_at(source, path, "expected number, got " + json_type_name(value));
  const double v = value.get<double>();
  if (!std::isfinite(v)) fail_at(source, path, "must be finite");
  return v;
}

ObjectReader::ObjectReader(const nlohmann::json& object, std::string path, std::string source)
    : object_(object), path_(std::move(path)), source_(std::move(source)) {
  if (!object_.is_object()) fail_at(source_, path_, "expected object, got " + json_type_name(object_));
}

bool ObjectReader::has(const std::string& key) const { return object_.contains(key); }

const nlohmann::json& ObjectReader::raw(const std::string& key) {
  known_.insert(key);
  if (!object_.contains(key)) fail(key, "required key is missing");
  return object_.at(key);
}

std::int64_t ObjectReader::integer(const std::string& key) { return as_integer(raw(key), path_of(key), source_); }
std::int64_t ObjectReader::integer(const std::string& key, std::int64_t fallback) {
  known_.insert(key);
  return has(key) ? integer(key) : fallback;
}

double ObjectReader::number(const std::string& key) { return as_number(raw(key), path_of(key), source_); }
double ObjectReader::number(const std::string& key, double fallback) {
  known_.insert(key);
  return has(key) ? number(key) : fallback;
}

std::string ObjectReader::string(const std::string& key) {
  const auto& v = raw(key);
  if (!v.is_string()) fail(key, "expected string, got " + json_type_name(v));
  return v.get<std::string>();
}
std::string ObjectReader::string(const std::string& key, const std::string& fallback) {
  known_.insert(key);
  return has(key) ? string(key) : fallback;
}

bool ObjectReader::boolean(const std::string& key, bool fallback) {
  known_.insert(key);
  if (!has(key)) return fallback;
  const auto& v = object_.at(key);
  if (!v.is_boolean()) fail(key, "expected boolean, got " + json_type_name(v));
  return v.get<bool>();
}

ObjectReader ObjectReader::object(const std::string& key) { return ObjectReader(raw(key), path_of(key), source_); }

void ObjectReader::reject_unknown_keys() const {
  for (const auto& [key, value] : object_.items()) {
    if (known_.count(key)) continue;
    std::string known_list;
    for (const auto& k : known_) append_to_list(known_list, k);
    fail_at(source_, path_of(key), "unknown key (known keys here: " + known_list + ")");
  }
}

void ObjectReader::fail(const std::string& key, const std::string& message) const {
  fail_at(source_, path_of(key), message);
}
void ObjectReader::fail_here(const std::string& message) const { fail_at(source_, path_, message); }

StrictJson parse_json_checked(std::string_view text) {
  StrictJson result;
  std::vector<std::set<std::string>> keys_of_open_objects;
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys_of_open_objects.emplace_back();
    if (event == Event::object_end && !keys_of_open_objects.empty()) keys_of_open_objects.pop_back();
    if (event == Event::key && !keys_of_open_objects.empty() && result.repeated_key.empty() &&
        !keys_of_open_objects.back().insert(parsed.get<std::string>()).second) {
      result.repeated_key = parsed.get<std::string>();
    }
    return true;
  };
  try {
    result.document = nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for 1e400
    result.parse_error = e.what();
  }
  return result;
}

nlohmann::json parse_json_strictly(std::string_view text, const std::string& source, const std::string& what) {
  StrictJson parsed = parse_json_checked(text);
  if (!parsed.parse_error.empty()) {
    throw CaseError(printable(source) + ": " + what + " is not valid JSON: " + printable(parsed.parse_error));
  }
  if (!parsed.repeated_key.empty()) {
    throw CaseError(printable(source) + ": " + what + " repeats the key \"" + printable(parsed.repeated_key) +
                    "\" in one object (which one is meant?)");
  }
  return std::move(parsed.document);
}

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    throw CaseError(printable(path) + ": cannot open " + what + ": " + std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode)) throw CaseError(printable(path) + ": cannot open " + what + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CaseError(printable(path) + ": cannot open " + what);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_json_strictly(buffer.str(), path, what);
}

}  // namespace lossverify::detail
