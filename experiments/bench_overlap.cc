// Whether a core overlaps streaming weights from DRAM with the arithmetic on them: colibri's
// own matrix-vector tiles (colibri/kernels/cpu/cpu.cc and its headers, included here:
// -DCPU_CC="path") run on one or two pinned cores, each over a buffer of its own. Built and run
// by bench_overlap.py.
//
// usage: bench_overlap ROW_FLOATS INPUTS MIB SECONDS REPEATS
// prints "case core inputs where GB/s GFLOP/s" per core of each case, the best of REPEATS
// (cases interleaved: load from elsewhere falls on all of them alike).

#include CPU_CC

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int64_t kItemRows = 64;  // rows a work item, as bench_streams.cc

struct Weights {
  float* w = nullptr;
  int64_t items = 0;
};

// `mib` MiB of float32 rows of L floats on huge pages where the kernel gives them (as the
// engine holds its experts), in items of kItemRows rows.
Weights make_weights(int64_t L, double mib) {
  const int64_t item = kItemRows * L * 4;
  const int64_t items = std::max<int64_t>(1, int64_t(mib * (1 << 20)) / item);
  const size_t huge = 2 << 20, bytes = (items * item + huge - 1) / huge * huge;
  Weights out{static_cast<float*>(std::aligned_alloc(huge, bytes)), items};
  madvise(out.w, bytes, MADV_HUGEPAGE);
  for (int64_t i = 0; i < items * kItemRows * L; ++i) out.w[i] = float(i % 97) * 1e-3f;
  return out;
}

void pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

struct Rate {
  double gb_s = 0, gflop_s = 0;
};

// One core's share of a case: `inputs` rows through every item of `w`, round and round, until
// `stop`; bytes of weights read and FLOPs done per second.
Rate work(const Weights& w, int64_t L, int64_t inputs, int core, const std::atomic<bool>& stop) {
  pin(core);
  std::vector<float> xs(inputs * L, 0.5f), ys(inputs * kItemRows);
  std::vector<const float*> x(inputs);
  for (int64_t j = 0; j < inputs; ++j) x[j] = xs.data() + j * L;
  // As the linear kernel does: inputs packed once for the paired tiles where the build has
  // them (cpu/pairs.h), the tiles of tiles.h otherwise.
  std::vector<float> packed_floats(Packed::floats(inputs, L));
  const bool paired = kPairs && inputs >= kPairedFrom;
  const Packed packed(packed_floats.data(), paired ? inputs : 0, L);
  if (paired) packed.pack(x.data());
  auto emit = [&](int64_t o, int64_t j, float v) { ys[j * kItemRows + o] = v; };
  int64_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (!stop.load(std::memory_order_relaxed))
    for (int64_t k = 0; k < w.items && !stop.load(std::memory_order_relaxed); ++k, ++done)
      if (paired)
        matvecs(w.w + k * kItemRows * L, kItemRows, L, packed, emit);
      else
        matvecs(w.w + k * kItemRows * L, kItemRows, L, x.data(), inputs, emit);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes = double(done) * kItemRows * L * 4;
  return {bytes / s / 1e9, bytes / 4 * 2 * inputs / s / 1e9};
}

// The core's multiply-add ceiling: twelve independent 8-lane chains (as many sums as a tile
// of three weight rows by four inputs keeps), nothing loaded, for `seconds`. Named variables,
// not an array: GCC keeps an array of them in memory.
Rate peak(int core, double seconds) {
  pin(core);
  v8 a0 = v8{} + 1e-3f, a1 = a0 + a0, a2 = a1 + a0, a3 = a2 + a0, a4 = a3 + a0, a5 = a4 + a0;
  v8 a6 = a5 + a0, a7 = a6 + a0, a8 = a7 + a0, a9 = a8 + a0, a10 = a9 + a0, a11 = a10 + a0;
  const v8 m = v8{} + 0.999f, b = v8{} + 1e-4f;
  int64_t rounds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double s = 0;
  using seconds_f = std::chrono::duration<double>;
  for (; s < seconds; s = seconds_f(std::chrono::steady_clock::now() - t0).count())
    for (int n = 0; n < 100000; ++n, ++rounds) {
#define COLIBRI_STEP(a) a = fma8(a, m, b);
      COLIBRI_STEP(a0) COLIBRI_STEP(a1) COLIBRI_STEP(a2) COLIBRI_STEP(a3) COLIBRI_STEP(a4)
      COLIBRI_STEP(a5) COLIBRI_STEP(a6) COLIBRI_STEP(a7) COLIBRI_STEP(a8) COLIBRI_STEP(a9)
      COLIBRI_STEP(a10) COLIBRI_STEP(a11)
#undef COLIBRI_STEP
    }
  const v8 sum = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11));
  if (sum[0] == 42.0f) std::printf("#\n");  // keeps the chains
  return {0, double(rounds) * 12 * 16 / s / 1e9};
}

struct Part {
  int core;
  int64_t inputs;
  const Weights* w;
};

std::vector<Rate> run_case(const std::vector<Part>& parts, int64_t L, double seconds) {
  std::atomic<bool> stop{false};
  std::vector<Rate> rates(parts.size());
  std::vector<std::thread> threads;
  for (size_t p = 0; p < parts.size(); ++p)
    threads.emplace_back(
        [&, p] { rates[p] = work(*parts[p].w, L, parts[p].inputs, parts[p].core, stop); });
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : threads) t.join();
  return rates;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s ROW_FLOATS INPUTS MIB SECONDS REPEATS\n", argv[0]);
    return 2;
  }
  const int64_t L = std::atoll(argv[1]), r = std::atoll(argv[2]);
  const double mib = std::atof(argv[3]), seconds = std::atof(argv[4]);
  const int repeats = std::atoi(argv[5]);
  const Weights dram0 = make_weights(L, mib), dram1 = make_weights(L, mib);
  const Weights cached = make_weights(L, 0.25);  // one item: stays in L2
  struct Case {
    std::string name;
    std::vector<Part> parts;
    std::vector<std::string> where;
  };
  std::vector<Case> cases = {
      {"one core streams", {{0, 1, &dram0}}, {"DRAM"}},
      {"one core computes", {{0, r, &cached}}, {"L2"}},
      {"one core computes", {{0, r, &dram0}}, {"DRAM"}},
  };
  if (std::thread::hardware_concurrency() >= 2) {
    cases.push_back({"two cores stream", {{0, 1, &dram0}, {1, 1, &dram1}}, {"DRAM", "DRAM"}});
    cases.push_back(
        {"one computes, one streams", {{0, r, &dram0}, {1, 1, &dram1}}, {"DRAM", "DRAM"}});
    cases.push_back({"two cores compute", {{0, r, &dram0}, {1, r, &dram1}}, {"DRAM", "DRAM"}});
  }
  Rate best_peak;
  for (int rep = 0; rep < repeats; ++rep) {
    const Rate p = peak(0, seconds / 4);
    if (p.gflop_s > best_peak.gflop_s) best_peak = p;
  }
  std::printf("one core multiply-adds\t0\t0\tregisters\t0\t%.2f\n", best_peak.gflop_s);
  std::vector<std::vector<Rate>> best(cases.size());
  for (int rep = 0; rep < repeats; ++rep)
    for (size_t c = 0; c < cases.size(); ++c) {
      const auto rates = run_case(cases[c].parts, L, seconds);
      double total = 0, best_total = 0;
      for (const auto& x : rates) total += x.gb_s;
      for (const auto& x : best[c]) best_total += x.gb_s;
      if (best[c].empty() || total > best_total) best[c] = rates;  // the best total traffic
    }
  for (size_t c = 0; c < cases.size(); ++c)
    for (size_t p = 0; p < cases[c].parts.size(); ++p)
      std::printf("%s\t%d\t%lld\t%s\t%.2f\t%.2f\n", cases[c].name.c_str(), cases[c].parts[p].core,
                  (long long)cases[c].parts[p].inputs, cases[c].where[p].c_str(), best[c][p].gb_s,
                  best[c][p].gflop_s);
  return 0;
}
