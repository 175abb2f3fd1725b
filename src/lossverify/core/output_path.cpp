#include "lossverify/core/output_path.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"

namespace lossverify {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void refuse(std::string_view option, const std::string& path, const std::string& why) {
  throw CaseError(std::string(option) + " " + printable(path) + ": " + why);
}

// Follows symbolic links until a path that is not one (it may not exist yet); the loop limit is the kernel's.
fs::path follow_links(std::string_view option, const std::string& path) {
  fs::path current = path;
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code error;
    if (!fs::is_symlink(fs::symlink_status(current, error))) return current;
    const fs::path target = fs::read_symlink(current, error);
    if (error) refuse(option, path, "cannot read the symbolic link " + printable(current.string()));
    current = target.is_absolute() ? target : current.parent_path() / target;
  }
  refuse(option, path, "too many levels of symbolic links");
}

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return nullptr;
}

bool same_file(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

}  // namespace

OutputTarget resolve_output(std::string_view option, const std::string& path) {
  if (path.empty()) refuse(option, path, "empty path");
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    if (const char* kind = kind_of(info.st_mode)) refuse(option, path, std::string("is ") + kind + ", not a file");
    if (S_ISCHR(info.st_mode) || S_ISFIFO(info.st_mode)) return {OutputTarget::Kind::stream, path};
  } else if (errno != ENOENT) {
    refuse(option, path, std::strerror(errno));
  }
  const fs::path target = follow_links(option, path);
  const fs::path folder = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code error;
  if (!fs::is_directory(folder, error))
    refuse(option, path, "folder " + printable(folder.string()) + " does not exist");
  return {OutputTarget::Kind::file, target.string()};
}

void check_output_path(std::string_view option, const std::string& path, const std::vector<std::string>& inputs) {
  if (path.empty()) return;
  const OutputTarget target = resolve_output(option, path);
  struct stat info {};
  const bool exists = ::stat(target.path.c_str(), &info) == 0;
  if (exists) {
    for (const std::string& input : inputs) {
      struct stat read {};
      if (::stat(input.c_str(), &read) == 0 && same_file(info, read)) {
        refuse(option, path, "is " + printable(input) + ", which this command reads; write elsewhere");
      }
    }
  }
  if (target.kind == OutputTarget::Kind::stream) {
    if (::access(target.path.c_str(), W_OK) != 0) refuse(option, path, std::strerror(errno));
    return;
  }
  const fs::path file(target.path);
  const std::string folder = file.parent_path().empty() ? "." : file.parent_path().string();
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    refuse(option, path, "folder " + printable(folder) + " cannot be written: " + std::strerror(errno));
  }
  const long name_max = ::pathconf(folder.c_str(), _PC_NAME_MAX);
  const std::size_t name_length = file.filename().string().size();
  if (name_max > 0 && name_length > static_cast<std::size_t>(name_max)) {
    refuse(option, path,
           "the file name is " + std::to_string(name_length) + " bytes, more than the " + std::to_string(name_max) +
               " its file system allows");
  }
}

std::string output_identity(const std::string& path) {
  const OutputTarget target = resolve_output("output", path);
  if (target.kind == OutputTarget::Kind::stream) return target.path;
  std::error_code error;
  const fs::path absolute = fs::absolute(fs::path(target.path), error);
  if (error) return target.path;
  const fs::path canonical = fs::weakly_canonical(absolute, error);
  return (error ? absolute.lexically_normal() : canonical).string();
}

void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& option_paths) {
  std::vector<std::pair<std::string, std::string>> seen;  // (identity, option)
  for (const auto& [option, path] : option_paths) {
    if (path.empty()) continue;
    if (resolve_output(option, path).kind == OutputTarget::Kind::stream) continue;
    const std::string identity = output_identity(path);
    for (const auto& [other_identity, other_option] : seen) {
      if (other_identity == identity) {
        refuse(option, path,
               "is the same file as " + other_option + " (" + printable(identity) +
                   "): one would overwrite the other; give each its own path");
      }
    }
    seen.emplace_back(identity, option);
  }
}

void check_output_folder(std::string_view option, const std::string& folder) {
  std::error_code error;
  if (!fs::is_directory(folder, error)) refuse(option, folder, "not an existing folder");
  if (::access(folder.c_str(), W_OK | X_OK) != 0)
    refuse(option, folder, std::string("cannot be written: ") + std::strerror(errno));
}

void prepare_new_folder(std::string_view option, const std::string& folder) {
  const std::string what = std::string(option) + " " + printable(folder);
  std::error_code error;
  const fs::file_status status = fs::status(folder, error);
  if (fs::exists(status)) {
    if (!fs::is_directory(status)) throw CaseError(what + ": exists and is not a folder");
    if (!fs::is_empty(folder, error)) {
      throw CaseError(what + ": the folder is not empty (give a new or empty folder; nothing was written)");
    }
    if (::access(folder.c_str(), W_OK | X_OK) != 0) {
      throw CaseError(what + ": the folder cannot be written: " + std::strerror(errno));
    }
    return;
  }
  if (!fs::create_directories(folder, error) && error) {
    throw CaseError(what + ": cannot create the folder: " + error.message());
  }
}

}  // namespace lossverify
