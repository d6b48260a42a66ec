// Weight streaming rate of matrix-vector products, by how the rows read side by side are laid
// out: built and run by bench_streams.py. Every dot product is one 8-lane FMA chain, as in
// colibri/kernels/cpu/tiles.h; only the order in which rows are visited changes.
//
// usage: bench_streams ROW_FLOATS CHUNK_ROWS MIB REPEATS
// prints "layout rows_side_by_side gap_rows item_rows GB/s ratio" per layout: GB/s the best of
// REPEATS, ratio the median over the repeats of its rate against the plain read of items as
// long in the same repeat (the machine's bandwidth moves between repeats).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline float hsum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// y[r] = W[r] . x over a chunk of R rows of L floats, TW rows at a time, `gap` rows apart;
// each row's stream fetched into L2 Ahead bytes on, once a cache line, where Ahead > 0 (as
// tiles.h's one-input tiles where COLIBRI_ONE_INPUT_FETCH says).
template <int TW, int Ahead = 0>
void chunk(const float* W, int64_t R, int64_t L, int64_t gap, const float* x, float* y) {
  int64_t b = 0;
  for (; b + TW * gap <= R; b += TW * gap)
    for (int64_t o = 0; o < gap; ++o) {
      const float* w[TW];
      v8 acc[TW];
      for (int i = 0; i < TW; ++i) {
        w[i] = W + (b + o + i * gap) * L;
        acc[i] = v8{};
      }
      for (int64_t c = 0; c + 8 <= L; c += 8) {
        if (Ahead && c % 16 == 0)
          for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + c + Ahead / 4, 0, 2);
        const v8 xv = load8(x + c);
        for (int i = 0; i < TW; ++i)
          acc[i] = (v8)_mm256_fmadd_ps((__m256)load8(w[i] + c), (__m256)xv, (__m256)acc[i]);
      }
      for (int i = 0; i < TW; ++i) y[b + o + i * gap] = hsum(acc[i]);
    }
  if (b < R) chunk<1, Ahead>(W + b * L, R - b, L, 1, x, y + b);  // rows left: one at a time
}

// The same with each group of TW rows stored interleaved, B floats of each row in turn: the
// group is read as one sequential stream.
template <int TW, int B>
void interleaved(const float* W, int64_t R, int64_t L, const float* x, float* y) {
  for (int64_t b = 0; b < R; b += TW) {
    const float* g = W + b * L;
    v8 acc[TW];
    for (int i = 0; i < TW; ++i) acc[i] = v8{};
    for (int64_t c = 0; c + B <= L; c += B, g += TW * B)
      for (int k = 0; k < B; k += 8) {
        const v8 xv = load8(x + c + k);
        for (int i = 0; i < TW; ++i)
          acc[i] = (v8)_mm256_fmadd_ps((__m256)load8(g + i * B + k), (__m256)xv, (__m256)acc[i]);
      }
    for (int i = 0; i < TW; ++i) y[b + i] = hsum(acc[i]);
  }
}

// Plain read of the same bytes (four independent sums): the ceiling.
void read_only(const float* W, int64_t n, float* y) {
  v8 a{}, b{}, c{}, d{};
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a += load8(W + i);
    b += load8(W + i + 8);
    c += load8(W + i + 16);
    d += load8(W + i + 24);
  }
  *y = hsum(a + b + c + d);
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s ROW_FLOATS CHUNK_ROWS MIB REPEATS\n", argv[0]);
    return 2;
  }
  const int64_t L = std::atoll(argv[1]), R = std::atoll(argv[2]);
  const int64_t bytes = std::atoll(argv[3]) << 20, reps = std::atoll(argv[4]);
  const int64_t most = bytes / (R * L * 4) / 4 * 4;  // items of R rows (of 4 R: a quarter)
  std::vector<float> W(most * R * L), x(L, 0.5f);
  for (size_t i = 0; i < W.size(); ++i) W[i] = float(i % 97) * 1e-3f;
  struct Layout {
    const char* name;
    int tw;
    int64_t gap, rows;  // rows an item
    int ahead = 0;      // bytes each row's stream is fetched ahead (0: not)
  } layouts[] = {{"read", 0, 0, R},
                 {"1 row at a time", 1, 1, R},
                 {"4 adjacent rows", 4, 1, R},
                 {"8 adjacent rows", 8, 1, R},
                 {"4 rows a quarter apart", 4, R / 4, R},
                 {"8 rows an eighth apart", 8, R / 8, R},
                 {"4 rows interleaved by 8", -4, 8, R},
                 {"4 rows interleaved by 16", -4, 16, R},
                 {"8 rows interleaved by 8", -8, 8, R},
                 {"read, items 4x as long", 0, 0, 4 * R},
                 {"4 rows a quarter apart, items 4x as long", 4, R, 4 * R},
                 {"4 rows a quarter apart, items 4x as long, 1 KiB fetched ahead", 4, R, 4 * R,
                  1024},
                 {"4 rows an odd number apart, items 4x as long", 4, R - 1, 4 * R},
                 {"4 rows an odd number apart, items 4x as long, 1 KiB fetched ahead", 4, R - 1,
                  4 * R, 1024},
                 {"4 rows an odd number apart, items 4x as long, 4 KiB fetched ahead", 4, R - 1,
                  4 * R, 4096}};
  const int n = sizeof layouts / sizeof layouts[0];
  std::vector<double> best(n, 0.0);
  std::vector<std::vector<double>> rate(n);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  for (int64_t rep = 0; rep < reps; ++rep)
    for (int v = 0; v < n; ++v) {  // layouts interleaved: load from elsewhere hits all alike
      const int64_t rows = layouts[v].rows, items = most * R / rows;
      std::atomic<int64_t> next{0};
      auto work = [&](unsigned t) {
        std::vector<float> y(rows);
        for (int64_t k; (k = next.fetch_add(1)) < items;) {
          const float* w = W.data() + k * rows * L;
          switch (layouts[v].tw) {
            case 0: read_only(w, rows * L, y.data()); break;
            case 1: chunk<1>(w, rows, L, 1, x.data(), y.data()); break;
            case 4:
              if (layouts[v].ahead == 1024)
                chunk<4, 1024>(w, rows, L, layouts[v].gap, x.data(), y.data());
              else if (layouts[v].ahead == 4096)
                chunk<4, 4096>(w, rows, L, layouts[v].gap, x.data(), y.data());
              else
                chunk<4>(w, rows, L, layouts[v].gap, x.data(), y.data());
              break;
            case 8: chunk<8>(w, rows, L, layouts[v].gap, x.data(), y.data()); break;
            case -4:
              if (layouts[v].gap == 8) interleaved<4, 8>(w, rows, L, x.data(), y.data());
              else interleaved<4, 16>(w, rows, L, x.data(), y.data());
              break;
            case -8: interleaved<8, 8>(w, rows, L, x.data(), y.data()); break;
          }
        }
      };
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work, t);
      work(0);
      for (auto& th : pool) th.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rate[v].push_back(double(items * rows * L * 4) / s / 1e9);
      best[v] = std::max(best[v], rate[v].back());
    }
  for (int v = 0; v < n; ++v) {
    int read = 0;  // the plain read of items as long
    for (int u = 0; u < n; ++u)
      if (layouts[u].tw == 0 && layouts[u].rows == layouts[v].rows) read = u;
    std::vector<double> ratio;
    for (int64_t rep = 0; rep < reps; ++rep) ratio.push_back(rate[v][rep] / rate[read][rep]);
    std::sort(ratio.begin(), ratio.end());
    const double median = (ratio[(reps - 1) / 2] + ratio[reps / 2]) / 2;
    std::printf("%s\t%d\t%lld\t%lld\t%.2f\t%.3f\n", layouts[v].name, layouts[v].tw,
                (long long)layouts[v].gap, (long long)layouts[v].rows, best[v], median);
  }
  return 0;
}
