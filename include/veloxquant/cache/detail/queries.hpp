// veloxquant — the queries an engine may pass with a call (docs/design.md 4.6, "observed
// attention"): their validation at the API boundary and the per-KV-head slices the scoring kernels
// read.
#pragma once

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

#include <Eigen/Core>

#include "../tensor.hpp"
#include "checks.hpp"

namespace veloxquant::cache::detail {

using Index = Eigen::Index;

/// The G query heads of one KV head for one call, float32: [G, S, D] contiguous (query head
/// h * G + g of the call belongs to KV head h). Empty (data == nullptr) when the call brought no
/// queries: the policy then scores with the key-as-query proxy.
struct QuerySlice {
  const float* data = nullptr;
  Index groups = 0;  // G
  Index tokens = 0;  // S
  Index dim = 0;     // D

  explicit operator bool() const { return data != nullptr; }
  /// Query head g of the call's token i: [D].
  const float* row(Index g, Index i) const { return data + (g * tokens + i) * dim; }
};

/// The queries of a whole call, float32 [B, Hq, S, D] with Hq = G * H; nullptr data = none.
struct CallQueries {
  const float* data = nullptr;
  Index groups = 0;  // G = Hq / H (0 without queries)
  Index tokens = 0;  // S
  Index dim = 0;     // D

  /// The slice of flat KV head `head` = b * H + h (its G query heads are contiguous).
  QuerySlice slice(Index head) const {
    if (data == nullptr) return {};
    return QuerySlice{data + head * groups * tokens * dim, groups, tokens, dim};
  }
};

/// Throws std::invalid_argument unless `queries` fits the call: [B, G * H, S, Dk] with the keys'
/// B, S and Dk and an integer G >= 1, every element finite. Called after check_update, before the
/// cache changes. queries: [B, Hq, S, Dk] (float32, converted from the caller's type);
/// keys: [B, H, S, Dk]
template <class T>
void check_queries(const Tensor4<float>& queries, const Tensor4<T>& keys, const char* api) {
  const auto fail = [&](const std::string& what) {
    std::ostringstream os;
    os << api << ": " << what << " (queries " << shape_str(queries) << ", keys " << shape_str(keys)
       << ')';
    throw std::invalid_argument(os.str());
  };
  const Index H = keys.dimension(1);
  const Index Hq = queries.dimension(1);
  if (queries.dimension(0) != keys.dimension(0)) fail("queries must have the keys' batch size B");
  if (Hq == 0 || Hq % H != 0) {
    fail("query heads Hq (" + std::to_string(Hq) + ") must be a positive multiple of the KV heads H (" +
         std::to_string(H) + ")");
  }
  if (queries.dimension(2) != keys.dimension(2)) {
    fail("queries must have the keys' sequence length S");
  }
  if (queries.dimension(3) != keys.dimension(3)) fail("queries must have the keys' head dim D");
  const float* q = queries.data();
  const Index n = queries.size();
  if (all_finite(q, n)) return;
  for (Index i = 0; i < n; ++i) {
    if (!std::isfinite(q[i])) {
      const Index d = queries.dimension(3), s = queries.dimension(2);
      std::ostringstream os;
      os << "non-finite query at [b=" << i / (d * s * Hq) << ", hq=" << (i / (d * s)) % Hq
         << ", s=" << (i / d) % s << ", d=" << i % d << "] (value " << q[i]
         << " after conversion to float32)";
      fail(os.str());
    }
  }
}

}  // namespace veloxquant::cache::detail
