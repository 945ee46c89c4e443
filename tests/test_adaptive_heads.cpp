// Adaptive head budgets (SPEC 14, docs/design.md 4.9) through the public API: SqueezeAttention
// (no coordinator, and in a model's set with one), H2O and PyramidKV with head_budgets =
// "adaptive".
//  * against the pooled-eviction oracle of tests/reference/adaptive_oracle.hpp on random call
//    sequences (with queries, the key-as-query proxy, KeyDiff and K-norm, value_norm_power);
//  * floor 1 with queries is uniform heads bit for bit;
//  * heads really become ragged, within their pool and floor, and kept_bytes() counts their rows;
//  * the config errors; update_and_fetch(_into) and state() refusing ragged heads, cache unchanged;
//  * the ragged KVView (also a quantized cache's dequantized copy); attend against a naive
//    attention over the rows the view shows;
//  * parallel heads bit-identical to serial ones; fork, checkpoint / rollback and prompt caches in
//    the middle of a run continuing bit-identically.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
#include <veloxquant/cache.hpp>

#include "reference/adaptive_oracle.hpp"
#include "reference/oracle.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
namespace ref = veloxquant::reference;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

using Scorer = ref::H2OHeadOracle::Scorer;
using SeqOracle = ref::AdaptiveSequenceOracle;
using Positions = std::vector<std::int64_t>;
template <class T>
using CachePtr = std::unique_ptr<vc::KVCache<T>>;
template <class T>
using Caches = std::vector<CachePtr<T>>;

constexpr double kNearTie = 1e-5;

/// One configuration: a cache and the calls fed to it.
struct AdaRun {
  Method method = Method::h2o;
  int budget = 8;  // pyramidkv from the builder: the average over its 3 layers
  int n_sink = 0;
  double recent = 0.5;  // squeeze / pyramidkv: the recent ratio; h2o: the grace (an integer)
  double decay = 1.0;
  double floor = 0.2;
  double value_power = 0.0;
  Scorer scorer = Scorer::key_as_query;
  int pyramid_layer = -1;  // pyramidkv: this layer of a 3-layer model (-1: the factory's cache)
  Index B = 1, H = 2, G = 1, Dk = 4, Dv = 4;  // G = 0: calls without queries
  int key_bits = 16, value_bits = 16;
  unsigned seed = 0;

  std::string describe() const {
    std::ostringstream os;
    os << method_name(method) << " budget=" << budget << " n_sink=" << n_sink
       << " recent=" << recent << " decay=" << decay << " floor=" << floor
       << " value_power=" << value_power
       << " proxy_scoring=" << ref::H2OHeadOracle::scorer_name(scorer) << " layer=" << pyramid_layer
       << " B=" << B << " H=" << H << " G=" << G << " Dk=" << Dk << " Dv=" << Dv
       << " bits=" << key_bits << "/" << value_bits << " seed=" << seed;
    return os.str();
  }
};

vc::KVCacheConfig config_of(const AdaRun& r, const std::string& mode = "adaptive") {
  vc::KVCacheConfig c = core_config(method_name(r.method), r.budget, r.n_sink, r.recent, r.decay);
  c.head_budgets = mode;
  c.head_budget_floor = r.floor;
  c.value_norm_power = r.value_power;
  c.proxy_scoring = ref::H2OHeadOracle::scorer_name(r.scorer);
  c.key_bits = r.key_bits;
  c.value_bits = r.value_bits;
  if (r.key_bits < 16 || r.value_bits < 16) c.quant_group = 8;
  return c;
}

/// The budget in force, from the spec (docs/design.md 6 for PyramidKV's layers).
int expected_budget(const AdaRun& r) {
  if (r.method == Method::pyramidkv && r.pyramid_layer >= 0) {
    return ref::pyramid_budgets(3, r.budget, r.n_sink)[static_cast<std::size_t>(r.pyramid_layer)];
  }
  return r.budget;
}

/// The protected recent rows for a budget (before the clamp).
std::function<int(int)> grace_rule(const AdaRun& r) {
  const int n_sink = r.n_sink;
  if (r.method == Method::h2o) {
    const int grace = static_cast<int>(r.recent);
    return [grace, n_sink](int b) { return ref::protected_recent_fixed(grace, b, n_sink); };
  }
  const double ratio = r.recent;
  return [ratio, n_sink](int b) { return ref::protected_recent_ratio(ratio, b, n_sink); };
}

template <class T>
CachePtr<T> make_cache(const AdaRun& r, const std::string& mode = "adaptive") {
  const vc::KVCacheConfig c = config_of(r, mode);
  if (r.method == Method::pyramidkv && r.pyramid_layer >= 0) {
    Caches<T> model = vc::KVCacheBuilder::for_model<T>(3, c);
    return std::move(model[static_cast<std::size_t>(r.pyramid_layer)]);
  }
  return vc::KVCacheFactory::create<T>(c);
}

std::vector<SeqOracle> make_oracle(const AdaRun& r) {
  std::vector<SeqOracle> out;
  for (Index b = 0; b < r.B; ++b) {
    out.emplace_back(static_cast<std::size_t>(r.H), r.n_sink, r.decay, grace_rule(r),
                     expected_budget(r), r.floor, r.scorer, r.value_power);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Calls
// ---------------------------------------------------------------------------------------------

/// One call's inputs: keys and values as drawn (double) and rounded to T, queries (G > 0).
template <class T>
struct Call {
  vc::Tensor4<double> kd, vd;  // [B, H, S, Dk], [B, H, S, Dv]
  vc::Tensor4<T> k, v;
  vc::Tensor4<float> q;  // [B, G * H, S, Dk]
  Index S() const { return k.dimension(2); }
};

template <class T>
void finish(Call<T>& c) {
  c.k = converted<T>(c.kd);
  c.v = converted<T>(c.vd);
}

/// N(0, 1) keys and queries scaled per KV head by scale[h] (larger: sharper attention), N(0, 1)
/// values; G = 0: no queries.
template <class T>
Call<T> random_call(std::mt19937& rng, const AdaRun& r, Index S, const std::vector<double>& scale) {
  Call<T> c;
  c.kd = random_doubles(rng, r.B, r.H, S, r.Dk);
  for (Index b = 0; b < r.B; ++b)
    for (Index h = 0; h < r.H; ++h)
      for (Index s = 0; s < S; ++s)
        for (Index d = 0; d < r.Dk; ++d) c.kd(b, h, s, d) *= scale[static_cast<std::size_t>(h)];
  c.vd = random_doubles(rng, r.B, r.H, S, r.Dv);
  finish(c);
  if (r.G > 0) {
    c.q = random_float_tensor(r.B, r.G * r.H, S, r.Dk, rng);
    for (Index b = 0; b < r.B; ++b)
      for (Index j = 0; j < r.G * r.H; ++j)
        for (Index s = 0; s < S; ++s)
          for (Index d = 0; d < r.Dk; ++d) {
            c.q(b, j, s, d) *= static_cast<float>(scale[static_cast<std::size_t>(j / r.G)]);
          }
  }
  return c;
}

/// The head of sequence b that concentrates its attention in focus_call.
Index focus_head(Index b, Index H) { return b % H; }

/// A call of S tokens from position `offset` on where, in sequence b, head focus_head(b)
/// concentrates and the others spread. The focus head's key at position 0 is (0, 8, 0, ...), its
/// later keys (0, 4, small noise...), and its queries (0, 4, 0, ...): every token (also as its
/// own query, the key-as-query proxy) puts almost all its mass on position 0. The other heads'
/// keys are zero: every token spreads its mass evenly over its window. Values N(0, 1).
template <class T>
Call<T> focus_call(std::mt19937& rng, const AdaRun& r, Index S, std::int64_t offset) {
  std::normal_distribution<double> noise(0.0, 0.3);
  Call<T> c;
  c.kd = vc::Tensor4<double>(r.B, r.H, S, r.Dk);
  c.kd.setZero();
  for (Index b = 0; b < r.B; ++b) {
    const Index fh = focus_head(b, r.H);
    for (Index s = 0; s < S; ++s) {
      c.kd(b, fh, s, 1) = offset + s == 0 ? 8.0 : 4.0;
      if (offset + s == 0) continue;
      for (Index d = 2; d < r.Dk; ++d) c.kd(b, fh, s, d) = noise(rng);
    }
  }
  c.vd = random_doubles(rng, r.B, r.H, S, r.Dv);
  finish(c);
  if (r.G > 0) {
    c.q = random_float_tensor(r.B, r.G * r.H, S, r.Dk, rng);
    for (Index b = 0; b < r.B; ++b) {
      const Index fh = focus_head(b, r.H);
      for (Index g = 0; g < r.G; ++g)
        for (Index s = 0; s < S; ++s)
          for (Index d = 0; d < r.Dk; ++d) c.q(b, fh * r.G + g, s, d) = d == 1 ? 4.0f : 0.0f;
    }
  }
  return c;
}

/// The rows of every head of sequence b: [H][S][D].
template <class X>
std::vector<Rows> head_rows(const vc::Tensor4<X>& t, Index b) {
  std::vector<Rows> out;
  for (Index h = 0; h < t.dimension(1); ++h) out.push_back(rows_of(t, b, h));
  return out;
}

/// The query heads of every KV head of sequence b: [H][S][G][D] (KV head h owns query heads
/// h * G .. h * G + G - 1).
std::vector<SeqOracle::Queries> head_queries(const vc::Tensor4<float>& q, Index b, Index H,
                                             Index G) {
  std::vector<SeqOracle::Queries> out(static_cast<std::size_t>(H));
  for (Index h = 0; h < H; ++h) {
    for (Index s = 0; s < q.dimension(2); ++s) {
      Rows token;
      for (Index g = 0; g < G; ++g) token.push_back(row_of(q, b, h * G + g, s));
      out[static_cast<std::size_t>(h)].push_back(std::move(token));
    }
  }
  return out;
}

/// Feeds call `c` to the oracle of every sequence; returns whether a pooled eviction met a
/// near-tie.
template <class T>
bool feed_oracle(std::vector<SeqOracle>& oracle, const Call<T>& c, bool with_queries) {
  bool near_tie = false;
  for (std::size_t b = 0; b < oracle.size(); ++b) {
    const auto bi = static_cast<Index>(b);
    const std::vector<Rows> k = head_rows(c.k, bi), v = head_rows(c.v, bi);
    if (with_queries) {
      const auto H = static_cast<Index>(oracle[b].heads());
      const std::vector<SeqOracle::Queries> q = head_queries(c.q, bi, H, c.q.dimension(1) / H);
      oracle[b].absorb_call(k, v, &q);
    } else {
      oracle[b].absorb_call(k, v, nullptr);
    }
    if (oracle[b].last_margin() < kNearTie) near_tie = true;
  }
  return near_tie;
}

/// positions(b, h) of every head, b-major.
template <class T>
std::vector<Positions> all_positions(const vc::KVCache<T>& c) {
  std::vector<Positions> out;
  for (Index b = 0; b < c.batch(); ++b)
    for (Index h = 0; h < c.heads(); ++h) out.push_back(c.positions(b, h));
  return out;
}
template <class T>
std::vector<std::vector<float>> all_scores(const vc::KVCache<T>& c) {
  std::vector<std::vector<float>> out;
  for (Index b = 0; b < c.batch(); ++b)
    for (Index h = 0; h < c.heads(); ++h) out.push_back(c.scores(b, h));
  return out;
}
/// Whether the heads hold different numbers of rows.
bool ragged(const std::vector<Positions>& heads) {
  for (const Positions& p : heads) {
    if (p.size() != heads.front().size()) return true;
  }
  return false;
}
std::size_t total(const std::vector<Positions>& heads) {
  std::size_t n = 0;
  for (const Positions& p : heads) n += p.size();
  return n;
}

std::string join(const Positions& p) {
  std::ostringstream os;
  os << "{";
  for (std::size_t i = 0; i < p.size(); ++i) os << (i ? ", " : "") << p[i];
  os << "}";
  return os.str();
}

/// Checks what update_and_view returned: heads (b, h) shows rows(b, h) = the rows it held before
/// the call plus the call's S; its keys, values and positions have that many; the first are the
/// rows held before (any order: their positions say which), the call's rows last, in order;
/// `held` gives the key and value every (b, h, position) was fed with (as T, in double), checked
/// exactly (`tol` 0) or within `tol` (a quantized cache's dequantized copy). rows() throws
/// std::logic_error exactly when the heads differ. Returns the first problem, or "".
template <class T>
std::string check_view(const vc::KVView<T>& view, const std::vector<Positions>& before_heads,
                       const Call<T>& c, std::int64_t offset_before,
                       const std::map<std::tuple<Index, Index, std::int64_t>,
                                      std::pair<std::vector<double>, std::vector<double>>>& held,
                       double tol) {
  std::ostringstream err;
  const Index B = c.k.dimension(0), H = c.k.dimension(1), S = c.S();
  if (before_heads.empty()) {
    // A cache before its first call holds no heads: each held nothing.
    return check_view(view, std::vector<Positions>(static_cast<std::size_t>(B * H)), c,
                      offset_before, held, tol);
  }
  const std::vector<Positions>& before = before_heads;
  if (view.batch() != B || view.heads() != H || view.new_rows() != S) {
    err << "view of B=" << view.batch() << " H=" << view.heads() << " new_rows=" << view.new_rows();
    return err.str();
  }
  bool differ = false;
  for (const Positions& p : before) differ = differ || p.size() != before.front().size();
  if (view.ragged() != differ) {
    err << "view.ragged() " << view.ragged() << " while the heads' windows differ: " << differ;
    return err.str();
  }
  if (differ) {
    try {
      (void)view.rows();
      return "rows() did not throw on a ragged view";
    } catch (const std::logic_error&) {
    }
  } else if (view.rows() != static_cast<Index>(before.front().size()) + S) {
    err << "rows() " << view.rows() << ", expected " << before.front().size() + S;
    return err.str();
  }
  const auto close = [tol](double got, double want) {
    return tol == 0.0 ? got == want : std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
  };
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const Positions& was = before[static_cast<std::size_t>(b * H + h)];
      const Index n = view.rows(b, h);
      if (n != static_cast<Index>(was.size()) + S) {
        err << "head (" << b << ", " << h << "): rows(b, h) " << n << ", expected " << was.size()
            << " held + " << S;
        return err.str();
      }
      const auto keys = view.keys(b, h);
      const auto values = view.values(b, h);
      const auto pos = view.positions(b, h);
      if (keys.rows() != n || values.rows() != n || pos.size() != n ||
          keys.cols() != c.k.dimension(3) || values.cols() != c.v.dimension(3)) {
        err << "head (" << b << ", " << h << "): maps of " << keys.rows() << ", " << values.rows()
            << ", " << pos.size() << " rows, expected " << n;
        return err.str();
      }
      Positions first(pos.data(), pos.data() + (n - S));
      std::sort(first.begin(), first.end());
      if (first != was) {
        err << "head (" << b << ", " << h << "): the view's earlier rows " << join(first)
            << ", held before " << join(was);
        return err.str();
      }
      for (Index s = 0; s < S; ++s) {
        if (pos(n - S + s) != offset_before + s) {
          err << "head (" << b << ", " << h << "): row " << n - S + s << " at position "
              << pos(n - S + s) << ", expected " << offset_before + s;
          return err.str();
        }
      }
      for (Index r = 0; r < n; ++r) {
        const auto it = held.find({b, h, pos(r)});
        if (it == held.end()) {
          err << "head (" << b << ", " << h << "): position " << pos(r) << " was never fed";
          return err.str();
        }
        for (Index d = 0; d < keys.cols(); ++d) {
          if (!close(to_double(keys(r, d)), it->second.first[static_cast<std::size_t>(d)])) {
            err << "head (" << b << ", " << h << "): key of position " << pos(r) << "[" << d << "] "
                << to_double(keys(r, d)) << ", fed "
                << it->second.first[static_cast<std::size_t>(d)];
            return err.str();
          }
        }
        for (Index d = 0; d < values.cols(); ++d) {
          if (!close(to_double(values(r, d)), it->second.second[static_cast<std::size_t>(d)])) {
            err << "head (" << b << ", " << h << "): value of position " << pos(r) << "[" << d
                << "] " << to_double(values(r, d)) << ", fed "
                << it->second.second[static_cast<std::size_t>(d)];
            return err.str();
          }
        }
      }
    }
  }
  return "";
}

using Held = std::map<std::tuple<Index, Index, std::int64_t>,
                      std::pair<std::vector<double>, std::vector<double>>>;

/// Records the rows of call `c` (as T, in double) by (b, h, position).
template <class T>
void remember(Held& held, const Call<T>& c, std::int64_t offset_before) {
  for (Index b = 0; b < c.k.dimension(0); ++b)
    for (Index h = 0; h < c.k.dimension(1); ++h)
      for (Index s = 0; s < c.S(); ++s) {
        held[{b, h, offset_before + s}] = {row_of(c.k, b, h, s), row_of(c.v, b, h, s)};
      }
}

/// The retained rows of the cache against the oracle after a call that brought it to `offset`:
/// positions exactly, scores within scores_close, each sequence within its pool (H x budget
/// after an evicting call) and every head at or above its floor after one, kept_bytes() the
/// rows held times the bytes of a row (unquantized). Returns the first mismatch, or "".
template <class T>
std::string compare_with_oracle(const vc::KVCache<T>& c, const std::vector<SeqOracle>& oracle,
                                std::int64_t offset, bool quantized) {
  std::ostringstream err;
  if (c.offset() != offset) {
    err << "offset " << c.offset() << ", expected " << offset;
    return err.str();
  }
  std::size_t rows = 0;
  for (std::size_t b = 0; b < oracle.size(); ++b) {
    const SeqOracle& o = oracle[b];
    std::size_t held = 0;
    for (std::size_t h = 0; h < o.heads(); ++h) {
      const Positions got = c.positions(static_cast<Index>(b), static_cast<Index>(h));
      const Positions want = o.positions(h);
      if (got != want) {
        err << "head (" << b << ", " << h << ") holds " << join(got) << ", the oracle "
            << join(want);
        return err.str();
      }
      const std::vector<float> sc = c.scores(static_cast<Index>(b), static_cast<Index>(h));
      const std::vector<double> ws = o.scores(h);
      for (std::size_t i = 0; i < sc.size(); ++i) {
        if (!scores_close(sc[i], ws[i])) {
          err << "head (" << b << ", " << h << ") position " << got[i] << ": score " << sc[i]
              << ", oracle " << ws[i];
          return err.str();
        }
      }
      if (o.evicted_last_call() > 0 && got.size() < o.floor_rows()) {
        err << "head (" << b << ", " << h << ") holds " << got.size() << " rows, below its floor "
            << o.floor_rows();
        return err.str();
      }
      held += got.size();
    }
    const std::size_t pool = o.budget() ? o.heads() * static_cast<std::size_t>(*o.budget()) : held;
    if (o.evicted_last_call() > 0 ? held != pool : held > pool) {
      err << "sequence " << b << " holds " << held << " rows, its pool " << pool;
      return err.str();
    }
    rows += held;
  }
  if (!quantized) {
    const std::size_t want =
        rows * static_cast<std::size_t>(c.key_dim() + c.value_dim()) * sizeof(T);
    if (c.kept_bytes() != want) {
      err << "kept_bytes " << c.kept_bytes() << ", " << rows << " rows hold " << want;
      return err.str();
    }
  }
  return "";
}

bool names_attend_and_view(const std::string& what) {
  return what.find("attend") != std::string::npos &&
         what.find("update_and_view") != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// The oracle sweep
// ---------------------------------------------------------------------------------------------

struct Outcome {
  std::string failure;
  bool near_tie = false, diverged_at_tie = false, became_ragged = false;
  int calls = 0, evicting_calls = 0, decode_evictions = 0, refusals = 0;
};

/// One run of `calls` calls: a prompt (of 1 to 2 x budget + 4 tokens), then decode steps mixed
/// with chunks of 2 to budget + 4 tokens, of 65-100 (the blocked paths) and empty calls, through
/// update_and_view, attend (with queries), the double-input view (without) or
/// update_and_fetch(_into) (refused, and checked to be, once the heads differ; the call then goes
/// through update_and_view). Keys and queries of each head scaled by 0.4, 1 or 2.5 (drawn per head)
/// so that heads attend differently. After every call: the retained rows against the oracle, and
/// what the call returned.
template <class T>
Outcome run_against_oracle(const AdaRun& r, int calls) {
  Outcome o;
  std::mt19937 rng(r.seed);
  CachePtr<T> cache = make_cache<T>(r);
  const int budget = expected_budget(r);
  if (cache->layer_budget() != budget) {
    o.failure = "layer_budget() " + std::to_string(cache->layer_budget()) + ", expected " +
                std::to_string(budget);
    return o;
  }
  std::vector<SeqOracle> oracle = make_oracle(r);
  const double scales[] = {0.4, 1.0, 2.5};
  std::vector<double> scale;
  for (Index h = 0; h < r.H; ++h) scale.push_back(scales[rng() % 3]);
  const bool queries = r.G > 0;
  Held held;
  vc::KVPair<T> into;
  std::int64_t offset = 0;
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (int call = 0; call < calls; ++call) {
    Index S = 1;
    if (call == 0) {
      S = std::uniform_int_distribution<Index>(1, 2 * budget + 4)(rng);
    } else {
      const double u = u01(rng);
      if (u < 0.04) {
        S = 0;
      } else if (u < 0.22) {
        S = std::uniform_int_distribution<Index>(2, budget + 4)(rng);
      } else if (u < 0.25) {
        S = std::uniform_int_distribution<Index>(65, 100)(rng);  // more than one block of tokens
      }
    }
    const Call<T> c = random_call<T>(rng, r, S, scale);
    const std::vector<Positions> before = all_positions(*cache);
    const bool was_ragged = call > 0 && ragged(before);
    int api = static_cast<int>(rng() % 4);  // 0 view, 1 fetch, 2 fetch_into, 3 attend / double
    if (S == 0 && api == 3) api = 0;
    std::ostringstream where;
    where << "call " << call << " (S=" << S << ", api " << api << ")";
    if ((api == 1 || api == 2) && was_ragged) {
      // Refused before anything changes: the call then goes through update_and_view.
      const vc::KVPair<T> into_before = into;
      try {
        if (api == 1) {
          queries ? (void)cache->update_and_fetch(c.k, c.v, c.q)
                  : (void)cache->update_and_fetch(c.k, c.v);
        } else {
          queries ? cache->update_and_fetch_into(c.k, c.v, c.q, into)
                  : cache->update_and_fetch_into(c.k, c.v, into);
        }
        o.failure = where.str() + ": fetch on ragged heads did not throw";
        return o;
      } catch (const std::invalid_argument& e) {
        if (!names_attend_and_view(e.what())) {
          o.failure =
              where.str() + ": the refusal does not name attend and update_and_view: " + e.what();
          return o;
        }
      }
      if (all_positions(*cache) != before || cache->offset() != offset ||
          !bitwise_equal(into.first, into_before.first)) {
        o.failure = where.str() + ": a refused fetch changed the cache or its output";
        return o;
      }
      ++o.refusals;
      api = 0;
    }
    std::string returned;
    if (api == 0) {
      const vc::KVView<T> view =
          queries ? cache->update_and_view(c.k, c.v, c.q) : cache->update_and_view(c.k, c.v);
      remember(held, c, offset);
      returned = check_view(view, before, c, offset, held, 0.0);
    } else if (api == 3) {
      if (queries) {
        const vc::Tensor4<float> out = cache->attend(c.q, c.k, c.v);
        if (out.dimension(0) != r.B || out.dimension(1) != r.G * r.H || out.dimension(2) != S ||
            out.dimension(3) != r.Dv) {
          returned = "attend's output has the wrong shape";
        }
      } else {
        const vc::KVView<T> view = cache->update_and_view(c.kd, c.vd);
        remember(held, c, offset);
        returned = check_view(view, before, c, offset, held, 0.0);
      }
    } else {
      vc::KVPair<T> got;
      if (api == 1) {
        got = queries ? cache->update_and_fetch(c.k, c.v, c.q) : cache->update_and_fetch(c.k, c.v);
      } else {
        queries ? cache->update_and_fetch_into(c.k, c.v, c.q, into)
                : cache->update_and_fetch_into(c.k, c.v, into);
        got = into;
      }
      const Index n = static_cast<Index>(before.empty() ? 0 : before.front().size()) + S;
      if (shape_of(got.first) != Shape{r.B, r.H, n, r.Dk} ||
          shape_of(got.second) != Shape{r.B, r.H, n, r.Dv}) {
        returned = "fetch returned the wrong shape";
      } else {
        for (Index b = 0; b < r.B && returned.empty(); ++b)
          for (Index h = 0; h < r.H && returned.empty(); ++h) {
            // The rows held before, in ascending position, then the call's.
            const Positions was =
                before.empty() ? Positions{} : before[static_cast<std::size_t>(b * r.H + h)];
            for (Index i = 0; i < n - S; ++i) {
              const auto& fed = held.at({b, h, was[static_cast<std::size_t>(i)]});
              if (row_of(got.first, b, h, i) != fed.first ||
                  row_of(got.second, b, h, i) != fed.second) {
                returned = "fetch did not return the rows held before first";
                break;
              }
            }
            for (Index s = 0; s < S && returned.empty(); ++s)
              if (row_of(got.first, b, h, n - S + s) != row_of(c.k, b, h, s) ||
                  row_of(got.second, b, h, n - S + s) != row_of(c.v, b, h, s)) {
                returned = "fetch did not return the call's rows last";
              }
          }
      }
    }
    remember(held, c, offset);
    if (!returned.empty()) {
      o.failure = where.str() + ": " + returned;
      return o;
    }
    offset += S;
    const bool tie = feed_oracle(oracle, c, queries);
    o.near_tie = o.near_tie || tie;
    const std::string err = compare_with_oracle(*cache, oracle, offset, false);
    if (!err.empty()) {
      if (tie) {
        o.diverged_at_tie = true;
        return o;
      }
      o.failure = where.str() + ": " + err;
      return o;
    }
    ++o.calls;
    bool evicted = false;
    for (const SeqOracle& s : oracle) evicted = evicted || s.evicted_last_call() > 0;
    if (evicted) {
      ++o.evicting_calls;
      if (S == 1) ++o.decode_evictions;
    }
    o.became_ragged = o.became_ragged || ragged(all_positions(*cache));
  }
  return o;
}

struct SweepStats {
  int runs = 0, failures = 0, near_ties = 0, tie_divergences = 0, calls = 0, evicting = 0,
      decode_evictions = 0, ragged_runs = 0, floor_runs_below_one = 0, refusals = 0;
  void add(const Outcome& o, const AdaRun& r) {
    ++runs;
    near_ties += o.near_tie;
    tie_divergences += o.diverged_at_tie;
    calls += o.calls;
    evicting += o.evicting_calls;
    decode_evictions += o.decode_evictions;
    refusals += o.refusals;
    if (r.floor < 1.0) {
      ++floor_runs_below_one;
      ragged_runs += o.became_ragged;
    } else if (o.became_ragged) {
      ++failures;
      ADD_FAILURE() << r.describe() << ": heads became ragged at floor 1";
    }
    if (!o.failure.empty()) {
      ++failures;
      ADD_FAILURE() << r.describe() << ": " << o.failure;
    }
  }
  void expect_sound() const {
    std::printf(
        "[ stats    ] %d runs, %d calls checked (%d evicting, %d decode), %d near-ties, %d "
        "diverged after one, %d of %d runs below floor 1 became ragged, %d fetches refused\n",
        runs, calls, evicting, decode_evictions, near_ties, tie_divergences, ragged_runs,
        floor_runs_below_one, refusals);
    EXPECT_EQ(failures, 0);
    EXPECT_LE(tie_divergences * 20, runs) << "too many runs diverged after a near-tie";
    EXPECT_GT(calls, runs * 30);
    EXPECT_GT(evicting, calls / 2);
    EXPECT_GT(decode_evictions, calls / 3);
    EXPECT_GT(ragged_runs * 2, floor_runs_below_one) << "too few runs became ragged";
    EXPECT_GT(refusals, 0);
  }
};

/// The sweep of one method: with queries (G 1 and 2), the key-as-query proxy, KeyDiff and
/// K-norm, floors 0.1 / 0.25 / 0.5 / 1, B 1 and 2, H 2-4, Dk 4 / 8 / 20, budgets 4-12, 0-2 sinks,
/// recent ratio (or grace) and decay drawn; value_norm_power 0, 2 or 1.5 (ignored by calls without
/// queries).
template <class T>
void sweep(Method method, unsigned seed) {
  std::mt19937 rng(seed);
  const auto pick = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  struct Mode {
    Index G;
    Scorer scorer;
  };
  const Mode modes[] = {{1, Scorer::key_as_query},
                        {2, Scorer::key_as_query},
                        {0, Scorer::key_as_query},
                        {0, Scorer::keydiff},
                        {0, Scorer::knorm}};
  const double powers[] = {0.0, 2.0, 1.5};
  const double ratios[] = {0.0, 0.25, 0.5};
  SweepStats stats;
  for (const Mode& mode : modes) {
    for (const double floor : {0.1, 0.25, 0.5, 1.0}) {
      for (const Index B : {1, 2}) {
        AdaRun r;
        r.method = method;
        r.G = mode.G;
        r.scorer = mode.scorer;
        r.floor = floor;
        r.B = B;
        r.H = pick(2, 4);
        r.budget = pick(4, 12);
        r.n_sink = pick(0, 2);
        r.recent = method == Method::h2o ? pick(0, 3) : ratios[pick(0, 2)];
        r.decay = pick(0, 1) ? 1.0 : 0.9;
        r.value_power = powers[stats.runs % 3];
        r.Dk = std::vector<Index>{4, 8, 20}[static_cast<std::size_t>(pick(0, 2))];
        r.Dv = pick(1, 4);
        if (method == Method::pyramidkv && stats.runs % 2 == 1) r.pyramid_layer = pick(0, 2);
        if (expected_budget(r) <= r.n_sink) r.n_sink = 0;
        r.seed = static_cast<unsigned>(rng());
        stats.add(run_against_oracle<T>(r, 40), r);
        if (stats.failures > 3) FAIL() << "too many failing runs; stopping";
      }
    }
  }
  stats.expect_sound();
}

template <class T>
class AdaptiveOracleTest : public ::testing::Test {};
using SweepTypes = ::testing::Types<Eigen::half, float>;
TYPED_TEST_SUITE(AdaptiveOracleTest, SweepTypes);

TYPED_TEST(AdaptiveOracleTest, H2OMatchesThePooledOracle) { sweep<TypeParam>(Method::h2o, 11u); }
TYPED_TEST(AdaptiveOracleTest, SqueezeWithoutCoordinatorMatchesThePooledOracle) {
  sweep<TypeParam>(Method::squeeze, 22u);
}
TYPED_TEST(AdaptiveOracleTest, PyramidKVMatchesThePooledOracle) {
  sweep<TypeParam>(Method::pyramidkv, 33u);
}

// ---------------------------------------------------------------------------------------------
// The oracle itself, on a hand-checked case
// ---------------------------------------------------------------------------------------------

/// Two heads, budget 3, floor 1/3 (one row), no sinks, g = 0, decay 1, queries: the one-hot setup
/// of test_query_oracle.cpp (keys M e_r, token r's query M e_r: all mass on its own row), so
/// every row scores exactly 1, except where a query is zero (uniform over the window). Head 0:
/// tokens 0-3 one-hot (scores 1, 1, 1, 1); head 1: token queries zero (uniform): scores
/// 1/1+1/2+1/3+1/4, 1/2+1/3+1/4, 1/3+1/4, 1/4. Pool 6 of 8 rows: the two lowest go: head 1's
/// position 3 (1/4) then position 2 (7/12); head 0 keeps all four (more than the budget of 3).
TEST(AdaptiveOracleSelfTest, TakesTheLowestRowsOfThePoolOneAtATime) {
  const double M = 100.0;
  Rows onehot(4, std::vector<double>(4, 0.0));
  for (std::size_t i = 0; i < 4; ++i) onehot[i][i] = M;
  const Rows values = value_rows(4);
  SeqOracle::Queries own, zero;
  for (std::size_t i = 0; i < 4; ++i) {
    own.push_back({onehot[i]});
    zero.push_back({std::vector<double>(4, 0.0)});
  }
  SeqOracle o(
      2, 0, 1.0, [](int) { return 0; }, 3, 1.0 / 3.0);
  EXPECT_EQ(o.floor_rows(), 1u);
  const std::vector<SeqOracle::Queries> q = {own, zero};
  o.absorb_call({onehot, onehot}, {values, values}, &q);
  EXPECT_EQ(o.positions(0), (Positions{0, 1, 2, 3}));
  EXPECT_EQ(o.positions(1), (Positions{0, 1}));
  EXPECT_EQ(o.evicted_last_call(), 2u);
  EXPECT_NEAR(o.scores(1)[0], 1.0 + 0.5 + 1.0 / 3.0 + 0.25, 1e-12);
  EXPECT_GT(o.last_margin(), 0.1);

  // Floor 1: each head keeps exactly 3; head 0's four rows tie at 1: the earliest goes.
  SeqOracle one(
      2, 0, 1.0, [](int) { return 0; }, 3, 1.0);
  one.absorb_call({onehot, onehot}, {values, values}, &q);
  EXPECT_EQ(one.positions(0), (Positions{1, 2, 3}));
  EXPECT_EQ(one.positions(1), (Positions{0, 1, 2}));
  EXPECT_EQ(one.last_margin(), 0.0);  // an exact tie at 1, not at 0: counted

  // Ties across heads go to the lower head: heads 0 and 1 one-hot (four rows at 1 each), head 2
  // uniform (1/4 at position 3, 7/12 at 2, 13/12 at 1); pool 9 of 12: position 3 then 2 of head
  // 2, then position 0 of head 0 (1, tied with position 0 of head 1).
  SeqOracle tie(
      3, 0, 1.0, [](int) { return 0; }, 3, 1.0 / 3.0);
  const std::vector<SeqOracle::Queries> q3 = {own, own, zero};
  tie.absorb_call({onehot, onehot, onehot}, {values, values, values}, &q3);
  EXPECT_EQ(tie.positions(0), (Positions{1, 2, 3}));
  EXPECT_EQ(tie.positions(1), (Positions{0, 1, 2, 3}));
  EXPECT_EQ(tie.positions(2), (Positions{0, 1}));
}

/// Exact ties through the library: three heads, budget 3, floor 0.2 (one row), no sinks, g = 0,
/// one call of four tokens with queries. Keys M e_r (M = 100, D = 4); heads 0 and 1 query with
/// M e_r (logits 5000 on the own row, 0 elsewhere: every row gets exactly 1 in float32 too),
/// head 2 with zero queries (uniform: 25/12, 13/12, 7/12, 1/4). The pool of 9 takes head 2's
/// positions 3 and 2, then the first of the rows tied at 1: the earliest position (0), of the
/// lower head (0, not 1).
TEST(AdaptiveHeadsTest, TiesGoToTheEarlierPositionThenTheLowerHead) {
  using T = float;
  for (const Method method : kCoreMethods) {
    AdaRun r;
    r.method = method;
    r.budget = 3;
    r.recent = 0.0;
    r.floor = 0.2;
    r.B = 1;
    r.H = 3;
    r.G = 1;
    r.Dk = 4;
    r.Dv = 2;
    const std::string ctx = r.describe();
    CachePtr<T> cache = make_cache<T>(r);
    Call<T> c;
    c.kd = vc::Tensor4<double>(1, 3, 4, 4);
    c.kd.setZero();
    c.q = vc::Tensor4<float>(1, 3, 4, 4);
    c.q.setZero();
    for (Index h = 0; h < 3; ++h)
      for (Index s = 0; s < 4; ++s) {
        c.kd(0, h, s, s) = 100.0;
        if (h < 2) c.q(0, h, s, s) = 100.0f;
      }
    std::mt19937 rng(2u);
    c.vd = random_doubles(rng, 1, 3, 4, 2);
    finish(c);
    (void)cache->attend(c.q, c.k, c.v);
    EXPECT_EQ(cache->positions(0, 0), (Positions{1, 2, 3})) << ctx;
    EXPECT_EQ(cache->positions(0, 1), (Positions{0, 1, 2, 3})) << ctx;
    EXPECT_EQ(cache->positions(0, 2), (Positions{0, 1})) << ctx;
    EXPECT_EQ(cache->scores(0, 1), (std::vector<float>{1.0f, 1.0f, 1.0f, 1.0f})) << ctx;
    // The oracle agrees.
    std::vector<SeqOracle> oracle = make_oracle(r);
    (void)feed_oracle(oracle, c, true);
    EXPECT_EQ(compare_with_oracle(*cache, oracle, 4, false), "") << ctx;
  }
}

/// Exact ties over many calls, where a head's slots no longer follow its positions (compaction
/// moves the newest row into an evicted row's slot): one-token calls whose key is M e_j for a
/// direction j no live row of its head has, and whose query is M e_i for a direction some row
/// holds (the token's own included), so every weight is exactly 0 or 1 and every score an
/// integer, equal for many rows. Two heads, budgets 3-6, floors 0.2-0.5, no sinks or grace, h2o
/// and squeeze: every call's rows and scores are the oracle's, whose ties go to the earlier
/// position (then the lower head) whatever the slots.
TEST(AdaptiveHeadsTest, ExactTiesAfterCompactionGoToTheEarlierPosition) {
  using T = float;
  constexpr Index D = 16;  // more than a head can hold: 2 x 6 rows, and the call's
  int runs = 0, tied = 0;
  for (const Method method : {Method::h2o, Method::squeeze}) {
    for (unsigned seed = 1; seed <= 12; ++seed) {
      std::mt19937 rng(seed);
      AdaRun r;
      r.method = method;
      r.budget = 3 + static_cast<int>(seed % 4);
      r.recent = 0.0;
      r.floor = std::array<double, 3>{0.2, 0.34, 0.5}[seed % 3];
      r.H = 2;
      r.Dk = D;
      r.Dv = 2;
      r.seed = seed;
      const std::string ctx = r.describe();
      CachePtr<T> cache = make_cache<T>(r);
      std::vector<SeqOracle> oracle = make_oracle(r);
      std::vector<std::map<std::int64_t, Index>> dir(static_cast<std::size_t>(r.H));
      for (std::int64_t pos = 0; pos < 40; ++pos) {
        Call<T> c;
        c.kd = vc::Tensor4<double>(1, r.H, 1, D);
        c.kd.setZero();
        c.q = vc::Tensor4<float>(1, r.H, 1, D);
        c.q.setZero();
        for (Index h = 0; h < r.H; ++h) {
          auto& held = dir[static_cast<std::size_t>(h)];
          std::map<std::int64_t, Index> live;
          for (const std::int64_t p : cache->positions(0, h)) live[p] = held.at(p);
          std::vector<Index> free_dirs, used;
          for (Index j = 0; j < D; ++j) {
            bool taken = false;
            for (const auto& pd : live) taken = taken || pd.second == j;
            (taken ? used : free_dirs).push_back(j);
          }
          ASSERT_FALSE(free_dirs.empty()) << ctx;
          const Index k = free_dirs[rng() % free_dirs.size()];
          used.push_back(k);
          live[pos] = k;
          held = live;
          c.kd(0, h, 0, k) = 100.0;
          c.q(0, h, 0, used[rng() % used.size()]) = 100.0f;
        }
        c.vd = random_doubles(rng, 1, r.H, 1, 2);
        finish(c);
        (void)cache->attend(c.q, c.k, c.v);
        (void)feed_oracle(oracle, c, true);
        const std::string err = compare_with_oracle(*cache, oracle, pos + 1, false);
        ASSERT_EQ(err, "") << ctx << " after position " << pos;
        for (Index h = 0; h < r.H; ++h) {
          const std::vector<float> sc = cache->scores(0, h);
          for (std::size_t i = 0; i < sc.size(); ++i)
            for (std::size_t j = i + 1; j < sc.size(); ++j) tied += sc[i] == sc[j];
        }
      }
      ++runs;
    }
  }
  EXPECT_EQ(runs, 24);
  EXPECT_GT(tied, 1000) << "the calls made too few exact ties to test them";
}

// ---------------------------------------------------------------------------------------------
// Floor 1 with queries: uniform heads bit for bit
// ---------------------------------------------------------------------------------------------

/// Two maps of a view: the same shape and bytes.
template <class M>
bool same_map(const M& a, const M& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(),
                      static_cast<std::size_t>(a.size()) * sizeof(typename M::Scalar)) == 0);
}

/// Bytes of a float tensor.
std::vector<unsigned char> out_bytes(const vc::Tensor4<float>& t) { return bytes_of(t); }

template <class T>
void expect_same_heads(const vc::KVCache<T>& a, const vc::KVCache<T>& b, const std::string& ctx) {
  EXPECT_EQ(a.offset(), b.offset()) << ctx;
  EXPECT_EQ(all_positions(a), all_positions(b)) << ctx;
  const auto sa = all_scores(a), sb = all_scores(b);
  ASSERT_EQ(sa.size(), sb.size()) << ctx;
  for (std::size_t i = 0; i < sa.size(); ++i) {
    ASSERT_EQ(sa[i].size(), sb[i].size()) << ctx;
    EXPECT_TRUE(sa[i].empty() ||
                std::memcmp(sa[i].data(), sb[i].data(), sa[i].size() * sizeof(float)) == 0)
        << ctx << ": scores of head " << i << " differ";
  }
  EXPECT_EQ(a.kept_bytes(), b.kept_bytes()) << ctx;
}

/// With queries, every call through attend, update_and_view or update_and_fetch, prompts over
/// the budget, decode steps and chunks: adaptive heads at floor 1 give the uniform heads'
/// positions, scores, attention outputs, fetched and viewed rows and state(), bit for bit, for
/// the three methods, with and without value_norm_power 2, G 1 and 2. At floor 0.25 the same
/// calls give other rows (the comparison sees a difference when there is one).
TEST(AdaptiveHeadsTest, FloorOneWithQueriesIsUniformBitForBit) {
  using T = Eigen::half;
  for (const Method method : kCoreMethods) {
    for (const double power : {0.0, 2.0}) {
      for (const Index G : {1, 2}) {
        AdaRun r;
        r.method = method;
        r.budget = 6;
        r.n_sink = 1;
        r.recent = method == Method::h2o ? 2.0 : 0.5;
        r.decay = 0.95;
        r.floor = 1.0;
        r.value_power = power;
        r.B = 2;
        r.H = 3;
        r.G = G;
        r.Dk = 8;
        r.Dv = 4;
        const std::string ctx = r.describe();
        CachePtr<T> uniform = make_cache<T>(r, "uniform");
        CachePtr<T> adaptive = make_cache<T>(r);
        AdaRun low = r;
        low.floor = 0.25;
        CachePtr<T> loose = make_cache<T>(low);
        std::mt19937 rng(7u + static_cast<unsigned>(G) * 13u + static_cast<unsigned>(power));
        const std::vector<double> scale = {0.4, 1.0, 2.5};
        const std::vector<Index> sizes = {9, 1, 1, 1, 5, 1, 1, 12, 1, 1, 1, 1, 3, 1, 1, 1};
        bool differs = false;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          const std::string at = ctx + ", call " + std::to_string(i);
          const Call<T> c = random_call<T>(rng, r, sizes[i], scale);
          switch (i % 3) {
            case 0:
              EXPECT_EQ(out_bytes(uniform->attend(c.q, c.k, c.v)),
                        out_bytes(adaptive->attend(c.q, c.k, c.v)))
                  << at;
              (void)loose->attend(c.q, c.k, c.v);
              break;
            case 1: {
              const vc::KVPair<T> u = uniform->update_and_fetch(c.k, c.v, c.q);
              const vc::KVPair<T> a = adaptive->update_and_fetch(c.k, c.v, c.q);
              EXPECT_TRUE(bitwise_equal(u.first, a.first) && bitwise_equal(u.second, a.second))
                  << at;
              (void)loose->update_and_view(c.k, c.v, c.q);
              break;
            }
            default: {
              const vc::KVView<T> u = uniform->update_and_view(c.k, c.v, c.q);
              const vc::KVView<T> a = adaptive->update_and_view(c.k, c.v, c.q);
              EXPECT_FALSE(a.ragged()) << at;
              ASSERT_EQ(u.rows(), a.rows()) << at;
              for (Index b = 0; b < r.B; ++b)
                for (Index h = 0; h < r.H; ++h) {
                  EXPECT_TRUE(same_map(u.positions(b, h), a.positions(b, h))) << at;
                  EXPECT_TRUE(same_map(u.keys(b, h), a.keys(b, h))) << at;
                  EXPECT_TRUE(same_map(u.values(b, h), a.values(b, h))) << at;
                }
              (void)loose->update_and_view(c.k, c.v, c.q);
              break;
            }
          }
          expect_same_heads(*uniform, *adaptive, at);
          const vc::KVPair<T> su = uniform->state(), sa = adaptive->state();
          EXPECT_TRUE(bitwise_equal(su.first, sa.first) && bitwise_equal(su.second, sa.second))
              << at;
          differs = differs || all_positions(*loose) != all_positions(*uniform);
        }
        // Not vacuous: the heads evicted (each holds the budget), and floor 0.25 chose others.
        EXPECT_EQ(adaptive->tokens_kept(), r.budget) << ctx;
        EXPECT_LT(adaptive->tokens_kept(), adaptive->offset()) << ctx;
        EXPECT_TRUE(differs) << ctx << ": floor 0.25 kept the same rows as uniform heads";
      }
    }
  }
}

/// Without queries, one-token calls (a prompt fed token by token, then decode steps): one row
/// arrives per head and at floor 1 each head gives up its own lowest, as a uniform head's
/// per-token eviction does. (A multi-token call without queries scores differently: uniform heads
/// evict token by token inside it, adaptive ones score the whole call first.)
TEST(AdaptiveHeadsTest, FloorOneProxyDecodeStepsAreUniform) {
  using T = float;
  for (const Method method : kCoreMethods) {
    AdaRun r;
    r.method = method;
    r.budget = 7;
    r.n_sink = 1;
    r.recent = method == Method::h2o ? 1.0 : 0.25;
    r.decay = 0.9;
    r.floor = 1.0;
    r.B = 2;
    r.H = 3;
    r.G = 0;
    r.Dk = 8;
    const std::string ctx = r.describe();
    CachePtr<T> uniform = make_cache<T>(r, "uniform");
    CachePtr<T> adaptive = make_cache<T>(r);
    std::mt19937 rng(99u);
    const std::vector<double> scale = {1.0, 2.5, 0.4};
    for (int i = 0; i < 30; ++i) {
      const Call<T> c = random_call<T>(rng, r, 1, scale);
      (void)uniform->update_and_view(c.k, c.v);
      (void)adaptive->update_and_view(c.k, c.v);
      expect_same_heads(*uniform, *adaptive, ctx + ", call " + std::to_string(i));
    }
    EXPECT_EQ(adaptive->tokens_kept(), r.budget) << ctx;
  }
}

// ---------------------------------------------------------------------------------------------
// Ragged heads
// ---------------------------------------------------------------------------------------------

/// focus_call's data, H = 2, B = 2 (sequence 0 focuses with head 0, sequence 1 with head 1),
/// budget 8, floor 0.25 (2 rows), no sinks: a prompt of 16 tokens, then decode steps. The focus
/// head keeps only position 0 (almost all the mass) and its protected newest rows (at least its
/// floor); the spreading head keeps the rest of the pool. Checked for the three methods, with
/// queries and with the key-as-query proxy, against the oracle too.
TEST(AdaptiveHeadsTest, HeadsBecomeRaggedWithinTheirPoolAndFloor) {
  using T = Eigen::half;
  for (const Method method : kCoreMethods) {
    for (const Index G : {1, 0}) {
      AdaRun r;
      r.method = method;
      r.budget = 8;
      r.recent = method == Method::h2o ? 1.0 : 0.25;  // g = 1, 2
      r.floor = 0.25;
      r.B = 2;
      r.H = 2;
      r.G = G;
      r.Dk = 4;
      r.Dv = 4;
      const std::string ctx = r.describe();
      CachePtr<T> cache = make_cache<T>(r);
      std::vector<SeqOracle> oracle = make_oracle(r);
      const int g = oracle[0].protected_recent();
      const std::size_t floor_rows = 2;
      ASSERT_EQ(oracle[0].floor_rows(), floor_rows) << ctx;
      std::mt19937 rng(5u);
      std::int64_t offset = 0;
      for (int i = 0; i < 8; ++i) {
        const Index S = i == 0 ? 16 : 1;
        const Call<T> c = focus_call<T>(rng, r, S, offset);
        if (G > 0) {
          (void)cache->attend(c.q, c.k, c.v);
        } else {
          (void)cache->update_and_view(c.k, c.v);
        }
        offset += S;
        (void)feed_oracle(oracle, c, G > 0);
        const std::string at = ctx + ", call " + std::to_string(i);
        EXPECT_EQ(compare_with_oracle(*cache, oracle, offset, false), "") << at;
        std::size_t rows = 0;
        for (Index b = 0; b < r.B; ++b) {
          const Positions focus = cache->positions(b, focus_head(b, r.H));
          const Positions spread = cache->positions(b, 1 - focus_head(b, r.H));
          // The focus head: position 0 and its newest g rows (g >= 1 here; the floor is 2).
          const auto want =
              static_cast<std::size_t>(std::max<int>(static_cast<int>(floor_rows), 1 + g));
          EXPECT_EQ(focus.size(), want) << at << ", sequence " << b << ": " << join(focus);
          ASSERT_FALSE(focus.empty());
          EXPECT_EQ(focus.front(), 0) << at;
          EXPECT_EQ(focus.back(), offset - 1) << at;
          EXPECT_EQ(focus.size() + spread.size(), 2u * 8u) << at << ": the pool";
          EXPECT_GT(spread.size(), focus.size()) << at;
          rows += focus.size() + spread.size();
        }
        EXPECT_EQ(cache->kept_bytes(), rows * static_cast<std::size_t>(r.Dk + r.Dv) * sizeof(T))
            << at;
        EXPECT_EQ(cache->tokens_kept(), static_cast<std::int64_t>(cache->positions(0, 0).size()))
            << at;
      }
    }
  }
}

/// kept_bytes() of quantized ragged heads: the rows held times a quantized row's bytes (measured
/// on a uniform cache of the same storage: kept_bytes / rows).
TEST(AdaptiveHeadsTest, KeptBytesCountTheRowsOfQuantizedRaggedHeads) {
  using T = float;
  AdaRun r;
  r.budget = 8;
  r.recent = 1.0;
  r.floor = 0.25;
  r.B = 2;
  r.H = 2;
  r.Dk = 16;
  r.Dv = 8;
  r.key_bits = 8;
  r.value_bits = 4;
  CachePtr<T> uniform = make_cache<T>(r, "uniform");
  CachePtr<T> adaptive = make_cache<T>(r);
  std::mt19937 rng(3u);
  const Call<T> c = focus_call<T>(rng, r, 16, 0);
  (void)uniform->attend(c.q, c.k, c.v);
  (void)adaptive->attend(c.q, c.k, c.v);
  const std::vector<Positions> held = all_positions(*adaptive);
  ASSERT_TRUE(ragged(held));
  const std::size_t uniform_rows = static_cast<std::size_t>(r.B * r.H * r.budget);
  ASSERT_EQ(uniform->kept_bytes() % uniform_rows, 0u);
  const std::size_t row_bytes = uniform->kept_bytes() / uniform_rows;
  EXPECT_LT(row_bytes, static_cast<std::size_t>(r.Dk + r.Dv) * sizeof(T));  // really quantized
  EXPECT_EQ(adaptive->kept_bytes(), total(held) * row_bytes);
  // A decode step: the heads stay ragged, the bytes follow the rows.
  const Call<T> d = focus_call<T>(rng, r, 1, 16);
  (void)adaptive->attend(d.q, d.k, d.v);
  EXPECT_EQ(adaptive->kept_bytes(), total(all_positions(*adaptive)) * row_bytes);
}

// ---------------------------------------------------------------------------------------------
// Config errors
// ---------------------------------------------------------------------------------------------

/// What `f` throws: std::invalid_argument naming `field`.
template <class F>
void expect_config_error(F&& f, const std::string& field, const std::string& ctx) {
  try {
    f();
    ADD_FAILURE() << ctx << ": no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos)
        << ctx << ": the message does not name " << field << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << ctx << ": threw another exception: " << e.what();
  }
}

TEST(AdaptiveHeadsConfigTest, BadModesAndFloorsAreRefusedNamingTheField) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const Method method : kCoreMethods) {
    AdaRun r;
    r.method = method;
    std::vector<std::pair<vc::KVCacheConfig, std::string>> bad;
    for (const char* mode : {"Adaptive", "", "per_head", "uniform "}) {
      bad.push_back({config_of(r, mode), "head_budgets"});
    }
    for (const double floor : {0.0, -0.1, 1.5, nan, inf, -inf, 1.0000001}) {
      AdaRun f = r;
      f.floor = floor;
      bad.push_back({config_of(f), "head_budget_floor"});
      // The floor is checked whatever the mode.
      bad.push_back({config_of(f, "uniform"), "head_budget_floor"});
    }
    for (const auto& item : bad) {
      const vc::KVCacheConfig& config = item.first;
      const std::string& field = item.second;
      const std::string ctx = std::string(method_name(method)) + " head_budgets='" +
                              config.head_budgets +
                              "' floor=" + std::to_string(config.head_budget_floor);
      expect_config_error([&] { config.validate(); }, field, ctx + ", validate()");
      expect_config_error([&] { (void)vc::KVCacheFactory::create<Eigen::half>(config); }, field,
                          ctx + ", the factory");
      expect_config_error([&] { (void)vc::KVCacheBuilder::for_model<float>(3, config); }, field,
                          ctx + ", for_model(n_layers)");
      expect_config_error(
          [&] {
            (void)vc::KVCacheBuilder::for_model<float>(
                std::vector<std::optional<int>>{16, std::nullopt, 16}, config);
          },
          field, ctx + ", for_model(head dims)");
    }
  }
}

TEST(AdaptiveHeadsConfigTest, FloorOneAndTinyFloorsAreAccepted) {
  for (const Method method : kCoreMethods) {
    for (const double floor : {1.0, 1e-12, std::numeric_limits<double>::denorm_min(), 0.2}) {
      AdaRun r;
      r.method = method;
      r.floor = floor;
      r.budget = 5;
      r.recent = 0.0;
      const vc::KVCacheConfig c = config_of(r);
      const std::string ctx = std::string(method_name(method)) + " floor " + std::to_string(floor);
      EXPECT_NO_THROW(c.validate()) << ctx;
      EXPECT_NO_THROW((void)vc::KVCacheBuilder::for_model<float>(2, c)) << ctx;
      CachePtr<float> cache;
      ASSERT_NO_THROW(cache = vc::KVCacheFactory::create<float>(c)) << ctx;
      EXPECT_EQ(cache->config().head_budgets, "adaptive") << ctx;
      EXPECT_EQ(cache->config().head_budget_floor, floor) << ctx;
      // A tiny floor keeps one row at least (ceil): the focus head of focus_call, with g = 0,
      // goes down to position 0 alone; floor 1 keeps it at the budget.
      r.B = 1;
      r.H = 2;
      std::mt19937 rng(1u);
      const Call<float> call = focus_call<float>(rng, r, 12, 0);
      (void)cache->attend(call.q, call.k, call.v);
      const std::size_t want = floor == 1.0 ? 5u : 1u;  // ceil(floor x 5)
      EXPECT_EQ(cache->positions(0, 0).size(), want) << ctx;
      EXPECT_EQ(cache->positions(0, 0).front(), 0) << ctx;
      EXPECT_EQ(cache->positions(0, 0).size() + cache->positions(0, 1).size(), 10u) << ctx;
    }
  }
}

/// The other methods ignore head_budgets (SPEC 14): every method outside the H2O core
/// (support/methods.hpp), the standard cache included, built with "adaptive" (floor 0.2) gives the
/// uniform configuration's outputs, fetched rows and state(), bit for bit, on calls past its budget
/// (6 rows, 1 sink; SnapKV's observation window 2).
TEST(AdaptiveHeadsConfigTest, OtherMethodsIgnoreHeadBudgets) {
  using T = Eigen::half;
  vc::KVCacheConfig six;
  set_n_sinks(six, 1);
  six.set_budget(6);
  six.snap_obs_window = 2;
  for (const Method m : kMethods) {
    if (is_core(m)) continue;
    const vc::KVCacheConfig uniform = vc::detail::with_method(six, m);
    vc::KVCacheConfig adaptive = uniform;
    adaptive.head_budgets = "adaptive";
    adaptive.head_budget_floor = 0.2;
    const std::string ctx = uniform.method;
    CachePtr<T> u = vc::KVCacheFactory::create<T>(uniform);
    CachePtr<T> a = vc::KVCacheFactory::create<T>(adaptive);
    AdaRun r;
    r.B = 2;
    r.H = 3;
    r.G = 2;
    r.Dk = 8;
    std::mt19937 rng(31u);
    for (const Index S : {9, 1, 1, 4, 1, 7, 1}) {
      const Call<T> c = random_call<T>(rng, r, S, {0.4, 1.0, 2.5});
      if (S > 1) {
        const vc::KVPair<T> fu = u->update_and_fetch(c.k, c.v, c.q);
        const vc::KVPair<T> fa = a->update_and_fetch(c.k, c.v, c.q);
        EXPECT_TRUE(bitwise_equal(fu.first, fa.first) && bitwise_equal(fu.second, fa.second))
            << ctx;
      } else {
        EXPECT_EQ(out_bytes(u->attend(c.q, c.k, c.v)), out_bytes(a->attend(c.q, c.k, c.v))) << ctx;
      }
      const vc::KVPair<T> su = u->state(), sa = a->state();
      EXPECT_TRUE(bitwise_equal(su.first, sa.first) && bitwise_equal(su.second, sa.second)) << ctx;
      EXPECT_EQ(u->kept_bytes(), a->kept_bytes()) << ctx;
    }
    if (uniform.method != "standard" && uniform.method != "kvzip") {  // they keep every row
      EXPECT_LT(a->tokens_kept(), a->offset()) << ctx << ": nothing was evicted";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fetch and state() refuse ragged heads
// ---------------------------------------------------------------------------------------------

/// An adaptive h2o / squeeze / pyramidkv cache (B 2, H 2, budget 8, floor 0.25, G 2) and its
/// twin, both fed the same focus_call prompt of 16 tokens: ragged.
template <class T>
AdaRun ragged_run(Method method) {
  AdaRun r;
  r.method = method;
  r.budget = 8;
  r.recent = method == Method::h2o ? 1.0 : 0.25;
  r.floor = 0.25;
  r.B = 2;
  r.H = 2;
  r.G = 2;
  r.Dk = 8;
  r.Dv = 4;
  return r;
}

/// While the heads hold equal numbers, update_and_fetch(_into) and state() work (a prompt within
/// the pool; the call that makes them ragged, whose window is still even); once they differ,
/// update_and_fetch (with and without queries, T and double inputs, an empty call),
/// update_and_fetch_into and state() throw std::invalid_argument naming attend and
/// update_and_view, and change nothing: the offset, every head's positions and scores, the
/// accounting and the fetch_into output are as before, and the next attend gives, bit for bit,
/// what a twin that never saw the refused calls gives.
TEST(AdaptiveHeadsTest, FetchAndStateRefuseRaggedHeadsAndChangeNothing) {
  using T = Eigen::half;
  for (const Method method : kCoreMethods) {
    const AdaRun r = ragged_run<T>(method);
    const std::string ctx = r.describe();
    CachePtr<T> cache = make_cache<T>(r);
    CachePtr<T> twin = make_cache<T>(r);
    std::mt19937 rng(21u);
    // 6 tokens, then 2: 8 per head, within the pool: the heads hold equal numbers and fetch.
    std::int64_t offset = 0;
    for (const Index S : {6, 2}) {
      const Call<T> c = focus_call<T>(rng, r, S, offset);
      const vc::KVPair<T> got = cache->update_and_fetch(c.k, c.v, c.q);
      (void)twin->update_and_fetch(c.k, c.v, c.q);
      ASSERT_EQ(got.first.dimension(2), offset + S) << ctx;
      for (Index b = 0; b < r.B; ++b)
        for (Index h = 0; h < r.H; ++h)
          for (Index s = 0; s < S; ++s)
            EXPECT_EQ(row_of(got.first, b, h, offset + s), row_of(c.k, b, h, s)) << ctx;
      offset += S;
      EXPECT_NO_THROW((void)cache->state()) << ctx;
    }
    // 8 more through fetch_into: the window (8 + 8 per head) is even, the pool then evicts
    // unevenly.
    const Call<T> c3 = focus_call<T>(rng, r, 8, offset);
    vc::KVPair<T> into;
    ASSERT_NO_THROW(cache->update_and_fetch_into(c3.k, c3.v, c3.q, into)) << ctx;
    (void)twin->update_and_fetch(c3.k, c3.v, c3.q);
    EXPECT_EQ(into.first.dimension(2), 16) << ctx;
    offset += 8;
    ASSERT_TRUE(ragged(all_positions(*cache))) << ctx << ": the data did not make ragged heads";

    const std::vector<Positions> positions = all_positions(*cache);
    const auto scores = all_scores(*cache);
    const std::size_t kept = cache->kept_bytes();
    const std::int64_t seen = cache->tokens_seen();
    const vc::KVPair<T> into_before = into;
    const Call<T> c = focus_call<T>(rng, r, 3, offset);
    const Call<T> empty = focus_call<T>(rng, r, 0, offset);
    const std::vector<std::pair<std::string, std::function<void()>>> refused = {
        {"update_and_fetch", [&] { (void)cache->update_and_fetch(c.k, c.v); }},
        {"update_and_fetch with queries", [&] { (void)cache->update_and_fetch(c.k, c.v, c.q); }},
        {"update_and_fetch of doubles", [&] { (void)cache->update_and_fetch(c.kd, c.vd); }},
        {"update_and_fetch of an empty call",
         [&] { (void)cache->update_and_fetch(empty.k, empty.v); }},
        {"update_and_fetch_into", [&] { cache->update_and_fetch_into(c.k, c.v, into); }},
        {"update_and_fetch_into with queries",
         [&] { cache->update_and_fetch_into(c.k, c.v, c.q, into); }},
        {"state", [&] { (void)cache->state(); }},
    };
    for (const auto& [name, f] : refused) {
      try {
        f();
        ADD_FAILURE() << ctx << ": " << name << " did not throw on ragged heads";
      } catch (const std::invalid_argument& e) {
        EXPECT_TRUE(names_attend_and_view(e.what())) << ctx << ", " << name << ": " << e.what();
      }
      EXPECT_EQ(all_positions(*cache), positions) << ctx << ", " << name;
      EXPECT_EQ(all_scores(*cache), scores) << ctx << ", " << name;
      EXPECT_EQ(cache->offset(), offset) << ctx << ", " << name;
      EXPECT_EQ(cache->tokens_seen(), seen) << ctx << ", " << name;
      EXPECT_EQ(cache->kept_bytes(), kept) << ctx << ", " << name;
      EXPECT_TRUE(bitwise_equal(into.first, into_before.first) &&
                  bitwise_equal(into.second, into_before.second))
          << ctx << ", " << name << ": the output changed";
    }
    // The next calls: bit for bit the twin's.
    for (int i = 0; i < 4; ++i) {
      const Call<T> n = focus_call<T>(rng, r, i == 0 ? 3 : 1, offset);
      EXPECT_EQ(out_bytes(cache->attend(n.q, n.k, n.v)), out_bytes(twin->attend(n.q, n.k, n.v)))
          << ctx << ", call " << i << " after the refusals";
      offset += n.S();
      expect_same_heads(*cache, *twin, ctx);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The ragged view
// ---------------------------------------------------------------------------------------------

/// update_and_view on ragged heads (queries and not, T and double inputs, an empty call):
/// ragged(), rows() throwing std::logic_error, rows(b, h) the head's rows before the call plus
/// the call's, keys / values / positions of that many rows, the held rows first (the positions
/// held before), the call's last; keys and values exactly the rows fed (unquantized) or within
/// the 8-bit quantization's error of them (the dequantized copy, laid out at the longest
/// head's rows: each head must still show its own rows).
template <class T>
void check_ragged_views(int bits) {
  for (const Method method : kCoreMethods) {
    AdaRun r = ragged_run<T>(method);
    r.key_bits = r.value_bits = bits;
    if (bits < 16) r.Dv = 8;  // quant_group 8 divides it
    const double tol = bits < 16 ? 0.05 : 0.0;
    const std::string ctx = r.describe();
    CachePtr<T> cache = make_cache<T>(r);
    std::mt19937 rng(8u);
    Held held;
    std::int64_t offset = 0;
    bool saw_ragged = false;
    const std::vector<Index> sizes = {16, 1, 0, 4, 1, 1, 9, 1, 0, 1};
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const Index S = sizes[i];
      const Call<T> c =
          i == 0 ? focus_call<T>(rng, r, S, offset) : random_call<T>(rng, r, S, {2.5, 0.4});
      const std::vector<Positions> before = all_positions(*cache);
      saw_ragged = saw_ragged || (i > 0 && ragged(before));
      remember(held, c, offset);
      const vc::KVView<T> view = i % 3 == 0   ? cache->update_and_view(c.k, c.v, c.q)
                                 : i % 3 == 1 ? cache->update_and_view(c.k, c.v)
                                              : cache->update_and_view(c.kd, c.vd);
      EXPECT_EQ(check_view(view, before, c, offset, held, tol), "") << ctx << ", call " << i;
      offset += S;
      if (i > 0 && ragged(before)) {
        EXPECT_THROW((void)view.rows(), std::logic_error) << ctx;
        EXPECT_THROW((void)view.rows(r.B, 0), std::out_of_range) << ctx;
        EXPECT_THROW((void)view.keys(0, r.H), std::out_of_range) << ctx;
      }
    }
    EXPECT_TRUE(saw_ragged) << ctx;
  }
}

TEST(AdaptiveHeadsViewTest, TheRaggedViewShowsEachHeadsOwnRows) {
  check_ragged_views<Eigen::half>(16);
}
TEST(AdaptiveHeadsViewTest, TheQuantizedRaggedViewShowsEachHeadsOwnRowsDequantized) {
  check_ragged_views<float>(8);
}

// ---------------------------------------------------------------------------------------------
// attend over ragged heads against a naive attention
// ---------------------------------------------------------------------------------------------

/// attend on an adaptive cache against the naive attention over the window a twin's
/// update_and_view of the same call shows (attend absorbs a call as update_and_view does): for
/// query head j of KV head h = j / G and token s, softmax(q K^T / sqrt(Dk)) over head (b, h)'s
/// own rows held before the call and the call's rows 0..s, times their values, in double.
template <class T>
void check_attend_naive(int bits) {
  for (const Method method : kCoreMethods) {
    AdaRun r = ragged_run<T>(method);
    r.key_bits = r.value_bits = bits;
    if (bits < 16) r.Dv = 8;  // quant_group 8 divides it
    const std::string ctx = r.describe();
    CachePtr<T> att = make_cache<T>(r);
    CachePtr<T> viewed = make_cache<T>(r);
    std::mt19937 rng(13u);
    std::int64_t offset = 0;
    bool saw_ragged = false;
    double worst = 0.0;
    for (const Index S : {16, 1, 1, 5, 1, 7, 1, 1}) {
      const Call<T> c =
          offset == 0 ? focus_call<T>(rng, r, S, offset) : random_call<T>(rng, r, S, {1.0, 2.5});
      saw_ragged = saw_ragged || (offset > 0 && ragged(all_positions(*att)));
      const vc::Tensor4<float> out = att->attend(c.q, c.k, c.v);
      const vc::KVView<T> view = viewed->update_and_view(c.k, c.v, c.q);
      ASSERT_EQ(all_positions(*att), all_positions(*viewed)) << ctx;
      for (Index b = 0; b < r.B; ++b) {
        for (Index j = 0; j < r.G * r.H; ++j) {
          const Index h = j / r.G;
          const auto keys = view.keys(b, h);
          const auto values = view.values(b, h);
          const auto pos = view.positions(b, h);
          for (Index s = 0; s < S; ++s) {
            std::vector<double> logit;
            std::vector<Index> seen;
            double top = -std::numeric_limits<double>::infinity();
            for (Index row = 0; row < view.rows(b, h); ++row) {
              if (pos(row) > offset + s) continue;  // the call's later rows (causal)
              double dot = 0.0;
              for (Index d = 0; d < r.Dk; ++d) {
                dot += static_cast<double>(c.q(b, j, s, d)) * to_double(keys(row, d));
              }
              logit.push_back(dot / std::sqrt(static_cast<double>(r.Dk)));
              seen.push_back(row);
              top = std::max(top, logit.back());
            }
            double z = 0.0;
            for (double& l : logit) z += (l = std::exp(l - top));
            for (Index d = 0; d < r.Dv; ++d) {
              double want = 0.0;
              for (std::size_t k = 0; k < seen.size(); ++k) {
                want += logit[k] / z * to_double(values(seen[k], d));
              }
              const double err = std::fabs(static_cast<double>(out(b, j, s, d)) - want);
              worst = std::max(worst, err);
              EXPECT_LE(err, 1e-4 * std::max(1.0, std::fabs(want)))
                  << ctx << ", offset " << offset << " b " << b << " j " << j << " s " << s << " d "
                  << d << ": attend " << out(b, j, s, d) << ", naive " << want;
            }
          }
        }
      }
      offset += S;
    }
    EXPECT_TRUE(saw_ragged) << ctx;
    std::printf("[ info     ] %s: largest |attend - naive| %.3g\n", ctx.c_str(), worst);
  }
}

TEST(AdaptiveHeadsAttendTest, AttendIsTheNaiveAttentionOverEachHeadsOwnRows) {
  check_attend_naive<Eigen::half>(16);
}
TEST(AdaptiveHeadsAttendTest, QuantizedAttendIsTheNaiveAttentionOverTheDequantizedRows) {
  check_attend_naive<float>(8);
}

// ---------------------------------------------------------------------------------------------
// Parallel heads
// ---------------------------------------------------------------------------------------------

/// Three caches fed the same calls: serial, on a thread pool, and on a parallel-for that runs
/// the tasks serially in reverse order. Positions, scores (bitwise), attention outputs and views
/// agree bit for bit, for the three methods, with queries and without; the parallel-for really
/// ran (calls large enough to be split), and the heads became ragged.
TEST(AdaptiveHeadsParallelTest, ParallelHeadsAreBitIdenticalToSerial) {
  using T = Eigen::half;
  for (const Method method : kCoreMethods) {
    for (const Index G : {2, 0}) {
      AdaRun r;
      r.method = method;
      r.budget = 10;
      r.n_sink = 1;
      r.recent = method == Method::h2o ? 2.0 : 0.3;
      r.decay = 0.95;
      r.floor = 0.2;
      r.value_power = G > 0 ? 2.0 : 0.0;
      r.B = 2;
      r.H = 4;
      r.G = G;
      r.Dk = 32;
      r.Dv = 8;
      const std::string ctx = r.describe();
      CachePtr<T> serial = make_cache<T>(r);
      CachePtr<T> pooled = make_cache<T>(r);
      CachePtr<T> reverse = make_cache<T>(r);
      pooled->set_parallel_for(thread_parallel_for(3), 3);
      int forks = 0;
      reverse->set_parallel_for(
          [&forks](int tasks, const std::function<void(int)>& task) {
            ++forks;
            for (int t = tasks - 1; t >= 0; --t) task(t);
          },
          4);
      std::mt19937 rng(17u);
      const std::vector<double> scale = {0.4, 1.0, 2.5, 1.0};
      bool saw_ragged = false;
      for (const Index S : {40, 1, 1, 24, 1, 1, 1, 17, 1, 33, 1}) {
        const Call<T> c = random_call<T>(rng, r, S, scale);
        if (G > 0) {
          const auto want = out_bytes(serial->attend(c.q, c.k, c.v));
          EXPECT_EQ(out_bytes(pooled->attend(c.q, c.k, c.v)), want) << ctx;
          EXPECT_EQ(out_bytes(reverse->attend(c.q, c.k, c.v)), want) << ctx;
        } else {
          const vc::KVView<T> a = serial->update_and_view(c.k, c.v);
          const vc::KVView<T> b = pooled->update_and_view(c.k, c.v);
          const vc::KVView<T> d = reverse->update_and_view(c.k, c.v);
          for (Index bi = 0; bi < r.B; ++bi)
            for (Index h = 0; h < r.H; ++h) {
              EXPECT_EQ(a.rows(bi, h), b.rows(bi, h)) << ctx;
              EXPECT_EQ(a.rows(bi, h), d.rows(bi, h)) << ctx;
              EXPECT_TRUE(same_map(a.keys(bi, h), b.keys(bi, h))) << ctx;
              EXPECT_TRUE(same_map(a.keys(bi, h), d.keys(bi, h))) << ctx;
              EXPECT_TRUE(same_map(a.positions(bi, h), b.positions(bi, h))) << ctx;
              EXPECT_TRUE(same_map(a.positions(bi, h), d.positions(bi, h))) << ctx;
            }
        }
        expect_same_heads(*serial, *pooled, ctx + ": thread pool");
        expect_same_heads(*serial, *reverse, ctx + ": reversed tasks");
        saw_ragged = saw_ragged || ragged(all_positions(*serial));
      }
      // Without queries, one attend at the end compares the values too.
      if (G == 0) {
        AdaRun q = r;
        q.G = 1;
        const Call<T> c = random_call<T>(rng, q, 2, scale);
        const auto want = out_bytes(serial->attend(c.q, c.k, c.v));
        EXPECT_EQ(out_bytes(pooled->attend(c.q, c.k, c.v)), want) << ctx;
        EXPECT_EQ(out_bytes(reverse->attend(c.q, c.k, c.v)), want) << ctx;
      }
      EXPECT_GT(forks, 2) << ctx << ": the calls never ran on the parallel-for";
      EXPECT_TRUE(saw_ragged) << ctx;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fork, checkpoint / rollback, prompt caches
// ---------------------------------------------------------------------------------------------

/// The calls of the runs below: ragged_run's, over quantized rows (8-bit keys, 4-bit values,
/// Dv 8) when bits < 16.
AdaRun serving_run(Method method, int bits) {
  AdaRun r = ragged_run<float>(method);
  if (bits < 16) {
    r.key_bits = 8;
    r.value_bits = 4;
    r.Dv = 8;
  }
  return r;
}

/// A model of two layers of `method` (squeeze: with the coordinator the builder wires, which
/// gives each layer its budget after the first call: a pending re-budget of the pools),
/// adaptive heads, floor 0.25.
vc::KVCacheConfig model_config(Method method, int bits) {
  const AdaRun r = serving_run(method, bits);
  vc::KVCacheConfig c = config_of(r);
  c.squeeze_calibration_tokens = 16;
  return c;
}

/// Call `i` of the runs below, the same for every set: prompt chunks (focus_call's data first,
/// then random), decode steps; through attend (with queries) except every fourth call, an
/// update_and_view without queries. Returns the attention outputs of every layer (bytes) or the
/// views' positions and keys.
const std::vector<Index>& run_sizes() {
  static const std::vector<Index> sizes = {16, 1, 3, 1, 1, 6, 1, 1, 1, 9, 1, 1, 1, 1};
  return sizes;
}
template <class T>
std::vector<unsigned char> model_step(Caches<T>& set, Method method, int bits, std::size_t i,
                                      unsigned seed = 0) {
  const AdaRun r = serving_run(method, bits);
  std::vector<unsigned char> out;
  for (std::size_t l = 0; l < set.size(); ++l) {
    std::mt19937 rng(1000u * static_cast<unsigned>(i) + 7u * static_cast<unsigned>(l) + seed);
    const Index S = run_sizes()[i];
    const Call<T> c = i == 0 ? focus_call<T>(rng, r, S, 0) : random_call<T>(rng, r, S, {2.5, 0.4});
    if (i % 4 == 3) {
      const vc::KVView<T> v = set[l]->update_and_view(c.k, c.v);
      for (Index b = 0; b < r.B; ++b)
        for (Index h = 0; h < r.H; ++h) {
          const auto p = v.positions(b, h);
          const auto k = v.keys(b, h);
          const auto* pb = reinterpret_cast<const unsigned char*>(p.data());
          out.insert(out.end(), pb, pb + p.size() * static_cast<Index>(sizeof(std::int64_t)));
          const auto* kb = reinterpret_cast<const unsigned char*>(k.data());
          out.insert(out.end(), kb, kb + k.size() * static_cast<Index>(sizeof(T)));
        }
    } else {
      const std::vector<unsigned char> b = out_bytes(set[l]->attend(c.q, c.k, c.v));
      out.insert(out.end(), b.begin(), b.end());
    }
  }
  return out;
}

/// Every layer's positions and scores of every head, offsets and kept bytes.
template <class T>
struct ModelState {
  std::vector<std::vector<Positions>> positions;
  std::vector<std::vector<std::vector<float>>> scores;
  std::vector<std::int64_t> offsets;
  std::vector<std::size_t> kept;
  std::vector<int> budgets;
  bool operator==(const ModelState& o) const {
    return positions == o.positions && scores == o.scores && offsets == o.offsets &&
           kept == o.kept && budgets == o.budgets;
  }
};
template <class T>
ModelState<T> model_state(const Caches<T>& set) {
  ModelState<T> s;
  for (const auto& c : set) {
    s.positions.push_back(all_positions(*c));
    s.scores.push_back(all_scores(*c));
    s.offsets.push_back(c->offset());
    s.kept.push_back(c->kept_bytes());
    s.budgets.push_back(c->layer_budget());
  }
  return s;
}
template <class T>
bool any_ragged(const Caches<T>& set) {
  for (const auto& c : set) {
    if (ragged(all_positions(*c))) return true;
  }
  return false;
}

/// A set forked, checkpointed and rolled back, or saved and loaded in the middle of a run (after
/// `at` calls, on ragged heads) continues bit for bit like the uninterrupted run: the outputs of
/// every later call, the heads' positions and scores; the source of a fork too; the loaded set
/// holds the saved per-head positions and scores. Unquantized and over quantized rows.
TEST(AdaptiveHeadsServingTest, ForkRollbackAndPromptCachesContinueBitIdentically) {
  using T = Eigen::half;
  for (const int bits : {16, 8})
    for (const Method method : kCoreMethods) {
      const std::string name = std::string(method_name(method)) + (bits < 16 ? " quantized" : "");
      const vc::KVCacheConfig config = model_config(method, bits);
      const std::size_t n = run_sizes().size();
      // The uninterrupted run.
      Caches<T> whole = vc::KVCacheBuilder::for_model<T>(2, config);
      std::vector<std::vector<unsigned char>> want;
      std::vector<ModelState<T>> states;
      for (std::size_t i = 0; i < n; ++i) {
        want.push_back(model_step(whole, method, bits, i));
        states.push_back(model_state(whole));
      }
      EXPECT_TRUE(any_ragged(whole)) << name;
      EXPECT_EQ(whole[0]->config().key_bits, bits) << name;
      for (const std::size_t at : {std::size_t{1}, std::size_t{4}, std::size_t{10}}) {
        const std::string ctx = name + ", interrupted after " + std::to_string(at) + " calls";
        Caches<T> source = vc::KVCacheBuilder::for_model<T>(2, config);
        Caches<T> marked = vc::KVCacheBuilder::for_model<T>(2, config);
        Caches<T> saved = vc::KVCacheBuilder::for_model<T>(2, config);
        for (std::size_t i = 0; i < at; ++i) {
          (void)model_step(source, method, bits, i);
          (void)model_step(marked, method, bits, i);
          (void)model_step(saved, method, bits, i);
        }
        ASSERT_TRUE(any_ragged(source)) << ctx << ": the heads should be ragged here";
        // Fork.
        Caches<T> copy = vc::KVCacheBuilder::fork(source);
        EXPECT_TRUE(model_state(copy) == states[at - 1]) << ctx << ": the fork";
        // Checkpoint, a draft of other calls, rollback.
        vc::KVCacheBuilder::checkpoint(marked);
        for (std::size_t i = at; i < std::min(n, at + 3); ++i)
          (void)model_step(marked, method, bits, i, 55u);
        EXPECT_FALSE(model_state(marked) == states[at - 1]) << ctx << ": the draft changed nothing";
        vc::KVCacheBuilder::rollback(marked);
        EXPECT_TRUE(model_state(marked) == states[at - 1]) << ctx << ": the rollback";
        // Save and load.
        std::stringstream file;
        vc::save_prompt_cache(file, saved);
        vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file);
        EXPECT_TRUE(model_state(loaded.caches) == states[at - 1]) << ctx << ": the loaded set";
        for (const auto& c : loaded.caches) {
          EXPECT_EQ(c->config().head_budgets, "adaptive") << ctx;
          EXPECT_EQ(c->config().head_budget_floor, 0.25) << ctx;
        }
        for (std::size_t i = at; i < n; ++i) {
          const std::string step = ctx + ", call " + std::to_string(i);
          EXPECT_EQ(model_step(copy, method, bits, i), want[i]) << step << ": the fork";
          EXPECT_EQ(model_step(source, method, bits, i), want[i]) << step << ": the fork's source";
          EXPECT_EQ(model_step(marked, method, bits, i), want[i]) << step << ": after the rollback";
          EXPECT_EQ(model_step(loaded.caches, method, bits, i), want[i])
              << step << ": the loaded set";
          EXPECT_TRUE(model_state(copy) == states[i]) << step;
          EXPECT_TRUE(model_state(source) == states[i]) << step;
          EXPECT_TRUE(model_state(marked) == states[i]) << step;
          EXPECT_TRUE(model_state(loaded.caches) == states[i]) << step;
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// SqueezeAttention with its coordinator: a pending re-budget of the pools
// ---------------------------------------------------------------------------------------------

/// SqueezeAttention in a model's set (three layers sharing the builder's coordinator, calibrating
/// on 12 tokens, deferring or not): the layers report after their second call and adopt budgets
/// of their own at the start of the third, where each sequence's heads give up their excess over
/// the new pool before they take the call, ranked as that call ranks (with queries, by score x
/// |v|^2; without, the scores or KeyDiff's ranking), with the new budget's g and floor; against
/// the oracle, whose budget changes at that call. The layers' keys lean along a direction by
/// different amounts, so that their concentrations, hence their budgets, differ.
TEST(AdaptiveHeadsCoordinatorTest, AdoptedBudgetsRebudgetThePoolsAtTheNextCall) {
  using T = Eigen::half;
  struct Mode {
    Index G;
    Scorer scorer;
    double power;
  };
  const Mode modes[] = {{1, Scorer::key_as_query, 2.0},
                        {2, Scorer::key_as_query, 0.0},
                        {0, Scorer::key_as_query, 0.0},
                        {0, Scorer::keydiff, 0.0}};
  const double lean[] = {0.0, 3.0, 1.0};
  int runs = 0, tie_divergences = 0, pending_evictions = 0, budgets_changed = 0;
  for (const bool defer : {false, true}) {
    for (const Mode& mode : modes) {
      for (const double floor : {0.25, 0.5}) {
        AdaRun r;
        r.method = Method::squeeze;
        r.budget = 8;
        r.n_sink = 1;
        r.recent = 0.25;
        r.decay = 0.95;
        r.floor = floor;
        r.value_power = mode.power;
        r.scorer = mode.scorer;
        r.B = 2;
        r.H = 3;
        r.G = mode.G;
        r.Dk = 4;
        r.Dv = 3;
        vc::KVCacheConfig config = config_of(r);
        config.squeeze_calibration_tokens = 12;
        config.squeeze_defer = defer;
        const std::string ctx = r.describe() + " defer=" + std::to_string(defer);
        Caches<T> model = vc::KVCacheBuilder::for_model<T>(3, config);
        std::vector<std::vector<SeqOracle>> oracle;
        for (std::size_t l = 0; l < model.size(); ++l) {
          std::vector<SeqOracle> o;
          for (Index b = 0; b < r.B; ++b) {
            o.emplace_back(static_cast<std::size_t>(r.H), r.n_sink, r.decay, grace_rule(r),
                           defer ? std::nullopt : std::optional<int>(r.budget), r.floor, r.scorer,
                           r.value_power);
          }
          oracle.push_back(std::move(o));
        }
        ++runs;
        std::mt19937 rng(400u + static_cast<unsigned>(runs));
        const std::vector<double> scale = {0.4, 1.0, 2.5};
        std::int64_t offset = 0;
        bool stop = false;
        for (const Index S : {5, 7, 1, 1, 4, 1, 1, 1, 9, 1, 1, 1, 1}) {
          for (std::size_t l = 0; l < model.size() && !stop; ++l) {
            Call<T> c = random_call<T>(rng, r, S, scale);
            for (Index b = 0; b < r.B; ++b)
              for (Index h = 0; h < r.H; ++h)
                for (Index s = 0; s < S; ++s) c.kd(b, h, s, 0) += lean[l];
            finish(c);
            if (mode.G > 0) {
              (void)model[l]->attend(c.q, c.k, c.v);
            } else {
              (void)model[l]->update_and_view(c.k, c.v);
            }
            // The budget this call found (adopted at its start; empty while deferring).
            const std::optional<int> now = core_budget(*model[l]);
            bool tie = false;
            for (SeqOracle& o : oracle[l]) {
              if (now && o.budget() != now) {
                ++budgets_changed;
                o.set_budget(*now, mode.G > 0);
                if (o.evicted_last_call() > 0) ++pending_evictions;
              }
            }
            tie = feed_oracle(oracle[l], c, mode.G > 0);
            const std::string err = compare_with_oracle(*model[l], oracle[l], offset + S, false);
            if (!err.empty()) {
              if (tie) {
                ++tie_divergences;
                stop = true;
                break;
              }
              ADD_FAILURE() << ctx << ", layer " << l << ", offset " << offset << ": " << err;
              stop = true;
            }
          }
          if (stop) break;
          offset += S;
        }
      }
    }
  }
  std::printf(
      "[ stats    ] %d runs, %d sequences re-budgeted (%d evicting at once), %d diverged "
      "after a near-tie\n",
      runs, budgets_changed, pending_evictions, tie_divergences);
  EXPECT_LE(tie_divergences * 10, runs);
  EXPECT_GT(budgets_changed, runs * 3);  // every run adopts budgets (and a deferring one its first)
  EXPECT_GT(pending_evictions, runs);    // ... which made pools give up rows at once
}

}  // namespace
