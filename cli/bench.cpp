#include "bench.hpp"

#include <charconv>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/layout/vocab_range.hpp"
#include "lossverify/report/report.hpp"
#include "options.hpp"

namespace lossverify::cli {

namespace {

// Runs a PyTorch comparison script with `arguments`, when python3 is there; its JSON line, or why not.
nlohmann::json run_torch_script(const std::string& script, const std::string& arguments) {
  const std::string command = "python3 " + script + " " + arguments + " 2>/dev/null";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {{"available", false}, {"reason", "cannot start python3"}};
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  pclose(pipe);
  try {
    return nlohmann::json::parse(output.substr(0, output.find('\n')));
  } catch (const std::exception&) {
    return {{"available", false}, {"reason", "no JSON from " + script}};
  }
}

nlohmann::json torch_figures(const BenchArguments& a, std::int64_t tokens, std::int64_t vocab) {
  const std::string script = !a.torch_script.empty() ? a.torch_script
                             : a.loss == "policy"    ? "bench/torch_logprob_bench.py"
                             : a.loss == "router"    ? "bench/torch_router_bench.py"
                                                     : "bench/torch_ce_bench.py";
  // Each script takes the TP degree last and times one rank's shard beyond 1 (the router's rows are whole: tp 1).
  return run_torch_script(script, std::to_string(tokens) + " " + std::to_string(vocab) + " " + a.dtype + " " +
                                      std::to_string(a.label_smoothing) + " " + std::to_string(a.repeats) + " " +
                                      std::to_string(a.tp));
}

// "N,V": two positive integers, or CaseError naming the option.
std::pair<std::int64_t, std::int64_t> parse_shape(const std::string& text) {
  const auto comma = text.find(',');
  const auto integer = [&](std::string_view part) {
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (error != std::errc() || end != part.data() + part.size() || part.empty()) {
      throw CaseError("--shape " + printable(text) + ": expected N,V (two integers), e.g. 16384,128256");
    }
    return value;
  };
  if (comma == std::string::npos) throw CaseError("--shape " + printable(text) + ": expected N,V, e.g. 16384,128256");
  const std::string_view view(text);
  return {integer(view.substr(0, comma)), integer(view.substr(comma + 1))};
}

// `bench --gpus N`: the TP-sharded step over N GPUs; prints the three comparisons and returns the figures.
nlohmann::json bench_gpus(const BenchArguments& a, std::int64_t tokens, std::int64_t vocab, DType dtype) {
  cuda::MultiGpuBenchOptions o;
  o.tokens = tokens;
  o.vocab = vocab;
  o.dtype = dtype;
  o.gpus = a.gpus;
  o.repeats = a.repeats;
  o.label_smoothing = a.label_smoothing;
  nlohmann::json r = cuda::bench_multi_gpu(o);
  const auto ms = [](const nlohmann::json& v) { return v.get<double>(); };
  std::cout << std::fixed << std::setprecision(3);
  for (const auto& g : r["per_gpu"]) {
    std::cout << "GPU " << g["gpu"].get<int>() << " " << g["device"].get<std::string>() << ": copy "
              << ms(g["copy_tb_per_s"]) << " TB/s, " << g["vocab_columns"].get<std::int64_t>() << " columns, kernels "
              << ms(g["kernel_ms"]) << " ms (floor " << ms(g["floor_ms"]) << " ms)\n";
  }
  std::cout << "shape N=" << tokens << " V=" << vocab << " over " << a.gpus << " GPUs (tp=" << a.gpus << "), "
            << a.dtype << ", smoothing " << a.label_smoothing << ", mean\n";
  const auto& k = r["kernels"];
  std::cout << "kernels (statistics + gradient, slowest GPU): " << ms(k["ms"]) << " ms; floor ("
            << ms(k["floor_bytes_per_logit"]) << " B/logit at its copy bandwidth) " << ms(k["floor_ms"])
            << " ms = " << std::setprecision(1) << ms(k["percent_of_floor"]) << "% of the floor\n"
            << std::setprecision(3);
  const auto& c = r["collectives"];
  std::cout << "collectives (" << c["path"].get<std::string>() << "):\n  model t = " << ms(c["model"]["latency_us"])
            << " us + bytes / " << std::setprecision(2) << ms(c["model"]["bandwidth_gb_per_s"])
            << " GB/s, fitted to the sweep\n"
            << std::setprecision(3);
  std::cout << "  bytes/rank     measured ms   model ms\n";
  for (const auto& p : c["sweep"]) {
    std::cout << "  " << std::setw(12) << p["bytes_per_rank"].get<std::int64_t>() << "   " << std::setw(11)
              << ms(p["ms"]) << "   " << std::setw(8) << ms(p["model_ms"]) << "\n";
  }
  for (const auto& m : c["step_messages"]) {
    std::cout << "  step's " << m["what"].get<std::string>() << " (" << m["bytes_per_rank"].get<std::int64_t>()
              << " B/rank): " << ms(m["ms"]) << " ms, model " << ms(m["model_ms"]) << " ms\n";
  }
  const auto& s = r["step"];
  std::cout << "step: " << ms(s["ms"]) << " ms (statistics pass and download " << ms(s["statistics_ms"])
            << ", collectives " << ms(s["collectives_ms"]) << ", host " << ms(s["host_ms"]) << ", gradient pass "
            << ms(s["gradient_ms"]) << ") vs kernels + model " << ms(s["kernels_plus_model_ms"])
            << " ms: " << std::setprecision(2) << ms(s["ratio_to_sum"]) << "x\n";
  const auto& ch = r["check"];
  std::cout << "check on " << ch["rows_sampled"].get<int>()
            << " sampled rows vs the float64 reference: " << (ch["pass"].get<bool>() ? "pass" : "FAIL") << " (gradient "
            << ms(ch["worst_ulp_beyond_atol"]) << " ulp beyond atol, loss " << std::scientific
            << ms(ch["worst_loss_relative"]) << " relative)\n"
            << std::defaultfloat;
  return r;
}

// Whether a bench run's checks passed: its sampled rows, and the GPU oracle where the kernel has one (the head's); the
// other kernels' reports hold no "gpu_oracle".
bool checks_passed(const nlohmann::json& r) {
  return r.at("check").at("pass").get<bool>() &&
         (!r.contains("gpu_oracle") || r.at("gpu_oracle").at("pass").get<bool>());
}

// `bench --loss head`: the CUDA head + cross-entropy against the three cuBLAS products, and the PyTorch peers
// (bench/torch_head_bench.py) in the same call.
int bench_head(const BenchArguments& a, std::int64_t tokens, std::int64_t vocab, DType dtype) {
  if (a.tp != 1 || a.gpus != 1) throw CaseError("--loss head: one GPU, tp 1 (no --tp, no --gpus)");
  if (a.hidden < 1 || a.chunks < 1) throw CaseError("--hidden and --chunks: positive integers");
  cuda::BenchOptions o;
  o.tokens = tokens;
  o.vocab = vocab;
  o.dtype = dtype;
  o.repeats = a.repeats;
  o.label_smoothing = a.label_smoothing;
  o.hidden = a.hidden;
  o.chunks = a.chunks;
  nlohmann::json r = cuda::bench_head(o);
  const std::string script = !a.torch_script.empty() ? a.torch_script : "bench/torch_head_bench.py";
  r["torch"] =
      run_torch_script(script, std::to_string(tokens) + " " + std::to_string(a.hidden) + " " + std::to_string(vocab) +
                                   " " + std::to_string(a.label_smoothing) + " " + std::to_string(a.repeats));
  const auto num = [](const nlohmann::json& v) { return v.get<double>(); };
  std::cout << std::fixed << std::setprecision(1);
  std::cout << "device " << r["device"].get<std::string>()
            << "; LM head + cross-entropy, forward and backward, N=" << tokens << " H=" << a.hidden << " V=" << vocab
            << " " << a.dtype << ", smoothing " << a.label_smoothing << ", " << a.chunks << " chunks\n";
  const auto& p = r["products"];
  std::cout << "three cuBLAS products (h W^T, g W, g^T h): " << num(p["ms"]) << " ms (" << num(p["forward_ms"]) << " + "
            << num(p["dh_ms"]) << " + " << num(p["dw_ms"]) << "), " << num(p["tflops"]) << " TFLOP/s\n";
  std::cout << "lossverify head: " << num(r["head_ms"]) << " ms, " << num(r["head_tflops"])
            << " TFLOP/s = " << num(r["percent_of_products"])
            << "% of the products' rate (one step timed by parts: forward " << num(r["parts_ms"]["forward_and_memset"])
            << " ms, cross-entropy " << num(r["parts_ms"]["kind"]) << " ms, backward " << num(r["parts_ms"]["backward"])
            << " ms)\n";
  const auto& m = r["memory"];
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::cout << std::setprecision(2) << "memory beyond h and W: " << num(m["extra_bytes"]) / gib
            << " GiB (bound: one chunk's logits + float32 dh and dW = " << num(m["bound_bytes"]) / gib
            << " GiB: " << (m["within_bound"].get<bool>() ? "within" : "OVER") << ")\n";
  const auto& ch = r["check"];
  std::cout << std::scientific << std::setprecision(2) << "check on " << ch["tokens_sampled"].get<int>()
            << " sampled tokens vs float64: " << (ch["pass"].get<bool>() ? "pass" : "FAIL") << " (dh relative L2 "
            << num(ch["dh_relative_l2"]) << ", loss " << num(ch["loss_worst_relative"]) << ")\n"
            << std::fixed << std::setprecision(1);
  const auto& g = r["gpu_oracle"];
  std::cout << std::setprecision(2) << "GPU float64 oracle, every element of dh, dW and db and every check: "
            << (g["pass"].get<bool>() ? "pass" : "FAIL") << " in " << num(g["seconds"]) << " s (generating h and W "
            << num(g["generate_seconds"]) << " s; goal 2 s: " << (g["within_2_seconds"].get<bool>() ? "met" : "MISSED")
            << ")\n";
  for (const auto& [name, check] : g["checks"].items()) {
    if (check["verdict"].get<std::string>() == "fail") {
      std::cout << "  failing check " << name << ": margin " << check["margin"].dump() << "\n";
    }
  }
  std::cout << std::setprecision(1);
  const auto& t = r["torch"];
  if (!t.value("available", false)) {
    std::cout << "PyTorch figures unavailable: " << t.value("reason", std::string("?")) << "\n";
  } else {
    for (const char* peer : {"eager", "compile", "liger", "gemms"}) {
      if (!t.contains(peer)) continue;
      const auto& f = t[peer];
      std::cout << "  " << peer << " (torch " << t["torch"].get<std::string>() << "): ";
      if (f.contains("error")) {
        std::cout << f["error"].get<std::string>() << "\n";
        continue;
      }
      std::cout << num(f["ms"]) << " ms, " << num(f["tflops"]) << " TFLOP/s, peak beyond inputs "
                << std::setprecision(2) << num(f["peak_extra_gib"]) << " GiB; lossverify is "
                << num(f["ms"]) / num(r["head_ms"]) << "x faster\n"
                << std::setprecision(1);
    }
  }
  std::cout << std::defaultfloat;
  if (!a.report_path.empty()) write_file_atomically(a.report_path, json_text(encode_nonfinite(r), 2) + "\n");
  const bool judged = checks_passed(r);
  return judged ? 0 : static_cast<int>(ExitCode::check_failed);
}

}  // namespace

int run_bench(const BenchArguments& a) {
  check_output_path("--report", a.report_path);
  const auto [tokens, vocab] = parse_shape(a.shape);
  const auto dtype = parse_dtype(a.dtype);
  if (!dtype) throw CaseError("--dtype " + a.dtype + ": expected fp32|bf16|fp16");
  if (tokens < 1 || vocab < 2 || a.tp < 1 || a.tp > vocab)
    throw CaseError("--shape/--tp: need N >= 1, V >= 2, 1 <= tp <= V");
  if (a.loss == "head") return bench_head(a, tokens, vocab, *dtype);
  if (a.loss != "cross_entropy" && a.gpus > 1) {
    throw CaseError("--loss " + a.loss + ": --gpus is not measured for it yet");
  }
  if (a.loss == "router" && (a.tp != 1 || a.dtype != "fp32")) {
    throw CaseError("--loss router: the router's rows are whole and float32 (--shape N,E; no --tp, --dtype fp32)");
  }
  if (a.gpus > 1) {
    if (a.tp != 1)
      throw CaseError("--gpus " + std::to_string(a.gpus) +
                      ": the vocabulary is split over the GPUs (tp = gpus); leave --tp out");
    if (a.gpus > vocab) throw CaseError("--gpus: more GPUs than vocabulary columns");
    const nlohmann::json r = bench_gpus(a, tokens, vocab, *dtype);
    if (!a.report_path.empty()) write_file_atomically(a.report_path, json_text(encode_nonfinite(r), 2) + "\n");
    const bool judged = checks_passed(r);
    return judged ? 0 : static_cast<int>(ExitCode::check_failed);
  }
  cuda::BenchOptions o;
  o.tokens = tokens;
  o.vocab = vocab_range(vocab, a.tp, 0).size();  // the first (largest) shard of a TP rank
  o.dtype = *dtype;
  o.tp = a.tp;
  o.repeats = a.repeats;
  o.label_smoothing = a.label_smoothing;
  const bool policy = a.loss == "policy";
  const bool router = a.loss == "router";
  nlohmann::json r = policy ? cuda::bench_policy(o) : router ? cuda::bench_router(o) : cuda::bench(o);
  r["global_vocab"] = vocab;
  r["torch"] = torch_figures(a, tokens, vocab);
  std::cout << std::fixed << std::setprecision(3);
  std::cout << "device " << r["device"].get<std::string>() << ", copy " << r["copy_tb_per_s"].get<double>()
            << " TB/s\n";
  std::cout << "shape N=" << tokens << " V=" << vocab << " (" << o.vocab << " per rank, tp=" << a.tp << "), " << a.dtype
            << (policy   ? ", policy loss: log-prob and entropy"
                : router ? ", router: aux loss (top-8) and z-loss"
                         : ", smoothing " + std::to_string(a.label_smoothing))
            << ", mean\n";
  std::cout << "floor (" << r["floor_bytes_per_logit"].get<double>()
            << " B/logit at the copy bandwidth): " << r["floor_ms"].get<double>() << " ms\n";
  std::cout << "lossverify " << r["kernel"].get<std::string>() << ": " << r["kernel_ms"].get<double>()
            << " ms = " << std::setprecision(1) << r["percent_of_floor"].get<double>() << "% of the floor"
            << std::setprecision(3) << "; check on sampled rows: " << (r["check"]["pass"].get<bool>() ? "pass" : "FAIL")
            << "\n";
  if (r.contains("route_ms")) {
    std::cout << "  of which, alone: route and count " << r["route_ms"].get<double>() << " ms, loss terms and gradient "
              << r["gradient_ms"].get<double>() << " ms\n";
  }
  if (r.contains("torch")) {
    const auto& t = r["torch"];
    if (t.value("available", false)) {
      for (const char* key : {"eager_ms", "compile_ms"}) {
        if (!t.contains(key)) continue;
        const double ms = t[key].get<double>();
        std::cout << "PyTorch " << t["torch"].get<std::string>() << " "
                  << (std::string(key) == "eager_ms" ? "eager" : "torch.compile")
                  << (a.tp > 1 ? " (the shard's vocabulary-parallel terms, all-reduces left out)" : "") << ": " << ms
                  << " ms = " << std::setprecision(1) << 100.0 * r["floor_ms"].get<double>() / ms
                  << "% of the floor; lossverify is " << ms / r["kernel_ms"].get<double>() << "x faster\n"
                  << std::setprecision(3);
      }
    } else {
      std::cout << "PyTorch figures unavailable: " << t.value("reason", std::string("?")) << "\n";
    }
  }
  std::cout << std::defaultfloat;
  if (!a.report_path.empty()) write_file_atomically(a.report_path, json_text(encode_nonfinite(r), 2) + "\n");
  const bool judged = checks_passed(r);
  return judged ? 0 : static_cast<int>(ExitCode::check_failed);
}

void register_bench(CLI::App& app, BenchCommand& command) {
  command.app = app.add_subcommand("bench", "kernel speed as % of the memory floor (CUDA), with PyTorch figures");
  command.app->footer(lossverify::cli::exit_codes(
      "0 measured and the sampled check passed, 1 the check failed, 2 usage error, 3 no GPU or internal error"));
  command.app->add_option("--backend", command.args.backend, "cuda (the only one measured here)")
      ->check(CLI::IsMember({"cuda"}));
  command.app->add_option("--shape", command.args.shape, "N,V (global vocabulary)");
  command.app->add_option("--dtype", command.args.dtype, "fp32|bf16|fp16");
  command.app->add_option("--tp", command.args.tp,
                          "time one rank's shard of the vocabulary: the two kernels around the all-reduce");
  command.app
      ->add_option("--gpus", command.args.gpus,
                   "time the TP-sharded step over this many GPUs (2 or more; NCCL between them)")
      ->check(CLI::PositiveNumber);
  command.app->add_option("--repeats", command.args.repeats, "timed repetitions (median)")->check(CLI::PositiveNumber);
  command.app->add_option("--label-smoothing", command.args.label_smoothing, "alpha");
  command.app
      ->add_option("--loss", command.args.loss,
                   "cross_entropy, policy (a log-prob and entropy pass), router (--shape N,E, fp32, top-8), or head "
                   "(an LM head of --hidden H in front of cross-entropy, in --chunks chunks)")
      ->check(CLI::IsMember({"cross_entropy", "policy", "router", "head"}));
  command.app->add_option("--hidden", command.args.hidden, "head: the hidden size H")->check(CLI::PositiveNumber);
  command.app->add_option("--chunks", command.args.chunks, "head: its chunks of the tokens")
      ->check(CLI::PositiveNumber);
  command.app->add_option("--report", command.args.report_path, "write the figures as JSON");
  command.app->add_option("--torch-script", command.args.torch_script, "PyTorch comparison script");
}

}  // namespace lossverify::cli
