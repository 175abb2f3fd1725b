#pragma once
// Where a command writes a file the user named (--report, --junit, --plot, --out, bundles), and the rule that
// decides how. The rule, documented in docs/command-line.md:
//   - a path that does not exist, or names a regular file, is written atomically: the bytes go to a temporary
//     file in the same folder, renamed over the path when complete;
//   - a symbolic link is followed (to any depth): the file it points to is what gets written, the link stays;
//   - a character device or a FIFO (/dev/stdout, /dev/null, a named pipe, `>(jq .)`) is written as a stream;
//   - a folder, a block device or a socket is refused.
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lossverify {

struct OutputTarget {
  enum class Kind { file, stream };
  Kind kind = Kind::file;
  std::string path;  // for a file: where the bytes land, symbolic links resolved; for a stream: as given
};

// Applies the rule to `path`; throws CaseError (exit 2) for a folder, a block device, a socket, a symbolic
// link loop or a missing folder. `option` names the path's origin in messages ("--report").
OutputTarget resolve_output(std::string_view option, const std::string& path);

// Everything that can be known before the work starts: the rule above, a folder that exists and can be
// written, a name the file system accepts, and not one of `inputs` (files the command reads: a case file, a
// manifest, a bundle). Throws CaseError (exit 2) naming the option, the path and the problem.
void check_output_path(std::string_view option, const std::string& path, const std::vector<std::string>& inputs = {});

// Where a file output lands, as one comparable name: absolute, its symbolic links followed, `.` and `..` resolved.
// A stream (a character device, a FIFO) is itself. For a path check_output_path accepted.
std::string output_identity(const std::string& path);

// The outputs one command writes, by option: two that land in one file (`./r.json` and `r.json`, a path through
// `sub/..`, a symbolic link to the other) are refused, CaseError (exit 2) naming both options; empty paths are
// ignored, and so are streams (two `/dev/stdout` are the user's choice).
void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& option_paths);

// A folder files will be written into (bundles): it exists and can be written. Throws CaseError (exit 2).
void check_output_folder(std::string_view option, const std::string& folder);

// A folder a command fills with files of its own (export-inputs --out, gate --run-reports): created when missing,
// refused when it exists and is not an empty, writable folder, so nothing there is written over. Throws CaseError
// (exit 2) naming the option.
void prepare_new_folder(std::string_view option, const std::string& folder);

}  // namespace lossverify
