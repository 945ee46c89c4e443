// veloxquant — input validation at the API boundary (docs/design.md 8): shapes, finiteness and
// capacity, all before the cache changes.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

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
  constexpr Index kPer = static_cast<Index>(8 / sizeof(T));
  std::uint64_t bad = 0;
  Index i = 0;
  for (; i + kPer <= n; i += kPer) {
    std::uint64_t w;
    std::memcpy(&w, x + i, sizeof(w));
    bad |= ((w & kExp) + kOne) & kTop;
  }
  if (i < n) {
    std::uint64_t w = 0;
    std::memcpy(&w, x + i, sizeof(T) * static_cast<std::size_t>(n - i));
    bad |= ((w & kExp) + kOne) & kTop;
  }
  return bad == 0;
}

/// Index of the first element of row (b, h, s) of `in` that is not finite once converted to X
/// (the storage type for keys, float32 for queries), and that value; -1 when all are.
/// buf: scratch of in.dim elements of X.
template <class X>
Index first_non_finite(const InputRows& in, Index b, Index h, Index s, std::vector<X>& buf,
                       double& value) {
  const Index d = in.dim;
  if (in.type == element_type_of<X>()) {
    const X* p = in.row<X>(b, h, s);
    if (all_finite(p, d)) return -1;
    for (Index j = 0; j < d; ++j) {
      if (!all_finite(p + j, 1)) {
        value = static_cast<double>(p[j]);
        return j;
      }
    }
    return -1;
  }
  buf.resize(static_cast<std::size_t>(d));
  with_row(in, b, h, s, [&](const auto* p) {
    for (Index j = 0; j < d; ++j) buf[static_cast<std::size_t>(j)] = static_cast<X>(p[j]);
  });
  if (all_finite(buf.data(), d)) return -1;
  for (Index j = 0; j < d; ++j) {
    if (!all_finite(buf.data() + j, 1)) {
      value = static_cast<double>(buf[static_cast<std::size_t>(j)]);
      return j;
    }
  }
  return -1;
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
  Index size = 1;
  for (const Index d : dims) {
    if (d < 0) fail("has a negative dimension");
  }
  for (const Index d : dims) {
    if (d != 0 && size > std::numeric_limits<Index>::max() / d) fail("has too many elements");
    size *= d;
  }
  if (data == nullptr && size != 0) fail("has null data but a non-zero size");
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

/// Throws std::invalid_argument for keys/values whose shapes disagree with each other or with the
/// dims of the first call, for a zero B, H or D, and for a key that is not finite once stored as
/// T (the first bad index). keys: [B, H, S, Dk], values: [B, H, S, Dv]
template <class T>
void check_update(const InputRows& keys, const InputRows& values, const LayerDims& dims,
                  const char* api) {
  const auto fail = [&](const std::string& what) {
    std::ostringstream os;
    os << api << ": " << what << " (keys " << shape_str(keys) << ", values " << shape_str(values)
       << ')';
    throw std::invalid_argument(os.str());
  };
  if (keys.batch != values.batch || keys.heads != values.heads || keys.seq != values.seq) {
    fail("keys and values must share B, H and S");
  }
  if (keys.batch == 0 || keys.heads == 0) fail("B and H must be >= 1");
  if (keys.dim == 0 || values.dim == 0) fail("head dim D must be >= 1");
  if (dims.known && (keys.batch != dims.batch || keys.heads != dims.heads ||
                     keys.dim != dims.key_dim || values.dim != dims.value_dim)) {
    std::ostringstream os;
    os << "B, H or D differ from the first call's (B=" << dims.batch << ", H=" << dims.heads
       << ", key D=" << dims.key_dim << ", value D=" << dims.value_dim << ")";
    fail(os.str());
  }
  // A dense input of the storage type (any layout): one pass over all of it first.
  if (keys.type == element_type_of<T>() && keys.dense &&
      all_finite(static_cast<const T*>(keys.data), keys.size())) {
    return;
  }
  std::vector<T> buf;
  double value = 0.0;
  for (Index b = 0; b < keys.batch; ++b) {
    for (Index h = 0; h < keys.heads; ++h) {
      for (Index s = 0; s < keys.seq; ++s) {
        const Index d = first_non_finite<T>(keys, b, h, s, buf, value);
        if (d < 0) continue;
        std::ostringstream os;
        os << "non-finite key at [b=" << b << ", h=" << h << ", s=" << s << ", d=" << d
           << "] (value " << value << " after conversion to the storage type)";
        fail(os.str());
      }
    }
  }
}

/// Throws std::invalid_argument for the rows of a call that a quantized format (quant.hpp) cannot
/// hold: a head dim that quant_group does not divide, or an element that is not finite or beyond
/// +-kHalfMax once converted to the storage type T (a group's offset and scale are halves).
/// `what`: "keys" or "values"; `bits_field`: "key_bits" or "value_bits". rows: [B, H, S, D]
template <class T>
void check_quantizable(const InputRows& rows, const RowFormat& f, const char* what,
                              const char* bits_field, const char* api) {
  if (rows.dim % f.group != 0) {
    std::ostringstream os;
    os << api << ": quant_group (" << f.group << ") must divide the " << what << "' head dim D ("
       << rows.dim << ") when " << bits_field << " is " << f.bits;
    throw std::invalid_argument(os.str());
  }
  for (Index b = 0; b < rows.batch; ++b) {
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

/// Throws std::invalid_argument unless `queries` fits the call: [B, G * H, S, Dk] with the keys'
/// B, S and Dk and an integer G >= 1, every element finite once converted to float32. Called after
/// check_update, before the cache changes. queries: [B, Hq, S, Dk]; keys: [B, H, S, Dk]
inline void check_queries(const InputRows& queries, const InputRows& keys, const char* api) {
  const auto fail = [&](const std::string& what) {
    std::ostringstream os;
    os << api << ": " << what << " (queries " << shape_str(queries) << ", keys " << shape_str(keys)
       << ')';
    throw std::invalid_argument(os.str());
  };
  const Index H = keys.heads;
  const Index Hq = queries.heads;
  if (queries.batch != keys.batch) fail("queries must have the keys' batch size B");
  if (Hq == 0 || Hq % H != 0) {
    fail("query heads Hq (" + std::to_string(Hq) +
         ") must be a positive multiple of the KV heads H (" + std::to_string(H) + ")");
  }
  if (queries.seq != keys.seq) fail("queries must have the keys' sequence length S");
  if (queries.dim != keys.dim) fail("queries must have the keys' head dim D");
  std::vector<float> buf;
  double value = 0.0;
  for (Index b = 0; b < queries.batch; ++b) {
    for (Index h = 0; h < Hq; ++h) {
      for (Index s = 0; s < queries.seq; ++s) {
        const Index d = first_non_finite<float>(queries, b, h, s, buf, value);
        if (d < 0) continue;
        std::ostringstream os;
        os << "non-finite query at [b=" << b << ", hq=" << h << ", s=" << s << ", d=" << d
           << "] (value " << static_cast<float>(value) << " after conversion to float32)";
        fail(os.str());
      }
    }
  }
}

}  // namespace veloxquant::cache::detail
