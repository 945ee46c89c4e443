// fuzz target `ops` (fuzz/fuzz_ops.hpp): what a run and its calls can be — the policies under
// test, the query modes of a sequence, the entry points of a call and the bad inputs — and their
// names in traces and violation messages.
#pragma once

namespace veloxquant::fuzz::detail {

enum class Policy {
  Standard,
  SqueezeSingle,
  SqueezeBuilder,
  H2O,
  PyramidSingle,
  PyramidBuilder,
  TOVA,
  Streaming,
  SnapKV,
  kCount
};

inline const char* policy_name(Policy p) {
  switch (p) {
    case Policy::Standard:
      return "standard";
    case Policy::SqueezeSingle:
      return "squeeze(single)";
    case Policy::SqueezeBuilder:
      return "squeeze(builder)";
    case Policy::H2O:
      return "h2o";
    case Policy::PyramidSingle:
      return "pyramidkv(single)";
    case Policy::PyramidBuilder:
      return "pyramidkv(builder)";
    case Policy::TOVA:
      return "tova";
    case Policy::Streaming:
      return "streaming_llm";
    case Policy::SnapKV:
      return "snapkv";
    default:
      return "?";
  }
}

/// The policies of the H2O core (SqueezeAttention, H2O, PyramidKV).
inline bool is_core(Policy p) {
  return p == Policy::SqueezeSingle || p == Policy::SqueezeBuilder || p == Policy::H2O ||
         p == Policy::PyramidSingle || p == Policy::PyramidBuilder;
}

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
