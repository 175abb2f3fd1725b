#include "lossverify/dump/safetensors_writer.hpp"

#include "lossverify/core/atomic_file.hpp"
#include "lossverify/core/errors.hpp"

namespace lossverify::dump {

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const nlohmann::json& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    std::uint64_t numel = 1;
    for (const std::int64_t d : t.shape) numel *= static_cast<std::uint64_t>(d);
    if (numel * item_size(t.dtype) != t.data.size()) {
      throw InternalError(path + ": tensor \"" + t.name + "\": " + std::to_string(t.data.size()) +
                          " bytes for its shape and dtype " + std::string(to_string(t.dtype)));
    }
    header[t.name] = {
        {"dtype", to_string(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  if (metadata.is_object()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>((text.size() >> (8 * i)) & 0xff);
  AtomicFile file(path, "tensor file");
  file.write(length, sizeof(length));
  file.write(text);
  for (const TensorToWrite& t : tensors) file.write(t.data.data(), t.data.size());
  file.commit();
}

}  // namespace lossverify::dump
