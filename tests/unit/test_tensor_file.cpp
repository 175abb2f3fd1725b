// The safetensors and .npy readers: every dtype, both formats' headers, and every way a file can be broken.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <filesystem>

#include <sys/stat.h>

#include <Eigen/Core>

#include "dump_writer.hpp"
#include "lossverify/dump/tensor_file.hpp"

using namespace lossverify;
using namespace lossverify::dump;
using namespace lossverify::testing;

namespace {

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::vector<TensorInfo> parse_st(const std::string& file) {
  return parse_safetensors_header(bytes_of(file), file.size(), "x.safetensors");
}

// The message of the DumpError that parsing throws, or "" when it parses.
std::string st_error(const std::string& file) {
  try {
    parse_st(file);
  } catch (const DumpError& e) {
    CHECK(e.code() == ExitCode::usage_error);
    return e.what();
  }
  return "";
}

std::string header_file(const std::string& header_json, std::size_t data_bytes) {
  return le64(header_json.size()) + header_json + std::string(data_bytes, '\0');
}

std::string npy_error(const std::string& file) {
  try {
    parse_npy_header(bytes_of(file), file.size(), "x.npy");
  } catch (const DumpError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors: every dtype is read and converted exactly") {
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0e-39f};
  const std::vector<double> f64 = {0.1, -1e300};
  const std::vector<std::uint16_t> bf16 = {std::bit_cast<std::uint32_t>(1.0f) >> 16,
                                           std::bit_cast<std::uint32_t>(-96.0f) >> 16};
  const std::vector<Eigen::half> f16 = {Eigen::half(0.5f), Eigen::half(-65504.0f)};
  const std::vector<std::int64_t> i64 = {-100, 4, INT64_MAX};
  const std::vector<std::int32_t> i32 = {-7, 300};
  const std::vector<std::uint8_t> b = {0, 1, 1};
  const std::string file = safetensors_bytes({{"f32", raw_tensor("F32", {3}, f32)},
                                              {"f64", raw_tensor("F64", {1, 2}, f64)},
                                              {"bf16", raw_tensor("BF16", {2}, bf16)},
                                              {"f16", raw_tensor("F16", {2, 1}, f16)},
                                              {"i64", raw_tensor("I64", {3}, i64)},
                                              {"i32", raw_tensor("I32", {2}, i32)},
                                              {"mask", raw_tensor("BOOL", {3}, b)},
                                              {"scalar", raw_tensor("F32", {}, std::vector<float>{7.0f})},
                                              {"empty", raw_tensor("F32", {0, 5}, std::vector<float>{})}},
                                             {{"format", "pt"}});
  const auto tensors = parse_st(file);
  REQUIRE(tensors.size() == 9);
  auto find = [&](const std::string& name) -> const TensorInfo& {
    for (const auto& t : tensors) {
      if (t.name == name) return t;
    }
    FAIL("missing " << name);
    return tensors.front();
  };
  auto data = [&](const TensorInfo& t) { return bytes_of(file).subspan(t.offset, t.bytes); };
  CHECK(to_doubles(find("f32"), data(find("f32")), "f32") ==
        std::vector<double>{1.5, -2.25, static_cast<double>(3.0e-39f)});
  CHECK(to_doubles(find("f64"), data(find("f64")), "f64") == f64);
  CHECK(to_doubles(find("bf16"), data(find("bf16")), "bf16") == std::vector<double>{1.0, -96.0});
  CHECK(to_doubles(find("f16"), data(find("f16")), "f16") == std::vector<double>{0.5, -65504.0});
  CHECK(to_integers(find("i64"), data(find("i64")), "i64") == i64);
  CHECK(to_integers(find("i32"), data(find("i32")), "i32") == std::vector<std::int64_t>{-7, 300});
  CHECK(to_integers(find("mask"), data(find("mask")), "mask") == std::vector<std::int64_t>{0, 1, 1});
  CHECK(find("scalar").shape.empty());
  CHECK(find("scalar").numel() == 1);
  CHECK(find("empty").bytes == 0);
  CHECK(find("f64").shape_string() == "[1, 2]");
  // floating-point labels or counts are not integers
  CHECK_THROWS_WITH_AS(to_integers(find("f32"), data(find("f32")), "f32 label"),
                       doctest::Contains("f32 label: dtype F32 where an integer"), DumpError);
}

TEST_CASE("safetensors: malformed headers and offsets are errors naming the file and tensor") {
  const std::string good = safetensors_bytes({{"a", raw_tensor("F32", {2}, std::vector<float>{1, 2})}});
  CHECK(st_error(good).empty());
  CHECK(st_error(good.substr(0, 5)) ==
        "x.safetensors: truncated safetensors file: 5 bytes, too short for the 8-byte header length");
  CHECK(st_error(le64(1ull << 62) + good.substr(8)) ==
        "x.safetensors: not a safetensors file (or a truncated one): the header length in its first 8 bytes exceeds "
        "the file's " +
            std::to_string(good.size()) + " bytes");
  CHECK(st_error(le64(~0ull) + good.substr(8)).find("exceeds the file's") !=
        std::string::npos);  // no overflow in 8 + n
  CHECK(st_error(good.substr(0, good.size() - 1))
            .find("x.safetensors: tensor \"a\": data_offsets [0,8] run past the end of the data (7 bytes") == 0);
  CHECK(st_error(header_file("[1, 2]", 0)).find("not a safetensors file: its header does not start with '{'") !=
        std::string::npos);
  CHECK(st_error(header_file("{\"a\": 1", 0)) ==
        "x.safetensors: safetensors header is not valid JSON");  // quotes none of it
  CHECK(st_error(header_file("{", 0)).find("too short for JSON") != std::string::npos);
  CHECK(st_error(header_file("{\"a\": 1}", 0)).find("tensor \"a\": header entry is not an object") !=
        std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [0, 1]}})", 1))
            .find("unsupported dtype \"F8_E5M2\"") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4))
            .find("must hold non-negative integers") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4))
            .find("must hold non-negative integers") != std::string::npos);
  CHECK(st_error(header_file(
                     R"({"a": {"dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 4]}})", 4))
            .find("too many elements") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}})", 8))
            .find("end before they begin") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}})", 8))
            .find("must be non-negative integers") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 8))
            .find("hold 4 bytes, but dtype F32 and shape [2] need 8") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})", 8))
            .find("unknown header key \"x\"") != std::string::npos);
  CHECK(st_error(header_file(R"({"a": {"dtype": "F32", "shape": [2]}})", 8)).find("data_offsets must be an array") !=
        std::string::npos);
  CHECK(
      st_error(header_file(
          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "I32", "shape": [1], "data_offsets": [4, 8]}})",
          8)) == "x.safetensors: tensors \"a\" and \"b\" overlap (data_offsets [0, 8) and [4, 8))");
  CHECK(
      st_error(
          header_file(
              R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
              4))
          .find("repeats the key \"a\"") != std::string::npos);
  CHECK(st_error(header_file(R"({"__metadata__": {"k": 1}})", 0)).find("must be a string") != std::string::npos);
  // names from the header are printed escaped (a terminal must not run their control characters)
  CHECK(st_error(header_file(R"({"a\u001b[2J": {"dtype": "X\u0007", "shape": [1], "data_offsets": [0, 1]}})", 1)) ==
        "x.safetensors: tensor \"a\\x1B[2J\": unsupported dtype \"X\\x07\" (this reader knows "
        "F64|F32|F16|BF16|I64|I32|I16|I8|U64|U32|U16|U8|BOOL)");
  // empty tensors may share an offset; gaps between tensors are allowed
  CHECK(
      st_error(
          header_file(
              R"({"e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [1], "data_offsets": [6, 7]}})",
              8))
          .empty());
}

TEST_CASE(".npy: versions 1-3, scalars, dtypes; Fortran order, big-endian and truncation rejected") {
  std::string data(24, '\0');
  for (int v : {1, 2, 3}) {
    const std::string file = npy_bytes("<i8", {3}, data, v);
    const TensorInfo info = parse_npy_header(bytes_of(file), file.size(), "x.npy");
    CHECK(info.dtype == TensorDType::i64);
    CHECK(info.shape == std::vector<std::int64_t>{3});
    CHECK(info.offset + info.bytes == file.size());
    CHECK(info.offset % 64 == 0);
  }
  const std::string scalar = npy_bytes("<f4", {}, std::string(4, '\0'));
  CHECK(parse_npy_header(bytes_of(scalar), scalar.size(), "s.npy").numel() == 1);
  const std::string mask = npy_bytes("|b1", {2, 2}, std::string(4, '\1'));
  CHECK(parse_npy_header(bytes_of(mask), mask.size(), "m.npy").dtype == TensorDType::boolean);
  CHECK(npy_error(npy_bytes("<f8", {3}, data, 1, true)).find("Fortran (column-major) order") != std::string::npos);
  CHECK(npy_error(npy_bytes(">f8", {3}, data)).find("big-endian") != std::string::npos);
  CHECK(npy_error(npy_bytes("<c8", {3}, data)).find("'<c8' is not supported") != std::string::npos);
  CHECK(npy_error(npy_bytes("<f8", {4}, data))
            .find("holds 24 bytes, but dtype '<f8' and shape [4] need 32: the file is truncated") != std::string::npos);
  CHECK(npy_error(npy_bytes("<f8", {2}, data)).find("holds 24 bytes") != std::string::npos);
  CHECK(npy_error("\x93NUMPY").find("truncated .npy file") != std::string::npos);
  CHECK(npy_error(std::string("\x93NUMPY\x04\x00\x10\x00", 10) + std::string(16, ' ')).find("version 4") !=
        std::string::npos);
  CHECK(npy_error(std::string("\x93NUMPY\x01\x00\xff\x7f", 10) + "{}") ==
        "x.npy: truncated .npy file: its header runs past the end of the file (12 bytes)");  // not its length 32767
  CHECK(npy_error(std::string("XXNUMPY\x01\x00\x00\x00", 10)).find("no \\x93NUMPY magic") != std::string::npos);
  std::string bad = npy_bytes("<f8", {3}, data);
  bad.replace(bad.find("'shape'"), 7, "'shapf'");
  CHECK(npy_error(bad).find(".npy header: unexpected or repeated key 'shapf'") != std::string::npos);
  bad = npy_bytes("<f8", {3}, data);
  bad.replace(bad.find("(3, )"), 5, "(3,-1)");
  CHECK(npy_error(bad).find(".npy header:") != std::string::npos);
  // the header quoted in a message: escaped, and no more than 200 characters of it
  bad = npy_bytes("<f8", {3}, data);
  bad.replace(bad.find("'shape'"), 7, "'\x1b[31m'");
  CHECK(npy_error(bad).find(".npy header: unexpected or repeated key '\\x1B[31m' at offset ") != std::string::npos);
  CHECK(npy_error(bad).find("), }\"") != std::string::npos);  // the whole (short) header, no "..."
  const std::string long_header = "{'descr': '<f8', " + std::string(300, 'x') + "}";
  std::string long_file = std::string("\x93NUMPY\x01\x00", 8) + std::string(1, static_cast<char>(long_header.size())) +
                          std::string(1, static_cast<char>(long_header.size() >> 8)) + long_header;
  const std::string long_error = npy_error(long_file);
  CHECK(long_error.find("xxx...\"") != std::string::npos);
  CHECK(long_error.size() < 320);
}

TEST_CASE("TensorFile: opens by extension, names what is missing, reads exactly the tensor's bytes") {
  const auto dir = temp_folder("tensor-file");
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  write_bytes(dir / "r.safetensors", safetensors_bytes({{"x", raw_tensor("F32", {2, 3}, values)},
                                                        {"y", raw_tensor("I64", {1}, std::vector<std::int64_t>{9})}}));
  std::string data(48, '\0');
  std::memcpy(data.data(), std::vector<double>{1, 2, 3, 4, 5, 6}.data(), 48);
  write_bytes(dir / "a.npy", npy_bytes("<f8", {3, 2}, data));
  const TensorFile st = TensorFile::open((dir / "r.safetensors").string());
  CHECK(st.format() == FileFormat::safetensors);
  const auto bytes = st.read(st.tensor("x"));
  CHECK(to_doubles(st.tensor("x"), bytes, "x") == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK_THROWS_WITH_AS(st.tensor("z"),
                       doctest::Contains("r.safetensors: no tensor \"z\" (the file holds \"x\", \"y\")"), DumpError);
  CHECK_THROWS_WITH_AS(st.tensor(""), doctest::Contains("needs a tensor name"), DumpError);
  const TensorFile npy = TensorFile::open((dir / "a.npy").string());
  CHECK(npy.format() == FileFormat::npy);
  CHECK(to_doubles(npy.tensor(""), npy.read(npy.tensor("")), "a") == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK_THROWS_WITH_AS(npy.tensor("x"), doctest::Contains("holds one unnamed tensor"), DumpError);
  CHECK_THROWS_WITH_AS(TensorFile::open((dir / "none.safetensors").string()), doctest::Contains("cannot open"),
                       DumpError);
  CHECK_THROWS_WITH_AS(TensorFile::open((dir / "r.bin").string()), doctest::Contains("expected .safetensors or .npy"),
                       DumpError);
  CHECK_THROWS_WITH_AS(TensorFile::open(dir.string() + "/.safetensors"), doctest::Contains("cannot open"), DumpError);
  std::filesystem::create_directories(dir / "d.safetensors");
  CHECK_THROWS_WITH_AS(TensorFile::open((dir / "d.safetensors").string()),
                       doctest::Contains("d.safetensors: is a directory, not a regular file"), DumpError);
  // A FIFO is refused at once, never opened for reading (that would wait for a writer forever); so is a device.
  REQUIRE(::mkfifo((dir / "f.safetensors").c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(TensorFile::open((dir / "f.safetensors").string()),
                       doctest::Contains("f.safetensors: is a FIFO, not a regular file"), DumpError);
  CHECK_THROWS_WITH_AS(read_regular_file((dir / "f.safetensors").string(), "manifest"),
                       doctest::Contains("is a FIFO, not a regular file"), DumpError);
  CHECK_THROWS_WITH_AS(TensorFile::open("/dev/null/../null.npy"), doctest::Contains("cannot open"), DumpError);
  std::filesystem::create_symlink("/dev/zero", dir / "z.npy");
  CHECK_THROWS_WITH_AS(TensorFile::open((dir / "z.npy").string()),
                       doctest::Contains("z.npy: is a character device, not a regular file"), DumpError);
  CHECK_THROWS_WITH_AS(read_regular_file((dir / "none.json").string(), "manifest"),
                       doctest::Contains("none.json: cannot open manifest: No such file"), DumpError);
  // Odd bytes in a file's name are printed escaped.
  write_bytes(dir / "odd\x1b\xff.safetensors", "short");
  CHECK_THROWS_WITH_AS(TensorFile::open((dir / "odd\x1b\xff.safetensors").string()),
                       doctest::Contains("odd\\x1B\\xFF.safetensors: truncated safetensors file: 5 bytes"), DumpError);
  // A file truncated after its header was read: the read fails, naming the tensor.
  std::filesystem::resize_file(dir / "r.safetensors", std::filesystem::file_size(dir / "r.safetensors") - 4);
  CHECK_THROWS_WITH_AS(st.read(st.tensor("y")), doctest::Contains("r.safetensors: tensor \"y\": the file ended early"),
                       DumpError);
  std::filesystem::remove_all(dir);
}
