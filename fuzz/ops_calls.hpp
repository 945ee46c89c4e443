// fuzz target `ops` (fuzz/fuzz_ops.hpp): one call of the cache — its plan decoded from the input
// (entry point, input types, queries, what is bad about it), the shapes and data of its tensors,
// the call itself through each entry point (update_and_fetch, update_and_view,
// update_and_fetch_into, with or without queries of each type) and the window it returned.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ops_input.hpp"
#include "ops_kinds.hpp"

namespace veloxquant::fuzz::detail {

/// How a call is made (decoded by decode_call).
struct CallPlan {
  Api api = Api::Fetch;
  bool as_double = false;
  bool with_queries = false;
  int qtype = 0;  // 0 float, 1 double, 2 half
  Index G = 1;
  Bad bad = Bad::None;
  DataMode key_data = DataMode::Uniform, query_data = DataMode::Uniform;
  std::uint32_t seed = 0;  ///< of the call's data
};

/// Reads a call's plan. `mode`: the sequence's query mode; `dims_known`: whether a call fixed the
/// dims already (changing them is bad only then).
inline CallPlan decode_call(Bytes& in, QueryMode mode, bool dims_known, Bad bad) {
  const std::uint8_t f = in.u8();
  CallPlan p;
  // Bits: 0-1 entry point, 2 double inputs, 3-4 query type, 5-6 G - 1, 7 queries (mixed mode).
  p.api = static_cast<Api>((f & 3) % 3);
  p.as_double = ((f >> 2) & 1) != 0;
  p.qtype = ((f >> 3) & 3) % 3;
  p.G = 1 + ((f >> 5) & 3) % 3;
  const std::uint8_t kmode = in.u8();
  p.seed = in.u32();
  switch (mode) {
    case QueryMode::None:
      p.with_queries = false;
      break;
    case QueryMode::Always:
      p.with_queries = true;
      break;
    case QueryMode::Mixed:
      p.with_queries = ((f >> 7) & 1) != 0;
      break;
  }
  p.bad = bad;
  if (is_query_bad(bad)) p.with_queries = true;
  // Changes of dims are only bad once the first call fixed them (an empty call claiming other
  // heads fixes nothing before that).
  if (!dims_known && (bad == Bad::ChangeB || bad == Bad::ChangeH || bad == Bad::ChangeDk ||
                      bad == Bad::ChangeDv || bad == Bad::ClaimedHeads)) {
    p.bad = Bad::None;
  }
  // Keys that are bad only through conversion need the double overload (fetch_into has no
  // converting overload without queries).
  if (p.bad == Bad::OverflowKey && p.api == Api::FetchInto && !p.with_queries) p.api = Api::Fetch;
  if (p.api == Api::FetchInto && !p.with_queries) p.as_double = false;
  // A value that overflows half is stored as given (inf) when converted before the call: only the
  // converting overloads see it finite.
  if (p.bad == Bad::HugeValue && p.api == Api::FetchInto && !p.with_queries) p.api = Api::Fetch;
  if (p.bad == Bad::OverflowKey || p.bad == Bad::HugeValue) p.as_double = true;
  if (p.bad == Bad::QueryOverflow) p.qtype = 1;
  p.key_data = static_cast<DataMode>((kmode & 7) % static_cast<int>(DataMode::kCount));
  p.query_data = static_cast<DataMode>((kmode >> 3) % static_cast<int>(DataMode::kCount));
  return p;
}

/// The dims of a call: the valid ones (B, H, Dk, Dv) and those of its keys, values and queries
/// ([B, G * H, S, Dk] when valid), which a bad call changes.
struct CallDims {
  Index B = 0, H = 0, Dk = 0, Dv = 0;
  Index kB = 0, kH = 0, kS = 0, kD = 0;
  Index vB = 0, vH = 0, vS = 0, vD = 0;
  Index qB = 0, qH = 0, qS = 0, qD = 0;
};

/// The dims of a call of S tokens on a sequence of dims (B, H, Dk, Dv).
inline CallDims call_dims(const CallPlan& p, Index S, Rng& rng, Index B, Index H, Index Dk,
                          Index Dv, bool dims_known) {
  // An empty call before the first call may use any dims (it fixes nothing).
  if (!dims_known && S == 0 && p.bad == Bad::None && (p.seed & 3) == 0) {
    B = 1 + rng.below(2);
    H = 1 + rng.below(3);
    Dk = 1 + rng.below(8);
    Dv = 1 + rng.below(8);
  }
  const Index G = p.G;
  CallDims d{B, H, Dk, Dv, B, H, S, Dk, B, H, S, Dv, B, G * H, S, Dk};
  switch (p.bad) {
    case Bad::ValuesB:
      d.vB = B + 1;
      break;
    case Bad::ValuesH:
      d.vH = H + 1;
      break;
    case Bad::ValuesS:
      d.vS = S + 1;
      break;
    case Bad::ZeroB:
      d.kB = d.vB = d.qB = 0;
      break;
    case Bad::ZeroH:
      d.kH = d.vH = 0;
      d.qH = G;
      break;
    case Bad::ZeroKeyD:
      d.kD = d.qD = 0;
      break;
    case Bad::ZeroValueD:
      d.vD = 0;
      break;
    case Bad::ChangeB:
      d.kB = d.vB = d.qB = B == 1 ? 2 : 1;
      break;
    case Bad::ChangeH:
      d.kH = d.vH = (H % 3) + 1;
      d.qH = G * d.kH;
      break;
    case Bad::ChangeDk:
      d.kD = d.qD = (Dk % 8) + 1;
      break;
    case Bad::ChangeDv:
      d.vD = (Dv % 8) + 1;
      break;
    case Bad::QueryHq:
      d.qH = H >= 2 ? G * H + 1 : 0;
      break;
    case Bad::QueryB:
      d.qB = B + 1;
      break;
    case Bad::QueryS:
      d.qS = S + 1;
      break;
    case Bad::QueryD:
      d.qD = Dk + 1;
      break;
    case Bad::HugeDim:
      if (rng.below(2) == 0) {
        d.kD = d.qD = 65537;
      } else {
        d.vD = 65537;
      }
      break;
    default:
      break;
  }
  return d;
}

/// A call's tensors: drawn in double (exact in every storage type), keys and values converted to T.
template <class T>
struct CallInputs {
  vc::Tensor4<double> kd, vd, qd;
  vc::Tensor4<T> kt, vt;
  bool expect_reject = false;  ///< the call is bad (a zero-size NaN poke is no error)
};

/// Sets one entry (chosen by rng, with a random sign) of t to x; false when t is empty.
inline bool poke(vc::Tensor4<double>& t, Rng& rng, double x) {
  if (t.size() == 0) return false;
  const int at = rng.below(static_cast<int>(t.size()));
  const bool negative = rng.below(2) != 0;
  t.data()[at] = negative ? -x : x;
  return true;
}

/// Draws the call's data (after call_dims, from the same rng) and plants its bad entry.
template <class T>
CallInputs<T> call_inputs(const CallPlan& p, const CallDims& d, Rng& rng, const Rows& palette,
                          bool one_hot) {
  CallInputs<T> c{vc::Tensor4<double>(d.kB, d.kH, d.kS, d.kD),
                  vc::Tensor4<double>(d.vB, d.vH, d.vS, d.vD),
                  vc::Tensor4<double>(d.qB, d.qH, d.qS, d.qD),
                  {},
                  {},
                  p.bad != Bad::None};
  fill(c.kd, rng, p.key_data, palette, one_hot);
  fill(c.vd, rng, DataMode::Uniform, {});
  fill(c.qd, rng, p.query_data, palette, one_hot);
  // The bad entry: what it is, and whether in the queries (else the keys).
  struct Planted {
    Bad bad;
    bool in_queries;
    double x;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  // Finite magnitudes beyond the bounds (2^48 for keys and queries, 2^96 for values; half holds
  // at most 65504, so a value of 1e5 is beyond it once stored).
  const double huge_kq = std::array<double, 3>{0x1p49, 1e20, 3e38}[rng.below(3)];
  const double huge_v =
      std::is_same_v<T, Eigen::half> ? 1e5 : std::array<double, 2>{0x1p97, 3e38}[rng.below(2)];
  for (const Planted& e :
       {Planted{Bad::NanKey, false, nan}, Planted{Bad::InfKey, false, inf},
        Planted{Bad::OverflowKey, false, 1e300}, Planted{Bad::QueryNan, true, nan},
        Planted{Bad::QueryInf, true, inf}, Planted{Bad::QueryOverflow, true, 1e300},
        Planted{Bad::HugeKey, false, huge_kq}, Planted{Bad::HugeQuery, true, huge_kq}}) {
    if (p.bad == e.bad) c.expect_reject = poke(e.in_queries ? c.qd : c.kd, rng, e.x);
  }
  if (p.bad == Bad::HugeValue) c.expect_reject = poke(c.vd, rng, huge_v);
  // Valid: an empty call with queries claiming 2^40 * H heads returns the retained set at once.
  if (p.bad == Bad::ClaimedQueryHeads) c.expect_reject = false;
  // A value-only change of S with S = 0 keys still disagrees; a zero-size NaN poke is no error.
  c.kt = c.kd.template cast<T>();
  c.vt = c.vd.template cast<T>();
  return c;
}

/// The trace line of a call; (B, H, Dk, Dv): the sequence's dims.
inline std::string describe_call(const CallPlan& p, Index S, const CallDims& d, Index B, Index H,
                                 Index Dk, Index Dv) {
  std::ostringstream os;
  os << api_name(p.api) << " S=" << S << " " << bad_name(p.bad) << (p.as_double ? " double" : "")
     << (p.with_queries ? " queries G=" + std::to_string(p.G) + " qtype=" + std::to_string(p.qtype)
                        : std::string())
     << " kmode=" << static_cast<int>(p.key_data) << " qmode=" << static_cast<int>(p.query_data)
     << " seed=" << p.seed;
  if (!(d.B == B && d.H == H && d.Dk == Dk && d.Dv == Dv)) {
    os << " dims=" << d.B << "," << d.H << "," << d.Dk << "," << d.Dv;
  }
  return os.str();
}

/// The window a call returned, copied out of the tensors or the view: per head n rows, or under
/// adaptive head budgets (SPEC 14) each view head its own rows (n = -1 then: ragged).
template <class T>
struct Window {
  Index B = 0, H = 0, n = 0, S = 0, Dk = 0, Dv = 0;
  std::vector<T> keys, values;  // head after head: [rows[i], Dk], [rows[i], Dv]
  Positions positions;          // head after head: [rows[i]] (views only)
  std::vector<Index> rows;      // per head (b-major)
  std::vector<Index> first;     // per head: the index of its first row in keys / values
  bool is_view = false;
  bool ragged = false;      ///< the view said ragged()
  bool rows_threw = false;  ///< the view's rows() threw std::logic_error
  /// The row index of row r of head i in keys / values / positions.
  Index at(Index i, Index r) const { return first[static_cast<std::size_t>(i)] + r; }
};

template <class T>
Window<T> from_pair(const vc::KVPair<T>& kv) {
  Window<T> w;
  w.B = kv.first.dimension(0);
  w.H = kv.first.dimension(1);
  w.n = kv.first.dimension(2);
  w.Dk = kv.first.dimension(3);
  w.Dv = kv.second.dimension(3);
  // Values must agree in B, H, n.
  if (kv.second.dimension(0) != w.B || kv.second.dimension(1) != w.H ||
      kv.second.dimension(2) != w.n) {
    w.n = -1;
    return w;
  }
  w.keys.assign(kv.first.data(), kv.first.data() + kv.first.size());
  w.values.assign(kv.second.data(), kv.second.data() + kv.second.size());
  for (Index i = 0; i < w.B * w.H; ++i) {
    w.rows.push_back(w.n);
    w.first.push_back(i * w.n);
  }
  return w;
}

template <class T>
Window<T> from_view(const vc::KVView<T>& v) {
  Window<T> w;
  w.is_view = true;
  w.B = v.batch();
  w.H = v.heads();
  w.ragged = v.ragged();
  try {
    w.n = v.rows();
  } catch (const std::logic_error&) {
    w.rows_threw = true;
    w.n = -1;
  }
  w.S = v.new_rows();
  w.Dk = v.key_dim();
  w.Dv = v.value_dim();
  for (Index b = 0; b < w.B; ++b) {
    for (Index h = 0; h < w.H; ++h) {
      const Index n = v.rows(b, h);
      w.first.push_back(static_cast<Index>(w.positions.size()));
      w.rows.push_back(n);
      if (n == 0) continue;
      const auto k = v.keys(b, h);
      const auto val = v.values(b, h);
      const auto pos = v.positions(b, h);
      for (Index r = 0; r < n; ++r) {
        for (Index d = 0; d < w.Dk; ++d) w.keys.push_back(k(r, d));
        for (Index d = 0; d < w.Dv; ++d) w.values.push_back(val(r, d));
        w.positions.push_back(pos(r));
      }
    }
  }
  return w;
}

/// A call with queries q (of the plan's query type: a tensor or a TensorRef) through the plan's
/// entry point.
template <class T, class QT>
Window<T> invoke_q(vc::KVCache<T>& c, vc::KVPair<T>& out, const CallPlan& p,
                   const CallInputs<T>& in, const QT& q) {
  switch (p.api) {
    case Api::Fetch:
      return from_pair(p.as_double ? c.update_and_fetch(in.kd, in.vd, q)
                                   : c.update_and_fetch(in.kt, in.vt, q));
    case Api::View:
      return from_view(p.as_double ? c.update_and_view(in.kd, in.vd, q)
                                   : c.update_and_view(in.kt, in.vt, q));
    case Api::FetchInto:
      if (p.as_double) {
        c.update_and_fetch_into(in.kd, in.vd, q, out);
      } else {
        c.update_and_fetch_into(in.kt, in.vt, q, out);
      }
      return from_pair(out);
  }
  return {};
}

/// Calls the cache through the chosen entry point and copies what it returned (`out`: the output
/// reused by update_and_fetch_into).
template <class T>
Window<T> invoke(vc::KVCache<T>& c, vc::KVPair<T>& out, const CallPlan& p,
                 const CallInputs<T>& in) {
  if (p.bad == Bad::ClaimedHeads || p.bad == Bad::OverflowShape) {
    // Shapes that claim what no data backs: refused at once, nothing walked or sized.
    const Index big = Index{1} << 20, huge = Index{1} << 62;
    const vc::TensorRef<T> r = p.bad == Bad::ClaimedHeads
                                   ? vc::TensorRef<T>(nullptr, big, big, 0, in.kt.dimension(3))
                                   : vc::TensorRef<T>(nullptr, 0, huge, huge, huge);
    switch (p.api) {
      case Api::Fetch:
        return from_pair(c.update_and_fetch(r, r));
      case Api::View:
        return from_view(c.update_and_view(r, r));
      case Api::FetchInto:
        c.update_and_fetch_into(r, r, out);
        return from_pair(out);
    }
  }
  if (p.bad == Bad::ClaimedQueryHeads) {
    const vc::TensorRef<float> q(nullptr, in.kt.dimension(0), (Index{1} << 40) * in.kt.dimension(1),
                                 0, in.kt.dimension(3));
    return invoke_q(c, out, p, in, q);
  }
  if (!p.with_queries) {
    switch (p.api) {
      case Api::Fetch:
        return from_pair(p.as_double ? c.update_and_fetch(in.kd, in.vd)
                                     : c.update_and_fetch(in.kt, in.vt));
      case Api::View:
        return from_view(p.as_double ? c.update_and_view(in.kd, in.vd)
                                     : c.update_and_view(in.kt, in.vt));
      case Api::FetchInto:
        c.update_and_fetch_into(in.kt, in.vt, out);
        return from_pair(out);
    }
  }
  switch (p.qtype) {
    case 1:
      return invoke_q(c, out, p, in, in.qd);
    case 2:
      return invoke_q(c, out, p, in, vc::Tensor4<Eigen::half>(in.qd.template cast<Eigen::half>()));
    default:
      return invoke_q(c, out, p, in, vc::Tensor4<float>(in.qd.template cast<float>()));
  }
}

}  // namespace veloxquant::fuzz::detail
