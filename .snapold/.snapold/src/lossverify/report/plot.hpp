#pragma once
// Where the error sits, drawn: a self-contained SVG (or an HTML page with the SVG inline) of one run's
// error map. A heatmap of ranks x vocabulary shards (rows: the DP x CP token groups, columns: the TP shards
// labelled with their column ranges) colored by log10 of each rank's largest margin, once for gradients and
// once for losses, and a per-token strip of the largest margins (binned, keeping the max of each bin).
// Margin = error / tolerance: the color scale turns from greens to reds at 1, the pass/fail threshold.
//
// Every mark carries its data for tools and tests: heatmap cells are
//   <rect id="grad-cell-r3" class="cell fail" data-rank="3" data-tp="1" data-cp="0" data-dp="1"
//         data-margin="1234.5" .../>
// and per-token bins are <rect class="bin fail" data-first-token=.. data-last-token=.. data-margin=../>.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "lossverify/runner/run_case.hpp"

namespace lossverify {

struct PlotOptions {
  int max_token_bins = 480;  // tokens beyond this are binned, each bin showing its largest margin
};

// Tokens [first, last] and their largest margins.
struct TokenBin {
  std::int64_t first = 0;
  std::int64_t last = 0;
  double grad_margin = 0.0;
  double loss_margin = 0.0;
};
// At most max_bins bins of consecutive tokens, as equal as possible; NaN margins count as the largest.
std::vector<TokenBin> bin_token_margins(const ErrorMap& map, int max_bins);

// One run as an SVG document (starts with <svg ...>, no XML declaration, so it can be inlined in HTML).
std::string plot_svg(const RunResult& run, const PlotOptions& options = {});

// An HTML page (well-formed XHTML-compatible markup) with every run's SVG inline and its checks as a table.
std::string plot_html(const std::vector<const RunResult*>& runs, const PlotOptions& options = {});

// Whether a --plot path names a format we write: ".svg", ".html" or ".htm" (case-insensitive).
bool is_plot_path(const std::string& path);

// The files --plot writes for the runs of one command, as (path, contents): FILE.html gives one page with
// every run; FILE.svg gives FILE.svg for a single run and FILE-<k>-<case>[-<layout>].svg for several
// (k counts from 1, names sanitised to [A-Za-z0-9._-]). Throws CaseError for another extension.
std::vector<std::pair<std::string, std::string>> render_plots(const std::string& path,
                                                              const std::vector<const RunResult*>& runs,
                                                              const PlotOptions& options = {});

}  // namespace lossverify
