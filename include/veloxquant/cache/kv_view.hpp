// veloxquant — KVView<T>, the zero-copy window of one call (docs/design.md 2.3): maps of the rows
// a cache's update_and_view hands back, living in the cache's own storage. Included by
// kv_cache.hpp.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "detail/head_store.hpp"

namespace veloxquant::cache {

/// Zero-copy view of the rows a call hands back: one block of rows per (b, h), living in the
/// cache's own storage. Valid until the next non-const call on the cache. Rows retained before the
/// call may come in any order (positions() says which is which); the rows of the call come last,
/// in arrival order. Every head holds the same number of rows, rows(), except under adaptive head
/// budgets (SPEC 14, docs/design.md 4.9), where head (b, h) holds rows(b, h).
template <class T>
class KVView {
 public:
  using RowsMap =
      Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  using PositionsMap = Eigen::Map<const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>>;

  /// A view of `heads` holding `rows` rows each (-1: heads of different lengths, each its own
  /// physical rows); with copy_keys and copy_values (a quantized cache, docs/design.md 2.3) the
  /// keys and values come from that dequantized copy of the window instead: [B·H, stride, Dk] and
  /// [B·H, stride, Dv] (stride: `rows` unless given).
  KVView(const std::vector<detail::HeadStore<T>>* heads, Eigen::Index batch, Eigen::Index n_heads,
         Eigen::Index key_dim, Eigen::Index value_dim, Eigen::Index rows, Eigen::Index new_rows,
         const T* copy_keys = nullptr, const T* copy_values = nullptr, Eigen::Index stride = -1)
      : heads_(heads),
        copy_k_(copy_keys),
        copy_v_(copy_values),
        batch_(batch),
        n_heads_(n_heads),
        key_dim_(key_dim),
        value_dim_(value_dim),
        rows_(rows),
        new_rows_(new_rows),
        stride_(stride < 0 ? rows : stride) {}

  /// Rows per head in this window, the same for every head. Throws std::logic_error when the
  /// heads hold different numbers of rows (adaptive head budgets, a KVzip compress): ask
  /// rows(b, h).
  Eigen::Index rows() const {
    if (rows_ < 0) {
      throw std::logic_error(
          "KVView::rows: the heads hold different numbers of rows (adaptive head budgets or a "
          "KVzip compress); use rows(b, h)");
    }
    return rows_;
  }
  /// Rows of head (b, h) in this window (its keys, values and positions have that many; the
  /// call's rows come last). Throws std::out_of_range for a head outside [0, B) x [0, H).
  Eigen::Index rows(Eigen::Index b, Eigen::Index h) const {
    const std::size_t i = index(b, h);
    if (rows_ >= 0) return rows_;
    return (*heads_)[i].physical();
  }
  /// Whether the heads hold different numbers of rows (rows() then throws).
  bool ragged() const { return rows_ < 0; }
  /// Rows of the current call among each head's (its last new_rows() rows).
  Eigen::Index new_rows() const { return new_rows_; }
  Eigen::Index batch() const { return batch_; }
  Eigen::Index heads() const { return n_heads_; }
  Eigen::Index key_dim() const { return key_dim_; }
  Eigen::Index value_dim() const { return value_dim_; }

  /// Keys of head (b, h): [rows(b, h), Dk].
  RowsMap keys(Eigen::Index b, Eigen::Index h) const {
    const Eigen::Index n = rows(b, h);
    if (n == 0) return RowsMap(nullptr, 0, key_dim_);
    if (copy_k_) return RowsMap(copy_k_ + (b * n_heads_ + h) * stride_ * key_dim_, n, key_dim_);
    return RowsMap(head(b, h).keys_data(), n, key_dim_);
  }
  /// Values of head (b, h): [rows(b, h), Dv].
  RowsMap values(Eigen::Index b, Eigen::Index h) const {
    const Eigen::Index n = rows(b, h);
    if (n == 0) return RowsMap(nullptr, 0, value_dim_);
    if (copy_v_) {
      return RowsMap(copy_v_ + (b * n_heads_ + h) * stride_ * value_dim_, n, value_dim_);
    }
    return RowsMap(head(b, h).values_data(), n, value_dim_);
  }
  /// Position of each row of head (b, h): [rows(b, h)].
  PositionsMap positions(Eigen::Index b, Eigen::Index h) const {
    const Eigen::Index n = rows(b, h);
    return PositionsMap(n ? head(b, h).positions_data() : nullptr, n);
  }

 private:
  // Index of head (b, h); throws std::out_of_range outside [0, B) x [0, H) (also on an empty view).
  std::size_t index(Eigen::Index b, Eigen::Index h) const {
    if (b < 0 || b >= batch_ || h < 0 || h >= n_heads_) {
      throw std::out_of_range("KVView: head (" + std::to_string(b) + ", " + std::to_string(h) +
                              ") out of range");
    }
    return static_cast<std::size_t>(b * n_heads_ + h);
  }
  const detail::HeadStore<T>& head(Eigen::Index b, Eigen::Index h) const {
    return (*heads_)[index(b, h)];
  }

  const std::vector<detail::HeadStore<T>>* heads_;
  const T* copy_k_;
  const T* copy_v_;
  Eigen::Index batch_, n_heads_, key_dim_, value_dim_, rows_, new_rows_, stride_;
};

}  // namespace veloxquant::cache
