// The host optimizer op's AdamW in one pass over memory (fused_host_adamw.py builds this file with
// torch.utils.cpp_extension and calls it; the numerics and the order of the sums are described there).
//
// One call updates the op's range [lo, hi), which may lie in several tensors of each kind (stretches, cut where
// any of them is): per element it reads the gradient, the master and the moments once, adds the gradient's
// square to its chunk's lanes, updates the moments and the master, writes the compute copy (bf16 bits or
// fp32; none) and, if asked, zeroes the gradient (the executor's adam op does not ask: the step's first
// gradient write overwrites the accumulator, ops/grads.py). Chunks of CHUNK elements counted from lo are the
// unit of the threads' work (at::parallel_for, each thread taking the next chunk, all of it whatever
// stretches and decay groups it meets) and of the sums of squares (LANES fp32 lanes each, element e in lane
// (e - lo) % LANES, then summed in fp64 in lane order, the chunks in order). Every tensor's bounds are
// checked before the loop.
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
#include <initializer_list>
#include <optional>
#include <vector>

namespace {

constexpr int64_t LANES = 16;     // fp32 partial sums of squares per chunk
constexpr int64_t CHUNK = 16384;  // elements per chunk (64 KiB of fp32)
constexpr int64_t UNIT = 1;       // chunks per unit of a thread's work (the next unit taken when one is done)

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
    if (c.clip != 1.0f) g = g * c.clip;  // (a factor of 1 changes no value: not multiplied, as torch)
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
// (CLIP: the gradient multiplied by the clipping factor; without, the factor is 1: nothing to multiply)
template <Dest D, bool NT, bool ZERO, bool CLIP>
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
    for (int64_t k = 0; k < VECS; ++k) {
      const int64_t j = i + k * Vec::size();
      Vec g = Vec::loadu(gs + j), p = Vec::loadu(ps + j), m = Vec::loadu(ms + j), v = Vec::loadu(vs + j);
      acc[k] = acc[k] + g * g;
      if constexpr (CLIP) g = g * clip;
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
template <bool ZERO, bool CLIP>
void vector_loop_to(const Stretch& s, int64_t i0, int64_t i1, const Coef& c, float f, float* lanes) {
  if (i1 <= i0) return;
  const auto addr = reinterpret_cast<uintptr_t>(s.d);
  if (s.dmode == DEST_BF16) {
    if (STREAMS && (addr + 2 * i0) % 32 == 0) {
      return vector_loop<DEST_BF16, STREAMS, ZERO, CLIP>(s, i0, i1, c, f, lanes);
    }
    return vector_loop<DEST_BF16, false, ZERO, CLIP>(s, i0, i1, c, f, lanes);
  }
  if (s.dmode == DEST_F32) {
    if (STREAMS && (addr + 4 * i0) % 32 == 0) {
      return vector_loop<DEST_F32, STREAMS, ZERO, CLIP>(s, i0, i1, c, f, lanes);
    }
    return vector_loop<DEST_F32, false, ZERO, CLIP>(s, i0, i1, c, f, lanes);
  }
  vector_loop<NO_DEST, false, ZERO, CLIP>(s, i0, i1, c, f, lanes);
}

// elements [a, z) of the stretch (one decay factor f, inside one chunk; element a in lane lane0)
template <bool ZERO>
void piece(const Stretch& s, int64_t a, int64_t z, const Coef& c, float f, float* lanes, int64_t lane0) {
  const int64_t head = std::min(z, a + (LANES - lane0 % LANES) % LANES);
  scalar_loop<ZERO>(s, a, head, c, f, lanes, lane0);
  const int64_t body = head + (z - head) / LANES * LANES;  // from head on, element i in lane (i - head) % LANES
  if (c.clip != 1.0f) {
    vector_loop_to<ZERO, true>(s, head, body, c, f, lanes);
  } else {
    vector_loop_to<ZERO, false>(s, head, body, c, f, lanes);
  }
  scalar_loop<ZERO>(s, body, z, c, f, lanes, 0);
}

// The op's arrays: the gradient accumulator (element e at g[e]) and its stretches, stretch k the elements
// [cuts[k], cuts[k + 1]) with its pointers at element cuts[k]
struct Range {
  const std::vector<int64_t>& cuts;
  std::vector<Stretch> st;
  const std::vector<int64_t>& ends;  // the decay groups' ends (the first group starts at cuts[0])
  const std::vector<bool>& decayed;
  Coef c;
};

// chunk `row` of the op's range (elements lo + row * CHUNK on, counted from lo = cuts[0]) through every
// stretch and decay group it meets, in element order; returns its squares (its lanes summed in lane order)
template <bool ZERO>
double chunk(const Range& r, int64_t row) {
  const int64_t lo = r.cuts.front(), hi = r.cuts.back();
  const int64_t a = lo + row * CHUNK, z = std::min(hi, a + CHUNK);
  float lanes[LANES] = {};
  size_t k = std::upper_bound(r.cuts.begin(), r.cuts.end(), a) - r.cuts.begin() - 1;
  size_t j = std::upper_bound(r.ends.begin(), r.ends.end(), a) - r.ends.begin();
  for (int64_t x = a; x < z;) {
    const int64_t s0 = r.cuts[k];
    const int64_t y = std::min({z, r.cuts[k + 1], r.ends[j]});
    piece<ZERO>(r.st[k], x - s0, y - s0, r.c, r.decayed[j] ? r.c.decay : 1.0f, lanes, (x - lo) % LANES);
    x = y;
    if (x == r.cuts[k + 1]) ++k;
    if (x == r.ends[j]) ++j;
  }
  double sum = 0.0;
  for (int64_t e = 0; e < LANES; ++e) sum += double(lanes[e]);
  return sum;
}

// tensor t holds the stretch's n elements from index `at` on: a contiguous 1-D CPU tensor of a dtype in
// `dtypes`, large enough (so that the loop reads and writes inside it)
void check_piece(const at::Tensor& t, int64_t at, int64_t n, std::initializer_list<at::ScalarType> dtypes,
                 const char* what, size_t k) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() &&
                  std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(),
              "fused_host_adamw: ", what, " of stretch ", k, " must be a contiguous 1-D CPU tensor (fp32",
              dtypes.size() > 1 ? " or bf16" : "", "), got ", t.scalar_type(), " of ", t.dim(), " dims");
  TORCH_CHECK(at >= 0 && at + n <= t.numel(), "fused_host_adamw: ", what, " of stretch ", k, " holds ",
              t.numel(), " elements, not [", at, ", ", at + n, ")");
}

// The op's stretches, checked: stretch k's master, moments and compute copy (bf16, fp32 or None) are p[k],
// m[k], v[k], d[k], holding its elements from index offsets[4k + 0..3] on
std::vector<Stretch> stretches(const at::Tensor& g, const std::vector<int64_t>& cuts,
                               const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& m,
                               const std::vector<at::Tensor>& v, const std::vector<std::optional<at::Tensor>>& d,
                               const std::vector<int64_t>& offsets) {
  const size_t n = cuts.size() - 1;
  TORCH_CHECK(p.size() == n && m.size() == n && v.size() == n && d.size() == n && offsets.size() == 4 * n,
              "fused_host_adamw: ", n, " stretches: as many masters, adam_m, adam_v, compute copies and 4 "
              "offsets each");
  TORCH_CHECK(g.device().is_cpu() && g.scalar_type() == at::kFloat && g.dim() == 1 && g.is_contiguous() &&
                  g.numel() >= cuts.back(),
              "fused_host_adamw: the gradient must be a contiguous 1-D fp32 CPU tensor of at least ",
              cuts.back(), " elements");
  std::vector<Stretch> out;
  for (size_t k = 0; k < n; ++k) {
    const int64_t len = cuts[k + 1] - cuts[k];
    const int64_t* at = &offsets[4 * k];
    check_piece(p[k], at[0], len, {at::kFloat}, "the master", k);
    check_piece(m[k], at[1], len, {at::kFloat}, "adam_m", k);
    check_piece(v[k], at[2], len, {at::kFloat}, "adam_v", k);
    Stretch s{g.data_ptr<float>() + cuts[k], p[k].data_ptr<float>() + at[0], m[k].data_ptr<float>() + at[1],
              v[k].data_ptr<float>() + at[2], nullptr, NO_DEST};
    if (d[k].has_value()) {
      const at::Tensor& t = *d[k];
      check_piece(t, at[3], len, {at::kFloat, at::kBFloat16}, "the compute copy", k);
      const bool bf16 = t.scalar_type() == at::kBFloat16;
      s.d = static_cast<char*>(t.data_ptr()) + at[3] * (bf16 ? 2 : 4);
      s.dmode = bf16 ? DEST_BF16 : DEST_F32;
    }
    out.push_back(s);
  }
  return out;
}

// The update of the op's range [cuts[0], cuts.back()): g is the gradient accumulator indexed by element; the
// range's stretches are as `stretches` says; group_ends / group_decayed: the ends of the op's decay groups
// (element numbers, increasing; the first group starts at cuts[0]) and whether each is decayed; zero_grads:
// whether the gradient is zeroed after its use (else only read). Returns the sum of the squares of the
// (unclipped) gradients. Runs on at::get_num_threads() threads, without the GIL.
double step(const at::Tensor& g, const std::vector<int64_t>& cuts, const std::vector<at::Tensor>& p,
            const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v,
            const std::vector<std::optional<at::Tensor>>& d, const std::vector<int64_t>& offsets,
            const std::vector<double>& coef, const std::vector<int64_t>& group_ends,
            const std::vector<bool>& group_decayed, bool zero_grads) {
  TORCH_CHECK(cuts.size() >= 2 && cuts.front() >= 0, "fused_host_adamw: the cuts must hold the range's ends");
  for (size_t k = 1; k < cuts.size(); ++k) {
    TORCH_CHECK(cuts[k - 1] < cuts[k], "fused_host_adamw: the cuts must increase");
  }
  TORCH_CHECK(coef.size() == 8, "fused_host_adamw: 8 coefficients, got ", coef.size());
  TORCH_CHECK(!group_ends.empty() && group_ends.size() == group_decayed.size() &&
                  group_ends.back() >= cuts.back() && group_ends.front() > cuts.front(),
              "fused_host_adamw: the decay groups must end inside the range and at or after ", cuts.back());
  for (size_t j = 1; j < group_ends.size(); ++j) {
    TORCH_CHECK(group_ends[j - 1] < group_ends[j], "fused_host_adamw: the decay groups' ends must increase");
  }
  const Range r{cuts, stretches(g, cuts, p, m, v, d, offsets), group_ends, group_decayed,
                Coef{float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), float(coef[4]),
                     float(coef[5]), float(coef[6]), float(coef[7])}};
  const int64_t rows = (cuts.back() - 1 - cuts.front()) / CHUNK + 1;
  std::vector<double> sums(rows, 0.0);  // each chunk's squares
  const int64_t units = (rows + UNIT - 1) / UNIT;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  std::atomic<int64_t> next{0};
  std::mutex seen_lock;
  std::vector<std::thread::id> seen;  // the threads that ran a unit (once per thread per call: no cost)
  // one task per thread; each takes the next unit of UNIT chunks until none is left (a preempted thread
  // holds up one unit, not a fixed share)
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    {
      std::lock_guard<std::mutex> hold(seen_lock);
      const auto me = std::this_thread::get_id();
      if (std::find(seen.begin(), seen.end(), me) == seen.end()) seen.push_back(me);
    }
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      for (int64_t k = u * UNIT; k < std::min(rows, (u + 1) * UNIT); ++k) {
        sums[k] = zero_grads ? chunk<true>(r, k) : chunk<false>(r, k);
      }
    }
  });
  last_team_size.store(int64_t(seen.size()));
  double total = 0.0;  // the chunks in order
  for (double s : sums) total += s;
  return total;
}

// how many distinct threads ran the last `step` call's units (of any caller): the check that the kernel runs
// on torch's team, not on one thread (built without -fopenmp, at::parallel_for's OpenMP region is dropped)
int64_t last_threads() { return last_team_size.load(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.attr("LANES") = LANES;
  mod.attr("CHUNK") = CHUNK;
  mod.def("step", &step, py::arg("g"), py::arg("cuts"), py::arg("p"), py::arg("m"), py::arg("v"), py::arg("d"),
          py::arg("offsets"), py::arg("coef"), py::arg("group_ends"), py::arg("group_decayed"),
          py::arg("zero_grads"), py::call_guard<py::gil_scoped_release>());
  mod.def("last_threads", &last_threads);
}
