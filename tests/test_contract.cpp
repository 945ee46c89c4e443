// The contract every cache keeps, swept over every policy (tests/support/contract.hpp: standard,
// squeeze without and with a coordinator, deferring squeeze, H2O, PyramidKV, TOVA, StreamingLLM,
// SnapKV, and H2O, squeeze, deferring squeeze and PyramidKV with adaptive head budgets, SPEC 14)
// x storage type (half, bfloat16, float) x update API (fetch, view, fetch_into, each with and
// without queries, and the converting double overloads), through the public API only; built
// a second time over quantized rows (8-bit keys, 4-bit values; head dims times 8,
// docs/testing.md):
//  * a call returns the rows retained before it, then its own rows (docs/design.md 4.4, 2.3);
//  * after a call every head holds the rows its policy allows: the budget, the sinks, the newest
//    row; offset() is the true position; the accounting follows the rows;
//  * every API leaves the same state as every other;
//  * the heap stays bounded over a long decode, and a head within budget + C rows in chunked
//  prefill;
//  * reset() starts a fresh sequence (bitwise a new cache's), trim() only on the standard cache;
//  * a cache saved and loaded after any call (save_prompt_cache / load_prompt_cache) continues
//    bitwise as if it had never been saved, and saves again to the same bytes; a cache forked
//    after any call (KVCacheBuilder::fork) and its source both do, neither changing the other;
//    so does a cache checkpointed after any call, driven on and rolled back;
//  * every bad call throws std::invalid_argument naming the problem and changes nothing
//    (docs/design.md 8): one snapshot, one list of bad calls, the next call as on a twin;
//  * adaptive heads (docs/design.md 4.9) may hold different numbers of rows: the snapshot then
//    reads each head's rows through an empty view (subjects.hpp), a fetch on ragged heads must be
//    refused changing nothing (invoke makes the call as a view then, so every sweep goes on), and
//    what the pool guarantees is checked after every call (expect_adaptive_heads): each sequence
//    H x budget rows, each head its floor, the accounting of the rows held, ragged views.
// What is particular to a policy (its semantics against its oracle, hand-computed cases) stays in
// the policy's own file.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>
#include <veloxquant/cache.hpp>

#include "support/contract.hpp"
#include "support/storage_types.hpp"
#include "support/test_support.hpp"

namespace {

namespace vc = veloxquant::cache;
using namespace veloxquant::test;  // NOLINT(google-build-using-namespace)

template <class T>
class ContractTest : public ::testing::Test {};
// Over quantized rows (tests/CMakeLists.txt builds this file once more, 8-bit keys with 4-bit
// values) the suite runs on half storage, the default (float and bfloat16 over quantized rows:
// test_quant.cpp, every policy).
#if VELOXQUANT_TEST_KEY_BITS < 16 || VELOXQUANT_TEST_VALUE_BITS < 16
using ContractTypes = ::testing::Types<Eigen::half>;
#else
using ContractTypes = StorageTypes;
#endif
TYPED_TEST_SUITE(ContractTest, ContractTypes);

// ---------------------------------------------------------------------------------------------
// What a head may hold after a call
// ---------------------------------------------------------------------------------------------

/// SnapKV's rows per head after a call of S tokens on a head of `rows` (SPEC 13.3): a chunk
/// (S > 1) that passes the budget (6) is cut to it; anything else appends.
Index snap_rows(Index rows, Index S) { return S > 1 && rows + S > 6 ? 6 : rows + S; }

/// Rows every head must hold after a call, given the tokens absorbed so far (`offset`) and the
/// calls made (`calls`), for the subjects of contract.hpp (budget 6, one sink; squeeze before
/// adoption 8) but SnapKV, whose count follows the calls (snap_rows).
Index expected_rows(Kind kind, std::int64_t offset, int calls) {
  const auto upto = [&](Index cap) { return std::min<Index>(offset, cap); };
  if (keeps_every_row(kind.method)) return offset;
  if (kind == Kind::kSqueezeDefer || kind == Kind::kSqueezeDeferKeyDiff) {
    // Holds everything in its first call (budget unknown), then falls back to squeeze_budget.
    return calls <= 1 ? offset : upto(8);
  }
  if (kind == Method::snapkv) return -1;  // follows the calls themselves: snap_rows
  return upto(6);
}

/// Whether the newest row of the sequence is always retained (protected recent window, FIFO;
/// TOVA may evict the current token, SnapKV ranks its prompt without a recent window).
bool keeps_newest(Kind kind) { return kind != Method::tova && kind != Method::snapkv; }

/// The positions every head holds, through an empty call (which changes nothing, docs/design.md
/// 8): one sorted list per head, b-major.
template <class T>
std::vector<std::vector<std::int64_t>> held_positions(vc::KVCache<T>& cache) {
  std::vector<std::vector<std::int64_t>> out;
  const Index B = cache.batch(), H = cache.heads();
  const vc::Tensor4<T> k(B, H, 0, cache.key_dim()), v(B, H, 0, cache.value_dim());
  const vc::KVView<T> view = cache.update_and_view(k, v);
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      std::vector<std::int64_t> p(view.positions(b, h).data(),
                                  view.positions(b, h).data() + view.rows(b, h));
      std::sort(p.begin(), p.end());
      out.push_back(std::move(p));
    }
  }
  return out;
}

/// Checks one call's result against the retained set before it (`before`: state(), ascending
/// position; `before_positions`: held_positions) and the call itself. Fetched results must be
/// exactly [before ; call rows]; a view's earlier rows may come in any order (matched by
/// position), its last rows are the call's in arrival order.
template <class T>
void expect_returned(const Returned& got, Api api, const vc::KVPair<T>& before,
                     const std::vector<std::vector<std::int64_t>>& before_positions,
                     std::int64_t offset_before, const Call& call, const std::string& ctx) {
  const vc::KVPair<T> stored = stored_call<T>(call.keys, call.values);
  const vc::Tensor4<T>& k = stored.first;
  const vc::Tensor4<T>& v = stored.second;
  const Index B = k.dimension(0), H = k.dimension(1), S = k.dimension(2);
  const Index Dk = k.dimension(3), Dv = v.dimension(3);
  const Index n_before = before.first.dimension(2);
  const bool is_view = api == Api::kView || api == Api::kViewQ || api == Api::kViewDouble;
  if (!is_view) {
    // [before ; call]: the expected tensors, compared bitwise.
    vc::KVPair<T> want{vc::Tensor4<T>(B, H, n_before + S, Dk), vc::Tensor4<T>(B, H, n_before + S, Dv)};
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index r = 0; r < n_before + S; ++r) {
          for (Index d = 0; d < Dk; ++d)
            want.first(b, h, r, d) = r < n_before ? before.first(b, h, r, d) : k(b, h, r - n_before, d);
          for (Index d = 0; d < Dv; ++d)
            want.second(b, h, r, d) =
                r < n_before ? before.second(b, h, r, d) : v(b, h, r - n_before, d);
        }
    EXPECT_EQ(got.key_shape, shape_of(want.first)) << ctx;
    EXPECT_EQ(got.value_shape, shape_of(want.second)) << ctx;
    EXPECT_TRUE(got.keys == bytes_of(want.first)) << ctx << ": returned keys";
    EXPECT_TRUE(got.values == bytes_of(want.second)) << ctx << ": returned values";
    return;
  }
  // A view: rows keyed by (head, position) -> key bytes then value bytes; the tail in arrival order.
  std::map<std::int64_t, std::vector<unsigned char>> want;
  std::vector<std::int64_t> tail;
  const auto row_bytes = [&](const vc::Tensor4<T>& kt, const vc::Tensor4<T>& vt, Index b, Index h,
                             Index r) {
    std::vector<unsigned char> bytes(static_cast<std::size_t>(Dk + Dv) * sizeof(T));
    std::memcpy(bytes.data(), &kt(b, h, r, 0), static_cast<std::size_t>(Dk) * sizeof(T));
    std::memcpy(bytes.data() + static_cast<std::size_t>(Dk) * sizeof(T), &vt(b, h, r, 0),
                static_cast<std::size_t>(Dv) * sizeof(T));
    return bytes;
  };
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const auto& pos = before_positions[static_cast<std::size_t>(b * H + h)];
      ASSERT_EQ(static_cast<Index>(pos.size()), n_before) << ctx;
      for (Index r = 0; r < n_before; ++r) {
        want[(b * H + h) * 1000000 + pos[static_cast<std::size_t>(r)]] =
            row_bytes(before.first, before.second, b, h, r);
      }
      for (Index s = 0; s < S; ++s) {
        want[(b * H + h) * 1000000 + offset_before + s] = row_bytes(k, v, b, h, s);
        tail.push_back(offset_before + s);
      }
    }
  }
  EXPECT_TRUE(got.view_rows == want) << ctx << ": the view's rows are not [before ; call]";
  EXPECT_EQ(got.view_tail, tail) << ctx << ": the call's rows are not last in arrival order";
}

// ---------------------------------------------------------------------------------------------
// Adaptive heads (SPEC 14, docs/design.md 4.9): what the pool guarantees
// ---------------------------------------------------------------------------------------------

/// The rows every head of an adaptive subject keeps at least under budget b: ceil(floor x b), at
/// most b.
Index floor_rows(Kind kind, int budget) {
  const auto rows = static_cast<Index>(std::ceil(adaptive_floor(kind) * budget));
  return std::min<Index>(rows, budget);
}

/// What the heads of an adaptive subject hold after a call of S tokens (`offset`: tokens absorbed
/// so far, `calls`: calls with tokens made; `before`: each head's rows before the call, empty
/// before the first), through the public API (docs/design.md 4.9):
///  * each sequence's heads hold together exactly H x what one uniform head would (the pool,
///    H x budget once the budget is known; every row is kept before);
///  * each head keeps at least min(its rows before + S, ceil(floor x budget)): the pool never takes
///    a head below its floor (a head below it, after a budget rose, loses nothing);
///  * each head's positions are distinct, ascending, below offset(), with the sink and the newest
///    max(g, 1) positions of the sequence (no head gives up its protected recent rows);
///  * positions, scores and an empty call's view agree on every head's rows; kept_bytes() is the
///    sum of the rows held, tokens_kept() head (0, 0)'s rows;
///  * the heads are ragged exactly when their rows differ: the view's ragged() says so and its
///    rows() throws std::logic_error (else it is the rows of every head), and state() throws
///    std::invalid_argument naming attend and update_and_view, changing nothing; otherwise state()
///    holds every head's rows as the view does.
/// Returns whether the heads are ragged.
template <class T>
bool expect_adaptive_heads(Subject<T>& s, Kind kind, std::int64_t offset, int calls,
                           const std::vector<std::size_t>& before, Index S,
                           const std::string& where) {
  vc::KVCache<T>& c = *s.cache;
  const Index B = c.batch(), H = c.heads();
  const std::vector<std::size_t> rows = core_head_rows(c);
  EXPECT_EQ(static_cast<Index>(rows.size()), B * H) << where;
  if (static_cast<Index>(rows.size()) != B * H) return false;
  const Index per_head = expected_rows(base_kind(kind), offset, calls);
  const std::optional<int> budget = core_budget(c);
  const int g = core_protected_recent(c);
  for (Index b = 0; b < B; ++b) {
    std::size_t held = 0;
    for (Index h = 0; h < H; ++h) held += rows[static_cast<std::size_t>(b * H + h)];
    EXPECT_EQ(static_cast<Index>(held), H * per_head)
        << where << ": sequence " << b << "'s heads hold " << held << " rows, not H x " << per_head
        << " (the pool)";
  }
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const auto i = static_cast<std::size_t>(b * H + h);
      const std::string head =
          where + ", head (" + std::to_string(b) + ", " + std::to_string(h) + ")";
      if (budget) {
        const Index was = before.empty() ? 0 : static_cast<Index>(before[i]);
        EXPECT_GE(static_cast<Index>(rows[i]), std::min(was + S, floor_rows(kind, *budget)))
            << head << ": below its floor of " << floor_rows(kind, *budget) << " (held " << was
            << " + " << S << " before the pool)";
      }
      const std::vector<std::int64_t> p = policy_positions(c, b, h);
      EXPECT_EQ(policy_scores(c, b, h).size(), p.size()) << head;
      EXPECT_TRUE(std::adjacent_find(p.begin(), p.end(), std::greater_equal<>()) == p.end())
          << head << ": positions not ascending";
      EXPECT_TRUE(p.empty() || (p.front() >= 0 && p.back() < offset)) << head;
      if (offset > 0) {
        EXPECT_TRUE(!p.empty() && p.front() == 0) << head << ": the sink was evicted";
        const std::int64_t newest = std::min<std::int64_t>(std::max(g, 1), offset);
        for (std::int64_t q = offset - newest; q < offset; ++q) {
          EXPECT_TRUE(std::binary_search(p.begin(), p.end(), q))
              << head << ": protected recent position " << q << " was evicted (g = " << g << ")";
        }
      }
    }
  }
  std::size_t total = 0;
  for (const std::size_t r : rows) total += r;
  EXPECT_EQ(c.kept_bytes(), total * stored_row_bytes<T>()) << where << ": kept_bytes()";
  EXPECT_EQ(c.tokens_kept(), static_cast<std::int64_t>(rows.front())) << where;
  const auto t_row_bytes = static_cast<std::size_t>(kKeys[3] + kValues[3]) * sizeof(T);
  EXPECT_EQ(c.full_seq_bytes(), static_cast<std::size_t>(B * H * offset) * t_row_bytes) << where;
  if (total > 0) {
    EXPECT_DOUBLE_EQ(c.compression_ratio(),
                     static_cast<double>(c.full_seq_bytes()) / static_cast<double>(c.kept_bytes()))
        << where;
  }
  const bool ragged =
      std::adjacent_find(rows.begin(), rows.end(), std::not_equal_to<>()) != rows.end();
  // The rows as an empty call's view shows them (held_rows), and that view's own shape.
  const std::vector<HeadRows> held = held_rows(c);
  {
    const vc::Tensor4<T> k0(B, H, 0, c.key_dim()), v0(B, H, 0, c.value_dim());
    const vc::KVView<T> view = c.update_and_view(k0, v0);
    EXPECT_EQ(view.ragged(), ragged) << where;
    if (ragged) {
      EXPECT_THROW((void)view.rows(), std::logic_error) << where << ": rows() of a ragged view";
    } else {
      EXPECT_EQ(view.rows(), static_cast<Index>(rows.front())) << where;
    }
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        const auto i = static_cast<std::size_t>(b * H + h);
        EXPECT_EQ(view.rows(b, h), static_cast<Index>(rows[i])) << where << ": view rows(b, h)";
        EXPECT_EQ(held[i].positions, policy_positions(c, b, h)) << where << ": view positions";
      }
    }
  }
  if (ragged) {
    const Snapshot was = snapshot(s);
    const std::string what = invalid_argument_message([&] { (void)c.state(); });
    EXPECT_TRUE(is_ragged_refusal(what)) << where << ": state() on ragged heads: " << what;
    EXPECT_TRUE(snapshot(s) == was) << where << ": a refused state() changed the cache";
  } else {
    const vc::KVPair<T> st = c.state();
    EXPECT_EQ(st.first.dimension(2), static_cast<Index>(rows.front())) << where;
    const std::vector<unsigned char> k = bytes_of(st.first), v = bytes_of(st.second);
    std::vector<unsigned char> want_k, want_v;
    for (const HeadRows& r : held) {
      want_k.insert(want_k.end(), r.keys.begin(), r.keys.end());
      want_v.insert(want_v.end(), r.values.begin(), r.values.end());
    }
    EXPECT_TRUE(k == want_k && v == want_v) << where << ": state() is not the rows a view shows";
  }
  return ragged;
}

/// expect_returned for heads that may hold different numbers of rows (adaptive subjects):
/// `before` holds each head's rows retained before the call (held_rows; empty before the first);
/// `as_view`: the call returned a view (a view API, or a fetch refused on ragged heads and made as
/// a view by invoke). Fetched: [before ; call] bitwise, every head holding as many rows; a view:
/// each head's earlier rows by position, then the call's rows last in arrival order.
template <class T>
void expect_returned_by_head(const Returned& got, bool as_view, const std::vector<HeadRows>& before,
                             std::int64_t offset_before, const Call& call, const std::string& ctx) {
  const vc::KVPair<T> stored = stored_call<T>(call.keys, call.values);
  const Index B = stored.first.dimension(0), H = stored.first.dimension(1);
  const Index S = stored.first.dimension(2);
  const auto kb = static_cast<std::size_t>(stored.first.dimension(3)) * sizeof(T);
  const auto vb = static_cast<std::size_t>(stored.second.dimension(3)) * sizeof(T);
  const auto* ck = reinterpret_cast<const unsigned char*>(stored.first.data());
  const auto* cv = reinterpret_cast<const unsigned char*>(stored.second.data());
  const auto n_before = [&](Index i) {
    return before.empty()
               ? Index{0}
               : static_cast<Index>(before[static_cast<std::size_t>(i)].positions.size());
  };
  if (!as_view) {
    std::vector<unsigned char> want_k, want_v;
    for (Index i = 0; i < B * H; ++i) {
      EXPECT_EQ(n_before(i), n_before(0)) << ctx << ": a fetch was served on ragged heads";
      if (!before.empty()) {
        const HeadRows& r = before[static_cast<std::size_t>(i)];
        want_k.insert(want_k.end(), r.keys.begin(), r.keys.end());
        want_v.insert(want_v.end(), r.values.begin(), r.values.end());
      }
      want_k.insert(want_k.end(), ck + static_cast<std::size_t>(i * S) * kb,
                    ck + static_cast<std::size_t>((i + 1) * S) * kb);
      want_v.insert(want_v.end(), cv + static_cast<std::size_t>(i * S) * vb,
                    cv + static_cast<std::size_t>((i + 1) * S) * vb);
    }
    EXPECT_EQ(got.key_shape, (Shape{B, H, n_before(0) + S, stored.first.dimension(3)})) << ctx;
    EXPECT_EQ(got.value_shape, (Shape{B, H, n_before(0) + S, stored.second.dimension(3)})) << ctx;
    EXPECT_TRUE(got.keys == want_k) << ctx << ": returned keys";
    EXPECT_TRUE(got.values == want_v) << ctx << ": returned values";
    return;
  }
  std::map<std::int64_t, std::vector<unsigned char>> want;
  std::vector<std::int64_t> tail;
  const auto row = [&](const unsigned char* k, const unsigned char* v) {
    std::vector<unsigned char> bytes(k, k + kb);
    bytes.insert(bytes.end(), v, v + vb);
    return bytes;
  };
  for (Index i = 0; i < B * H; ++i) {
    for (Index r = 0; r < n_before(i); ++r) {
      const HeadRows& hr = before[static_cast<std::size_t>(i)];
      want[i * 1000000 + hr.positions[static_cast<std::size_t>(r)]] =
          row(hr.keys.data() + static_cast<std::size_t>(r) * kb,
              hr.values.data() + static_cast<std::size_t>(r) * vb);
    }
    for (Index t = 0; t < S; ++t) {
      want[i * 1000000 + offset_before + t] = row(ck + static_cast<std::size_t>(i * S + t) * kb,
                                                  cv + static_cast<std::size_t>(i * S + t) * vb);
      tail.push_back(offset_before + t);
    }
  }
  EXPECT_TRUE(got.view_rows == want) << ctx << ": the view's rows are not [before ; call]";
  EXPECT_EQ(got.view_tail, tail) << ctx << ": the call's rows are not last in arrival order";
}

/// The calls of a sequence: a prefill longer than the budget, decode steps, a multi-token call,
/// an empty call, and a second multi-token call. Sizes along S.
const std::vector<Index>& sequence_sizes() {
  static const std::vector<Index> sizes = {9, 1, 1, 1, 3, 0, 1, 7, 1, 1, 2};
  return sizes;
}

bool with_queries(Api api) {
  return api == Api::kFetchQ || api == Api::kViewQ || api == Api::kFetchIntoQ ||
         api == Api::kFetchIntoDoubleQ;
}

// ---------------------------------------------------------------------------------------------
// Return rule, budgets, sinks, offset and accounting
// ---------------------------------------------------------------------------------------------

/// The sequence of EveryCallReturns... on an adaptive subject through `api`: each call returns
/// [retained before ; its rows] per head (a fetch on ragged heads is refused, changing nothing,
/// and made as a view: invoke), offset() and tokens_seen() count every token, and the heads hold
/// what the pool allows (expect_adaptive_heads). Returns after how many calls the heads were
/// ragged.
template <class T>
int adaptive_sequence(Kind kind, Api api) {
  const std::string ctx = std::string(kind_name(kind)) + ", " + api_name(api);
  std::mt19937 rng(100u + kind_index(kind) * 16u + static_cast<unsigned>(api));
  Subject<T> s = make_subject<T>(kind);
  vc::KVPair<T> into;
  std::int64_t offset = 0, seen = 0;
  int calls = 0, ragged = 0;
  for (const Index S : sequence_sizes()) {
    const Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
    const std::vector<HeadRows> before = held_rows(*s.cache);
    const std::vector<std::size_t> rows_before = core_head_rows(*s.cache);
    const bool was_ragged = ragged_heads(*s.cache);
    const std::string where =
        ctx + ", call " + std::to_string(calls) + " (S = " + std::to_string(S) + ")";
    Returned got;
    try {
      got = invoke(*s.cache, api, call, into);
    } catch (const std::exception& e) {
      ADD_FAILURE() << where << ": " << e.what();
      return ragged;
    }
    expect_returned_by_head<T>(got, is_view_api(api) || was_ragged, before, offset, call, where);
    offset += S;
    seen += kKeys[0] * kKeys[1] * S;
    if (S > 0) ++calls;
    EXPECT_EQ(s.cache->offset(), offset) << where;
    EXPECT_EQ(s.cache->tokens_seen(), seen) << where;
    if (expect_adaptive_heads(s, kind, offset, calls, rows_before, S, where)) ++ragged;
  }
  return ragged;
}

/// Every policy x API: each call of a sequence returns [retained before ; its rows]; afterwards
/// each head holds what its policy allows (all heads the same count), the sinks and (but for
/// TOVA and SnapKV) the newest row; offset() counts every token; the accounting follows the rows.
/// Adaptive subjects: adaptive_sequence (their heads may hold different counts); the sweep must
/// leave each of them ragged after some call.
TYPED_TEST(ContractTest, EveryCallReturnsTheRetainedRowsThenItsOwnAndStaysWithinItsPolicy) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    if (is_adaptive(kind)) {
      int ragged = 0;
      for (const Api api : kApis) ragged += adaptive_sequence<T>(kind, api);
      EXPECT_GT(ragged, 0) << kind_name(kind) << ": the heads never became ragged";
      continue;
    }
    for (const Api api : kApis) {
      const std::string ctx = std::string(kind_name(kind)) + ", " + api_name(api);
      std::mt19937 rng(100u + kind_index(kind) * 16u + static_cast<unsigned>(api));
      Subject<T> s = make_subject<T>(kind);
      vc::KVPair<T> into;
      std::int64_t offset = 0, seen = 0;
      int calls = 0;
      Index snap = 0;
      for (const Index S : sequence_sizes()) {
        const Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
        const vc::KVPair<T> before = s.cache->state();
        const auto before_positions =
            calls == 0 ? std::vector<std::vector<std::int64_t>>(4) : held_positions(*s.cache);
        const Returned got = invoke(*s.cache, api, call, into);
        const std::string where = ctx + ", call " + std::to_string(calls) + " (S = " +
                                  std::to_string(S) + ")";
        expect_returned(got, api, before, before_positions, offset, call, where);
        offset += S;
        seen += kKeys[0] * kKeys[1] * S;
        if (S > 0) ++calls;
        ASSERT_EQ(s.cache->offset(), offset) << where;
        EXPECT_EQ(s.cache->tokens_seen(), seen) << where;
        snap = snap_rows(snap, S);
        const Index rows = kind == Method::snapkv ? snap : expected_rows(kind, offset, calls);
        const auto held = held_positions(*s.cache);
        for (const auto& p : held) {
          ASSERT_EQ(static_cast<Index>(p.size()), rows) << where;
          EXPECT_TRUE(std::adjacent_find(p.begin(), p.end()) == p.end()) << where;
          EXPECT_TRUE(p.empty() || (p.front() >= 0 && p.back() < offset)) << where;
          if (offset > 0) {
            EXPECT_EQ(p.front(), 0) << where << ": the sink was evicted";
            if (keeps_newest(kind)) {
              EXPECT_EQ(p.back(), offset - 1) << where;
            }
          }
        }
        const vc::KVPair<T> st = s.cache->state();
        EXPECT_EQ(st.first.dimension(2), rows) << where;
        const std::size_t row_bytes = stored_row_bytes<T>();
        const auto t_row_bytes = static_cast<std::size_t>(kKeys[3] + kValues[3]) * sizeof(T);
        const auto heads = static_cast<std::size_t>(kKeys[0] * kKeys[1]);
        EXPECT_EQ(s.cache->kept_bytes(), heads * static_cast<std::size_t>(rows) * row_bytes) << where;
        EXPECT_EQ(s.cache->full_seq_bytes(), heads * static_cast<std::size_t>(offset) * t_row_bytes)
            << where;
        EXPECT_EQ(s.cache->tokens_kept(), rows) << where;
        if (rows > 0) {
          EXPECT_DOUBLE_EQ(s.cache->compression_ratio(),
                           static_cast<double>(offset * t_row_bytes) /
                               static_cast<double>(rows * row_bytes))
              << where;
        }
      }
    }
  }
}

/// Adaptive subjects (SPEC 14) over 40 calls of 0 to 12 tokens through every API and attend, 4
/// sequences each: after every call the heads hold what the pool allows (expect_adaptive_heads:
/// each sequence H x min(offset, budget) rows, each head at least min(its rows + S,
/// ceil(floor x budget)), sinks and recent rows kept, accounting of the rows held, ragged views
/// and state() refused on ragged heads); and while the heads are ragged every fetching API (also
/// with an empty call) throws std::invalid_argument naming attend and update_and_view, before
/// changing anything: the cache, its coordinator and the caller's fetch_into output. Not vacuous:
/// every subject turns ragged and fetches are refused (the floor where it binds:
/// AdaptiveFloorHoldsAHeadWhoseRowsDrawNoAttention).
TYPED_TEST(ContractTest, AdaptiveHeadsKeepTheirPoolAndFloorsAndRefuseDenseReturns) {
  using T = TypeParam;
  const Api fetching[] = {Api::kFetch,      Api::kFetchInto,   Api::kFetchQ,
                          Api::kFetchIntoQ, Api::kFetchDouble, Api::kFetchIntoDoubleQ};
  for (const Kind kind : kAdaptiveKinds) {
    int ragged = 0, refused = 0;
    for (unsigned run = 0; run < 4; ++run) {
      std::mt19937 rng(1400u + 16u * kind_index(kind) + run);
      Subject<T> s = make_subject<T>(kind);
      std::int64_t offset = 0;
      int calls = 0;
      for (int i = 0; i < 40; ++i) {
        const Index S = i == 0 ? 9 : static_cast<Index>(rng() % 13 < 8 ? rng() % 3 : rng() % 13);
        const Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
        const std::string where = std::string(kind_name(kind)) + ", run " + std::to_string(run) +
                                  ", call " + std::to_string(i) + " (S = " + std::to_string(S) +
                                  ")";
        if (ragged_heads(*s.cache)) {
          for (const Api api : fetching) {
            for (const Index n : {S, Index{0}}) {
              const Call c = n == S ? call : random_call(rng, with_s(kKeys, 0), with_s(kValues, 0));
              const Snapshot before = snapshot(s);
              vc::KVPair<T> into = earlier_output(*s.cache);
              const std::vector<unsigned char> into_keys = bytes_of(into.first);
              const std::string what =
                  invalid_argument_message([&] { (void)invoke_as_given(*s.cache, api, c, into); });
              const std::string ctx = where + ", " + api_name(api) + " of " + std::to_string(n);
              EXPECT_TRUE(is_ragged_refusal(what)) << ctx << ": " << what;
              const std::string name = api_name(api);
              EXPECT_TRUE(contains(what, name.substr(0, name.find('(')))) << ctx << ": " << what;
              EXPECT_TRUE(snapshot(s) == before) << ctx << ": a refused fetch changed the cache";
              EXPECT_TRUE(bytes_of(into.first) == into_keys) << ctx << ": the output was touched";
              ++refused;
            }
          }
        }
        const std::vector<std::size_t> rows_before = core_head_rows(*s.cache);
        const int how = static_cast<int>(rng() % 4);
        vc::KVPair<T> into;
        if (how == 0) {
          (void)s.cache->attend(converted<float>(call.queries), converted<T>(call.keys),
                                converted<T>(call.values));
        } else {
          (void)invoke(*s.cache, kApis[rng() % (sizeof(kApis) / sizeof(kApis[0]))], call, into);
        }
        offset += S;
        if (S > 0) ++calls;
        if (expect_adaptive_heads(s, kind, offset, calls, rows_before, S, where)) ++ragged;
      }
    }
    EXPECT_GT(ragged, 0) << kind_name(kind) << ": the heads never became ragged";
    EXPECT_GT(refused, 0) << kind_name(kind);
  }
}

/// The floor (SPEC 14) where the pool would go below it: in every sequence head 0 attends to its
/// sink alone (its first key and its queries large and alike, its other keys 0), so its other
/// rows draw no attention, and head 1's keys are 0 (every row draws the same share): the pool
/// takes what it gives up from head 0 while it may. After a 9-token prefill and 30 decode steps
/// with queries, head 0 holds exactly what it must keep, its floor or its sink and protected
/// recent rows, whichever is more, and head 1 the rest of the pool: a floor the pool ignored
/// (squeeze: 5 rows of 6, above the 3 it protects) or a pool that skipped the heads at their floor
/// would show.
TYPED_TEST(ContractTest, AdaptiveFloorHoldsAHeadWhoseRowsDrawNoAttention) {
  using T = TypeParam;
  for (const Kind kind : kAdaptiveKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(77u + kind_index(kind));
    Subject<T> s = make_subject<T>(kind);
    std::vector<std::size_t> before;
    std::int64_t offset = 0;
    int calls = 0;
    for (int i = 0; i <= 30; ++i) {
      const Index S = i == 0 ? 9 : 1;
      Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
      for (Index b = 0; b < kKeys[0]; ++b) {
        for (Index t = 0; t < S; ++t) {
          for (Index d = 0; d < kKeys[3]; ++d) {
            call.keys(b, 0, t, d) = offset + t == 0 ? 8.0 : 0.0;
            call.keys(b, 1, t, d) = 0.0;
            call.queries(b, 0, t, d) = 8.0;  // head 0's two query heads (G = 2)
            call.queries(b, 1, t, d) = 8.0;
          }
        }
      }
      vc::KVPair<T> into;
      (void)invoke(*s.cache, Api::kViewQ, call, into);
      offset += S;
      ++calls;
      (void)expect_adaptive_heads(s, kind, offset, calls, before, S, "call " + std::to_string(i));
      before = core_head_rows(*s.cache);
    }
    const int budget = s.cache->layer_budget();
    const Index keep =
        std::max<Index>(floor_rows(kind, budget), 1 + core_protected_recent(*s.cache));
    for (Index b = 0; b < kKeys[0]; ++b) {
      EXPECT_EQ(static_cast<Index>(before[static_cast<std::size_t>(b * 2)]), keep)
          << "sequence " << b << ": head 0 (budget " << budget << ", floor "
          << floor_rows(kind, budget) << ")";
      EXPECT_EQ(static_cast<Index>(before[static_cast<std::size_t>(b * 2 + 1)]), 2 * budget - keep)
          << "sequence " << b << ": head 1";
    }
  }
}

/// Every API of a family (without queries: fetch, view, fetch_into, fetch(double), view(double);
/// with queries: the same with queries of float or double) leaves bitwise the same state after
/// every call of the sequence. Adaptive subjects: a fetch on ragged heads is refused, changing
/// nothing, and the call made as a view (invoke), so every subject takes every call; with queries
/// attend (docs/design.md 2.8) joins the family.
TYPED_TEST(ContractTest, EveryApiLeavesTheSameState) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    for (const bool queries : {false, true}) {
      std::vector<Api> family;
      for (const Api api : kApis)
        if (with_queries(api) == queries) family.push_back(api);
      std::vector<Subject<T>> subjects;
      for (std::size_t i = 0; i < family.size(); ++i) subjects.push_back(make_subject<T>(kind));
      std::optional<Subject<T>> attending;
      if (queries && is_adaptive(kind)) attending = make_subject<T>(kind);
      std::mt19937 rng(300u + kind_index(kind));
      int call_no = 0;
      for (const Index S : sequence_sizes()) {
        const Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
        for (std::size_t i = 0; i < family.size(); ++i) {
          vc::KVPair<T> into;
          (void)invoke(*subjects[i].cache, family[i], call, into);
        }
        if (attending) {
          (void)attending->cache->attend(converted<float>(call.queries), converted<T>(call.keys),
                                         converted<T>(call.values));
        }
        // A quantized cache's view holds a dequantized copy of the window (docs/design.md 2.3),
        // which the other APIs do not: its heap is not compared here.
        const auto state_of = [](const Subject<T>& s) {
          Snapshot snap = snapshot(s);
          if (kQuantized) snap.heap = 0;
          return snap;
        };
        const Snapshot first = state_of(subjects.front());
        for (std::size_t i = 1; i < family.size(); ++i) {
          EXPECT_TRUE(state_of(subjects[i]) == first)
              << kind_name(kind) << ": " << api_name(family[i]) << " differs from "
              << api_name(family.front()) << " after call " << call_no;
        }
        if (attending) {
          // attend sizes scratch for its output (the heap is not its state: logical_state).
          Snapshot a = logical_state(*attending), f = first;
          f.heap = 0;
          EXPECT_TRUE(a == f) << kind_name(kind) << ": attend differs from "
                              << api_name(family.front()) << " after call " << call_no;
        }
        ++call_no;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bounded heap, reset, trim
// ---------------------------------------------------------------------------------------------

/// Over a long decode the heap stops growing once a bounded policy is full: it stays within a
/// small multiple of the retained rows, and equal from step 500 to the end (SnapKV after its
/// compressed prompt and the standard cache grow with the sequence and are left out).
/// Adaptive subjects are not held to the equality: a head's storage follows its own rows
/// (docs/design.md 4.9, B), and a head may reach a new largest share of its pool at any step
/// (each sequence's heads still hold at most H x budget rows: a head at most H x budget). Instead
/// their heap stays, at every step from 100 on, below a ceiling that does not grow with the
/// sequence: every head holding the whole pool, H x budget + 1 rows, at 64 bytes of bookkeeping
/// per slot (docs/design.md B: 25 to 29), half again for growth, and the same 16 KiB per head.
TYPED_TEST(ContractTest, HeapStaysBoundedOverALongDecode) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    if (keeps_every_row(kind.method) || kind == Method::snapkv) continue;
    SCOPED_TRACE(kind_name(kind));
    Subject<T> s = make_subject<T>(kind);
    std::mt19937 rng(23u);
    std::size_t at_500 = 0;
    for (int step = 1; step <= 1500; ++step) {
      const Call call = random_call(rng, with_s(kKeys, 1), with_s(kValues, 1));
      vc::KVPair<T> into;
      (void)invoke(*s.cache, step % 2 ? Api::kView : Api::kViewQ, call, into);
      if (step >= 100) {
        const std::size_t call_rows =
            static_cast<std::size_t>(kKeys[0] * kKeys[1] * (kKeys[3] + kValues[3])) * sizeof(T);
        const std::size_t bound = static_cast<std::size_t>(
            1.5 * static_cast<double>(s.cache->kept_bytes() + call_rows) +
            16384.0 * static_cast<double>(kKeys[0] * kKeys[1]));
        ASSERT_LT(s.cache->heap_bytes(), bound) << "step " << step;
        if (is_adaptive(kind)) {
          const auto heads = static_cast<std::size_t>(kKeys[0] * kKeys[1]);
          const auto pool = static_cast<std::size_t>(kKeys[1] * s.cache->layer_budget() + 1);
          const std::size_t ceiling = static_cast<std::size_t>(
              1.5 * static_cast<double>(heads * pool * (stored_row_bytes<T>() + 64)) +
              16384.0 * static_cast<double>(heads));
          ASSERT_LT(s.cache->heap_bytes(), ceiling) << "step " << step;
        }
      }
      if (step == 500) at_500 = s.cache->heap_bytes();
    }
    if (!is_adaptive(kind)) {
      EXPECT_EQ(s.cache->heap_bytes(), at_500);
    }
    EXPECT_EQ(s.cache->offset(), 1500);
  }
}

/// Rows each head (b-major) of B x H returned in `r`: a fetched window's n, or a view's rows.
std::vector<Index> returned_rows(const Returned& r, Index B, Index H) {
  std::vector<Index> out(static_cast<std::size_t>(B * H), r.key_shape[2]);
  if (r.key_shape[2] > 0) return out;
  for (const auto& row : r.view_rows) ++out[static_cast<std::size_t>(row.first / 1000000)];
  return out;
}

/// ChunkedPrefillHoldsAtMostBudgetPlusC on an adaptive subject, whose heads share their rows (a
/// head may hold more than the budget; SPEC 14): once the budget is known, a chunk's call returns
/// at most H x (budget + C) rows per sequence, each head its rows before the call and the C new
/// ones (the fetching APIs on ragged heads are refused and the call made as a view: invoke), and
/// after it each sequence's heads hold at most H x budget rows and kept_bytes() is that of budget
/// rows per head at most.
template <class T>
void adaptive_chunked_prefill(Kind kind, Index C, const Api (&apis)[4]) {
  const std::string ctx = std::string(kind_name(kind)) + ", chunks of " + std::to_string(C);
  Subject<T> s = make_subject<T>(kind);
  std::mt19937 rng(31u + static_cast<unsigned>(C));
  const Index B = kKeys[0], H = kKeys[1];
  int bounded_chunks = 0;
  for (Index done = 0, i = 0; done < 60; done += C, ++i) {
    const std::string where = ctx + ", chunk " + std::to_string(i);
    const int budget_before = s.cache->layer_budget();
    std::vector<std::size_t> before = core_head_rows(*s.cache);
    if (before.empty()) before.assign(static_cast<std::size_t>(B * H), 0);
    const Call call = random_call(rng, with_s(kKeys, C), with_s(kValues, C));
    vc::KVPair<T> into;
    const Returned r = invoke(*s.cache, apis[static_cast<std::size_t>(i) % 4], call, into);
    const std::vector<Index> got = returned_rows(r, B, H);
    for (std::size_t h = 0; h < got.size(); ++h) {
      EXPECT_EQ(got[h], static_cast<Index>(before[h]) + C) << where << ", head " << h;
    }
    const int budget = s.cache->layer_budget();
    if (!(budget > 0 && budget == budget_before)) continue;
    ++bounded_chunks;
    const std::vector<std::size_t> rows = core_head_rows(*s.cache);
    std::size_t total = 0;
    for (Index b = 0; b < B; ++b) {
      Index returned = 0, held = 0;
      for (Index h = 0; h < H; ++h) {
        returned += got[static_cast<std::size_t>(b * H + h)];
        held += static_cast<Index>(rows[static_cast<std::size_t>(b * H + h)]);
      }
      EXPECT_LE(returned, H * (budget + C)) << where << ", sequence " << b;
      EXPECT_LE(held, H * budget) << where << ", sequence " << b;
      total += static_cast<std::size_t>(held);
    }
    EXPECT_EQ(s.cache->kept_bytes(), total * stored_row_bytes<T>()) << where;
    EXPECT_LE(s.cache->kept_bytes(),
              stored_row_bytes<T>() * static_cast<std::size_t>(budget * B * H))
        << where;
  }
  EXPECT_GE(bounded_chunks, 5) << ctx << ": the budget was never known";
  std::size_t total = 0;
  for (const std::size_t n : core_head_rows(*s.cache)) total += n;
  EXPECT_LT(total, static_cast<std::size_t>(60 * B * H)) << ctx << ": nothing was evicted";
}

/// Chunked prefill (SPEC 13.3, docs/design.md 10.3): a prompt of 60 tokens fed in chunks of C
/// (2, 3 or 5) through every fetching API. Once a cache's budget is known (layer_budget(), held the
/// whole call), a chunk's call returns at most budget + C rows per head (the rows retained before
/// it and its own, all a head holds during the call), and after it a head holds at most budget rows
/// and kept_bytes() is that of budget rows at most; SnapKV too. The standard cache keeps all.
TYPED_TEST(ContractTest, ChunkedPrefillHoldsAtMostBudgetPlusC) {
  using T = TypeParam;
  // (The fetching APIs: their return has the shape that counts the rows.)
  const Api apis[] = {Api::kFetch, Api::kFetchIntoQ, Api::kFetchInto, Api::kFetchQ};
  for (const Kind kind : kContractKinds) {
    if (keeps_every_row(kind.method)) continue;
    if (is_adaptive(kind)) {
      for (const Index C : {2, 3, 5}) adaptive_chunked_prefill<T>(kind, C, apis);
      continue;
    }
    for (const Index C : {2, 3, 5}) {
      const std::string ctx = std::string(kind_name(kind)) + ", chunks of " + std::to_string(C);
      Subject<T> s = make_subject<T>(kind);
      std::mt19937 rng(31u + static_cast<unsigned>(C));
      std::size_t row_bytes = 0;  // of one row of one head
      int bounded_chunks = 0;
      for (Index done = 0, i = 0; done < 60; done += C, ++i) {
        const int budget_before = s.cache->layer_budget();
        const Index kept_before = s.cache->tokens_kept();
        const Call call = random_call(rng, with_s(kKeys, C), with_s(kValues, C));
        vc::KVPair<T> into;
        const Returned r = invoke(*s.cache, apis[static_cast<std::size_t>(i) % 4], call, into);
        EXPECT_EQ(r.key_shape[2], kept_before + C) << ctx << ", chunk " << i;
        const int budget = s.cache->layer_budget();
        const bool known = budget > 0 && (budget == budget_before || kind == Method::snapkv);
        if (row_bytes == 0 && s.cache->tokens_kept() > 0) {
          row_bytes = s.cache->kept_bytes() /
                      static_cast<std::size_t>(s.cache->tokens_kept() * kKeys[0] * kKeys[1]);
        }
        if (!known) continue;
        ++bounded_chunks;
        EXPECT_LE(kept_before + C, budget + C) << ctx << ", chunk " << i;
        EXPECT_LE(s.cache->tokens_kept(), budget) << ctx << ", chunk " << i;
        EXPECT_LE(s.cache->kept_bytes(),
                  row_bytes * static_cast<std::size_t>(budget * kKeys[0] * kKeys[1]))
            << ctx << ", chunk " << i;
      }
      EXPECT_GE(bounded_chunks, 5) << ctx << ": the budget was never known";
      EXPECT_LT(s.cache->tokens_kept(), 60) << ctx << ": nothing was evicted";
    }
  }
}

/// reset() (with the coordinator's, as KVCacheBuilder::reset does) starts a new sequence: the
/// same calls then give bitwise what a new cache gives, whatever came before.
TYPED_TEST(ContractTest, ResetStartsASequenceLikeANewCache) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    for (const Api api : {Api::kFetch, Api::kViewQ}) {
      const std::string ctx = std::string(kind_name(kind)) + ", " + api_name(api);
      std::mt19937 rng(700u + kind_index(kind));
      Subject<T> used = make_subject<T>(kind);
      vc::KVPair<T> into;
      for (const Index S : sequence_sizes()) {
        (void)invoke(*used.cache, api, random_call(rng, with_s(kKeys, S), with_s(kValues, S)), into);
      }
      if (used.coordinator) used.coordinator->reset();
      used.cache->reset();
      EXPECT_EQ(used.cache->offset(), 0) << ctx;
      EXPECT_EQ(used.cache->kept_bytes(), 0u) << ctx;
      EXPECT_EQ(used.cache->tokens_seen(), 0) << ctx;
      Subject<T> fresh = make_subject<T>(kind);
      for (const Index S : sequence_sizes()) {
        const Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
        vc::KVPair<T> a, b;
        EXPECT_TRUE(invoke(*used.cache, api, call, a) == invoke(*fresh.cache, api, call, b)) << ctx;
        // The used coordinator was reset once, so its generation is one ahead; everything else
        // must match the fresh subject's.
        Snapshot u = logical_state(used);
        const Snapshot f = logical_state(fresh);
        if (used.coordinator) {
          EXPECT_EQ(u.generation, f.generation + 1) << ctx;
          u.generation = f.generation;
        }
        EXPECT_TRUE(u == f) << ctx << " (S = " << S << ")";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prompt caches on disk
// ---------------------------------------------------------------------------------------------

/// Saves `s` (docs/design.md G) and puts the loaded cache in its place, with the loaded
/// coordinator; the loaded set must save to the very bytes it was loaded from.
template <class T>
void save_and_load(Subject<T>& s, const std::string& ctx) {
  std::vector<std::unique_ptr<vc::KVCache<T>>> set;
  set.push_back(std::move(s.cache));
  std::stringstream file;
  vc::save_prompt_cache(file, set, {{"context", ctx}});
  const std::string bytes = file.str();
  vc::PromptCache<T> loaded = vc::load_prompt_cache<T>(file);
  ASSERT_EQ(loaded.caches.size(), 1u) << ctx;
  EXPECT_EQ(loaded.metadata.at("context"), ctx);
  std::stringstream again;
  vc::save_prompt_cache(again, loaded.caches, loaded.metadata);
  EXPECT_TRUE(again.str() == bytes) << ctx << ": the loaded set saves to other bytes";
  s.cache = std::move(loaded.caches.front());
  s.cache->set_parallel_heads(false);
  const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(s.cache.get());
  ASSERT_EQ(s.coordinator != nullptr, sq != nullptr && sq->coordinator() != nullptr) << ctx;
  if (s.coordinator) {
    EXPECT_NE(sq->coordinator(), s.coordinator) << ctx << ": the loaded coordinator is a new object";
    s.coordinator = sq->coordinator();
  }
}

/// Forks `s` (KVCacheBuilder::fork of its one-cache set, docs/design.md 10.1): returns the
/// source and its copy, which has a coordinator of its own when the source has one, the same
/// logical state, and no more heap than the source (the bound against the kept bytes, for rows
/// of real size: test_serving.cpp).
template <class T>
std::vector<Subject<T>> fork_of(Subject<T>& s, const std::string& ctx) {
  std::vector<std::unique_ptr<vc::KVCache<T>>> set;
  set.push_back(std::move(s.cache));
  std::vector<std::unique_ptr<vc::KVCache<T>>> copies = vc::KVCacheBuilder::fork(set);
  std::vector<Subject<T>> out(2);
  out[0].cache = std::move(set.front());
  out[0].coordinator = s.coordinator;
  out[1].cache = std::move(copies.front());
  if (s.coordinator) {
    const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(out[1].cache.get());
    EXPECT_TRUE(sq && sq->coordinator() && sq->coordinator() != s.coordinator)
        << ctx << ": the copy has no coordinator of its own";
    if (sq) out[1].coordinator = sq->coordinator();
  }
  EXPECT_TRUE(logical_state(out[1]) == logical_state(out[0])) << ctx << ": the copy differs";
  EXPECT_LE(out[1].cache->heap_bytes(), out[0].cache->heap_bytes())
      << ctx << ": the copy holds more than its source";
  return out;
}

/// Checkpoints `s` (KVCacheBuilder::checkpoint of its one-cache set, docs/design.md 10.2), makes
/// calls of other data through several APIs (a prompt chunk, an empty call, decode steps, an
/// attend of 3 tokens) and rolls back: returns it. A second rollback is refused.
template <class T>
std::vector<Subject<T>> rolled_back(Subject<T>& s, const std::string& ctx) {
  std::vector<std::unique_ptr<vc::KVCache<T>>> set;
  set.push_back(std::move(s.cache));
  vc::KVCacheBuilder::checkpoint(set);
  std::mt19937 rng(77u);
  const Api apis[] = {Api::kFetchQ, Api::kView, Api::kFetchInto, Api::kViewQ};
  const Index sizes[] = {7, 0, 1, 1};
  for (std::size_t i = 0; i < 4; ++i) {
    const Call c = random_call(rng, with_s(kKeys, sizes[i]), with_s(kValues, sizes[i]));
    vc::KVPair<T> into;
    (void)invoke(*set.front(), apis[i], c, into);
  }
  const Call c = random_call(rng, with_s(kKeys, 3), with_s(kValues, 3));
  (void)set.front()->attend(converted<float>(c.queries), converted<T>(c.keys),
                            converted<T>(c.values));
  vc::KVCacheBuilder::rollback(set);
  EXPECT_THROW(vc::KVCacheBuilder::rollback(set), std::logic_error) << ctx;
  s.cache = std::move(set.front());
  std::vector<Subject<T>> out;
  out.push_back(std::move(s));
  return out;
}

/// Saves `s` and loads it back: returns the loaded cache (save_and_load).
template <class T>
std::vector<Subject<T>> saved_and_loaded(Subject<T>& s, const std::string& ctx) {
  save_and_load(s, ctx);
  std::vector<Subject<T>> out;
  out.push_back(std::move(s));
  return out;
}

/// A subject turned, after any call of the sequence, into the caches `make` gives (a loaded copy;
/// a fork and its source) continues bitwise as its twin that never was: every one of them makes
/// the same calls, in turn, and gives the same returns and attention outputs, with everything
/// observable equal after every call, through every API. (With a source and its fork, either one
/// changing the other would show at the next comparison.)
template <class T, class Make>
void continues_like_its_twin(const Make& make, const char* what) {
  const Api apis[] = {Api::kFetch, Api::kViewQ, Api::kFetchInto, Api::kView, Api::kFetchQ,
                      Api::kFetchIntoDoubleQ, Api::kViewDouble};
  const std::vector<Index>& sizes = sequence_sizes();
  for (const Kind kind : kContractKinds) {
    for (std::size_t at = 0; at <= sizes.size(); ++at) {
      const std::string ctx =
          std::string(kind_name(kind)) + ", " + what + " before call " + std::to_string(at);
      std::mt19937 rng(900u + kind_index(kind));
      Subject<T> twin = make_subject<T>(kind);
      std::vector<Subject<T>> subjects;
      subjects.push_back(make_subject<T>(kind));
      for (std::size_t i = 0; i <= sizes.size(); ++i) {
        if (i == at) {
          subjects = make(subjects.front(), ctx);
          for (Subject<T>& s : subjects) {
            EXPECT_TRUE(logical_state(s) == logical_state(twin)) << ctx << ": state after it";
          }
          // An empty call's view first (a quantized cache's goes through its row buffer).
          const vc::Tensor4<T> k0(kKeys[0], kKeys[1], 0, kKeys[3]), v0(kValues[0], kValues[1], 0, kValues[3]);
          const Returned want = from_view(twin.cache->update_and_view(k0, v0));
          for (Subject<T>& s : subjects) {
            EXPECT_TRUE(from_view(s.cache->update_and_view(k0, v0)) == want)
                << ctx << ": an empty view after it";
          }
        }
        if (i == sizes.size()) break;
        const Call call = random_call(rng, with_s(kKeys, sizes[i]), with_s(kValues, sizes[i]));
        const std::string where = ctx + ", call " + std::to_string(i);
        if (i % 4 == 2) {
          // attend: the fused attention output too (docs/design.md 2.8).
          const vc::Tensor4<T> k = converted<T>(call.keys), v = converted<T>(call.values);
          const vc::Tensor4<float> q = converted<float>(call.queries);
          const std::vector<unsigned char> want = bytes_of(twin.cache->attend(q, k, v));
          for (Subject<T>& s : subjects) {
            EXPECT_EQ(bytes_of(s.cache->attend(q, k, v)), want) << where << ": attend";
          }
        } else {
          const Api api = apis[i % (sizeof(apis) / sizeof(apis[0]))];
          vc::KVPair<T> a, b;
          const Returned want = invoke(*twin.cache, api, call, b);
          for (Subject<T>& s : subjects) {
            EXPECT_TRUE(invoke(*s.cache, api, call, a) == want)
                << where << ": " << api_name(api) << " returned other rows";
          }
        }
        for (Subject<T>& s : subjects) {
          EXPECT_TRUE(logical_state(s) == logical_state(twin)) << where << ": state differs";
        }
      }
    }
  }
}

/// A cache saved and loaded after any call (docs/design.md G) continues bitwise as its twin.
TYPED_TEST(ContractTest, SavedAndLoadedAfterAnyCallContinuesBitIdentically) {
  continues_like_its_twin<TypeParam>(
      [](Subject<TypeParam>& s, const std::string& ctx) { return saved_and_loaded(s, ctx); },
      "saved");
}

/// A cache checkpointed after any call, then driven through calls of every kind and rolled back
/// (KVCacheBuilder::checkpoint / rollback), continues bitwise as its twin that made none of them.
TYPED_TEST(ContractTest, RolledBackAfterAnyCallContinuesBitIdentically) {
  continues_like_its_twin<TypeParam>(
      [](Subject<TypeParam>& s, const std::string& ctx) { return rolled_back(s, ctx); },
      "rolled back");
}

/// A cache forked after any call (KVCacheBuilder::fork) and its source both continue bitwise as
/// their twin, each unchanged by the other's calls.
TYPED_TEST(ContractTest, ForkedAfterAnyCallBothContinueBitIdentically) {
  continues_like_its_twin<TypeParam>(
      [](Subject<TypeParam>& s, const std::string& ctx) { return fork_of(s, ctx); }, "forked");
}

/// Only the standard cache is trimmable; on every other policy trim() removes nothing and
/// changes nothing (a negative count is an error everywhere: test_bad_inputs.cpp).
TYPED_TEST(ContractTest, OnlyTheStandardCacheTrims) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(800u);
    Subject<T> s = make_subject<T>(kind);
    vc::KVPair<T> into;
    (void)invoke(*s.cache, Api::kFetch, random_call(rng, with_s(kKeys, 9), with_s(kValues, 9)), into);
    const Snapshot before = snapshot(s);
    if (kind == Method::standard) {
      EXPECT_TRUE(s.cache->is_trimmable());
      EXPECT_EQ(s.cache->trim(4), 4);
      EXPECT_EQ(s.cache->offset(), 5);
      EXPECT_EQ(s.cache->tokens_kept(), 5);
      EXPECT_EQ(s.cache->trim(100), 5);
      EXPECT_EQ(s.cache->offset(), 0);
    } else {
      EXPECT_FALSE(s.cache->is_trimmable());
      EXPECT_EQ(s.cache->trim(3), 0);
      EXPECT_TRUE(snapshot(s) == before);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Non-finite keys: every position class, every policy, every API
// ---------------------------------------------------------------------------------------------

/// Flat positions of a call of `n` elements to put a bad key at, one per class the finiteness
/// scan tells apart (detail/checks.hpp all_finite reads 8-byte words: 4 half or bfloat16, 2 float
/// or 1 double elements): every lane of the first word, an interior element, and the last four
/// (every lane of the last full word, and the tail of a call whose size is not a multiple of 4).
std::vector<Index> position_classes(Index n) {
  std::vector<Index> out = {0, 1, 2, 3, n / 2 + 1};
  for (Index i = std::max<Index>(4, n - 4); i < n; ++i) out.push_back(i);
  return out;
}

/// [b, h, s, d] of flat element i of a tensor of shape `sh`.
Shape index_of(Index i, const Shape& sh) {
  return {i / (sh[1] * sh[2] * sh[3]), (i / (sh[2] * sh[3])) % sh[1], (i / sh[3]) % sh[2],
          i % sh[3]};
}

/// `call` with `bad` at flat key element i through `api` must throw std::invalid_argument naming
/// that [b, h, s, d] and change nothing observable, nor the caller's fetch_into output. Returns
/// the first problem, or "".
template <class T>
std::string rejects_bad_key(Subject<T>& s, Api api, Call call, Index i, double bad) {
  const Shape at = index_of(i, shape_of(call.keys));
  call.keys.data()[i] = bad;
  const Snapshot before = snapshot(s);
  vc::KVPair<T> into = earlier_output(*s.cache);
  const std::vector<unsigned char> into_keys = bytes_of(into.first);
  std::ostringstream where;
  where << api_name(api) << ", key " << bad << " at [" << at[0] << "," << at[1] << "," << at[2]
        << "," << at[3] << "]";
  try {
    (void)invoke(*s.cache, api, call, into);
    return where.str() + ": did not throw";
  } catch (const std::invalid_argument& e) {
    if (named_index(e.what()) != std::optional<Shape>(at)) {
      return where.str() + ": message " + e.what();
    }
  }
  if (!(snapshot(s) == before)) return where.str() + ": the cache changed";
  if (bytes_of(into.first) != into_keys) return where.str() + ": the fetch_into output changed";
  return "";
}

/// Every position class of a bad key (NaN, +Inf, -Inf), in calls of whole words and calls with a
/// tail, through the dense scan of keys stored as T (update_and_fetch) and the row-by-row
/// conversion of double keys (update_and_fetch(double)), on a fresh cache and an established one;
/// the check is the same function for every policy (the next test sweeps the policies).
TYPED_TEST(ContractTest, NonFiniteKeyAtEveryPositionClassIsRejected) {
  using T = TypeParam;
  std::mt19937 rng(1234u);
  int checked = 0;
  for (const bool established : {false, true}) {
    Subject<T> subject = make_subject<T>(Method::h2o);
    Subject<T> twin = make_subject<T>(Method::h2o);
    if (established) establish(subject, twin, rng, "h2o");
    // A call of the established shape; on a fresh cache also one whose size leaves a tail.
    std::vector<Shape> shapes = {kKeys};
    if (!established) shapes.push_back(Shape{1, 1, 3, dim(5)});
    for (const Shape& keys : shapes) {
      const Call call = random_call(rng, keys, {keys[0], keys[1], keys[2], kValues[3]});
      for (const Index i : position_classes(call.keys.size())) {
        for (const double bad : {kNaN, kInf, -kInf}) {
          for (const Api api : {Api::kFetch, Api::kFetchDouble}) {
            EXPECT_EQ(rejects_bad_key(subject, api, call, i, bad), "")
                << (established ? "established" : "first call");
            ++checked;
          }
        }
      }
    }
    // The valid calls then go on as on the twin.
    for (const Api api : {Api::kFetch, Api::kViewQ}) {
      valid_call_on_both(subject, twin, rng, 2, api, "after the bad calls");
    }
  }
  EXPECT_GT(checked, 100);
}

/// Every policy x every API, on a fresh cache and on one past its budget: a bad key at the last
/// element (where a scan that stops one short would miss it) and at the first, as NaN and +Inf,
/// is rejected naming it, nothing changes (the coordinator records nothing), the repaired call
/// then goes through as on a twin that never saw the bad calls, and so do the next calls.
TYPED_TEST(ContractTest, NonFiniteKeyEveryPolicyEveryApi) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    std::mt19937 rng(1234u + kind_index(kind));
    for (const bool established : {false, true}) {
      const std::string ctx =
          std::string(kind_name(kind)) + (established ? " (established)" : " (first call)");
      Subject<T> subject = make_subject<T>(kind);
      Subject<T> twin = make_subject<T>(kind);
      if (established) establish(subject, twin, rng, ctx);
      const Call call = random_call(rng, kKeys, kValues);
      const Index last = call.keys.size() - 1;
      for (const Api api : kApis) {
        EXPECT_EQ(rejects_bad_key(subject, api, call, last, kNaN), "") << ctx;
        EXPECT_EQ(rejects_bad_key(subject, api, call, 0, kInf), "") << ctx;
      }
      vc::KVPair<T> a_out, b_out;
      EXPECT_TRUE(invoke(*subject.cache, Api::kFetch, call, a_out) ==
                  invoke(*twin.cache, Api::kFetch, call, b_out))
          << ctx << ": the repaired call differs from the twin's";
      EXPECT_TRUE(snapshot(subject) == snapshot(twin)) << ctx;
      for (const Api api : kApis) valid_call_on_both(subject, twin, rng, 1, api, ctx + ": next");
      valid_call_on_both(subject, twin, rng, 4, Api::kViewQ, ctx + ": next multi-token call");
    }
  }
}

/// A finite double key that overflows the storage type becomes infinite on conversion: rejected
/// as non-finite by every policy through both converting overloads, nothing changed.
TYPED_TEST(ContractTest, DoubleKeyOverflowingTheStorageTypeOnEveryPolicy) {
  using T = TypeParam;
  const double huge = std::is_same_v<T, Eigen::half> ? 65520.0 : 3.5e38;  // just past T's max
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(77u);
    Subject<T> subject = make_subject<T>(kind);
    Subject<T> twin = make_subject<T>(kind);
    establish(subject, twin, rng, kind_name(kind));
    const Snapshot before = snapshot(subject);
    Call call = random_call(rng, kKeys, kValues);
    call.keys(1, 1, 2, 3) = huge;
    call.keys(0, 1, 0, 2) = -huge;
    for (const Api api : {Api::kFetchDouble, Api::kViewDouble, Api::kFetchIntoDoubleQ}) {
      vc::KVPair<T> into;
      const std::string what =
          invalid_argument_message([&] { (void)invoke(*subject.cache, api, call, into); });
      EXPECT_EQ(named_index(what), std::optional<Shape>(Shape{0, 1, 0, 2}))
          << api_name(api) << ": " << what;
      EXPECT_TRUE(snapshot(subject) == before) << api_name(api);
    }
    // The largest key a call may hold is accepted: half's largest finite value, 2^48 in float
    // and bfloat16 (docs/robustness.md, "Magnitudes"); quantized keys hold up to the half range
    // (in bfloat16: its largest value below 65504).
    const double largest_quantized = std::is_same_v<T, Eigen::bfloat16> ? 65280.0 : 65504.0;
    call.keys(1, 1, 2, 3) = kKeyBits < 16                    ? largest_quantized
                            : std::is_same_v<T, Eigen::half> ? 65504.0
                                                             : 0x1p48;
    call.keys(0, 1, 0, 2) = 1.0;
    vc::KVPair<T> a_out, b_out;
    EXPECT_TRUE(invoke(*subject.cache, Api::kFetchDouble, call, a_out) ==
                invoke(*twin.cache, Api::kFetchDouble, call, b_out));
    EXPECT_TRUE(snapshot(subject) == snapshot(twin));
  }
}

// ---------------------------------------------------------------------------------------------
// Mismatched shapes and shape changes between calls, every policy, every API
// ---------------------------------------------------------------------------------------------

struct ShapeCase {
  std::string name;
  Shape keys, values;
  bool needs_established;
};

std::vector<ShapeCase> shape_cases() {
  return {
      {"values B differs", kKeys, {1, 2, 3, dim(3)}, false},
      {"values H differs", kKeys, {2, 3, 3, dim(3)}, false},
      {"values S differs", kKeys, {2, 2, 4, dim(3)}, false},
      {"keys S differs", {2, 2, 1, dim(4)}, kValues, false},
      {"zero key D", {2, 2, 3, 0}, kValues, false},
      {"zero value D", kKeys, {2, 2, 3, 0}, false},
      {"zero B", {0, 2, 3, dim(4)}, {0, 2, 3, dim(3)}, false},
      {"zero H", {2, 0, 3, dim(4)}, {2, 0, 3, dim(3)}, false},
      {"zero B and S", {0, 2, 0, dim(4)}, {0, 2, 0, dim(3)}, false},
      {"B changes", {3, 2, 1, dim(4)}, {3, 2, 1, dim(3)}, true},
      {"H changes", {2, 1, 1, dim(4)}, {2, 1, 1, dim(3)}, true},
      {"key D changes", {2, 2, 1, 8}, {2, 2, 1, dim(3)}, true},
      {"value D changes", {2, 2, 1, dim(4)}, {2, 2, 1, dim(1)}, true},
      {"key and value D swap", {2, 2, 1, dim(3)}, {2, 2, 1, dim(4)}, true},
      {"empty call with another D", {2, 2, 0, dim(5)}, {2, 2, 0, dim(3)}, true},
      {"empty call with another B", {1, 2, 0, dim(4)}, {1, 2, 0, dim(3)}, true},
  };
}

/// Every shape error through every API on every policy: std::invalid_argument whose message
/// names the API and both shapes; nothing changes; the next valid calls equal the twin's.
TYPED_TEST(ContractTest, ShapeErrorsEveryPolicyEveryApi) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    for (const bool established : {false, true}) {
      const std::string ctx =
          std::string(kind_name(kind)) + (established ? " (established)" : " (first call)");
      std::mt19937 rng(31u + kind_index(kind));
      Subject<T> subject = make_subject<T>(kind);
      Subject<T> twin = make_subject<T>(kind);
      if (established) establish(subject, twin, rng, ctx);
      const Snapshot before = snapshot(subject);
      for (const ShapeCase& sc : shape_cases()) {
        if (sc.needs_established && !established) continue;
        const Call call = random_call(rng, sc.keys, sc.values);
        const std::regex keys_shape = shape_regex(sc.keys), values_shape = shape_regex(sc.values);
        for (const Api api : kApis) {
          vc::KVPair<T> into;
          const std::string what =
              invalid_argument_message([&] { (void)invoke(*subject.cache, api, call, into); });
          const std::string where = ctx + ", " + sc.name + ", " + api_name(api);
          EXPECT_TRUE(std::regex_search(what, keys_shape)) << where << ": " << what;
          EXPECT_TRUE(std::regex_search(what, values_shape)) << where << ": " << what;
          const std::string full_api = api_name(api);
          const std::string short_api = full_api.substr(0, full_api.find('('));
          EXPECT_TRUE(contains(what, short_api))
              << where << ": message does not name the API: " << what;
          EXPECT_TRUE(snapshot(subject) == before) << where << ": the cache changed";
          EXPECT_EQ(into.first.size(), 0) << where << ": fetch_into output was touched";
        }
      }
      for (const Api api : kApis) valid_call_on_both(subject, twin, rng, 2, api, ctx + ": next");
    }
  }
}

/// After reset() a cache may take new B, H and D (docs/design.md 2.2: the next call starts a new
/// sequence); the old shape is then the wrong one.
TYPED_TEST(ContractTest, ResetAllowsNewShapesAndThenRejectsTheOldOnes) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(5u);
    Subject<T> s = make_subject<T>(kind);
    vc::KVPair<T> into;
    (void)invoke(*s.cache, Api::kFetch, random_call(rng, kKeys, kValues), into);
    if (s.coordinator) s.coordinator->reset();
    s.cache->reset();
    const Shape k2{1, 3, 2, dim(5)}, v2{1, 3, 2, dim(2)};
    const Returned r = invoke(*s.cache, Api::kFetch, random_call(rng, k2, v2), into);
    EXPECT_EQ(r.key_shape, k2);
    EXPECT_EQ(r.value_shape, v2);
    EXPECT_EQ(s.cache->offset(), 2);
    const Snapshot before = snapshot(s);
    const Call old = random_call(rng, with_s(kKeys, 1), with_s(kValues, 1));
    const std::string what =
        invalid_argument_message([&] { (void)invoke(*s.cache, Api::kView, old, into); });
    EXPECT_TRUE(contains(what, "first call")) << what;
    EXPECT_TRUE(snapshot(s) == before);
  }
}

/// Two bad keys in one call: the message names the first in row-major order ([b, h, s, d]).
TYPED_TEST(ContractTest, TheFirstOfSeveralBadKeysIsNamed) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(41u);
    Subject<T> s = make_subject<T>(kind);
    Call call = random_call(rng, kKeys, kValues);
    call.keys(1, 1, 0, 1) = kInf;
    call.keys(1, 0, 2, 3) = kNaN;
    const Snapshot before = snapshot(s);
    for (const Api api : kApis) {
      vc::KVPair<T> into;
      const std::string what =
          invalid_argument_message([&] { (void)invoke(*s.cache, api, call, into); });
      EXPECT_EQ(named_index(what), std::optional<Shape>(Shape{1, 0, 2, 3}))
          << api_name(api) << ": " << what;
      EXPECT_TRUE(snapshot(s) == before) << api_name(api);
    }
  }
}

/// Values are not inspected for finiteness (docs/design.md 8): NaN and infinite values are
/// stored and returned as given, by every policy, through fetch and view.
TYPED_TEST(ContractTest, NonFiniteValuesAreAccepted) {
  using T = TypeParam;
  if (kValueBits < 16) {
    GTEST_SKIP() << "quantized values are inspected (test_quant.cpp: QuantizedRowsRejectWhatA"
                    "GroupCannotHold)";
  }
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(5u);
    Subject<T> s = make_subject<T>(kind);
    Call call = random_call(rng, kKeys, kValues);
    call.values(1, 0, 2, 1) = kNaN;
    call.values(0, 1, 0, 0) = kInf;
    vc::KVPair<T> out;
    ASSERT_NO_THROW(out = s.cache->update_and_fetch(call.keys, call.values));
    EXPECT_EQ(s.cache->offset(), 3);
    ASSERT_EQ(out.second.dimension(2), 3);
    EXPECT_TRUE((Eigen::numext::isnan)(out.second(1, 0, 2, 1)));
    EXPECT_TRUE((Eigen::numext::isinf)(out.second(0, 1, 0, 0)));
    call = random_call(rng, with_s(kKeys, 1), with_s(kValues, 1));
    call.values(0, 0, 0, 2) = kNaN;
    ASSERT_NO_THROW(s.cache->update_and_view(call.keys, call.values));
    EXPECT_EQ(s.cache->offset(), 4);
    EXPECT_EQ(s.cache->tokens_seen(), 16);
  }
}

/// A double that fits the storage type is accepted (only the converted value is checked), and
/// stored as its conversion to T.
TYPED_TEST(ContractTest, LargeFiniteDoubleKeysThatFitTheStorageTypeAreAccepted) {
  using T = TypeParam;
  if (kKeyBits < 16) {
    GTEST_SKIP() << "quantized keys hold +-65504 at most (test_quant.cpp: QuantizedRowsRejectWhat"
                    "AGroupCannotHold)";
  }
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(6u);
    Subject<T> s = make_subject<T>(kind);
    Call call = random_call(rng, with_s(kKeys, 2), with_s(kValues, 2));
    call.keys(0, 0, 1, 1) = std::is_same_v<T, Eigen::half> ? 60000.0 : 1e6;
    const vc::KVPair<T> out = s.cache->update_and_fetch(call.keys, call.values);
    EXPECT_EQ(static_cast<float>(out.first(0, 0, 1, 1)),
              static_cast<float>(static_cast<T>(call.keys(0, 0, 1, 1))));
  }
}

// ---------------------------------------------------------------------------------------------
// Moved from the per-policy files (test_tova_cache.cpp, test_streaming_llm_cache.cpp,
// test_kv_cache.cpp): their trim and bad-input checks, swept over every policy
// ---------------------------------------------------------------------------------------------

/// No eviction cache is trimmable, before its first call or after it: trim() of 2, 3 or 100
/// returns 0 and changes nothing observable (offset, positions, scores, state), a negative count
/// throws std::invalid_argument and changes nothing, and the next token continues at the old
/// offset (StreamingLLM: the window is still the sinks and the last rows).
TYPED_TEST(ContractTest, EvictionCachesTrimNothingBeforeOrAfterACall) {
  using T = TypeParam;
  for (const Kind kind : kContractKinds) {
    if (kind == Method::standard) continue;
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(810u);
    Subject<T> s = make_subject<T>(kind);
    EXPECT_FALSE(s.cache->is_trimmable());
    EXPECT_EQ(s.cache->trim(2), 0);
    EXPECT_EQ(s.cache->offset(), 0);
    vc::KVPair<T> into;
    (void)invoke(*s.cache, Api::kFetch, random_call(rng, with_s(kKeys, 9), with_s(kValues, 9)), into);
    EXPECT_FALSE(s.cache->is_trimmable());
    // (The positions first: over quantized rows the first view sizes the view's buffer.)
    const auto held_before = held_positions(*s.cache);
    const Snapshot before = snapshot(s);
    EXPECT_EQ(s.cache->trim(3), 0);
    EXPECT_EQ(s.cache->trim(100), 0);
    EXPECT_THROW(s.cache->trim(-1), std::invalid_argument);
    EXPECT_EQ(s.cache->offset(), 9);
    EXPECT_TRUE(snapshot(s) == before);
    EXPECT_EQ(held_positions(*s.cache), held_before);
    if (kind == Method::streaming_llm) {
      // One sink and the last window of 5.
      for (const auto& p : held_before) EXPECT_EQ(p, (std::vector<std::int64_t>{0, 4, 5, 6, 7, 8}));
    }
    // The next token continues at position 9.
    const Call next = random_call(rng, with_s(kKeys, 1), with_s(kValues, 1));
    const vc::KVView<T> view = s.cache->update_and_view(next.keys, next.values);
    if (is_adaptive(kind)) {
      // Heads may differ (SPEC 14): each holds its rows and the new one, at position 9, last.
      for (Index b = 0; b < view.batch(); ++b) {
        for (Index h = 0; h < view.heads(); ++h) {
          const std::size_t held =
              held_before[static_cast<std::size_t>(b * view.heads() + h)].size();
          ASSERT_EQ(view.rows(b, h), static_cast<Index>(held) + 1);
          EXPECT_EQ(view.positions(b, h)(view.rows(b, h) - 1), 9);
        }
      }
      continue;
    }
    ASSERT_EQ(view.rows(), before.tokens_kept + 1);
    for (Index b = 0; b < view.batch(); ++b)
      for (Index h = 0; h < view.heads(); ++h) EXPECT_EQ(view.positions(b, h)(view.rows() - 1), 9);
  }
}

/// The shared list of bad calls of test_support.hpp (bad_calls: mismatched shapes, zero sizes,
/// shapes that differ from the first call, an empty call with another H, NaN/Inf keys at several
/// positions as T and as double, a double key overflowing T: 1e6 for half, 1e300 otherwise),
/// through update_and_fetch and update_and_view, on every policy (and StreamingLLM with 2 sinks
/// and a window of 4), on a fresh cache and one past its budget: std::invalid_argument naming the
/// bad [b, h, s, d] or both shapes, nothing observable changed (compression_ratio too), and the
/// next fetch, view and decode give what an untouched twin gives.
TYPED_TEST(ContractTest, TheSharedBadCallListThrowsAndChangesNothingOnEveryPolicy) {
  using T = TypeParam;
  std::vector<std::pair<Kind, vc::KVCacheConfig>> variants;
  for (const Kind kind : kContractKinds) variants.emplace_back(kind, small_config());
  {
    vc::KVCacheConfig c = small_config();
    c.stream_n_sink = 2;
    c.stream_window_size = 4;
    variants.emplace_back(Method::streaming_llm, c);
  }
  const std::regex idx(R"(b\s*=\s*(\d+)\D*?h\s*=\s*(\d+)\D*?s\s*=\s*(\d+)\D*?d\s*=\s*(\d+))");
  for (const auto& [kind, config] : variants) {
    std::mt19937 rng(77u + kind_index(kind));
    const std::vector<BadCall> cases = bad_calls(rng, std::is_same_v<T, Eigen::half>);
    int thrown = 0, expected = 0;
    for (const bool established : {false, true}) {
      for (const BadCall& bc : cases) {
        if (bc.needs_established && !established) continue;
        const std::string ctx = std::string(kind_name(kind)) + " (" +
                                std::to_string(config.stream_n_sink) + " sinks), " + bc.name +
                                (established ? " (after decoding)" : " (first call)");
        Subject<T> subject = make_subject<T>(kind, config);
        Subject<T> twin = make_subject<T>(kind, config);
        if (established) {
          establish(subject, twin, rng, ctx);
          const Index snap = snap_rows(snap_rows(snap_rows(snap_rows(0, 9), 1), 1), 1);
          if (is_adaptive(kind)) {
            // The heads share their rows: each sequence holds H x what a uniform head would.
            std::size_t held = 0;
            for (const std::size_t n : core_head_rows(*subject.cache)) held += n;
            ASSERT_EQ(static_cast<Index>(held),
                      kKeys[0] * kKeys[1] * expected_rows(base_kind(kind), 12, 4))
                << ctx;
          } else {
            ASSERT_EQ(subject.cache->tokens_kept(),
                      kind == Method::snapkv ? snap : expected_rows(kind, 12, 4))
                << ctx;
          }
        }
        const Snapshot before = snapshot(subject);
        const double ratio_before = subject.cache->compression_ratio();
        for (const bool view : {false, true}) {
          const std::string name = ctx + (view ? " via update_and_view" : " via update_and_fetch");
          ++expected;
          try {
            feed(*subject.cache, bc, view);
            ADD_FAILURE() << name << ": did not throw";
          } catch (const std::invalid_argument& e) {
            ++thrown;
            const std::string what = e.what();
            if (bc.bad_index) {
              std::smatch m;
              if (std::regex_search(what, m, idx)) {
                const Shape got{std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3]),
                                std::stoll(m[4])};
                EXPECT_EQ(got, *bc.bad_index) << name << ": " << what;
              } else {
                ADD_FAILURE() << name << ": no index in: " << what;
              }
            } else {
              EXPECT_TRUE(std::regex_search(what, shape_regex(shape_of(bc.keys))))
                  << name << ": message lacks the keys shape: " << what;
              EXPECT_TRUE(std::regex_search(what, shape_regex(shape_of(bc.values))))
                  << name << ": message lacks the values shape: " << what;
            }
          } catch (const std::exception& e) {
            ADD_FAILURE() << name << ": threw something else: " << e.what();
          }
          EXPECT_TRUE(snapshot(subject) == before) << name << ": the cache changed";
          const double ratio_after = subject.cache->compression_ratio();
          EXPECT_EQ(std::memcmp(&ratio_after, &ratio_before, sizeof(double)), 0)
              << name << ": compression_ratio changed";
        }
        valid_call_on_both(subject, twin, rng, established ? 1 : 8, Api::kFetch, ctx + ": next fetch");
        valid_call_on_both(subject, twin, rng, 2, Api::kView, ctx + ": next view");
        valid_call_on_both(subject, twin, rng, 1, Api::kFetch, ctx + ": next decode");
      }
    }
    EXPECT_EQ(thrown, expected) << kind_name(kind);
    EXPECT_GT(expected, 40) << kind_name(kind);
  }
}

// ---------------------------------------------------------------------------------------------
// Moved from test_queries.cpp: the contract for calls with queries, swept over every policy
// ---------------------------------------------------------------------------------------------

/// Calls [2, 2, 3, 4] / [2, 2, 3, 3] with queries [2, 4, 3, 4] (G = 2). Every bad query tensor of
/// bad_query_variants (subjects.hpp), through each entry point with queries, on an established
/// cache (past its budget: evicting / compressed / reported) and on a fresh one (keys and values
/// as T and as double): std::invalid_argument naming the queries, nothing observable changed, the
/// fetch_into output untouched; the fresh cache then takes a call of another shape as its first
/// call. An empty call is validated too (Hq = 3; S = 1). Afterwards the established cache
/// continues exactly as a twin that never saw a bad call.
TYPED_TEST(ContractTest, BadQueriesThrowAndLeaveTheCacheUnchanged) {
  using T = TypeParam;
  const Index B = 2, H = 2, S = 3, D = dim(4), Dv = dim(3), G = 2;
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(31u + kind_index(kind));
    Subject<T> established = make_subject<T>(kind), twin = make_subject<T>(kind);
    establish(established, twin, rng, kind_name(kind));
    const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, S, D);
    const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, Dv);
    const vc::Tensor4<float> q = random_queries(rng, B, G * H, S, D);
    const std::vector<BadQueries> bad = bad_query_variants(q, H, rng);
    ASSERT_GE(bad.size(), 17u);
    for (const BadQueries& bq : bad) {
      for (const Api api : kQueryApis) {
        EXPECT_EQ(bad_queries_rejected(established, api, k, v, bq), "");
        // A fresh cache: nothing latched (B, H, D, offset, concentration, report, compression).
        Subject<T> fresh = make_subject<T>(kind);
        EXPECT_EQ(bad_queries_rejected(fresh, api, k, v, bq), "");
        // Keys and values as double, through the converting overload: same checks.
        const vc::Tensor4<double> kd = k.template cast<double>();
        const vc::Tensor4<double> vd = v.template cast<double>();
        EXPECT_EQ(bad_queries_rejected(fresh, api, kd, vd, bq), "");
        // The fresh cache then takes a call of another shape as its first call.
        const vc::Tensor4<T> k1 = random_tensor<T>(rng, 1, 3, 2, dim(5));
        const vc::Tensor4<T> v1 = random_tensor<T>(rng, 1, 3, 2, dim(2));
        vc::KVPair<T> o;
        EXPECT_NO_THROW((void)invoke_with(*fresh.cache, api, k1, v1, random_queries(rng, 1, 3, 2, dim(5)), o))
            << bq.name;
        EXPECT_EQ(fresh.cache->offset(), 2);
        EXPECT_EQ(fresh.cache->heads(), 3);
      }
    }
    // An empty call is validated too.
    for (const Api api : kQueryApis) {
      const vc::Tensor4<T> k0(B, H, 0, D), v0(B, H, 0, Dv);
      BadQueries hq;
      hq.name = "empty call, queries Hq = 3";
      hq.f = vc::Tensor4<float>(B, 3, 0, D);
      EXPECT_EQ(bad_queries_rejected(established, api, k0, v0, hq), "");
      BadQueries s1;
      s1.name = "empty call, queries S = 1";
      s1.f = random_queries(rng, B, G * H, 1, D);
      EXPECT_EQ(bad_queries_rejected(established, api, k0, v0, s1), "");
    }
    // The established cache continues exactly as its twin.
    for (const Api api : kApis) valid_call_on_both(established, twin, rng, 3, api, "after the bad queries");
  }
}

/// Empty calls (S = 0) with queries: valid ones return nothing, change nothing and latch nothing,
/// even as a fresh cache's first call; the next call may then have any shape (here B = 1, H = 3,
/// D = 6, G = 2); an empty call (G = 3) then returns the retained set and changes nothing.
TYPED_TEST(ContractTest, EmptyCallsWithQueriesChangeNothing) {
  using T = TypeParam;
  std::mt19937 rng(21);
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    Subject<T> subject = make_subject<T>(kind);
    for (const Api api : kQueryApis) {
      const Snapshot before = snapshot(subject);
      vc::KVPair<T> out;
      const Returned o = invoke_with(*subject.cache, api, vc::Tensor4<T>(2, 2, 0, dim(4)),
                                     vc::Tensor4<T>(2, 2, 0, dim(3)), vc::Tensor4<float>(2, 4, 0, dim(4)), out);
      EXPECT_EQ(o.key_shape[2], 0) << api_name(api);
      EXPECT_TRUE(o.view_rows.empty() && o.view_tail.empty()) << api_name(api);
      EXPECT_TRUE(snapshot(subject) == before) << api_name(api);
    }
    // First real call with another B, H and D; then an empty call returns the retained set.
    const vc::Tensor4<T> k = random_tensor<T>(rng, 1, 3, 5, dim(6));
    const vc::Tensor4<T> v = random_tensor<T>(rng, 1, 3, 5, dim(2));
    vc::KVPair<T> out;
    (void)invoke_with(*subject.cache, Api::kFetchQ, k, v, random_queries(rng, 1, 6, 5, dim(6)), out);
    EXPECT_EQ(subject.cache->offset(), 5);
    const Snapshot before = snapshot(subject);
    const Returned o = invoke_with(*subject.cache, Api::kFetchQ, vc::Tensor4<T>(1, 3, 0, dim(6)),
                                   vc::Tensor4<T>(1, 3, 0, dim(2)), vc::Tensor4<float>(1, 9, 0, dim(6)), out);
    EXPECT_EQ(o.keys, before.keys);
    EXPECT_EQ(o.values, before.values);
    EXPECT_TRUE(snapshot(subject) == before);
  }
}

/// Key and value errors are reported before query errors: with bad queries (Hq not a multiple of
/// H) too, the message is the key/value one (a NaN key: names the key and its [b, h, s, d]; values
/// whose S differs from the keys'), never the queries; nothing changes.
TYPED_TEST(ContractTest, KeyAndValueErrorsComeBeforeQueryErrors) {
  using T = TypeParam;
  std::mt19937 rng(8);
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    Subject<T> subject = make_subject<T>(kind);
    vc::Tensor4<T> k = random_tensor<T>(rng, 2, 2, 3, dim(4));
    k(1, 0, 2, 3) = T(std::numeric_limits<float>::quiet_NaN());
    const vc::Tensor4<T> v = random_tensor<T>(rng, 2, 2, 3, dim(3));
    const vc::Tensor4<T> v_bad = random_tensor<T>(rng, 2, 2, 2, dim(3));  // S differs from the keys'
    const vc::Tensor4<T> k_ok = random_tensor<T>(rng, 2, 2, 3, dim(4));
    const vc::Tensor4<float> q_bad_heads = random_queries(rng, 2, 3, 3, dim(4));  // Hq not a multiple of H
    for (const Api api : kQueryApis) {
      const Snapshot before = snapshot(subject);
      vc::KVPair<T> out;
      const std::string m1 = invalid_argument_message(
          [&] { (void)invoke_with(*subject.cache, api, k, v, q_bad_heads, out); });
      EXPECT_TRUE(contains(m1, "key")) << m1;
      EXPECT_FALSE(contains(m1, "quer")) << m1;
      EXPECT_EQ(named_index(m1), std::optional<Shape>(Shape{1, 0, 2, 3})) << m1;
      const std::string m2 = invalid_argument_message(
          [&] { (void)invoke_with(*subject.cache, api, k_ok, v_bad, q_bad_heads, out); });
      EXPECT_FALSE(m2.empty());
      EXPECT_FALSE(contains(m2, "quer")) << m2;
      EXPECT_TRUE(snapshot(subject) == before) << api_name(api);
    }
  }
}

/// A non-finite query in the LAST element of a 130-token call on an established cache (all earlier
/// tokens valid; the call would evict) changes nothing; the same call with finite queries then
/// gives what it gives on a twin that never saw the bad call (the differential runs of
/// test_queries.cpp check such calls against the oracles).
TYPED_TEST(ContractTest, NonFiniteQueryInTheLastTokenOfALongCallChangesNothing) {
  using T = TypeParam;
  const Index S = 130, G = 2;
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    std::mt19937 rng(12u + kind_index(kind));
    Subject<T> subject = make_subject<T>(kind), twin = make_subject<T>(kind);
    establish(subject, twin, rng, kind_name(kind));
    const Call call = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
    const vc::Tensor4<T> k = call.keys.template cast<T>(), v = call.values.template cast<T>();
    BadQueries bq;
    bq.name = "NaN in the last query element of a 130-token call";
    bq.f = call.queries.template cast<float>();
    ASSERT_EQ(bq.f.dimension(1), G * kKeys[1]);
    bq.f(kKeys[0] - 1, G * kKeys[1] - 1, S - 1, kKeys[3] - 1) = std::numeric_limits<float>::quiet_NaN();
    for (const Api api : kQueryApis) EXPECT_EQ(bad_queries_rejected(subject, api, k, v, bq), "");
    // Then the same call with the finite queries, as on the twin.
    vc::KVPair<T> a_out, b_out;
    EXPECT_TRUE(invoke(*subject.cache, Api::kViewQ, call, a_out) ==
                invoke(*twin.cache, Api::kViewQ, call, b_out));
    EXPECT_TRUE(snapshot(subject) == snapshot(twin));
    valid_call_on_both(subject, twin, rng, 1, Api::kFetchQ, "next decode");
  }
}

/// StreamingLLM (2 sinks, a window of 10) and the standard cache ignore valid queries: with
/// queries (G = 1, 2, 4 in turn, entries N(0, 9)) they return and hold bitwise what they do without,
/// through fetch, view and fetch_into, over calls of 7, 1, 1, 0, 12, 1, 70, 1, 1, 3, 1 tokens
/// ([2, 2, S, 5] keys, [2, 2, S, 3] values).
TYPED_TEST(ContractTest, StreamingAndStandardIgnoreQueriesBitwise) {
  using T = TypeParam;
  vc::KVCacheConfig config = small_config();
  config.stream_n_sink = 2;
  config.stream_window_size = 10;
  for (const Kind kind : {Method::standard, Method::streaming_llm}) {
    SCOPED_TRACE(kind_name(kind));
    Subject<T> with = make_subject<T>(kind, config), without = make_subject<T>(kind, config);
    std::mt19937 rng(kind == Method::streaming_llm ? 5u : 6u);
    const Index B = 2, H = 2, D = dim(5), Dv = dim(3);
    const Index sizes[] = {7, 1, 1, 0, 12, 1, 70, 1, 1, 3, 1};
    vc::KVPair<T> out_with, out_without;
    int c = 0;
    for (const Index S : sizes) {
      const Api api = kQueryApis[c % 3];
      const Index G = Index{1} << (c % 3);  // 1, 2, 4: G may change from call to call
      const vc::Tensor4<T> k = random_tensor<T>(rng, B, H, S, D);
      const vc::Tensor4<T> v = random_tensor<T>(rng, B, H, S, Dv);
      const vc::Tensor4<float> q = random_queries(rng, B, G * H, S, D, 3.0);
      const Returned a = invoke_with(*with.cache, api, k, v, q, out_with);
      const Returned b = invoke_without_queries(*without.cache, api, k, v, out_without);
      EXPECT_TRUE(a == b) << "call " << c << " (S=" << S << ", " << api_name(api) << ")";
      EXPECT_TRUE(snapshot(with) == snapshot(without)) << "call " << c;
      ++c;
    }
    EXPECT_EQ(with.cache->offset(), 98);
    // Not vacuous: StreamingLLM evicted (2 sinks + a window of 10), the standard cache kept all.
    EXPECT_EQ(with.cache->tokens_kept(), kind == Method::streaming_llm ? 12 : 98);
  }
}

/// Query element types: double, half and bfloat16 queries give bitwise what their float32
/// conversion gives (double queries with double keys and values through the converting
/// overload), and bfloat16 keys and values (converted by the cache) what their conversion to T
/// gives; returns and everything observable, after every call of 40, 1, 1, 9, 1, 100, 1, 1, 0, 3,
/// 1 tokens through fetch, view and fetch_into ([2, 2, S, 8] keys, [2, 2, S, 3] values, G = 2;
/// budgets 16, 2 sinks, SnapKV obs_window 8). Not vacuous: on a scored policy the queries gave
/// other scores than the key-as-query proxy.
TYPED_TEST(ContractTest, QueriesOfEveryElementTypeEqualTheirFloatConversion) {
  using T = TypeParam;
  vc::KVCacheConfig config = small_config();
  config.squeeze_budget = config.h2o_budget = config.pyramid_budget = config.tova_budget =
      config.snap_budget = 16;
  config.squeeze_n_sink = config.h2o_n_sink = config.pyramid_n_sink = config.tova_n_sink =
      config.snap_n_sink = 2;
  config.h2o_grace = 4;
  config.snap_obs_window = 8;
  for (const Kind kind : kContractKinds) {
    SCOPED_TRACE(kind_name(kind));
    const auto make = [&] { return make_subject<T>(kind, config); };
    // Pairs of caches: (reference fed float32 queries, subject fed another query type).
    Subject<T> ref_double = make(), by_double = make();
    Subject<T> ref_half = make(), by_half = make();
    Subject<T> ref_bf16 = make(), by_bf16 = make();
    Subject<T> ref_kb = make(), by_kb = make();
    Subject<T> plain = make();
    std::mt19937 rng(99u + kind_index(kind));
    const Index B = 2, H = 2, G = 2, D = 8, Dv = dim(3);
    const Index sizes[] = {40, 1, 1, 9, 1, 100, 1, 1, 0, 3, 1};
    vc::KVPair<T> o1, o2, o3, o4, o5, o6, o7, o8, o9;
    int c = 0;
    for (const Index S : sizes) {
      const Api api = kQueryApis[c % 3];
      const std::string where = "call " + std::to_string(c) + " " + api_name(api);
      // Keys and values as double through the converting overload vs converted to T first.
      const vc::Tensor4<double> kd = random_doubles(rng, B, H, S, D);
      const vc::Tensor4<double> vd = random_doubles(rng, B, H, S, Dv);
      const vc::Tensor4<T> k = kd.template cast<T>();
      const vc::Tensor4<T> v = vd.template cast<T>();
      vc::Tensor4<double> qd = random_doubles(rng, B, G * H, S, D);
      for (Index i = 0; i < qd.size(); ++i) qd.data()[i] *= 1.7;  // values float32 must round
      const vc::Tensor4<float> qd_f = qd.template cast<float>();
      const vc::Tensor4<Eigen::half> qh =
          random_doubles(rng, B, G * H, S, D).template cast<Eigen::half>();
      const vc::Tensor4<float> qh_f = qh.template cast<float>();
      const vc::Tensor4<Eigen::bfloat16> qb =
          random_doubles(rng, B, G * H, S, D).template cast<Eigen::bfloat16>();
      const vc::Tensor4<float> qb_f = qb.template cast<float>();

      EXPECT_TRUE(invoke_with(*ref_double.cache, api, k, v, qd_f, o1) ==
                  invoke_with(*by_double.cache, api, kd, vd, qd, o2))
          << where << " (double)";
      EXPECT_TRUE(snapshot(ref_double) == snapshot(by_double)) << where << " (double)";
      EXPECT_TRUE(invoke_with(*ref_half.cache, api, k, v, qh_f, o3) ==
                  invoke_with(*by_half.cache, api, k, v, qh, o4))
          << where << " (half)";
      EXPECT_TRUE(snapshot(ref_half) == snapshot(by_half)) << where << " (half)";
      EXPECT_TRUE(invoke_with(*ref_bf16.cache, api, k, v, qb_f, o5) ==
                  invoke_with(*by_bf16.cache, api, k, v, qb, o6))
          << where << " (bfloat16)";
      EXPECT_TRUE(snapshot(ref_bf16) == snapshot(by_bf16)) << where << " (bfloat16)";
      // Keys and values as bfloat16 (converted to T by the cache) with float32 queries.
      const vc::Tensor4<Eigen::bfloat16> kb = kd.template cast<Eigen::bfloat16>();
      const vc::Tensor4<Eigen::bfloat16> vb = vd.template cast<Eigen::bfloat16>();
      const vc::Tensor4<T> kb_t = kb.template cast<T>(), vb_t = vb.template cast<T>();
      EXPECT_TRUE(invoke_with(*ref_kb.cache, api, kb_t, vb_t, qd_f, o8) ==
                  invoke_with(*by_kb.cache, api, kb, vb, qd_f, o9))
          << where << " (bfloat16 keys)";
      EXPECT_TRUE(snapshot(ref_kb) == snapshot(by_kb)) << where << " (bfloat16 keys)";
      (void)invoke_without_queries(*plain.cache, api, k, v, o7);
      ++c;
    }
    // Not vacuous: the queries changed the scores relative to the key-as-query proxy.
    if (visit_scored(*plain.cache, [](const auto&) {})) {
      EXPECT_NE(policy_scores(*ref_double.cache, 0, 0), policy_scores(*plain.cache, 0, 0));
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// What each policy publishes about itself
// ---------------------------------------------------------------------------------------------

/// layer_budget() on the base (docs/design.md 2.6): the rows per head each policy evicts down to,
/// -1 for the standard cache; the H2O-core accessors (budget, sinks, protected window, decay) and
/// squeeze_kept_bytes() report the configuration and the state, before and after a call.
TYPED_TEST(ContractTest, PoliciesReportTheirBudgetsAndParameters) {
  using T = TypeParam;
  const vc::KVCacheConfig c = small_config();
  for (const Kind subject_kind : kContractKinds) {
    SCOPED_TRACE(kind_name(subject_kind));
    Subject<T> s = make_subject<T>(subject_kind);
    // An adaptive subject reports what its uniform base does, and its mode (SPEC 14).
    const Kind kind = base_kind(subject_kind);
    if (is_adaptive(subject_kind)) {
      EXPECT_EQ(s.cache->config().head_budgets, "adaptive");
      EXPECT_EQ(s.cache->config().head_budget_floor, adaptive_floor(subject_kind));
    }
    // Coordinated squeeze layers report squeeze_budget (8 here) until they adopt the published
    // budget: the one-layer coordinator publishes 6 in the first call; the deferring layer's
    // coordinator waits for a second layer that never reports.
    const bool squeeze_fallback = kind == Kind::kSqueezeCoordinated || is_squeeze_defer(kind);
    const int before = keeps_every_row(kind.method)    ? -1
                       : kind == Method::streaming_llm ? c.stream_n_sink + c.stream_window_size
                       : squeeze_fallback              ? c.squeeze_budget
                                                       : 6;
    const int after = kind == Kind::kSqueezeCoordinated ? 6 : before;
    EXPECT_EQ(s.cache->layer_budget(), before);
    std::mt19937 rng(61);
    vc::KVPair<T> into;
    (void)invoke(*s.cache, Api::kFetch, random_call(rng, with_s(kKeys, 9), with_s(kValues, 9)), into);
    EXPECT_EQ(s.cache->layer_budget(), after);
    visit_core(*s.cache, [&](const auto& p) {
      const bool h2o = kind == Method::h2o || kind == Kind::kH2OKNorm;
      EXPECT_EQ(p.n_sink(), 1);
      EXPECT_FLOAT_EQ(p.decay(), 0.98f);
      if (is_squeeze_defer(kind)) {
        EXPECT_FALSE(p.budget().has_value());
        EXPECT_EQ(p.protected_recent(), 0);
      } else {
        EXPECT_EQ(p.budget(), std::optional<int>(6));
        // g = floor(0.5 * (6 - 1)) = 2 by ratio; H2O's fixed grace is 2 as well.
        EXPECT_EQ(p.protected_recent(), h2o ? c.h2o_grace : 2);
      }
    });
    if (const auto* sq = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(s.cache.get())) {
      EXPECT_EQ(sq->squeeze_kept_bytes(), sq->kept_bytes());
      EXPECT_GT(sq->squeeze_kept_bytes(), 0u);
    }
    if (const auto* tova = dynamic_cast<const vc::TOVACache<T>*>(s.cache.get())) {
      EXPECT_EQ(tova->n_sink(), 1);
    }
  }
}
