#include "lossverify/report/plot.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <sstream>

#include "lossverify/core/build_info.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/report/report.hpp"

namespace lossverify {

namespace {

using nlohmann::json;

constexpr double kWidth = 980.0;
constexpr double kLogFloor = -4.0;   // margins below 1e-4 share the palest color
constexpr double kLogCeiling = 4.0;  // and above 1e4 the darkest red

std::string fixed(double v, int decimals = 1) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, v);
  return buffer;
}

// Short margin for labels: 0, 3.2e-05, 0.41, 1.2e+03, inf, NaN.
std::string short_margin(double m) {
  if (std::isnan(m)) return "NaN";
  if (std::isinf(m)) return m > 0 ? "inf" : "-inf";
  if (m == 0.0) return "0";
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.2g", m);
  // 4.1e+32 -> 4.1e32, 3e-05 -> 3e-5: narrow heatmap cells.
  std::string text = buffer;
  const std::size_t e = text.find('e');
  if (e != std::string::npos) {
    std::string exponent = text.substr(e + 1);
    const bool negative = exponent[0] == '-';
    exponent.erase(0, exponent.find_first_not_of("+-0"));
    text = text.substr(0, e + 1) + (negative ? "-" : "") + (exponent.empty() ? "0" : exponent);
  }
  return text;
}

// Exact margin for data attributes (round-trips; non-finite as in the JSON report).
std::string exact_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "%.17g", v);
  return buffer;
}

bool fails(double margin) { return std::isnan(margin) || margin > 1.0; }

// Whether a label fits a width at a font size (sans-serif digits are about 0.6 em wide), with some air.
bool fits(std::string_view label, double font_size, double width) {
  return 0.62 * font_size * static_cast<double>(label.size()) + 6.0 <= width;
}

struct Rgb {
  double r, g, b;
};
Rgb mix(Rgb a, Rgb b, double t) {
  t = std::clamp(t, 0.0, 1.0);
  return {a.r + (b.r - a.r) * t, a.g + (b.g - a.g) * t, a.b + (b.b - a.b) * t};
}
std::string hex(Rgb c) {
  char buffer[8];
  auto channel = [](double x) { return static_cast<int>(std::lround(std::clamp(x, 0.0, 255.0))); };
  std::snprintf(buffer, sizeof(buffer), "#%02x%02x%02x", channel(c.r), channel(c.g), channel(c.b));
  return buffer;
}

// Passing margins in greens (paler further from the threshold), failing ones from orange to dark red, and
// NaN/inf in dark purple: the step at margin 1 is the pass/fail threshold.
std::string margin_color(double margin) {
  if (std::isnan(margin) || std::isinf(margin)) return "#49006a";
  const double l = margin > 0.0 ? std::clamp(std::log10(margin), kLogFloor, kLogCeiling) : kLogFloor;
  if (margin <= 1.0) return hex(mix({237, 248, 233}, {65, 171, 93}, (l - kLogFloor) / -kLogFloor));
  return hex(mix({253, 174, 97}, {165, 0, 38}, l / kLogCeiling));
}

class Svg {
 public:
  std::ostringstream body;
  void text(double x, double y, std::string_view content, const std::string& attributes = "") {
    body << "<text x=\"" << fixed(x) << "\" y=\"" << fixed(y) << "\"" << (attributes.empty() ? "" : " ") << attributes
         << ">" << xml_escape(content) << "</text>\n";
  }
  void line(double x1, double y1, double x2, double y2, const std::string& attributes) {
    body << "<line x1=\"" << fixed(x1) << "\" y1=\"" << fixed(y1) << "\" x2=\"" << fixed(x2) << "\" y2=\"" << fixed(y2)
         << "\" " << attributes << "/>\n";
  }
};

std::string check_line(const CheckResult& check) {
  std::string line = check.name + ": " +
                     (check.verdict == Verdict::fail ? "FAIL" : std::string(to_string(check.verdict))) + ", margin " +
                     short_margin(check.margin);
  if (check.worst && check.margin > 0.0) {
    const ElementRecord& w = *check.worst;
    line += "; worst at token " + (w.token >= 0 ? std::to_string(w.token) : std::string("-")) + ", column " +
            (w.column >= 0 ? std::to_string(w.column) : std::string("-")) + ", rank " + std::to_string(w.rank) +
            ": expected " + short_margin(w.expected) + ", got " + short_margin(w.got);
    if (w.padding_sequence >= 0) line += " (padding of sequence " + std::to_string(w.padding_sequence) + ")";
  }
  return line;
}

std::string failing_checks(const RunResult& run) {
  std::string list;
  for (const CheckResult& c : run.checks) {
    if (c.verdict == Verdict::fail) append_to_list(list, c.name);
  }
  return list;
}

// A heatmap of one margin per rank: rows are (dp, cp) token groups, columns the TP shards.
double draw_heatmap(Svg& svg, const RunResult& run, bool grad, double left, double top, double width) {
  const LayoutSpec& layout = run.the_case.layout;
  const ErrorMap& map = run.error_map;
  const std::string prefix = grad ? "grad" : "loss";
  const int groups = layout.dp * layout.cp;
  const double label_width = 86.0;
  const double grid_left = left + label_width;
  const double grid_width = width - label_width - 28.0;  // room for the last column's range label
  const double cell_w = std::clamp(grid_width / layout.tp, 2.0, 120.0);
  const double cell_h = std::clamp(320.0 / groups, 3.0, 30.0);
  svg.text(left, top + 14.0, grad ? "gradient margin per rank x vocabulary shard" : "per-token loss margin per rank",
           "font-size=\"13\" font-weight=\"bold\"");
  // Column labels: TP rank and its vocabulary range, when there is room; ranges too wide for one cell
  // alternate between two lines.
  const int tp_label_every = std::max(1, static_cast<int>(std::ceil(34.0 / cell_w)));
  auto range_of = [&](int t) {
    if (static_cast<std::size_t>(t) >= map.ranks.size()) return std::string();
    const auto& cell = map.ranks[static_cast<std::size_t>(t)];
    return "[" + std::to_string(cell.vocab_begin) + ", " + std::to_string(cell.vocab_end) + ")";
  };
  const std::string widest = range_of(layout.tp - 1);
  const bool ranges_inline = tp_label_every == 1 && fits(widest, 9.0, cell_w);
  const bool ranges_staggered = !ranges_inline && tp_label_every == 1 && fits(widest, 9.0, 2.0 * cell_w);
  const double header = ranges_staggered ? 60.0 : 48.0;
  const double grid_top = top + header;
  for (int t = 0; t < layout.tp; ++t) {
    if (t % tp_label_every != 0) continue;
    const double x = grid_left + (t + 0.5) * cell_w;
    svg.text(x, grid_top - (ranges_staggered ? 31.0 : 20.0), "tp " + std::to_string(t),
             "font-size=\"11\" text-anchor=\"middle\"");
    if (ranges_inline || ranges_staggered) {
      const double y = grid_top - (ranges_staggered && t % 2 == 0 ? 18.0 : 7.0);
      svg.text(x, y, range_of(t), "font-size=\"9\" text-anchor=\"middle\" fill=\"#555\" class=\"vocab-range\"");
    }
  }
  const int row_label_every = std::max(1, static_cast<int>(std::ceil(11.0 / cell_h)));
  for (int g = 0; g < groups; ++g) {
    if (g % row_label_every != 0) continue;
    const int dp = g / layout.cp;
    const int cp = g % layout.cp;
    std::string label = "dp " + std::to_string(dp);
    if (layout.cp > 1) label += " cp " + std::to_string(cp);
    svg.text(grid_left - 6.0, grid_top + (g + 0.5) * cell_h + 4.0, label, "font-size=\"11\" text-anchor=\"end\"");
  }
  for (const RankErrorCell& cell : map.ranks) {
    const double margin = grad ? cell.grad_margin : cell.loss_margin;
    const auto g = static_cast<double>(cell.dp * layout.cp + cell.cp);
    const double x = grid_left + static_cast<double>(cell.tp) * cell_w;
    const double y = grid_top + g * cell_h;
    const bool failed = fails(margin);
    svg.body << "<rect id=\"" << prefix << "-cell-r" << cell.rank << "\" class=\"cell " << (failed ? "fail" : "pass")
             << "\" data-rank=\"" << cell.rank << "\" data-tp=\"" << cell.tp << "\" data-cp=\"" << cell.cp
             << "\" data-dp=\"" << cell.dp << "\" data-vocab-begin=\"" << cell.vocab_begin << "\" data-vocab-end=\""
             << cell.vocab_end << "\" data-margin=\"" << exact_number(margin) << "\" x=\"" << fixed(x) << "\" y=\""
             << fixed(y) << "\" width=\"" << fixed(cell_w) << "\" height=\"" << fixed(cell_h) << "\" fill=\""
             << margin_color(margin) << "\" stroke=\"" << (failed ? "#000" : "#fff") << "\" stroke-width=\""
             << (failed && cell_w >= 6.0 ? "2" : "0.5") << "\"><title>"
             << xml_escape("rank " + std::to_string(cell.rank) + " (tp " + std::to_string(cell.tp) + ", cp " +
                           std::to_string(cell.cp) + ", dp " + std::to_string(cell.dp) + "), columns [" +
                           std::to_string(cell.vocab_begin) + ", " + std::to_string(cell.vocab_end) + "): " + prefix +
                           " margin " + short_margin(margin) +
                           (grad ? ", " + std::to_string(cell.grad_mismatches) + " mismatching elements" : ""))
             << "</title></rect>\n";
    const std::string label = short_margin(margin);
    if (cell_h >= 14.0 && fits(label, 11.0, cell_w)) {
      const bool dark = failed || margin > 0.1;
      svg.text(x + cell_w / 2.0, y + cell_h / 2.0 + 4.0, label,
               std::string("font-size=\"11\" text-anchor=\"middle\" fill=\"") + (dark ? "#fff" : "#222") + "\"");
    }
  }
  double height = header + groups * cell_h + 8.0;
  if (!grad) {
    // The logged (reduced) loss is one value per rank group, checked apart from the per-token losses.
    for (const CheckResult& check : run.checks) {
      if (check.name != "loss" || !check.metrics.contains("reduced")) continue;
      const json& reduced = check.metrics["reduced"];
      if (!reduced.contains("margin")) continue;
      const double margin = decode_number(reduced["margin"]);
      svg.body << "<rect id=\"logged-loss\" class=\"logged " << (fails(margin) ? "fail" : "pass") << "\" data-margin=\""
               << exact_number(margin) << "\" x=\"" << fixed(grid_left) << "\" y=\"" << fixed(top + height)
               << "\" width=\"14\" height=\"14\" fill=\"" << margin_color(margin) << "\"/>\n";
      svg.text(grid_left + 20.0, top + height + 11.0,
               "logged (reduced) loss, all ranks: margin " + short_margin(margin) + (fails(margin) ? "  FAIL" : ""),
               "font-size=\"11\"");
      height += 22.0;
    }
  }
  return height;
}

// The color scale with the threshold at margin 1.
double draw_legend(Svg& svg, double left, double top) {
  const double bar_left = left + 170.0;
  const double bar_width = 400.0;
  svg.text(left, top + 13.0, "margin (error / tolerance)", "font-size=\"11\"");
  const int steps = 64;
  for (int i = 0; i < steps; ++i) {
    const double l = kLogFloor + (kLogCeiling - kLogFloor) * (i + 0.5) / steps;
    svg.body << "<rect class=\"legend\" x=\"" << fixed(bar_left + bar_width * i / steps) << "\" y=\""
             << fixed(top + 2.0) << "\" width=\"" << fixed(bar_width / steps + 0.3) << "\" height=\"14\" fill=\""
             << margin_color(std::pow(10.0, l)) << "\"/>\n";
  }
  for (int l = static_cast<int>(kLogFloor); l <= static_cast<int>(kLogCeiling); l += 2) {
    const double x = bar_left + bar_width * (l - kLogFloor) / (kLogCeiling - kLogFloor);
    svg.text(x, top + 30.0, l == 0 ? "1" : "1e" + std::to_string(l), "font-size=\"10\" text-anchor=\"middle\"");
  }
  const double threshold = bar_left + bar_width * (0.0 - kLogFloor) / (kLogCeiling - kLogFloor);
  svg.line(threshold, top - 2.0, threshold, top + 20.0, "stroke=\"#000\" stroke-width=\"2\" class=\"threshold\"");
  svg.text(bar_left + bar_width + 14.0, top + 13.0, "pass <= 1 < fail", "font-size=\"11\" font-weight=\"bold\"");
  svg.body << "<rect x=\"" << fixed(bar_left + bar_width + 120.0) << "\" y=\"" << fixed(top + 2.0)
           << "\" width=\"14\" height=\"14\" fill=\"" << margin_color(std::numeric_limits<double>::infinity())
           << "\"/>\n";
  svg.text(bar_left + bar_width + 138.0, top + 13.0, "inf / NaN", "font-size=\"11\"");
  return 40.0;
}

// One per-token strip: a bar per bin, log-scaled height, dashed threshold at 1.
double draw_token_strip(Svg& svg, const RunResult& run, const std::vector<TokenBin>& bins, bool grad, double top) {
  const double left = 70.0;
  const double width = kWidth - left - 20.0;
  const double height = 110.0;
  const std::int64_t n = run.the_case.shape.tokens;
  const std::string name = grad ? "grad" : "loss";
  svg.text(left, top + 12.0,
           std::string("largest ") + (grad ? "gradient" : "loss") + " margin per token" +
               (bins.size() < static_cast<std::size_t>(n)
                    ? " (" + std::to_string(bins.size()) + " bins of ~" +
                          std::to_string((n + static_cast<std::int64_t>(bins.size()) - 1) /
                                         static_cast<std::int64_t>(bins.size())) +
                          " tokens, max per bin)"
                    : ""),
           "font-size=\"13\" font-weight=\"bold\"");
  const double plot_top = top + 20.0;
  const double log_top = 6.0;
  auto y_of = [&](double l) { return plot_top + height * (log_top - l) / (log_top - kLogFloor); };
  svg.body << "<rect x=\"" << fixed(left) << "\" y=\"" << fixed(plot_top) << "\" width=\"" << fixed(width)
           << "\" height=\"" << fixed(height) << "\" fill=\"#fafafa\" stroke=\"#ccc\"/>\n";
  for (int l = static_cast<int>(kLogFloor); l <= static_cast<int>(log_top); l += 2) {
    svg.text(left - 4.0, y_of(l) + 3.0, l == 0 ? "1" : "1e" + std::to_string(l), "font-size=\"9\" text-anchor=\"end\"");
    svg.line(left, y_of(l), left + width, y_of(l), "stroke=\"#eee\"");
  }
  // Sequence boundaries, when few enough to read.
  const GlobalBatch batch(run.the_case.batch);
  if (batch.sequences().size() > 1 && batch.sequences().size() <= 64) {
    for (const Sequence& s : batch.sequences()) {
      if (s.begin == 0) continue;
      const double x = left + width * static_cast<double>(s.begin) / static_cast<double>(n);
      svg.line(x, plot_top, x, plot_top + height, "stroke=\"#bbb\" stroke-dasharray=\"2,2\" class=\"sequence-start\"");
    }
  }
  const double bar_width = width / static_cast<double>(std::max<std::size_t>(1, bins.size()));
  for (const TokenBin& bin : bins) {
    const double margin = grad ? bin.grad_margin : bin.loss_margin;
    const double x = left + width * static_cast<double>(bin.first) / static_cast<double>(n);
    const bool nonfinite = std::isnan(margin) || std::isinf(margin);
    const double l = nonfinite      ? log_top
                     : margin > 0.0 ? std::clamp(std::log10(margin), kLogFloor, log_top)
                                    : kLogFloor;
    const double y = y_of(l);
    const bool failed = fails(margin);
    svg.body << "<rect class=\"bin " << (failed ? "fail" : "pass") << "\" data-quantity=\"" << name
             << "\" data-first-token=\"" << bin.first << "\" data-last-token=\"" << bin.last << "\" data-margin=\""
             << exact_number(margin) << "\" x=\"" << fixed(x) << "\" y=\"" << fixed(y) << "\" width=\""
             << fixed(std::max(bar_width - (bar_width > 3.0 ? 0.5 : 0.0), 0.6)) << "\" height=\""
             << fixed(plot_top + height - y) << "\" fill=\"" << margin_color(margin) << "\"><title>"
             << xml_escape((bin.first == bin.last
                                ? "token " + std::to_string(bin.first)
                                : "tokens " + std::to_string(bin.first) + "-" + std::to_string(bin.last)) +
                           ": " + name + " margin " + short_margin(margin))
             << "</title></rect>\n";
  }
  svg.line(left, y_of(0.0), left + width, y_of(0.0),
           "stroke=\"#a50026\" stroke-width=\"1.5\" stroke-dasharray=\"6,3\" class=\"threshold\"");
  svg.text(left + width + 2.0, y_of(0.0) + 3.0, "1", "font-size=\"9\" fill=\"#a50026\"");
  // Token axis.
  const double axis_y = plot_top + height + 12.0;
  for (int k = 0; k <= 4; ++k) {
    const std::int64_t token = (n - 1) * k / 4;
    const double x = left + width * (static_cast<double>(token) + 0.5) / static_cast<double>(n);
    svg.text(x, axis_y, std::to_string(token), "font-size=\"9\" text-anchor=\"middle\"");
  }
  svg.text(left + width / 2.0, axis_y + 12.0, "token", "font-size=\"10\" text-anchor=\"middle\" fill=\"#555\"");
  return 20.0 + height + 30.0;
}

std::string sanitise(std::string_view text) {
  std::string out;
  for (char ch : text) {
    out += (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-') ? ch : '_';
  }
  return out;
}

std::string lower(std::string text) {
  for (char& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return text;
}

std::string run_title(const RunResult& run) {
  return "case " + run.the_case.name + ", impl " + run.implementation->name;
}

}  // namespace

std::vector<TokenBin> bin_token_margins(const ErrorMap& map, int max_bins) {
  const auto n = static_cast<std::int64_t>(std::max(map.token_grad_margin.size(), map.token_loss_margin.size()));
  std::vector<TokenBin> bins;
  if (n == 0) return bins;
  const std::int64_t count = std::min<std::int64_t>(n, std::max(1, max_bins));
  auto worse = [](double a, double b) {  // NaN wins, then the larger
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
    return std::max(a, b);
  };
  for (std::int64_t b = 0; b < count; ++b) {
    TokenBin bin;
    bin.first = b * n / count;
    bin.last = (b + 1) * n / count - 1;
    for (std::int64_t t = bin.first; t <= bin.last; ++t) {
      const auto k = static_cast<std::size_t>(t);
      if (k < map.token_grad_margin.size()) bin.grad_margin = worse(bin.grad_margin, map.token_grad_margin[k]);
      if (k < map.token_loss_margin.size()) bin.loss_margin = worse(bin.loss_margin, map.token_loss_margin[k]);
    }
    bins.push_back(bin);
  }
  return bins;
}

std::string plot_svg(const RunResult& run, const PlotOptions& options) {
  const Case& c = run.the_case;
  Svg svg;
  double y = 26.0;
  svg.text(16.0, y, "lossverify error map: " + run_title(run), "font-size=\"18\" font-weight=\"bold\" class=\"title\"");
  y += 20.0;
  const std::string failing = failing_checks(run);
  svg.text(16.0, y,
           std::string(to_string(c.loss.kind)) + ", N=" + std::to_string(c.shape.tokens) +
               " V=" + std::to_string(c.shape.vocab) + ", " + std::string(to_string(c.inputs.dtype)) +
               ", tp=" + std::to_string(c.layout.tp) + " cp=" + std::to_string(c.layout.cp) + " dp=" +
               std::to_string(c.layout.dp) + " ga=" + std::to_string(c.layout.ga) + " (" + std::to_string(run.ranks) +
               " ranks)   verdict: " + (run.verdict == Verdict::fail ? "FAIL (" + failing + ")" : std::string("pass")),
           std::string("font-size=\"13\" class=\"verdict\" fill=\"") +
               (run.verdict == Verdict::fail ? "#a50026" : "#1b5e20") + "\"");
  y += 6.0;
  for (const CheckResult& check : run.checks) {
    if (check.verdict != Verdict::fail) continue;
    y += 16.0;
    svg.text(28.0, y, check_line(check), "font-size=\"11\" class=\"failing-check\"");
  }
  y += 16.0;
  const double half = (kWidth - 32.0) / 2.0;
  const double grad_height = draw_heatmap(svg, run, true, 16.0, y, half);
  const double loss_height = draw_heatmap(svg, run, false, 16.0 + half + 16.0, y, half);
  y += std::max(grad_height, loss_height);
  y += draw_legend(svg, 16.0, y);
  const std::vector<TokenBin> bins = bin_token_margins(run.error_map, options.max_token_bins);
  if (!bins.empty()) {
    y += draw_token_strip(svg, run, bins, true, y);
    y += draw_token_strip(svg, run, bins, false, y);
  }
  y += 4.0;
  svg.text(16.0, y, std::string("lossverify ") + build_info::version + " (git " + build_info::git_revision + ")",
           "font-size=\"9\" fill=\"#888\"");
  y += 10.0;
  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << fixed(kWidth, 0) << "\" height=\"" << fixed(y, 0)
      << "\" viewBox=\"0 0 " << fixed(kWidth, 0) << " " << fixed(y, 0)
      << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
      << "<title>" << xml_escape("lossverify error map: " + run_title(run)) << "</title>\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n"
      << svg.body.str() << "</svg>\n";
  return out.str();
}

std::string plot_html(const std::vector<const RunResult*>& runs, const PlotOptions& options) {
  std::ostringstream out;
  std::string title = "lossverify error map";
  if (runs.size() == 1) title += ": " + run_title(*runs.front());
  out << "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n<meta "
         "charset=\"utf-8\"/>\n"
      << "<title>" << xml_escape(title) << "</title>\n"
      << "<style>body{font-family:sans-serif;margin:16px;color:#222}table{border-collapse:collapse;margin:"
         "8px 0 24px}"
         "td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}.fail{color:#a50026;"
         "font-weight:bold}section{margin-bottom:32px}</style>\n</head>\n<body>\n"
      << "<h1>" << xml_escape(title) << "</h1>\n";
  for (const RunResult* run : runs) {
    out << "<section>\n<h2>"
        << xml_escape(run_title(*run) + ", layout " + layout_name(run->the_case.layout) + ": " +
                      (run->verdict == Verdict::fail ? "FAIL" : "pass"))
        << "</h2>\n";
    if (!run->the_case.description.empty()) out << "<p>" << xml_escape(run->the_case.description) << "</p>\n";
    out << plot_svg(*run, options);
    out << "<table>\n<tr><th>check</th><th>verdict</th><th>margin</th><th>summary</th></tr>\n";
    for (const CheckResult& check : run->checks) {
      const bool failed = check.verdict == Verdict::fail;
      out << "<tr" << (failed ? " class=\"fail\"" : "") << "><td>" << xml_escape(check.name) << "</td><td>"
          << (failed ? "FAIL" : std::string(to_string(check.verdict))) << "</td><td>" << short_margin(check.margin)
          << "</td><td>" << xml_escape(check_line(check) + (check.summary.empty() ? "" : " (" + check.summary + ")"))
          << "</td></tr>\n";
    }
    out << "</table>\n</section>\n";
  }
  out << "<p style=\"color:#888;font-size:11px\">lossverify " << build_info::version << " (git "
      << xml_escape(build_info::git_revision) << ")</p>\n</body>\n</html>\n";
  return out.str();
}

bool is_plot_path(const std::string& path) {
  const std::string extension = lower(std::filesystem::path(path).extension().string());
  return extension == ".svg" || extension == ".html" || extension == ".htm";
}

std::vector<std::pair<std::string, std::string>> render_plots(const std::string& path,
                                                              const std::vector<const RunResult*>& runs,
                                                              const PlotOptions& options) {
  if (!is_plot_path(path)) {
    throw CaseError("--plot " + path + ": expected a file ending in .svg, .html or .htm");
  }
  std::vector<std::pair<std::string, std::string>> files;
  if (runs.empty()) return files;
  const std::filesystem::path p(path);
  const std::string extension = lower(p.extension().string());
  if (extension != ".svg") {
    files.emplace_back(path, plot_html(runs, options));
    return files;
  }
  if (runs.size() == 1) {
    files.emplace_back(path, plot_svg(*runs.front(), options));
    return files;
  }
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const RunResult& run = *runs[k];
    std::string stem = p.stem().string() + "-" + std::to_string(k + 1) + "-" + sanitise(run.the_case.name);
    bool several_layouts = false;
    for (const RunResult* other : runs) {
      several_layouts = several_layouts || (other->the_case.name == run.the_case.name && other != &run);
    }
    if (several_layouts) stem += "-" + layout_name(run.the_case.layout);
    files.emplace_back((p.parent_path() / (stem + p.extension().string())).string(), plot_svg(run, options));
  }
  return files;
}

}  // namespace lossverify
