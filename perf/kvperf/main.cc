// kvperf: the project's main job (issue 7). With no arguments it runs the default scenario: a
// model shaped like a 1B-parameter Llama (16 layers, 32 query heads, 8 KV heads, head_dim 64;
// deterministic pseudo-random K/V/Q, no weights), 4 sequences sharing a 1024-token system prompt,
// own 1024-token prompts prefilled in 512-token batches, 128 batched decode steps; storage f16 and
// q8_0. It prints a table of throughput, attention bandwidth as a fraction of the read bandwidth
// measured in the same run, cache bytes, and a correctness line; it exits non-zero when a check
// exceeds its tolerance. Named scenarios, the context sweep, JSON and the SVG chart are behind
// flags (--help).
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kvperf/kvperf.h"
#include "machine.h"

namespace kvperf {
namespace {

using nlohmann::json;

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

bool ParseDType(const std::string& s, kv::DType* out) {
  for (int i = 0; i < kv::kNumDTypes; ++i) {
    const kv::DType t = static_cast<kv::DType>(i);
    if (s == kv::DTypeName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

std::string Fmt(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string Bytes(double b) {
  if (b >= 1024.0 * 1024 * 1024) return Fmt("%.2f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return Fmt("%.1f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return Fmt("%.1f KiB", b / 1024.0);
  return Fmt("%.0f B", b);
}

std::string Rate(double per_s) {
  if (per_s >= 1e6) return Fmt("%.2f M", per_s * 1e-6);
  if (per_s >= 1e4) return Fmt("%.0f", per_s);
  return Fmt("%.1f", per_s);
}

std::string Gbs(double bytes_per_s) { return Fmt("%.2f GB/s", bytes_per_s * 1e-9); }
std::string Pct(double f) { return Fmt("%.0f%%", f * 100); }
std::string Sci(double v) { return Fmt("%.2g", v); }

// A markdown table: one row per figure, one column per result (dtype).
struct Row {
  std::string label;
  std::function<std::string(const json&)> cell;
};

void PrintTable(const std::vector<json>& results, const std::vector<Row>& rows) {
  size_t w0 = 6;
  for (const Row& r : rows) w0 = std::max(w0, r.label.size());
  std::vector<std::vector<std::string>> cells(rows.size());
  std::vector<size_t> w(results.size(), 4);
  for (size_t c = 0; c < results.size(); ++c) {
    w[c] = std::max(w[c], results[c].value("dtype", std::string("?")).size());
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t c = 0; c < results.size(); ++c) {
      std::string s = rows[r].cell(results[c]);
      w[c] = std::max(w[c], s.size());
      cells[r].push_back(s);
    }
  }
  std::printf("| %-*s |", static_cast<int>(w0), "figure");
  for (size_t c = 0; c < results.size(); ++c) {
    std::printf(" %*s |", static_cast<int>(w[c]), results[c].value("dtype", "?").c_str());
  }
  std::printf("\n|%s|", std::string(w0 + 2, '-').c_str());
  for (size_t c = 0; c < results.size(); ++c) {
    std::printf("%s:|", std::string(w[c] + 1, '-').c_str());
  }
  std::printf("\n");
  for (size_t r = 0; r < rows.size(); ++r) {
    std::printf("| %-*s |", static_cast<int>(w0), rows[r].label.c_str());
    for (size_t c = 0; c < results.size(); ++c) {
      std::printf(" %*s |", static_cast<int>(w[c]), cells[r][c].c_str());
    }
    std::printf("\n");
  }
  std::printf("\n");
}

double D(const json& j, const std::vector<std::string>& path) {
  const json* p = &j;
  for (const std::string& k : path) {
    if (!p->contains(k)) return NAN;
    p = &(*p)[k];
  }
  return p->is_number() ? p->get<double>() : NAN;
}

std::string CheckCell(const json& c) {
  if (c.is_null()) return "-";
  return std::string(c.value("ok", false) ? "PASS" : "FAIL") + " (" +
         std::to_string(c.value("samples", 0)) + " samples)";
}
std::string KernelErrCell(const json& c) {
  return Sci(c.value("kernel_max_abs_err", NAN)) + " (tol " +
         Sci(c.value("kernel_tolerance", NAN)) + ")";
}
std::string StorageErrCell(const json& c) {
  return Sci(c.value("storage_max_abs_err", NAN)) + " (tol " +
         Sci(c.value("storage_tolerance", NAN)) + ")";
}

// A row whose cell is one number of the result, at `path`, in the given format.
Row NumberRow(std::string label, std::string (*format)(double), std::vector<std::string> path) {
  return {std::move(label),
          [format, path = std::move(path)](const json& j) { return format(D(j, path)); }};
}
std::string Fixed0(double v) { return Fmt("%.0f", v); }
std::string Fixed1(double v) { return Fmt("%.1f", v); }
std::string Fixed2(double v) { return Fmt("%.2f", v); }

Row ReadBandwidthRow() {
  return NumberRow("read bandwidth measured before this run", Gbs, {"read_bandwidth_bytes_per_s"});
}
std::string Gflops(double flop_per_s) { return Fmt("%.1f GFLOP/s", flop_per_s * 1e-9); }
Row FmaPeakRow() {
  return NumberRow("FMA peak measured before this run", Gflops, {"fma_peak_flop_per_s"});
}
Row CacheBytesRow(const char* label) { return NumberRow(label, Bytes, {"cache_bytes_allocated"}); }

std::vector<Row> PhaseRows(const std::string& prefill_label, const std::string& decode_label) {
  return {
      ReadBandwidthRow(),
      FmaPeakRow(),
      NumberRow(prefill_label, Rate, {"prefill", "tokens_per_s"}),
      NumberRow("  Attend share of prefill time", Pct, {"prefill", "attend_share"}),
      NumberRow("  prefill attention GFLOP/s", Fixed1, {"prefill", "attention_gflop_per_s"}),
      NumberRow("    as a fraction of the FMA peak", Fixed2,
                {"prefill", "attention_fraction_of_fma_peak"}),
      NumberRow(decode_label, Rate, {"decode", "tokens_per_s"}),
      NumberRow("  Attend share of decode time", Pct, {"decode", "attend_share"}),
      // Shared cells serve every sequence's query rows: the flops per byte read rise with sharing.
      {"  decode attention GFLOP/s (flop per K+V byte)",
       [](const json& j) {
         return Fmt("%.1f", D(j, {"decode", "attention_gflop_per_s"})) + " (" +
                Fmt("%.1f", D(j, {"decode", "attention_gflop"}) * 1e9 /
                                D(j, {"decode", "attention_bytes"})) +
                ")";
       }},
      NumberRow("    as a fraction of the FMA peak", Fixed2,
                {"decode", "attention_fraction_of_fma_peak"}),
      NumberRow("decode attention read (K+V bytes / Attend time)", Gbs,
                {"decode", "attention_bytes_per_s"}),
      NumberRow("  as a fraction of read bandwidth", Fixed2,
                {"decode", "attention_fraction_of_read_bw"}),
      NumberRow("  whole decode step (all cache work), same bytes", Fixed2,
                {"decode", "step_fraction_of_read_bw"}),
  };
}

std::vector<Row> CheckRows(const char* key) {
  const std::string k = key;
  return {
      {"max abs error vs double, same stored K/V",
       [k](const json& j) { return KernelErrCell(j[k]); }},
      {"max abs error vs double, f32 K/V before storage",
       [k](const json& j) { return StorageErrCell(j[k]); }},
      {"correctness", [k](const json& j) { return CheckCell(j[k]); }},
  };
}

// `rows`, then the three rows of the "check" result, as one table.
void PrintWithChecks(const std::vector<json>& rs, std::vector<Row> rows) {
  for (const Row& r : CheckRows("check")) rows.push_back(r);
  PrintTable(rs, rows);
}

// The default traffic's phase rows, `extra`, then the checks.
void PrintWorkloadRows(const std::vector<json>& rs, const std::vector<Row>& extra) {
  std::vector<Row> rows =
      PhaseRows("prefill tokens/s (cache work)", "decode tokens/s (cache work)");
  rows.insert(rows.end(), extra.begin(), extra.end());
  PrintWithChecks(rs, std::move(rows));
}

void PrintDefault(const std::vector<json>& rs) {
  const json& f = rs.front();
  std::printf(
      "## default: %d sequences share a %d-token system prompt (prefilled once, CopyPrefix), each "
      "prefills its own %d-token prompt in %d-token batches, then %d decode steps with the %d "
      "sequences in one batch\n\n",
      f.value("sequences", 0), f.value("system_prompt", 0), f.value("prompt", 0),
      f.value("prefill_batch", 0), f.value("decode_steps", 0), f.value("sequences", 0));
  PrintWorkloadRows(rs, {
                            CacheBytesRow("cache bytes allocated"),
                            NumberRow("cache bytes holding tokens", Bytes, {"cache_bytes_in_use"}),
                            NumberRow("bytes saved by sharing the system prompt", Bytes,
                                      {"bytes_saved_by_sharing"}),
                            {"CopyPrefix to the other sequences: bytes copied, time",
                             [](const json& j) {
                               return Bytes(D(j, {"copy_prefix_bytes_allocated"})) + ", " +
                                      Fmt("%.0f us", D(j, {"copy_prefix_seconds"}) * 1e6);
                             }},
                        });
}

void PrintWorkloadScenario(const std::vector<json>& rs, const std::string& title,
                           const std::vector<Row>& extra) {
  std::printf("## %s\n\n", title.c_str());
  PrintWorkloadRows(rs, extra);
}

void PrintScenario(const std::string& name, const std::vector<json>& rs) {
  if (rs.empty()) return;
  if (name == "default") return PrintDefault(rs);
  if (name == "swa") {
    return PrintWorkloadScenario(
        rs, "swa: interleaved sliding window (5 layers of window 1024 : 1 global), default traffic",
        {CacheBytesRow("cache bytes allocated (all layers)"),
         {"  sliding-window layers / global layers",
          [](const json& j) {
            return Bytes(D(j, {"cache_bytes_swa_layers"})) + " / " +
                   Bytes(D(j, {"cache_bytes_global_layers"}));
          }},
         NumberRow("  if every layer were global", Bytes, {"cache_bytes_if_all_global"})});
  }
  if (name == "chunked") {
    return PrintWorkloadScenario(
        rs, "chunked: chunked attention (3 layers of chunk 1024 : 1 global), default traffic",
        {CacheBytesRow("cache bytes allocated")});
  }
  if (name == "swa-mem") {
    std::vector<Row> extra = {
        CacheBytesRow("cache bytes allocated (memory 1536)"),
        NumberRow("  with unlimited memory", Bytes, {"cache_bytes_if_unlimited"}),
        {"resume 64 back: CanResume / position 0",
         [](const json& j) {
           return std::string(j["resume"].value("can_resume", false) ? "yes" : "no") + " / " +
                  (j["resume"].value("can_resume_position_0", true) ? "yes" : "no");
         }},
        NumberRow("resumed decode tokens/s", Rate, {"resume", "decode", "tokens_per_s"}),
        {"resumed decode correctness",
         [](const json& j) { return CheckCell(j["resume"]["check"]); }},
    };
    return PrintWorkloadScenario(
        rs, "swa-mem: sliding window 1024 with memory 1536, then resume from a prefix", extra);
  }
  if (name == "shift") {
    std::printf(
        "## shift: context shift: %d sequences of %d RoPE'd tokens; Remove drops the older half "
        "(re-rotating the kept keys), then decoding continues\n\n",
        rs[0].value("sequences", 0), rs[0].value("prompt", 0));
    std::vector<Row> rows =
        PhaseRows("prefill tokens/s (cache work)", "decode tokens/s after the shift");
    const std::vector<Row> more = {
        {"Remove + re-rotation time",
         [](const json& j) { return Fmt("%.1f ms", D(j, {"remove_seconds"}) * 1e3); }},
        NumberRow("  re-rotated key rows/s", Rate, {"rerotated_key_rows_per_s"}),
        NumberRow("  K bytes read+written / read bandwidth", Fixed2,
                  {"remove_fraction_of_read_bw"}),
        {"max abs error vs double, same stored K/V",
         [](const json& j) { return KernelErrCell(j["decode_check"]); }},
        {"max abs error vs double, keys rotated at new positions",
         [](const json& j) { return StorageErrCell(j["decode_check"]); }},
        {"correctness (prefill / after the shift)",
         [](const json& j) {
           return CheckCell(j["prefill_check"]) + " / " + CheckCell(j["decode_check"]);
         }},
    };
    rows.insert(rows.end(), more.begin(), more.end());
    PrintTable(rs, rows);
    return;
  }
  if (name == "encdec") {
    std::printf(
        "## encdec: encoder-decoder: %d sequences, %d-token prompts, cross-attention to a %d-frame "
        "encoder output (f16, stored as given) in every layer of every decode step\n\n",
        rs[0].value("sequences", 0), rs[0].value("prompt", 0), rs[0].value("encoder_frames", 0));
    PrintWithChecks(
        rs,
        {
            ReadBandwidthRow(),
            NumberRow("decode tokens/s (self + cross attention)", Rate, {"decode", "tokens_per_s"}),
            NumberRow("  Attend share of decode time", Pct, {"decode", "attend_share"}),
            NumberRow("decode attention read (K+V bytes / Attend time)", Gbs,
                      {"decode", "attention_bytes_per_s"}),
            NumberRow("  as a fraction of read bandwidth", Fixed2,
                      {"decode", "attention_fraction_of_read_bw"}),
            {"encoder cache bytes / decoder cache bytes",
             [](const json& j) {
               return Bytes(D(j, {"cache_bytes_encoder"})) + " / " +
                      Bytes(D(j, {"cache_bytes_decoder"}));
             }},
        });
    return;
  }
  if (name == "rotating") {
    std::printf(
        "## rotating: one sequence streams %d tokens one at a time through a %d-token rotating "
        "cache with %d sink tokens in each of the 16 layers; Attend over the window on every "
        "%dth token\n\n",
        rs[0].value("tokens_streamed", 0), rs[0].value("window", 0), rs[0].value("sinks", 0),
        rs[0].value("attend_every", 0));
    PrintWithChecks(
        rs,
        {
            ReadBandwidthRow(),
            NumberRow("append tokens/s (Update, 16 layers)", Rate, {"update_tokens_per_s"}),
            NumberRow("bytes moved per token per layer (sinks, compaction)", Bytes,
                      {"layer0_bytes_moved_per_token"}),
            NumberRow("allocations per layer over the stream", Fixed0, {"layer0_allocations"}),
            NumberRow("attended tokens/s (Attend only, 16 layers)", Rate, {"attend_tokens_per_s"}),
            NumberRow("attention read / read bandwidth", Fixed2, {"attention_fraction_of_read_bw"}),
            NumberRow("held tokens at the end", Fixed0, {"held_tokens"}),
            CacheBytesRow("cache bytes allocated"),
        });
    return;
  }
}

// ---- the chart -------------------------------------------------------------------------------

std::string Esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&')
      o += "&amp;";
    else if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else
      o += c;
  }
  return o;
}

bool WriteSvg(const std::string& path, const json& sweep, double read_bw, const std::string& cpu,
              int threads) {
  const double W = 760, H = 440, ml = 70, mr = 150, mt = 50, mb = 60;
  const double pw = W - ml - mr, ph = H - mt - mb;
  std::vector<int> xs;
  double ymax = read_bw * 1e-9;
  for (auto it = sweep.begin(); it != sweep.end(); ++it) {
    for (const json& p : it.value()) {
      xs.push_back(p["context"].get<int>());
      ymax = std::max(ymax, p["attention_bytes_per_s"].get<double>() * 1e-9);
    }
  }
  if (xs.empty()) return false;
  std::sort(xs.begin(), xs.end());
  const double lx0 = std::log2(xs.front()), lx1 = std::log2(xs.back());
  // A round y range: steps of 1, 2, 5 x 10^k.
  double step = std::pow(10.0, std::floor(std::log10(ymax / 5)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (ymax / (step * m) <= 6) {
      step *= m;
      break;
    }
  }
  const double ytop = std::ceil(ymax * 1.08 / step) * step;
  auto X = [&](double ctx) {
    return ml + (lx1 > lx0 ? (std::log2(ctx) - lx0) / (lx1 - lx0) : 0.5) * pw;
  };
  auto Y = [&](double gbs) { return mt + ph - gbs / ytop * ph; };
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << " " << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << ml << "\" y=\"22\" font-size=\"15\" font-weight=\"bold\">"
    << "kvperf: decode attention read throughput vs context (1 sequence, 16 layers)</text>\n";
  s << "<text x=\"" << ml << "\" y=\"40\" fill=\"#555\">" << Esc(cpu) << ", " << threads
    << " threads; K+V bytes read / Attend time</text>\n";
  // grid + y labels
  for (double y = 0; y <= ytop + 1e-9; y += step) {
    s << "<line x1=\"" << ml << "\" y1=\"" << Y(y) << "\" x2=\"" << ml + pw << "\" y2=\"" << Y(y)
      << "\" stroke=\"#e4e4e4\"/>\n";
    s << "<text x=\"" << ml - 8 << "\" y=\"" << Y(y) + 4 << "\" text-anchor=\"end\">" << y
      << "</text>\n";
  }
  // x labels
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  for (int x : xs) {
    s << "<line x1=\"" << X(x) << "\" y1=\"" << mt + ph << "\" x2=\"" << X(x) << "\" y2=\""
      << mt + ph + 5 << "\" stroke=\"black\"/>\n";
    std::string lab = x >= 1024 ? std::to_string(x / 1024) + "K" : std::to_string(x);
    s << "<text x=\"" << X(x) << "\" y=\"" << mt + ph + 20 << "\" text-anchor=\"middle\">" << lab
      << "</text>\n";
  }
  // axes
  s << "<line x1=\"" << ml << "\" y1=\"" << mt << "\" x2=\"" << ml << "\" y2=\"" << mt + ph
    << "\" stroke=\"black\"/>\n";
  s << "<line x1=\"" << ml << "\" y1=\"" << mt + ph << "\" x2=\"" << ml + pw << "\" y2=\""
    << mt + ph << "\" stroke=\"black\"/>\n";
  s << "<text x=\"" << ml + pw / 2 << "\" y=\"" << H - 15
    << "\" text-anchor=\"middle\">context length (tokens, log scale)</text>\n";
  s << "<text transform=\"translate(20," << mt + ph / 2
    << ") rotate(-90)\" text-anchor=\"middle\">GB/s of K+V read by Attend</text>\n";
  // ceiling
  const double c = read_bw * 1e-9;
  s << "<line x1=\"" << ml << "\" y1=\"" << Y(c) << "\" x2=\"" << ml + pw << "\" y2=\"" << Y(c)
    << "\" stroke=\"#d62728\" stroke-width=\"2\" stroke-dasharray=\"8,5\"/>\n";
  s << "<text x=\"" << ml + pw + 8 << "\" y=\"" << Y(c) - 4
    << "\" fill=\"#d62728\">measured</text>\n";
  s << "<text x=\"" << ml + pw + 8 << "\" y=\"" << Y(c) + 10 << "\" fill=\"#d62728\">read bw "
    << Fmt("%.1f", c) << "</text>\n";
  // series
  const char* colors[] = {"#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  int si = 0;
  for (auto it = sweep.begin(); it != sweep.end(); ++it, ++si) {
    const char* col = colors[si % 5];
    std::ostringstream pts;
    for (const json& p : it.value()) {
      pts << X(p["context"].get<int>()) << "," << Y(p["attention_bytes_per_s"].get<double>() * 1e-9)
          << " ";
    }
    s << "<polyline fill=\"none\" stroke=\"" << col << "\" stroke-width=\"2.5\" points=\""
      << pts.str() << "\"/>\n";
    for (const json& p : it.value()) {
      s << "<circle cx=\"" << X(p["context"].get<int>()) << "\" cy=\""
        << Y(p["attention_bytes_per_s"].get<double>() * 1e-9) << "\" r=\"3.5\" fill=\"" << col
        << "\"/>\n";
    }
    // Legend at the bottom right, clear of the ceiling label.
    const double ly = mt + ph - 20.0 * static_cast<double>(sweep.size() - si);
    s << "<line x1=\"" << ml + pw + 10 << "\" y1=\"" << ly << "\" x2=\"" << ml + pw + 34
      << "\" y2=\"" << ly << "\" stroke=\"" << col << "\" stroke-width=\"2.5\"/>\n";
    s << "<text x=\"" << ml + pw + 40 << "\" y=\"" << ly + 4 << "\">" << Esc(it.key())
      << " storage</text>\n";
  }
  s << "</svg>\n";
  std::ofstream f(path);
  f << s.str();
  return static_cast<bool>(f);
}

}  // namespace
}  // namespace kvperf

int main(int argc, char** argv) {
  using namespace kvperf;
  CLI::App app{
      "kvperf: the kvcache performance and correctness harness.\n"
      "With no arguments: the default scenario (a 1B-Llama-shaped model, 4 sequences sharing a "
      "system prompt, prefill + batched decode) for f16 and q8_0 storage."};
  Options opt;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string dtypes = "f16,q8_0";
  std::vector<std::string> scenarios;
  bool all = false, sweep = false;
  std::string json_path, svg_path;
  std::vector<int> sweep_contexts = {512, 1024, 2048, 4096, 8192, 16384, 32768};
  app.add_option("--threads", threads, "threads for Attend and the bandwidth baseline")
      ->check(CLI::Range(1, 256));
  app.add_option("--dtype", dtypes, "storage dtypes, comma-separated (f32,f16,bf16,q8_0,q4_0)");
  app.add_option("--context", opt.context, "tokens of each sequence's own prompt")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--system", opt.system_prompt, "tokens of the shared system prompt")
      ->check(CLI::Range(0, 1 << 20));
  // Above 64 sequences a decode step's batch runs in groups of rows (kernels/attention.h, Mode).
  app.add_option("--sequences", opt.sequences, "sequences (at most --batch)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--steps", opt.decode_steps, "decode steps")->check(CLI::Range(1, 1 << 20));
  app.add_option("--batch", opt.batch, "prefill batch tokens")->check(CLI::Range(1, 1 << 16));
  app.add_option("--checks", opt.check_samples,
                 "sampled prefill batches and decode steps checked against the double reference "
                 "(x 3 layers each)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--scenario", scenarios,
                 "scenarios to run: default, swa, chunked, swa-mem, encdec, rotating, shift")
      ->delimiter(',')
      ->check(
          CLI::IsMember({"default", "swa", "chunked", "swa-mem", "encdec", "rotating", "shift"}));
  app.add_flag("--all", all, "run every scenario");
  app.add_flag("--sweep", sweep, "decode attention throughput against context length");
  app.add_option("--sweep-contexts", sweep_contexts, "context lengths of the sweep")
      ->delimiter(',');
  app.add_option("--json", json_path, "write every figure to this JSON file");
  app.add_option("--svg", svg_path, "write the sweep chart to this SVG file (runs the sweep)");
  CLI11_PARSE(app, argc, argv);

  std::stringstream ds(dtypes);
  for (std::string t; std::getline(ds, t, ',');) {
    kv::DType d;
    if (!ParseDType(t, &d)) {
      std::fprintf(stderr, "kvperf: unknown dtype '%s'\n", t.c_str());
      return 2;
    }
    opt.dtypes.push_back(d);
  }
  if (opt.sequences > opt.batch) {
    // A decode step is one batch of every sequence's new token: the cache must take it.
    std::fprintf(stderr, "kvperf: --sequences %d exceeds --batch %d\n", opt.sequences, opt.batch);
    return 2;
  }
  if (all) scenarios = {"default", "swa", "chunked", "swa-mem", "encdec", "rotating", "shift"};
  if (scenarios.empty()) scenarios = {"default"};
  if (!svg_path.empty()) sweep = true;
  opt.threads = threads;

  kv::ThreadPool pool(threads);
  RunContext ctx;
  ctx.opt = opt;
  ctx.pool = &pool;
  ctx.t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  const std::string cpu = CpuName();
  Progress("measuring read bandwidth (sum over 256 MiB, %d threads)", threads);
  ctx.read_bw = MeasureReadBandwidth(&pool);
  ctx.fma_peak = MeasureFmaPeak(&pool);

  json report;
  const char* attention_target = kvbench::DispatchedTargetName();
  const char* prefetch_level =
      kv::kernels::ResolvePrefetchLevel(kv::kernels::PrefetchLevel::kAuto) ==
              kv::kernels::PrefetchLevel::kL2
          ? "L2"
          : "L1";
  // What the dispatched target runs: kWeights is resolved by CPU vendor but exists only on
  // AVX-512 targets, and the integer K pass only on AVX3_DL.
  const kv::kernels::DecodeVariants variants = kv::kernels::DispatchedDecodeVariants();
  const char* quant_v_scaling = variants.scaled_weights && kv::kernels::ResolveQuantVScaling(
                                                               kv::kernels::QuantVScaling::kAuto) ==
                                                               kv::kernels::QuantVScaling::kWeights
                                    ? "weights"
                                    : "codes";
  const char* q8_k_pass = variants.integer_k ? "integer dot products (24-bit query)" : "f32";
  report["machine"] = {
      {"cpu", cpu},
      {"attention_highway_target", attention_target},
      {"decode_prefetch", prefetch_level},
      {"decode_quant_v_scaling", quant_v_scaling},
      {"decode_q8_0_k_pass", q8_k_pass},
      {"threads", threads},
      {"hardware_threads", std::thread::hardware_concurrency()},
      {"read_bandwidth_bytes_per_s", ctx.read_bw},
      {"read_bandwidth_method", "best of 5 sums over a 256 MiB buffer"},
      {"fma_peak_flop_per_s", ctx.fma_peak},
      {"fma_peak_method", "best of 20 runs of independent FMA chains, ~10 ms each, every thread"}};
  const Shape& sh = opt.shape;
  report["model"] = {{"layers", sh.layers},
                     {"q_heads", sh.q_heads},
                     {"kv_heads", sh.kv_heads},
                     {"head_dim", sh.head_dim},
                     {"weights", "none: deterministic pseudo-random K/V/Q"}};

  std::vector<std::string> failures;
  std::map<std::string, std::vector<json>> results;
  using RunFn = json (*)(RunContext&, kv::DType, std::vector<std::string>*);
  const std::map<std::string, RunFn> fns = {
      {"default", RunDefault},      {"swa", RunInterleavedSWA},    {"chunked", RunChunked},
      {"swa-mem", RunSWAMemResume}, {"encdec", RunEncoderDecoder}, {"rotating", RunRotating},
      {"shift", RunContextShift}};
  // The read bandwidth is measured again right before every run, and each run's ratios use the
  // figure measured next to it: on a shared machine the bandwidth available changes over minutes.
  std::vector<double> bws = {ctx.read_bw};
  bool first_run = true;
  auto measure = [&]() {
    if (!first_run) {
      Progress("measuring read bandwidth (sum over 256 MiB, %d threads)", threads);
      ctx.read_bw = MeasureReadBandwidth(&pool);
      ctx.fma_peak = MeasureFmaPeak(&pool);
      bws.push_back(ctx.read_bw);
    }
    first_run = false;
  };
  for (const std::string& name : scenarios) {
    for (kv::DType d : opt.dtypes) {
      measure();
      json r = fns.at(name)(ctx, d, &failures);
      r["read_bandwidth_bytes_per_s"] = ctx.read_bw;
      r["fma_peak_flop_per_s"] = ctx.fma_peak;
      results[name].push_back(r);
    }
  }
  json sweep_json;
  double sweep_bw = 0;
  if (sweep) {
    for (kv::DType d : opt.dtypes) {
      measure();
      sweep_bw = std::max(sweep_bw, ctx.read_bw);
      sweep_json[kv::DTypeName(d)] = RunSweep(ctx, d, sweep_contexts, &failures);
    }
  }
  const double bw_min = *std::min_element(bws.begin(), bws.end());
  const double bw_max = *std::max_element(bws.begin(), bws.end());
  const double total_s = Seconds(ctx.t0, Clock::now());
  const double cpu_s = ProcessCpuSeconds() - cpu0;
  ProgressDone();

  std::printf("# kvperf\n\n");
  std::printf(
      "model: Llama-1B-shaped attention (%d layers, %d query heads, %d KV heads, head_dim %d); "
      "deterministic pseudo-random K/V/Q, no weights\n",
      sh.layers, sh.q_heads, sh.kv_heads, sh.head_dim);
  std::printf(
      "machine: %s, %d threads; read bandwidth %.2f to %.2f GB/s (best of 5 sums over 256 MiB with "
      "%d threads, measured before each run; each run's ratios use its own figure)\n",
      cpu.c_str(), threads, bw_min * 1e-9, bw_max * 1e-9, threads);
  std::printf(
      "kernels: attention on Highway target %s; decode prefetches into %s, applies q8_0 / q4_0 "
      "V block scales to the %s and forms q8_0 logits in %s (kernels/attention.h)\n",
      attention_target, prefetch_level, quant_v_scaling, q8_k_pass);
  // Idle pool workers spin briefly before sleeping, so this overstates useful work a little; far
  // below `threads` it says the machine was shared and every absolute figure is pessimistic.
  std::printf(
      "CPU: the process used %.1f CPU-s in %.1f s of wall time (%.2f of %d threads busy on "
      "average)\n",
      cpu_s, total_s, total_s > 0 ? cpu_s / total_s : 0, threads);
  std::printf(
      "timed: StartForward + per layer SetLayer, Put, Get, Attend (data generation and checks "
      "excluded); attention bytes = KV heads x (K+V row bytes) x cells visible to >= 1 token\n\n");
  for (const std::string& name : scenarios) PrintScenario(name, results[name]);
  if (sweep) {
    std::printf("## sweep: decode attention (1 sequence, batch 1, 16 layers) against context\n\n");
    std::printf("| context |");
    for (auto it = sweep_json.begin(); it != sweep_json.end(); ++it) {
      std::printf(" %s GB/s | %s / read bw | %s tok/s |", it.key().c_str(), it.key().c_str(),
                  it.key().c_str());
    }
    std::printf("\n|--:|");
    for (size_t i = 0; i < sweep_json.size(); ++i) std::printf("--:|--:|--:|");
    std::printf("\n");
    for (size_t i = 0; i < sweep_contexts.size(); ++i) {
      std::printf("| %d |", sweep_contexts[i]);
      for (auto it = sweep_json.begin(); it != sweep_json.end(); ++it) {
        const json& p = it.value()[i];
        std::printf(" %.2f | %.2f | %.1f |", p["attention_bytes_per_s"].get<double>() * 1e-9,
                    p["attention_fraction_of_read_bw"].get<double>(),
                    p["decode_tokens_per_s"].get<double>());
      }
      std::printf("\n");
    }
    std::printf("\n");
  }

  for (auto& [name, rs] : results) report["scenarios"][name] = rs;
  if (sweep) report["sweep"] = sweep_json;
  report["machine"]["read_bandwidth_measurements_bytes_per_s"] = bws;
  report["seconds_total"] = total_s;
  report["process_cpu_seconds"] = cpu_s;
  report["failures"] = failures;
  report["ok"] = failures.empty();
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << report.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "kvperf: cannot write %s\n", json_path.c_str());
      failures.push_back("cannot write " + json_path);
    } else {
      std::printf("wrote %s\n", json_path.c_str());
    }
  }
  if (!svg_path.empty()) {
    if (!WriteSvg(svg_path, sweep_json, sweep_bw, cpu, threads)) {
      failures.push_back("cannot write " + svg_path);
    } else {
      std::printf("wrote %s\n", svg_path.c_str());
    }
  }
  std::printf("total run time %.1f s\n", total_s);
  if (!failures.empty()) {
    std::printf("\nFAILED:\n");
    for (const std::string& f : failures) std::printf("  %s\n", f.c_str());
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}
