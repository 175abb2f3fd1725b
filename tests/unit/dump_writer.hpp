#pragma once
// Writes safetensors and .npy bytes for the dump tests (the same formats safetensors.torch.save_file and
// numpy.save write).
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

namespace lossverify::testing {

struct RawTensor {
  std::string dtype;  // safetensors name: F32, BF16, I64, ...
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
};

template <class T>
RawTensor raw_tensor(const std::string& dtype, std::vector<std::int64_t> shape, const std::vector<T>& values) {
  RawTensor t{dtype, std::move(shape), std::vector<std::byte>(values.size() * sizeof(T))};
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

inline std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

inline std::string safetensors_bytes(const std::map<std::string, RawTensor>& tensors,
                                     const nlohmann::json& metadata = nullptr) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    header[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.data.size()}}};
    data.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  }
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return le64(text.size()) + text + data;
}

inline std::string npy_bytes(const std::string& descr, const std::vector<std::int64_t>& shape, const std::string& data,
                             int version = 1, bool fortran = false) {
  std::string dims;
  for (auto d : shape) dims += std::to_string(d) + ", ";
  std::string header =
      "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") + ", 'shape': (" + dims + "), }";
  const std::size_t prefix = version == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  const std::uint64_t n = header.size();
  for (std::size_t i = 0; i < (version == 1 ? 2u : 4u); ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A fresh, empty temporary folder.
inline std::filesystem::path temp_folder(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("lossverify-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace lossverify::testing
