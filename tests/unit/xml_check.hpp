#pragma once
// A small well-formedness checker for the SVG and HTML lossverify writes: balanced tags, quoted
// attributes, entities only where XML allows them. Returns "" when well formed, else what is wrong.
#include <cctype>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace lossverify::testing {

inline bool valid_entities(const std::string& text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '<') return false;
    if (text[i] != '&') continue;
    const std::size_t semi = text.find(';', i);
    if (semi == std::string::npos) return false;
    const std::string name = text.substr(i + 1, semi - i - 1);
    static const std::regex entity("amp|lt|gt|quot|apos|#[0-9]+|#x[0-9a-fA-F]+");
    if (!std::regex_match(name, entity)) return false;
  }
  return true;
}

inline std::string xml_problem(const std::string& doc) {
  std::vector<std::string> stack;
  std::size_t i = 0;
  int roots = 0;
  static const std::regex attribute(R"(\s+([A-Za-z_:][-A-Za-z0-9_:.]*)\s*=\s*"([^"]*)\")");
  while (i < doc.size()) {
    const std::size_t lt = doc.find('<', i);
    const std::string text = doc.substr(i, lt == std::string::npos ? std::string::npos : lt - i);
    if (!valid_entities(text)) return "bad character data near offset " + std::to_string(i);
    if (lt == std::string::npos) break;
    if (doc.compare(lt, 4, "<!--") == 0) {
      const std::size_t end = doc.find("-->", lt);
      if (end == std::string::npos) return "unterminated comment";
      i = end + 3;
      continue;
    }
    if (doc.compare(lt, 2, "<!") == 0 || doc.compare(lt, 2, "<?") == 0) {
      if (!stack.empty()) return "declaration inside an element";
      const std::size_t end = doc.find('>', lt);
      if (end == std::string::npos) return "unterminated declaration";
      i = end + 1;
      continue;
    }
    const std::size_t gt = doc.find('>', lt);
    if (gt == std::string::npos) return "unterminated tag at offset " + std::to_string(lt);
    std::string tag = doc.substr(lt + 1, gt - lt - 1);
    if (!tag.empty() && tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) {
        return "closing </" + name + "> does not match <" + (stack.empty() ? std::string("nothing") : stack.back()) +
               ">";
      }
      stack.pop_back();
      i = gt + 1;
      continue;
    }
    const bool self_closing = !tag.empty() && tag.back() == '/';
    if (self_closing) tag.pop_back();
    std::size_t name_end = 0;
    while (name_end < tag.size() && !std::isspace(static_cast<unsigned char>(tag[name_end]))) ++name_end;
    const std::string name = tag.substr(0, name_end);
    if (name.empty() || !(std::isalpha(static_cast<unsigned char>(name[0])))) return "bad tag name <" + tag + ">";
    std::string rest = tag.substr(name_end);
    std::map<std::string, int> seen;
    std::smatch m;
    while (std::regex_search(rest, m, attribute, std::regex_constants::match_continuous)) {
      if (++seen[m[1]] > 1) return "attribute " + m[1].str() + " repeated in <" + name + ">";
      if (!valid_entities(m[2])) return "bad attribute value in <" + name + ">";
      rest = m.suffix();
    }
    for (char ch : rest) {
      if (!std::isspace(static_cast<unsigned char>(ch))) return "malformed attributes in <" + tag + ">";
    }
    if (stack.empty()) ++roots;
    if (!self_closing) stack.push_back(name);
    i = gt + 1;
  }
  if (!stack.empty()) return "unclosed <" + stack.back() + ">";
  if (roots != 1) return "expected one root element, found " + std::to_string(roots);
  return "";
}

// The attributes of the element with id="..." (empty when there is none).
inline std::map<std::string, std::string> element_with_id(const std::string& doc, const std::string& id) {
  std::map<std::string, std::string> out;
  const std::size_t at = doc.find("id=\"" + id + "\"");
  if (at == std::string::npos) return out;
  const std::size_t lt = doc.rfind('<', at);
  const std::size_t gt = doc.find('>', at);
  const std::string tag = doc.substr(lt, gt - lt);
  static const std::regex attribute(R"(([A-Za-z_:][-A-Za-z0-9_:.]*)=\"([^\"]*)\")");
  for (auto it = std::sregex_iterator(tag.begin(), tag.end(), attribute); it != std::sregex_iterator(); ++it) {
    out[(*it)[1]] = (*it)[2];
  }
  return out;
}

// How many times `needle` occurs in `text`.
inline std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++n;
  return n;
}

}  // namespace lossverify::testing
