// The host optimizer op's AdamW in one pass over memory (fused_host_adamw.py builds this file with
// torch.utils.cpp_extension and calls it; the numerics and the order of the sums are described there).
//
// One call updates one stretch [s0, s1) of the op's range [lo, hi): per element it reads the gradient, the
// master and the moments once, adds the gradient's square to its chunk's lanes, updates the moments and the
// master, writes the compute copy (bf16 bits or fp32; none) and, if asked, zeroes the gradient (the
// executor's adam op does not ask: the step's first gradient write overwrites the accumulator, ops/grads.py).
// Chunks of CHUNK elements counted from lo are the unit of the threads' work (at::parallel_for, each thread
// taking the next chunk) and of the sums of squares (LANES fp32 lanes each, element e in lane (e - lo) % LANES).
//
// Built with -ffp-contract=off: the only fused multiply-adds are the two written as such (as torch's
// vector path computes them); every other operation rounds on its own, in the vector and in the scalar loop.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t LANES = 16;     // fp32 partial sums of squares per chunk
constexpr int64_t CHUNK = 16384;  // elements per chunk (64 KiB of fp32)
constexpr int64_t PREFETCH = 512; // elements ahead that the vector loop prefetches in each fp32 stream

using Vec = at::vec::Vectorized<float>;
static_assert(LANES % Vec::size() == 0, "a lane group is whole vectors");
constexpr int64_t VECS = LANES / Vec::size();

std::atomic<int64_t> last_team_size{0};  // last_threads()

enum Dest : int64_t { NO_DEST = 0, DEST_BF16 = 1, DEST_F32 = 2 };

struct Coef {  // the step's fp32 constants, as fused_host_adamw.coefficients rounds them
  float decay, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step, clip;
};

struct Stretch {  // the arrays of [s0, s1), each from index 0
  float* g;
  float* p;
  float* m;
  float* v;
  void* d;
  Dest dmode;
};

inline uint16_t bf16_bits(float x) {  // rounded to nearest even, NaN as 0xffff (torch's vectorized cast)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0xFFFF) : uint16_t(r);
}

#if defined(CPU_CAPABILITY_AVX2)
constexpr bool STREAMS = true;  // non-temporal stores of the compute copy where it is aligned
#else
constexpr bool STREAMS = false;
#endif

// the updated master's LANES elements (VECS vectors) into the compute copy at element i; with NT as
// non-temporal stores (the address aligned to a whole store: no read for ownership of a line only written)
template <Dest D, bool NT>
inline void store_dest(void* d, int64_t i, const Vec* p) {
  if constexpr (D == DEST_F32) {
    for (int64_t k = 0; k < VECS; ++k) {
      float* out = static_cast<float*>(d) + i + k * Vec::size();
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (NT) {
        _mm256_stream_ps(out, __m256(p[k]));
        continue;
      }
#endif
      p[k].store(out);
    }
  } else if constexpr (D == DEST_BF16) {
    uint16_t* out = static_cast<uint16_t*>(d) + i;
#if defined(CPU_CAPABILITY_AVX2)
    static_assert(VECS == 2, "two AVX2 vectors of fp32 make one of bf16");
    const __m256i bits = at::vec::cvtfp32_bf16(__m256(p[0]), __m256(p[1]));  // torch's own cast
    if constexpr (NT) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out), bits);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bits);
    }
#else
    for (int64_t k = 0; k < VECS; ++k) {
      float x[Vec::size()];
      p[k].store(x);
      for (int64_t e = 0; e < Vec::size(); ++e) out[k * Vec::size() + e] = bf16_bits(x[e]);
    }
#endif
  }
}

inline void write_dest(const Stretch& s, int64_t i, float x) {
  if (s.dmode == DEST_BF16) {
    static_cast<uint16_t*>(s.d)[i] = bf16_bits(x);
  } else if (s.dmode == DEST_F32) {
    static_cast<float*>(s.d)[i] = x;
  }
}

// elements [i0, i1) one at a time; element i's square in lanes[(lane0 + i - i0) % LANES]
template <bool ZERO>
void scalar_loop(const Stretch& s, int64_t i0, int64_t i1, const Coef& c, float f, float* lanes,
                 int64_t lane0) {
  for (int64_t i = i0; i < i1; ++i) {
    float g = s.g[i];
    float& lane = lanes[(lane0 + i - i0) % LANES];
    lane = lane + g * g;
    g = g * c.clip;
    float m = std::fma(c.one_minus_beta1, g - s.m[i], s.m[i]);
    float v = std::fma(c.one_minus_beta2 * g, g, s.v[i] * c.beta2);
    float den = std::sqrt(v) / c.bc2_sqrt + c.eps;
    float p = s.p[i] * f + (c.neg_step * m) / den;
    s.p[i] = p;
    s.m[i] = m;
    s.v[i] = v;
    write_dest(s, i, p);
    if constexpr (ZERO) s.g[i] = 0.0f;
  }
}

// elements [i0, i1) (a multiple of LANES of them, i0 in lane 0) LANES at a time: the same operations
template <Dest D, bool NT, bool ZERO>
void vector_loop(const Stretch& s, int64_t i0, int64_t i1, const Coef& c, float f, float* lanes) {
  const Vec clip(c.clip), b1(c.one_minus_beta1), b2(c.beta2), one_b2(c.one_minus_beta2), bc2(c.bc2_sqrt),
      eps(c.eps), step(c.neg_step), fv(f), zero(0.0f);
  float* __restrict gs = s.g;  // (the arrays do not overlap: the pointers stay in registers)
  float* __restrict ps = s.p;
  float* __restrict ms = s.m;
  float* __restrict vs = s.v;
  void* ds = s.d;
  Vec acc[VECS], out[VECS];
  for (int64_t k = 0; k < VECS; ++k) acc[k] = Vec::loadu(lanes + k * Vec::size());
  for (int64_t i = i0; i < i1; i += LANES) {
    __builtin_prefetch(gs + i + PREFETCH, 0, 3);
    __builtin_prefetch(ps + i + PREFETCH, 0, 3);
    __builtin_prefetch(ms + i + PREFETCH, 0, 3);
    __builtin_prefetch(vs + i + PREFETCH, 0, 3);
    for (int64_t k = 0; k < VECS; ++k) {
      const int64_t j = i + k * Vec::size();
      Vec g = Vec::loadu(gs + j), p = Vec::loadu(ps + j), m = Vec::loadu(ms + j), v = Vec::loadu(vs + j);
      acc[k] = acc[k] + g * g;
      g = g * clip;
      m = at::vec::fmadd(b1, g - m, m);
      v = at::vec::fmadd(one_b2 * g, g, v * b2);
      Vec den = v.sqrt() / bc2 + eps;
      p = p * fv + (step * m) / den;
      p.store(ps + j);
      m.store(ms + j);
      v.store(vs + j);
      if constexpr (ZERO) zero.store(gs + j);
      out[k] = p;
    }
    store_dest<D, NT>(ds, i, out);
  }
  for (int64_t k = 0; k < VECS; ++k) acc[k].store(lanes + k * Vec::size());
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (NT) _mm_sfence();  // the streaming stores ordered before whatever the caller does next
#endif
}

// vector_loop for the stretch's compute copy, with non-temporal stores where its address at i0 is aligned
template <bool ZERO>
void vector_loop_to(const Stretch& s, int64_t i0, int64_t i1, const Coef& c, float f, float* lanes) {
  if (i1 <= i0) return;
  const auto addr = reinterpret_cast<uintptr_t>(s.d);
  if (s.dmode == DEST_BF16) {
    if (STREAMS && (addr + 2 * i0) % 32 == 0) {
      return vector_loop<DEST_BF16, STREAMS, ZERO>(s, i0, i1, c, f, lanes);
    }
    return vector_loop<DEST_BF16, false, ZERO>(s, i0, i1, c, f, lanes);
  }
  if (s.dmode == DEST_F32) {
    if (STREAMS && (addr + 4 * i0) % 32 == 0) {
      return vector_loop<DEST_F32, STREAMS, ZERO>(s, i0, i1, c, f, lanes);
    }
    return vector_loop<DEST_F32, false, ZERO>(s, i0, i1, c, f, lanes);
  }
  vector_loop<NO_DEST, false, ZERO>(s, i0, i1, c, f, lanes);
}

// elements [a, z) of the stretch (one decay factor f, inside one chunk; element a in lane lane0)
template <bool ZERO>
void piece(const Stretch& s, int64_t a, int64_t z, const Coef& c, float f, float* lanes, int64_t lane0) {
  const int64_t head = std::min(z, a + (LANES - lane0 % LANES) % LANES);
  scalar_loop<ZERO>(s, a, head, c, f, lanes, lane0);
  const int64_t body = head + (z - head) / LANES * LANES;  // from head on, element i in lane (i - head) % LANES
  vector_loop_to<ZERO>(s, head, body, c, f, lanes);
  scalar_loop<ZERO>(s, body, z, c, f, lanes, 0);
}

// chunk k of [s0, s1) (chunk 0: the one that s0 is in, counted from lo), its lanes in partials[row]
template <bool ZERO>
void chunk(const Stretch& s, int64_t s0, int64_t s1, int64_t lo, int64_t k, const Coef& c,
           const std::vector<int64_t>& ends, const std::vector<bool>& decayed, float* partials) {
  const int64_t row = (s0 - lo) / CHUNK + k;
  const int64_t cs = lo + row * CHUNK;
  const int64_t a = std::max(s0, cs), z = std::min(s1, cs + CHUNK);
  size_t j = 0;
  while (ends[j] <= a) ++j;
  for (int64_t x = a; x < z; ++j) {
    const int64_t y = std::min(z, ends[j]);
    piece<ZERO>(s, x - s0, y - s0, c, decayed[j] ? c.decay : 1.0f, partials + row * LANES, (x - lo) % LANES);
    x = y;
  }
}

void check_fp32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous() &&
                  t.numel() == n,
              "fused_host_adamw: ", what, " must be a contiguous 1-D fp32 CPU tensor of ", n, " elements");
}

// The update of elements [s0, s1) of the op's range starting at element lo: g, p, m, v (fp32) and d (bf16,
// fp32 or None) hold them from index 0; group_ends / group_decayed: the ends of the op's decay groups
// (element numbers, increasing) and whether each is decayed; partials: one row of LANES fp32 per chunk of
// the op's range, added to; zero_grads: whether g is zeroed after its use (else left as it was). Runs on
// at::get_num_threads() threads, without the GIL.
void step(const at::Tensor& g, const at::Tensor& p, const at::Tensor& m, const at::Tensor& v,
          const std::optional<at::Tensor>& d, const std::vector<double>& coef, int64_t lo, int64_t s0,
          int64_t s1, const std::vector<int64_t>& group_ends, const std::vector<bool>& group_decayed,
          const at::Tensor& partials, bool zero_grads) {
  const int64_t n = s1 - s0;
  TORCH_CHECK(lo <= s0 && s0 < s1, "fused_host_adamw: the stretch [", s0, ", ", s1, ") is empty or before ",
              lo);
  check_fp32(g, n, "the gradient");
  check_fp32(p, n, "the master");
  check_fp32(m, n, "adam_m");
  check_fp32(v, n, "adam_v");
  TORCH_CHECK(coef.size() == 8, "fused_host_adamw: 8 coefficients, got ", coef.size());
  TORCH_CHECK(!group_ends.empty() && group_ends.size() == group_decayed.size() && group_ends.back() >= s1,
              "fused_host_adamw: the decay groups must end at or after ", s1);
  for (size_t j = 1; j < group_ends.size(); ++j) {
    TORCH_CHECK(group_ends[j - 1] < group_ends[j], "fused_host_adamw: the decay groups' ends must increase");
  }
  const int64_t rows = (s1 - 1 - lo) / CHUNK + 1;
  TORCH_CHECK(partials.device().is_cpu() && partials.scalar_type() == at::kFloat && partials.dim() == 2 &&
                  partials.is_contiguous() && partials.size(1) == LANES && partials.size(0) >= rows,
              "fused_host_adamw: partials must be a contiguous fp32 CPU tensor of at least ", rows, " x ",
              LANES);
  Stretch s{g.data_ptr<float>(), p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), nullptr,
            NO_DEST};
  if (d.has_value()) {
    const at::Tensor& t = *d;
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.numel() == n &&
                    (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat),
                "fused_host_adamw: the compute copy must be a contiguous 1-D bf16 or fp32 CPU tensor of ", n,
                " elements");
    s.d = t.data_ptr();
    s.dmode = t.scalar_type() == at::kBFloat16 ? DEST_BF16 : DEST_F32;
  }
  const Coef c{float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]),
               float(coef[4]), float(coef[5]), float(coef[6]), float(coef[7])};
  float* parts = partials.data_ptr<float>();
  const int64_t n_chunks = rows - (s0 - lo) / CHUNK;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n_chunks);
  std::atomic<int64_t> next{0};
  std::mutex seen_lock;
  std::vector<std::thread::id> seen;  // the threads that ran a unit (once per thread per call: no cost)
  // one unit per thread; each takes the next chunk until none is left (a preempted thread holds up one
  // chunk, not a fixed share)
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    {
      std::lock_guard<std::mutex> hold(seen_lock);
      const auto me = std::this_thread::get_id();
      if (std::find(seen.begin(), seen.end(), me) == seen.end()) seen.push_back(me);
    }
    for (int64_t k = next.fetch_add(1); k < n_chunks; k = next.fetch_add(1)) {
      if (zero_grads) {
        chunk<true>(s, s0, s1, lo, k, c, group_ends, group_decayed, parts);
      } else {
        chunk<false>(s, s0, s1, lo, k, c, group_ends, group_decayed, parts);
      }
    }
  });
  last_team_size.store(int64_t(seen.size()));
}

// how many distinct threads ran the last `step` call's units (of any caller): the check that the kernel runs
// on torch's team, not on one thread (built without -fopenmp, at::parallel_for's OpenMP region is dropped)
int64_t last_threads() { return last_team_size.load(); }

// the sum of squares: each row's lanes in fp64 in lane order, the rows in order
double total(const at::Tensor& partials) {
  TORCH_CHECK(partials.device().is_cpu() && partials.scalar_type() == at::kFloat && partials.dim() == 2 &&
                  partials.is_contiguous() && partials.size(1) == LANES,
              "fused_host_adamw: partials must be a contiguous fp32 CPU tensor of rows of ", LANES);
  const float* x = partials.data_ptr<float>();
  double sum = 0.0;
  for (int64_t r = 0; r < partials.size(0); ++r) {
    double row = 0.0;
    for (int64_t k = 0; k < LANES; ++k) row += double(x[r * LANES + k]);
    sum += row;
  }
  return sum;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.attr("LANES") = LANES;
  mod.attr("CHUNK") = CHUNK;
  // zero_grads defaults to true (the gradient zeroed, as before the argument was added)
  mod.def("step", &step, py::arg("g"), py::arg("p"), py::arg("m"), py::arg("v"), py::arg("d"), py::arg("coef"),
          py::arg("lo"), py::arg("s0"), py::arg("s1"), py::arg("group_ends"), py::arg("group_decayed"),
          py::arg("partials"), py::arg("zero_grads") = true, py::call_guard<py::gil_scoped_release>());
  mod.def("total", &total, py::call_guard<py::gil_scoped_release>());
  mod.def("last_threads", &last_threads);
}
