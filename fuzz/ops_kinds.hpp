// fuzz target `ops` (fuzz/fuzz_ops.hpp): what a run and its calls can be — the methods under
// test, the query modes of a sequence, the entry points of a call and the bad inputs — and their
// names in traces and violation messages.
#pragma once

#include <cstddef>
#include <string>

#include "support/methods.hpp"

namespace veloxquant::fuzz::detail {

using Method = veloxquant::test::Method;

/// What a run tests: a method of the library's table (tests/support/methods.hpp), as one cache or
/// as one layer of a builder model (the methods whose layers the builder wires together: squeeze's
/// coordinator, pyramidkv's per-layer budgets).
struct RunMethod {
  Method method;
  bool builder;
};

/// The runs, by the index the input's first byte picks (pick(9)). The saved inputs (fuzz/corpus,
/// fuzz/regressions) decode through these indices: a run is only ever appended, and appending one
/// changes the modulus, so every saved input then decodes to another run (make_corpus.py writes
/// the seeds again; the regressions need their bytes re-derived).
inline constexpr RunMethod kRunMethods[] = {
    {Method::standard, false}, {Method::squeeze, false},       {Method::squeeze, true},
    {Method::h2o, false},      {Method::pyramidkv, false},     {Method::pyramidkv, true},
    {Method::tova, false},     {Method::streaming_llm, false}, {Method::snapkv, false},
};
inline constexpr int kRunCount = static_cast<int>(std::size(kRunMethods));

/// "squeeze(builder)": the method's name, and for a method that also runs in a builder model
/// whether this run is one.
inline std::string run_name(int run) {
  const RunMethod& r = kRunMethods[run];
  bool in_builder = false;
  for (const RunMethod& other : kRunMethods) {
    in_builder = in_builder || (other.method == r.method && other.builder);
  }
  std::string out = veloxquant::test::method_name(r.method);
  if (in_builder) out += r.builder ? "(builder)" : "(single)";
  return out;
}

using veloxquant::test::is_core;  // the methods of the H2O core (SqueezeAttention, H2O, PyramidKV)

enum class QueryMode { None, Always, Mixed };
enum class Api { Fetch, View, FetchInto };

inline const char* api_name(Api a) {
  return a == Api::Fetch ? "fetch" : a == Api::View ? "view" : "fetch_into";
}

/// What is wrong with a call (None: a valid call).
enum class Bad {
  None,
  NanKey,
  InfKey,
  OverflowKey,  // double key that is +-inf after conversion to T
  ValuesB,      // values' B differs from the keys'
  ValuesH,
  ValuesS,
  ZeroB,
  ZeroH,
  ZeroKeyD,
  ZeroValueD,
  ChangeB,  // differs from the first call (only once dims are known)
  ChangeH,
  ChangeDk,
  ChangeDv,
  HugeKey,        // a finite key beyond +-2^48 once stored (docs/robustness.md, "Magnitudes")
  HugeValue,      // a finite value beyond +-2^96, or beyond the storage type, once stored
  HugeDim,        // a head dim of 65537
  ClaimedHeads,   // an empty call through null TensorRefs claiming 2^20 x 2^20 heads
  OverflowShape,  // TensorRefs whose non-zero dims overflow an Index, one dim 0
  QueryHq,        // Hq not a positive multiple of H
  QueryB,
  QueryS,
  QueryD,
  QueryNan,
  QueryInf,
  QueryOverflow,      // double query that is inf in float32
  HugeQuery,          // a finite query beyond +-2^48 in float32
  ClaimedQueryHeads,  // an empty call with null queries claiming 2^40 * H heads: valid, and quick
  kCount
};

inline const char* bad_name(Bad b) {
  static const char* names[] = {"none",
                                "nan-key",
                                "inf-key",
                                "overflow-key",
                                "values-B",
                                "values-H",
                                "values-S",
                                "zero-B",
                                "zero-H",
                                "zero-Dk",
                                "zero-Dv",
                                "change-B",
                                "change-H",
                                "change-Dk",
                                "change-Dv",
                                "huge-key",
                                "huge-value",
                                "huge-dim",
                                "claimed-heads",
                                "overflow-shape",
                                "query-Hq",
                                "query-B",
                                "query-S",
                                "query-D",
                                "query-nan",
                                "query-inf",
                                "query-overflow",
                                "huge-query",
                                "claimed-query-heads"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<int>(Bad::kCount),
                "a name for every bad input");
  return names[static_cast<int>(b)];
}

inline bool is_query_bad(Bad b) { return b >= Bad::QueryHq; }

}  // namespace veloxquant::fuzz::detail
