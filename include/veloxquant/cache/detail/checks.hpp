// veloxquant — input validation at the API boundary (docs/design.md 8): shapes, finiteness and
// capacity, all before the cache changes.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "checked.hpp"
#include "input.hpp"
#include "quant.hpp"

namespace veloxquant::cache::detail {

/// Shape of one cache's calls, fixed by its first call with S >= 1 (until reset()).
struct LayerDims {
  Index batch = 0;
  Index heads = 0;
  Index key_dim = 0;
  Index value_dim = 0;
  bool known = false;
};

inline std::string shape_str(const InputRows& t) {
  std::ostringstream os;
  os << '[' << t.batch << ", " << t.heads << ", " << t.seq << ", " << t.dim << ']';
  return os.str();
}

/// The word-at-a-time scan behind all_finite and all_within: x[0..n) read as 64-bit words of
/// 8 / sizeof(T) lanes (a zero-padded word for the tail); true when ((w & mask) + add) & top is
/// non-zero for any word, i.e. when some lane's masked bits plus `add` carry into its top bit.
template <class T>
bool any_lane_carries(const T* x, Index n, std::uint64_t mask, std::uint64_t add,
                      std::uint64_t top) {
  constexpr Index kPer = static_cast<Index>(8 / sizeof(T));
  std::uint64_t carried = 0;
  Index i = 0;
  for (; i + kPer <= n; i += kPer) {
    std::uint64_t w;
    std::memcpy(&w, x + i, sizeof(w));
    carried |= ((w & mask) + add) & top;
  }
  if (i < n) {
    std::uint64_t w = 0;
    std::memcpy(&w, x + i, sizeof(T) * static_cast<std::size_t>(n - i));
    carried |= ((w & mask) + add) & top;
  }
  return carried != 0;
}

/// True when every element of x[0..n) is finite: a branch-free test of the exponent bits, a 64-bit
/// word (four halves, two floats) at a time. Within each lane, exponent bits plus the lowest
/// exponent bit carry into the lane's top bit exactly when the exponent is all ones, and never
/// into the next lane.
template <class T>
bool all_finite(const T* x, Index n) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "16, 32 or 64-bit elements");
  constexpr std::uint64_t kExp = std::is_same_v<T, double>            ? 0x7FF0000000000000ull
                                 : std::is_same_v<T, float>           ? 0x7F8000007F800000ull
                                 : std::is_same_v<T, Eigen::bfloat16> ? 0x7F807F807F807F80ull
                                                                      : 0x7C007C007C007C00ull;
  constexpr std::uint64_t kOne = std::is_same_v<T, double>            ? 0x0010000000000000ull
                                 : std::is_same_v<T, float>           ? 0x0080000000800000ull
                                 : std::is_same_v<T, Eigen::bfloat16> ? 0x0080008000800080ull
                                                                      : 0x0400040004000400ull;
  constexpr std::uint64_t kTop = std::is_same_v<T, double>  ? 0x8000000000000000ull
                                 : std::is_same_v<T, float> ? 0x8000000080000000ull
                                                            : 0x8000800080008000ull;
  return !any_lane_carries(x, n, kExp, kOne, kTop);
}

/// What a call may hold (docs/robustness.md, "Magnitudes"). Keys and queries within +-2^48 and
/// head dims up to 2^16 keep every logit q.k (at most 2^16 * 2^96 = 2^112) and every squared key
/// norm inside float32; values within +-2^96 keep the attention output's sums (at most 2^31 rows
/// of weight <= 1) inside it too. Powers of two: exact in every storage type but half, whose finite
/// values (+-65504) all lie within both.
inline constexpr float kMaxKeyMagnitude = 0x1p48f;
inline constexpr float kMaxQueryMagnitude = 0x1p48f;
inline constexpr float kMaxValueMagnitude = 0x1p96f;
inline constexpr Index kMaxHeadDim = Index{1} << 16;

/// |x| as a float, or as a double for double input (so that a double beyond float's range is
/// compared as it is).
template <class X>
auto magnitude(X x) {
  if constexpr (std::is_same_v<X, double>) {
    return std::abs(x);
  } else {
    return std::abs(static_cast<float>(x));
  }
}

/// True when every element of x[0, n) is finite and within +-limit (a half: finite is enough;
/// limit: a positive power of two, exact in X). Branch-free like all_finite, a 64-bit word at a
/// time: a lane's magnitude bits plus (lane max - limit's bits) carry into the lane's top bit
/// exactly when the magnitude is above the limit (NaN and infinities included), and never into the
/// next lane.
template <class X>
bool all_within(const X* x, Index n, float limit) {
  if constexpr (std::is_same_v<X, Eigen::half>) {
    return all_finite(x, n);
  } else {
    static_assert(std::is_same_v<X, float> || std::is_same_v<X, Eigen::bfloat16>,
                  "float32 or bfloat16 elements");
    constexpr int kLaneBits = 8 * static_cast<int>(sizeof(X));
    std::uint32_t limit_bits = 0;
    std::memcpy(&limit_bits, &limit, sizeof(limit_bits));
    if constexpr (kLaneBits == 16) limit_bits >>= 16;  // bfloat16: float32's top half
    const std::uint64_t lane_abs = (std::uint64_t{1} << (kLaneBits - 1)) - 1;
    std::uint64_t abs = 0, add = 0, top = 0;
    for (int l = 0; l < 64; l += kLaneBits) {
      abs |= lane_abs << l;
      add |= (lane_abs - limit_bits) << l;
      top |= (lane_abs + 1) << l;
    }
    return !any_lane_carries(x, n, abs, add, top);
  }
}

/// Index of the first element of row (b, h, s) of `in` that is not finite or beyond +-limit once
/// converted to X (the storage type for keys, float32 for queries), and that value; -1 when none
/// is. buf: scratch of in.dim elements of X.
template <class X>
Index first_out_of_range(const InputRows& in, Index b, Index h, Index s, float limit,
                         std::vector<X>& buf, double& value) {
  const Index d = in.dim;
  const X* p = nullptr;
  if (in.type == element_type_of<X>()) {
    p = in.row<X>(b, h, s);
  } else {
    buf.resize(static_cast<std::size_t>(d));
    with_row(in, b, h, s, [&](const auto* r) {
      for (Index j = 0; j < d; ++j) buf[static_cast<std::size_t>(j)] = static_cast<X>(r[j]);
    });
    p = buf.data();
  }
  if (all_within(p, d, limit)) return -1;
  for (Index j = 0; j < d; ++j) {
    if (!all_within(p + j, 1, limit)) {
      value = static_cast<double>(p[j]);
      return j;
    }
  }
  return -1;
}

/// Where an element was out of range: "<what> at [b=.., h=.., s=.., d=..] (value .. after
/// conversion to <type>) is not finite" or "... is beyond +-<limit>".
inline std::string out_of_range_message(const char* what, const char* head, Index b, Index h,
                                        Index s, Index d, double value, const char* type,
                                        float limit) {
  std::ostringstream os;
  os << what << " at [b=" << b << ", " << head << "=" << h << ", s=" << s << ", d=" << d
     << "] (value " << value << " after conversion to " << type << ") is ";
  if (std::isfinite(value)) {
    os << "beyond +-2^" << std::ilogb(limit) << ", the largest magnitude a call may hold";
  } else {
    os << "not finite";
  }
  return os.str();
}

/// Throws std::invalid_argument for a tensor reference (`what`: "keys", "values", "queries")
/// with a negative dimension, more elements than an Index holds, or null data with a non-zero
/// size; called before its rows are addressed. dims: {B, H, S, D}
inline void check_tensor_ref(const void* data, const Index (&dims)[4], const char* what,
                             const char* api) {
  const auto fail = [&](const std::string& why) {
    std::ostringstream os;
    os << api << ": " << what << ' ' << why << " (shape [" << dims[0] << ", " << dims[1] << ", "
       << dims[2] << ", " << dims[3] << "])";
    throw std::invalid_argument(os.str());
  };
  for (const Index d : dims) {
    if (d < 0) fail("has a negative dimension");
  }
  // The product of the non-zero dims fits, so every product of some of them does (strides, the
  // B·H of an empty call).
  std::optional<Index> product = 1;
  bool empty = false;
  for (const Index d : dims) {
    empty = empty || d == 0;
    if (d != 0 && product) product = checked_mul(*product, d);
  }
  if (!product) fail("has too many elements");
  if (data == nullptr && !empty) fail("has null data but a non-zero size");
}

/// Throws std::invalid_argument when a head that holds `live` rows cannot take `new_rows` more:
/// rows are addressed by 32-bit slots, so a head holds at most 2^31 - 1 rows.
inline void check_rows_fit(Index live, Index new_rows, const char* api) {
  constexpr Index kMaxRows = 2147483647;  // std::numeric_limits<std::int32_t>::max()
  if (new_rows > kMaxRows - live) {
    std::ostringstream os;
    os << api << ": a head holding " << live << " rows cannot take " << new_rows
       << " more (at most " << kMaxRows << " rows per head)";
    throw std::invalid_argument(os.str());
  }
}

/// The keys of a call with S >= 1: finite and within +-kMaxKeyMagnitude once stored as T;
/// fail(message) on the first that is not.
template <class T, class Fail>
void check_key_rows(const InputRows& keys, const Fail& fail) {
  // A dense input of the storage type (any layout): one pass over all of it first.
  if (keys.type == element_type_of<T>() && keys.dense &&
      all_within(static_cast<const T*>(keys.data), keys.size(), kMaxKeyMagnitude)) {
    return;
  }
  std::vector<T> buf;
  double value = 0.0;
  for (Index b = 0; b < keys.batch; ++b) {
    for (Index h = 0; h < keys.heads; ++h) {
      for (Index s = 0; s < keys.seq; ++s) {
        const Index d = first_out_of_range<T>(keys, b, h, s, kMaxKeyMagnitude, buf, value);
        if (d < 0) continue;
        fail(out_of_range_message(std::isfinite(value) ? "key" : "non-finite key", "h", b, h, s, d,
                                  value, "the storage type", kMaxKeyMagnitude));
      }
    }
  }
}

/// Index of the first element of `row` ([n] of U) that is finite as given but not finite or
/// beyond +-kMaxValueMagnitude once converted to T, and that converted value; -1 when none is.
template <class T, class U>
Index first_unstorable_value(const U* row, Index n, double& value) {
  if constexpr (std::is_same_v<U, T> && std::is_same_v<T, Eigen::half>) {
    return -1;  // every finite half is within range, and nothing is converted
  } else {
    bool ok = true;
    for (Index j = 0; j < n; ++j) {
      const auto x = magnitude(row[j]);
      const float y = magnitude(static_cast<T>(row[j]));
      ok &= !(x <= std::numeric_limits<decltype(x)>::max()) || y <= kMaxValueMagnitude;
    }
    if (ok) return -1;
    for (Index j = 0; j < n; ++j) {
      const auto x = magnitude(row[j]);
      const float y = magnitude(static_cast<T>(row[j]));
      if (x <= std::numeric_limits<decltype(x)>::max() && !(y <= kMaxValueMagnitude)) {
        value = static_cast<double>(static_cast<float>(static_cast<T>(row[j])));
        return j;
      }
    }
    return -1;
  }
}

/// The values of a call with S >= 1: a value that is finite as given must stay finite and within
/// +-kMaxValueMagnitude once stored as T (a NaN or infinite value is stored as given);
/// fail(message) on the first that does not.
template <class T, class Fail>
void check_value_rows(const InputRows& values, const Fail& fail) {
  if (values.type == element_type_of<T>() && std::is_same_v<T, Eigen::half>) return;
  double value = 0.0;
  for (Index b = 0; b < values.batch; ++b) {
    for (Index h = 0; h < values.heads; ++h) {
      for (Index s = 0; s < values.seq; ++s) {
        const Index d = with_row(values, b, h, s, [&](const auto* p) {
          return first_unstorable_value<T>(p, values.dim, value);
        });
        if (d < 0) continue;
        std::ostringstream os;
        os << "value at [b=" << b << ", h=" << h << ", s=" << s << ", d=" << d
           << "] is finite but ";
        if (std::isfinite(value)) {
          os << value << " once stored in the storage type, beyond +-2^"
             << std::ilogb(kMaxValueMagnitude) << ", the largest magnitude a call may hold";
        } else {
          os << "overflows the storage type";
        }
        fail(os.str());
      }
    }
  }
}

/// The std::invalid_argument of an update call: "<api>: <what> (keys [..], values [..])".
[[noreturn]] inline void update_error(const char* api, const InputRows& keys,
                                      const InputRows& values, const std::string& what) {
  std::ostringstream os;
  os << api << ": " << what << " (keys " << shape_str(keys) << ", values " << shape_str(values)
     << ')';
  throw std::invalid_argument(os.str());
}

/// Throws std::invalid_argument for keys/values whose shapes disagree with each other or with the
/// dims of the first call, and for a zero B, H or D or a D above kMaxHeadDim. Looks at no
/// element. keys: [B, H, S, Dk], values: [B, H, S, Dv]
inline void check_update_shapes(const InputRows& keys, const InputRows& values,
                                const LayerDims& dims, const char* api) {
  const auto fail = [&](const std::string& what) { update_error(api, keys, values, what); };
  if (keys.batch != values.batch || keys.heads != values.heads || keys.seq != values.seq) {
    fail("keys and values must share B, H and S");
  }
  if (keys.batch == 0 || keys.heads == 0) fail("B and H must be >= 1");
  if (keys.dim == 0 || values.dim == 0) fail("head dim D must be >= 1");
  if (keys.dim > kMaxHeadDim || values.dim > kMaxHeadDim) {
    fail("head dim D must be <= " + std::to_string(kMaxHeadDim));
  }
  if (dims.known && (keys.batch != dims.batch || keys.heads != dims.heads ||
                     keys.dim != dims.key_dim || values.dim != dims.value_dim)) {
    std::ostringstream os;
    os << "B, H or D differ from the first call's (B=" << dims.batch << ", H=" << dims.heads
       << ", key D=" << dims.key_dim << ", value D=" << dims.value_dim << ")";
    fail(os.str());
  }
}

/// The rows of a call whose shapes passed check_update_shapes (only those it has: an empty call
/// looks at nothing, whatever B and H claim): a key that is not finite or beyond
/// +-kMaxKeyMagnitude once stored as T, or a value that is finite as given but not finite or
/// beyond +-kMaxValueMagnitude once stored as T, throws std::invalid_argument naming the first
/// such element (a NaN or infinite value is stored as given, docs/design.md 8).
template <class T>
void check_update_rows(const InputRows& keys, const InputRows& values, const char* api) {
  if (keys.seq == 0) return;
  const auto fail = [&](const std::string& what) { update_error(api, keys, values, what); };
  check_key_rows<T>(keys, fail);
  check_value_rows<T>(values, fail);
}

/// Throws std::invalid_argument for the rows of a call that a quantized format (quant.hpp) cannot
/// hold: a head dim that quant_group does not divide (token axis), or an element that is not finite or beyond
/// +-kHalfMax once converted to the storage type T (a group's offset and scale are halves).
/// `what`: "keys" or "values"; `bits_field`: "key_bits" or "value_bits". rows: [B, H, S, D]
template <class T>
void check_quantizable(const InputRows& rows, const RowFormat& f, const char* what,
                       const char* bits_field, const char* api) {
  if (!f.channel && rows.dim % f.group != 0) {
    std::ostringstream os;
    os << api << ": quant_group (" << f.group << ") must divide the " << what << "' head dim D ("
       << rows.dim << ") when " << bits_field << " is " << f.bits;
    throw std::invalid_argument(os.str());
  }
  for (Index b = 0; b < rows.batch && rows.seq > 0; ++b) {
    for (Index h = 0; h < rows.heads; ++h) {
      for (Index s = 0; s < rows.seq; ++s) {
        Index bad = -1;
        float x = 0.0f;
        // Every finite half lies within +-65504: a half row of the storage type needs only the
        // finiteness test.
        if constexpr (std::is_same_v<T, Eigen::half>) {
          if (rows.type == element_type_of<T>() &&
              all_finite(rows.row<Eigen::half>(b, h, s), rows.dim)) {
            continue;
          }
        }
        with_row(rows, b, h, s, [&](const auto* p) {
          for (Index d = 0; d < rows.dim && bad < 0; ++d) {
            x = static_cast<float>(static_cast<T>(p[d]));
            if (!(std::abs(x) <= kHalfMax)) bad = d;  // also NaN
          }
        });
        if (bad < 0) continue;
        std::ostringstream os;
        os << api << ": " << what << " element at [b=" << b << ", h=" << h << ", s=" << s
           << ", d=" << bad << "] (value " << x << " after conversion to the storage type) is not "
           << "finite or beyond +-65504, the range of quantized storage (" << bits_field << " "
           << f.bits << ")";
        throw std::invalid_argument(os.str());
      }
    }
  }
}

/// The std::invalid_argument of a call with queries: "<api>: <what> (queries [..], keys [..])".
[[noreturn]] inline void query_error(const char* api, const InputRows& queries,
                                     const InputRows& keys, const std::string& what) {
  std::ostringstream os;
  os << api << ": " << what << " (queries " << shape_str(queries) << ", keys " << shape_str(keys)
     << ')';
  throw std::invalid_argument(os.str());
}

/// Throws std::invalid_argument unless `queries` is [B, G * H, S, Dk] with the keys' B, S and Dk
/// and an integer G >= 1. Called after check_update_shapes (H >= 1). Looks at no element.
/// queries: [B, Hq, S, Dk]; keys: [B, H, S, Dk]
inline void check_query_shapes(const InputRows& queries, const InputRows& keys, const char* api) {
  const auto fail = [&](const std::string& what) { query_error(api, queries, keys, what); };
  const Index H = keys.heads;
  const Index Hq = queries.heads;
  if (queries.batch != keys.batch) fail("queries must have the keys' batch size B");
  if (Hq == 0 || Hq % H != 0) {
    fail("query heads Hq (" + std::to_string(Hq) +
         ") must be a positive multiple of the KV heads H (" + std::to_string(H) + ")");
  }
  if (queries.seq != keys.seq) fail("queries must have the keys' sequence length S");
  if (queries.dim != keys.dim) fail("queries must have the keys' head dim D");
}

/// Every element of `rows` finite and within +-limit once converted to float32; `fail(what)`
/// throws naming the first that is not (a `name`, "query" or "key", of head `head` "hq" or "h").
template <class Fail>
void check_float_values(const InputRows& rows, float limit, const char* name, const char* head,
                        const Fail& fail) {
  if (rows.seq == 0) return;
  std::vector<float> buf;
  double value = 0.0;
  const std::string non_finite = std::string("non-finite ") + name;
  for (Index b = 0; b < rows.batch; ++b) {
    for (Index h = 0; h < rows.heads; ++h) {
      for (Index s = 0; s < rows.seq; ++s) {
        const Index d = first_out_of_range<float>(rows, b, h, s, limit, buf, value);
        if (d < 0) continue;
        fail(out_of_range_message(std::isfinite(value) ? name : non_finite.c_str(), head, b, h, s,
                                  d, value, "float32", limit));
      }
    }
  }
}
/// Queries: every element finite and within +-kMaxQueryMagnitude in float32.
template <class Fail>
void check_query_values(const InputRows& queries, const Fail& fail) {
  check_float_values(queries, kMaxQueryMagnitude, "query", "hq", fail);
}

/// check_query_shapes, then every element finite and within +-kMaxQueryMagnitude once converted
/// to float32 (the first that is not is named). Called after check_update, before the cache
/// changes. queries: [B, Hq, S, Dk]; keys: [B, H, S, Dk]
inline void check_queries(const InputRows& queries, const InputRows& keys, const char* api) {
  check_query_shapes(queries, keys, api);
  check_query_values(queries,
                     [&](const std::string& what) { query_error(api, queries, keys, what); });
}

/// The queries of KVCache::observe against the rows of a layer of B sequences of H KV heads of
/// dim Dk: [B, G·H, S, Dk] for an integer G >= 1 and any S >= 0, every element as check_queries
/// wants it. Throws std::invalid_argument naming what is wrong, with the shapes.
inline void check_observed_queries(const InputRows& queries, Index batch, Index heads, Index dim,
                                   const char* api) {
  const auto fail = [&](const std::string& what) {
    std::ostringstream os;
    os << api << ": " << what << " (queries " << shape_str(queries) << ", the cache's rows ["
       << batch << ", " << heads << ", n, " << dim << "])";
    throw std::invalid_argument(os.str());
  };
  if (queries.batch != batch) fail("queries must have the cache's batch size B");
  if (queries.heads == 0 || queries.heads % heads != 0) {
    fail("query heads Hq (" + std::to_string(queries.heads) +
         ") must be a positive multiple of the KV heads H (" + std::to_string(heads) + ")");
  }
  if (queries.dim != dim) fail("queries must have the keys' head dim D");
  check_query_values(queries, fail);
}

/// The re-read's own keys given to KVCache::observe beside its queries: [B, H, S, Dk], the
/// queries' B and S and the cache's H and Dk, every element finite and within
/// +-kMaxKeyMagnitude in float32. Throws std::invalid_argument naming what is wrong.
inline void check_observed_keys(const InputRows& keys, const InputRows& queries, Index heads,
                                Index dim, const char* api) {
  const auto fail = [&](const std::string& what) {
    std::ostringstream os;
    os << api << ": " << what << " (keys " << shape_str(keys) << ", queries "
       << shape_str(queries) << ", the cache's rows [" << queries.batch << ", " << heads
       << ", n, " << dim << "])";
    throw std::invalid_argument(os.str());
  };
  if (keys.batch != queries.batch || keys.heads != heads || keys.seq != queries.seq ||
      keys.dim != dim) {
    fail("keys must be [B, H, S, Dk]: the queries' B and S, the cache's H and Dk");
  }
  check_float_values(keys, kMaxKeyMagnitude, "key", "h", fail);
}

/// attend's output [B, Hq, S, Dv] (queries' B, Hq, S; values' Dv): the product of its non-zero
/// dims must fit an Index, so every stride computed from them does (an empty output, one dim 0,
/// still has strides); checked before they are computed. Everything else about the shapes is
/// run()'s to check, in its order.
inline void check_attend_output(const InputRows& queries, const InputRows& values) {
  const auto nonzero = [](Index d) { return d == 0 ? Index{1} : d; };
  if (!checked_product({nonzero(queries.batch), nonzero(queries.heads), nonzero(queries.seq),
                        nonzero(values.dim)})) {
    std::ostringstream os;
    os << "attend: the output [B, Hq, S, Dv] = [" << queries.batch << ", " << queries.heads << ", "
       << queries.seq << ", " << values.dim << "] has more elements than an Index holds";
    throw std::invalid_argument(os.str());
  }
}

/// The rows of an engine's tensor reference `t` (a TensorRef: data, batch, heads, seq, dim and a
/// layout; `what` names it in errors), checked first by check_tensor_ref.
template <class Ref>
InputRows rows_of(const Ref& t, const char* what, const char* api) {
  const Index dims[4] = {t.batch, t.heads, t.seq, t.dim};
  check_tensor_ref(t.data, dims, what, api);
  return t.layout == decltype(t.layout)::head_major
             ? head_major_rows(t.data, t.batch, t.heads, t.seq, t.dim)
             : token_major_rows(t.data, t.batch, t.heads, t.seq, t.dim);
}

}  // namespace veloxquant::cache::detail
