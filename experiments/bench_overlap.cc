// Whether a core overlaps streaming weights from DRAM with the arithmetic on them: colibri's
// own matrix-vector tiles (colibri/kernels/cpu/cpu.cc and its headers, included here:
// -DCPU_CC="path") run on one or two pinned cores, each over a buffer of its own. Built and run
// by bench_overlap.py.
//
// usage: bench_overlap ROW_VALUES INPUTS MIB SECONDS REPEATS [HELD]
// HELD: f32 (the default), int8 or int4: the rows as the kernels hold those formats (values,
// then a float32 scale per 128 columns, and for int8 an offset), widened as they are loaded.
// prints "case core inputs where GB/s GFLOP/s" per core of each case, the best of REPEATS
// (cases interleaved: load from elsewhere falls on all of them alike).

#include CPU_CC

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 128;  // columns a scale of held rows

// How the rows are held: float32, or int8 / int4 rows with their scales (formats.h).
enum class Held { kF32, kInt8, kInt4 };

// Bytes of a row of L values as held.
int64_t row_bytes(Held held, int64_t L) {
  switch (held) {
    case Held::kInt8: return L + 8 * (L / kBlock);  // values, scales, offsets
    case Held::kInt4: return L / 2 + 4 * (L / kBlock);  // values, scales
    default: return 4 * L;
  }
}

// Rows a work item: 64 float32 rows, as bench_streams.cc; held rows in items of ~256 KiB, as
// the expert kernel shares its calls out (gang.h's chunk_rows).
int64_t item_rows(Held held, int64_t L) {
  if (held == Held::kF32) return 64;
  return std::max<int64_t>(8, (256 << 10) / row_bytes(held, L) / 8 * 8);
}

struct Weights {
  char* w = nullptr;
  int64_t items = 0, rows = 0, row = 0;  // items of `rows` rows of `row` bytes
};

// `mib` MiB of rows of L values on huge pages where the kernel gives them (as the engine holds
// its experts), in items of item_rows rows. Held rows: values from a fixed pattern, every
// block scaled by 1/128 (int8: offset -1).
Weights make_weights(Held held, int64_t L, double mib) {
  const int64_t row = row_bytes(held, L), rows = item_rows(held, L), item = rows * row;
  const int64_t items = std::max<int64_t>(1, int64_t(mib * (1 << 20)) / item);
  const size_t huge = 2 << 20, bytes = (items * item + huge - 1) / huge * huge;
  Weights out{static_cast<char*>(std::aligned_alloc(huge, bytes)), items, rows, row};
  madvise(out.w, bytes, MADV_HUGEPAGE);
  for (int64_t r = 0; r < items * rows; ++r) {
    char* p = out.w + r * row;
    if (held == Held::kF32) {
      for (int64_t c = 0; c < L; ++c) reinterpret_cast<float*>(p)[c] = float((r * L + c) % 97) * 1e-3f;
      continue;
    }
    const int64_t values = held == Held::kInt8 ? L : L / 2, nb = L / kBlock;
    for (int64_t c = 0; c < values; ++c) p[c] = char((r * 131 + c * 29) % 251);
    const float scale = 1.0f / 128, offset = -1.0f;
    for (int64_t k = 0; k < nb; ++k) {
      std::memcpy(p + values + 4 * k, &scale, 4);
      if (held == Held::kInt8) std::memcpy(p + values + 4 * (nb + k), &offset, 4);
    }
  }
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

// One core's share of a case: `inputs` rows through every item of `w` (its rows held as T),
// round and round, until `stop`; bytes of weights read and FLOPs done per second.
template <typename T>
Rate work(const Weights& w, int64_t L, int64_t inputs, int core, const std::atomic<bool>& stop) {
  pin(core);
  [[maybe_unused]] std::conditional_t<kScaled<T>, KeepSubnormals, int> keep{};  // as the kernels
  std::vector<float> xs(inputs * L, 0.5f), ys(inputs * w.rows);
  std::vector<const float*> x(inputs);
  for (int64_t j = 0; j < inputs; ++j) x[j] = xs.data() + j * L;
  // As the linear kernel does: inputs packed once for the paired tiles where the build has
  // them (cpu/pairs.h), from a 64-byte boundary as the calls' scratch is (gang.h), the tiles
  // of tiles.h otherwise.
  std::vector<float> packed_floats;
  const bool paired = kPairs && inputs >= kPairedFrom;
  const Packed packed(aligned_floats(packed_floats, Packed::floats(inputs, L)),
                      paired ? inputs : 0, L);
  if (paired) packed.pack(x.data());
  const int64_t rows = w.rows, ld = w.row / static_cast<int64_t>(sizeof(T));
  const int64_t blk = kScaled<T> ? kBlock : 0;
  auto emit = [&](int64_t o, int64_t j, float v) { ys[j * rows + o] = v; };
  int64_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (!stop.load(std::memory_order_relaxed))
    for (int64_t k = 0; k < w.items && !stop.load(std::memory_order_relaxed); ++k, ++done) {
      const T* W = reinterpret_cast<const T*>(w.w + k * rows * w.row);
      if (paired)
        matvecs(W, rows, L, packed, emit, ld, blk);
      else
        matvecs(W, rows, L, x.data(), inputs, emit, ld, blk);
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {double(done) * rows * w.row / s / 1e9, double(done) * rows * L * 2 * inputs / s / 1e9};
}

// One core reading its buffer with nothing else to do: the plain read the roofline probe takes
// (colibri_read_sum, peak.h), round and round until `stop`.
Rate read(const Weights& w, int core, const std::atomic<bool>& stop) {
  pin(core);
  const int64_t n = w.items * w.rows * w.row / 4;  // floats
  const float* p = reinterpret_cast<const float*>(w.w);
  float sum = 0;
  int64_t rounds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (; !stop.load(std::memory_order_relaxed); ++rounds) sum += colibri_read_sum(p, n);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sum == 42.0f) std::printf("#\n");  // keeps the sums
  return {double(rounds) * n * 4 / s / 1e9, 0};
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

#if COLIBRI_ROW_PAIRS && defined(__AVX512VBMI__)
// The operations that make one input's held weights and multiply them in, in registers,
// nothing loaded: per 32 weights of a row pair what the tiles do at one input (tiles.h):
// int8 two steps of a byte permute, a conversion, a multiply-add making the weights
// (byte_weights) and one summing them (byte_pair_line); int4, held lane by lane, per 128
// weights two ternary logics, seven shifts, eight two-table permutes and eight multiply-adds
// (nibble_pair_line). Four pairs as a tile of eight rows, their bytes already in registers
// (each pair's made anew a round by an empty asm, so that nothing is hoisted). The rate a
// core's widening allows one input at most (GB/s of the rows as held): the loads, and the
// insert that brings a pair's int4 bytes into one vector, cost more. Builds that keep held
// rows out of the row pairs (COLIBRI_HELD_PAIRS=0: Zen 4) do per eight weights of a row what
// the 8-lane tiles do: int8 a zero-extension, a conversion and two multiply-adds (scaled8);
// int4 a shift, a two-table 256-bit permute and a multiply-add (tiles.h's looked_up_block),
// the group's bytes already loaded; eight rows.
Rate widen_peak(Held held, int core, double seconds) {
  pin(core);
#if !COLIBRI_HELD_PAIRS
  {
    constexpr int TW = 8;
    __m256i bytes[TW];
    __m256 lo[TW], hi[TW];
    v8 acc[TW], scale = v8{} + 1.0f / 128, offset = v8{} - 1.0f;
    const v8 xv = v8{} + 0.5f;
    for (int i = 0; i < TW; ++i) {
      bytes[i] = _mm256_set1_epi32(0x01020304 * (i + 1));
      lo[i] = _mm256_set1_ps(1.0f / 128);
      hi[i] = _mm256_set1_ps(-1.0f);
      acc[i] = v8{};
    }
    int64_t rounds = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double s = 0;
    using seconds_f = std::chrono::duration<double>;
    const auto round = [&](auto int8) __attribute__((always_inline)) {
#pragma GCC unroll 8
      for (int i = 0; i < TW; ++i) {
        __m256i b = bytes[i];
        asm volatile("" : "+v"(b));  // made anew each round, as if loaded
        if constexpr (decltype(int8)::value) {
          const __m256i q = _mm256_cvtepu8_epi32(_mm256_castsi256_si128(b));
          const v8 w = fma8(reinterpret_cast<v8>(_mm256_cvtepi32_ps(q)), scale, offset);
          acc[i] = fma8(w, xv, acc[i]);
        } else {
          const __m256i q = _mm256_srli_epi32(b, 4);
          acc[i] = fma8(reinterpret_cast<v8>(_mm256_permutex2var_ps(lo[i], q, hi[i])), xv,
                        acc[i]);
        }
      }
    };
    for (; s < seconds; s = seconds_f(std::chrono::steady_clock::now() - t0).count())
      for (int n = 0; n < 10000; ++n, ++rounds) {
        if (held == Held::kInt8)
          round(std::true_type{});
        else
          round(std::false_type{});
      }
    float sum = 0;
    for (int i = 0; i < TW; ++i) sum += acc[i][0];
    if (sum == 42.0f) std::printf("#\n");  // keeps the sums
    const double weights = double(rounds) * TW * 8 / s;  // TW rows, 8 columns a round
    return {weights * row_bytes(held, kBlock) / kBlock / 1e9, weights * 2 / 1e9};
  }
#endif
  constexpr int TP = 4;
  __m512i both[TP], pick[4];
  v16 acc[TP], xv = v16{} + 0.5f;
  __m512 ta[TP], tb[TP];
  for (int p = 0; p < TP; ++p) {
    both[p] = _mm512_set1_epi32(0x01020304 * (p + 1));
    acc[p] = v16{};
    ta[p] = _mm512_set1_ps(1.0f / 128);
    tb[p] = _mm512_set1_ps(-1.0f);
  }
  for (int s = 0; s < 4; ++s) {  // byte_pair_line's picks
    alignas(64) uint8_t idx[64] = {};
    for (int lane = 0; lane < 16; ++lane)
      idx[4 * lane] = static_cast<uint8_t>((lane < 8 ? 0 : 32) + 8 * s + lane % 8);
    pick[s] = _mm512_load_si512(idx);
  }
  const __m512i low = _mm512_set1_epi32(0x0f0f0f0f), second = _mm512_set1_epi32(0x10101010);
  const __mmask64 at = 0x1111111111111111ull;
  int64_t rounds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double s = 0;
  using seconds_f = std::chrono::duration<double>;
  for (; s < seconds; s = seconds_f(std::chrono::steady_clock::now() - t0).count())
    for (int n = 0; n < 10000; ++n, ++rounds)
      if (held == Held::kInt8) {
#pragma GCC unroll 2
        for (int step = 0; step < 4; step += 2)
          for (int p = 0; p < TP; ++p) {
            asm("" : "+v"(both[p]));
            for (int h = 0; h < 2; ++h) {
              const __m512i q = _mm512_maskz_permutexvar_epi8(at, pick[step + h], both[p]);
              acc[p] = fma16(byte_weights<false, Int8Z>(q, ta[p], tb[p]), xv, acc[p]);
            }
          }
      } else {
        for (int p = 0; p < TP; ++p) {
          asm("" : "+v"(both[p]));
          const __m512i early = _mm512_ternarylogic_epi32(both[p], low, second, 0xea);
          const __m512i late =
              _mm512_ternarylogic_epi32(_mm512_srli_epi32(both[p], 4), low, second, 0xea);
#pragma GCC unroll 8
          for (int step = 0; step < 8; ++step) {
            const __m512i from = step < 4 ? early : late;
            const __m512i i = step % 4 ? _mm512_srli_epi32(from, 8 * (step % 4)) : from;
            acc[p] = fma16(reinterpret_cast<v16>(_mm512_permutex2var_ps(ta[p], i, tb[p])), xv,
                           acc[p]);
          }
        }
      }
  float sum = 0;
  for (int p = 0; p < TP; ++p) sum += acc[p][0];
  if (sum == 42.0f) std::printf("#\n");  // keeps the sums
  // A round: 2 TP rows of 64 columns (int4: a group lane by lane), of 32 (int8: four steps).
  const double weights = double(rounds) * 2 * TP * (held == Held::kInt8 ? 32 : 64) / s;
  return {weights * row_bytes(held, kBlock) / kBlock / 1e9, weights * 2 / 1e9};
}
#endif

struct Part {
  int core;
  int64_t inputs;  // 0: read only
  const Weights* w;
};

Rate part(Held held, const Part& p, int64_t L, const std::atomic<bool>& stop) {
  if (p.inputs == 0) return read(*p.w, p.core, stop);
  switch (held) {
    case Held::kInt8: return work<Int8Z>(*p.w, L, p.inputs, p.core, stop);
    case Held::kInt4: return work<Int4>(*p.w, L, p.inputs, p.core, stop);
    default: return work<float>(*p.w, L, p.inputs, p.core, stop);
  }
}

std::vector<Rate> run_case(Held held, const std::vector<Part>& parts, int64_t L,
                           double seconds) {
  std::atomic<bool> stop{false};
  std::vector<Rate> rates(parts.size());
  std::vector<std::thread> threads;
  for (size_t p = 0; p < parts.size(); ++p)
    threads.emplace_back([&, p] { rates[p] = part(held, parts[p], L, stop); });
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : threads) t.join();
  return rates;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: %s ROW_VALUES INPUTS MIB SECONDS REPEATS [f32|int8|int4]\n",
                 argv[0]);
    return 2;
  }
  const int64_t L = std::atoll(argv[1]), r = std::atoll(argv[2]);
  const double mib = std::atof(argv[3]), seconds = std::atof(argv[4]);
  const int repeats = std::atoi(argv[5]);
  const std::string name = argc == 7 ? argv[6] : "f32";
  const Held held = name == "int8" ? Held::kInt8 : name == "int4" ? Held::kInt4 : Held::kF32;
  if ((held != Held::kF32 && L % kBlock) || (held == Held::kF32 && name != "f32")) {
    std::fprintf(stderr, "held rows: f32, int8 or int4, of a multiple of %lld values\n",
                 (long long)kBlock);
    return 2;
  }
  const Weights dram0 = make_weights(held, L, mib), dram1 = make_weights(held, L, mib);
  const Weights cached = make_weights(held, L, 0.25);  // one item: stays in L2
  struct Case {
    std::string name;
    std::vector<Part> parts;
    std::vector<std::string> where;
  };
  std::vector<Case> cases = {
      {"one core streams", {{0, 1, &cached}}, {"L2"}},
      {"one core streams", {{0, 1, &dram0}}, {"DRAM"}},
      {"one core computes", {{0, r, &cached}}, {"L2"}},
      {"one core computes", {{0, r, &dram0}}, {"DRAM"}},
  };
  if (std::thread::hardware_concurrency() >= 2) {
    cases.push_back({"two cores read", {{0, 0, &dram0}, {1, 0, &dram1}}, {"DRAM", "DRAM"}});
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
#if COLIBRI_ROW_PAIRS && defined(__AVX512VBMI__)
  if (held != Held::kF32) {
    Rate best_widen;
    for (int rep = 0; rep < repeats; ++rep) {
      const Rate w = widen_peak(held, 0, seconds / 4);
      if (w.gb_s > best_widen.gb_s) best_widen = w;
    }
    std::printf("one core widens\t0\t1\tregisters\t%.2f\t%.2f\n", best_widen.gb_s,
                best_widen.gflop_s);
  }
#endif
  std::vector<std::vector<Rate>> best(cases.size());
  for (int rep = 0; rep < repeats; ++rep)
    for (size_t c = 0; c < cases.size(); ++c) {
      const auto rates = run_case(held, cases[c].parts, L, seconds);
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
