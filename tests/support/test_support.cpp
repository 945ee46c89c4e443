// The test support functions the sanitized suite spent most of its time in (random inputs, their
// conversion to a storage type, the element-by-element checks of what a call returned), compiled
// once with the library's instances (tests/CMakeLists.txt; -O1 in scripts/test.sh) instead of at
// -O0 in every test TU. Declared, with their contracts, in support/test_support.hpp.
//
// It is linked into test_contract_q84, whose TU sees other VELOXQUANT_TEST_KEY_BITS / VALUE_BITS:
// nothing defined here may use kKeyBits, kValueBits, kQuantized, dim() or bad_calls().
#include "support/test_support.hpp"

namespace veloxquant::test {

cache::Tensor4<double> random_doubles(std::mt19937& rng, Index B, Index H, Index S, Index D) {
  std::normal_distribution<double> dist(0.0, 1.0);
  cache::Tensor4<double> t(B, H, S, D);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = dist(rng);
  return t;
}

template <class T>
cache::Tensor4<T> converted(const cache::Tensor4<double>& t) {
  cache::Tensor4<T> out(t.dimensions());
  for (Index i = 0; i < t.size(); ++i) out.data()[i] = static_cast<T>(t.data()[i]);
  return out;
}

template <class T>
cache::Tensor4<T> random_tensor(std::mt19937& rng, Index B, Index H, Index S, Index D) {
  return converted<T>(random_doubles(rng, B, H, S, D));
}

template <class T>
std::string compare_returned(const cache::KVPair<T>& got,
                             const std::vector<std::vector<reference::OracleRow>>& before,
                             const cache::Tensor4<T>& keys, const cache::Tensor4<T>& values,
                             Index B, Index H, Index Dk, Index Dv) {
  std::ostringstream err;
  const Index S = keys.dimension(2);
  const auto n_before = static_cast<Index>(before.front().size());
  const Index n = n_before + S;
  if (shape_of(got.first) != Shape{B, H, n, Dk} || shape_of(got.second) != Shape{B, H, n, Dv}) {
    err << "returned " << got.first.dimension(2) << " rows, expected " << n_before << " + " << S;
    return err.str();
  }
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const auto& prev = before[static_cast<std::size_t>(b * H + h)];
      for (Index r = 0; r < n; ++r) {
        const bool old = r < n_before;
        const auto pr = static_cast<std::size_t>(r);
        for (Index d = 0; d < Dk; ++d) {
          const double want = old ? prev[pr].key[static_cast<std::size_t>(d)]
                                  : to_double(keys(b, h, r - n_before, d));
          if (to_double(got.first(b, h, r, d)) != want) {
            err << "returned key differs at head (" << b << ", " << h << ") row " << r << " d "
                << d;
            return err.str();
          }
        }
        for (Index d = 0; d < Dv; ++d) {
          const double want = old ? prev[pr].value[static_cast<std::size_t>(d)]
                                  : to_double(values(b, h, r - n_before, d));
          if (to_double(got.second(b, h, r, d)) != want) {
            err << "returned value differs at head (" << b << ", " << h << ") row " << r << " d "
                << d;
            return err.str();
          }
        }
      }
    }
  }
  return err.str();
}

template <class T>
std::string compare_state_row(const cache::KVPair<T>& st, Index b, Index h, Index r,
                              const reference::OracleRow& row) {
  std::ostringstream err;
  for (Index d = 0; d < st.first.dimension(3); ++d) {
    if (to_double(st.first(b, h, r, d)) != row.key[static_cast<std::size_t>(d)]) {
      err << "state() key differs at head (" << b << ", " << h << ") row " << r << " (position "
          << row.position << ") d " << d;
      return err.str();
    }
  }
  for (Index d = 0; d < st.second.dimension(3); ++d) {
    if (to_double(st.second(b, h, r, d)) != row.value[static_cast<std::size_t>(d)]) {
      err << "state() value differs at head (" << b << ", " << h << ") row " << r << " (position "
          << row.position << ") d " << d;
      return err.str();
    }
  }
  return "";
}

template <class T>
std::string compare_view(const cache::KVView<T>& view,
                         const std::vector<std::vector<reference::OracleRow>>& before,
                         const cache::Tensor4<T>& keys, const cache::Tensor4<T>& values,
                         std::int64_t offset_before) {
  std::ostringstream err;
  const Index B = keys.dimension(0), H = keys.dimension(1), S = keys.dimension(2);
  const Index Dk = keys.dimension(3), Dv = values.dimension(3);
  const auto n_before = static_cast<Index>(before.front().size());
  if (view.rows() != n_before + S || view.new_rows() != S || view.batch() != B ||
      view.heads() != H || view.key_dim() != Dk || view.value_dim() != Dv) {
    err << "view has " << view.rows() << " rows (" << view.new_rows() << " new), expected "
        << n_before << " + " << S;
    return err.str();
  }
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      const auto& prev = before[static_cast<std::size_t>(b * H + h)];
      std::map<std::int64_t, std::size_t> index_of;
      for (std::size_t i = 0; i < prev.size(); ++i) index_of[prev[i].position] = i;
      const auto k = view.keys(b, h);
      const auto v = view.values(b, h);
      const auto p = view.positions(b, h);
      std::vector<std::int64_t> old_positions;
      for (Index r = 0; r < view.rows(); ++r) {
        const std::int64_t pos = p(r);
        std::vector<double> want_k, want_v;
        if (r < n_before) {
          old_positions.push_back(pos);
          const auto it = index_of.find(pos);
          if (it == index_of.end()) {
            err << "view row " << r << " of head (" << b << ", " << h << ") has position " << pos
                << ", not retained before the call";
            return err.str();
          }
          want_k = prev[it->second].key;
          want_v = prev[it->second].value;
        } else {
          if (pos != offset_before + (r - n_before)) {
            err << "view row " << r << " of head (" << b << ", " << h << ") has position " << pos
                << ", expected the call's token " << offset_before + (r - n_before);
            return err.str();
          }
          want_k = row_of(keys, b, h, r - n_before);
          want_v = row_of(values, b, h, r - n_before);
        }
        for (Index d = 0; d < Dk; ++d) {
          if (to_double(k(r, d)) != want_k[static_cast<std::size_t>(d)]) {
            err << "view key differs at head (" << b << ", " << h << ") row " << r << " d " << d;
            return err.str();
          }
        }
        for (Index d = 0; d < Dv; ++d) {
          if (to_double(v(r, d)) != want_v[static_cast<std::size_t>(d)]) {
            err << "view value differs at head (" << b << ", " << h << ") row " << r << " d " << d;
            return err.str();
          }
        }
      }
      std::sort(old_positions.begin(), old_positions.end());
      std::vector<std::int64_t> want_positions;
      for (const auto& row : prev) want_positions.push_back(row.position);
      if (old_positions != want_positions) {
        err << "view of head (" << b << ", " << h
            << ") is not a permutation of the rows retained before the call";
        return err.str();
      }
    }
  }
  return err.str();
}

#define VELOXQUANT_TEST_SUPPORT_INSTANCE(T)                               \
  template cache::Tensor4<T> converted<T>(const cache::Tensor4<double>&); \
  template cache::Tensor4<T> random_tensor<T>(std::mt19937&, Index, Index, Index, Index);
VELOXQUANT_TEST_SUPPORT_TYPES(VELOXQUANT_TEST_SUPPORT_INSTANCE)
#undef VELOXQUANT_TEST_SUPPORT_INSTANCE
#define VELOXQUANT_TEST_CHECKS_INSTANCE(T) VELOXQUANT_TEST_CHECKS(template, T)
VELOXQUANT_TEST_STORAGE_TYPES(VELOXQUANT_TEST_CHECKS_INSTANCE)
#undef VELOXQUANT_TEST_CHECKS_INSTANCE

}  // namespace veloxquant::test
