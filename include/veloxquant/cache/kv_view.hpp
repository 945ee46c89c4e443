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

/// Zero-copy view of the rows a call hands back: one block of `rows()` rows per (b, h), living in
/// the cache's own storage. Valid until the next non-const call on the cache. Rows retained before
/// the call may come in any order (positions() says which is which); the rows of the call come
/// last, in arrival order.
template <class T>
class KVView {
 public:
  using RowsMap =
      Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  using PositionsMap = Eigen::Map<const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>>;

  /// A view of `heads`; with copy_keys and copy_values (a quantized cache, docs/design.md 2.3)
  /// the keys and values come from that dequantized copy of the window instead: [B·H, rows, Dk]
  /// and [B·H, rows, Dv].
  KVView(const std::vector<detail::HeadStore<T>>* heads, Eigen::Index batch, Eigen::Index n_heads,
         Eigen::Index key_dim, Eigen::Index value_dim, Eigen::Index rows, Eigen::Index new_rows,
         const T* copy_keys = nullptr, const T* copy_values = nullptr)
      : heads_(heads),
        copy_k_(copy_keys),
        copy_v_(copy_values),
        batch_(batch),
        n_heads_(n_heads),
        key_dim_(key_dim),
        value_dim_(value_dim),
        rows_(rows),
        new_rows_(new_rows) {}

  /// Rows per head in this window (the same for every head).
  Eigen::Index rows() const { return rows_; }
  /// Rows of the current call among them (the last new_rows() rows).
  Eigen::Index new_rows() const { return new_rows_; }
  Eigen::Index batch() const { return batch_; }
  Eigen::Index heads() const { return n_heads_; }
  Eigen::Index key_dim() const { return key_dim_; }
  Eigen::Index value_dim() const { return value_dim_; }

  /// Keys of head (b, h): [rows(), Dk].
  RowsMap keys(Eigen::Index b, Eigen::Index h) const {
    if (copy_k_ && rows_) {
      (void)head(b, h);
      return RowsMap(copy_k_ + (b * n_heads_ + h) * rows_ * key_dim_, rows_, key_dim_);
    }
    return RowsMap(rows_ ? head(b, h).keys_data() : nullptr, rows_, key_dim_);
  }
  /// Values of head (b, h): [rows(), Dv].
  RowsMap values(Eigen::Index b, Eigen::Index h) const {
    if (copy_v_ && rows_) {
      (void)head(b, h);
      return RowsMap(copy_v_ + (b * n_heads_ + h) * rows_ * value_dim_, rows_, value_dim_);
    }
    return RowsMap(rows_ ? head(b, h).values_data() : nullptr, rows_, value_dim_);
  }
  /// Position of each row of head (b, h): [rows()].
  PositionsMap positions(Eigen::Index b, Eigen::Index h) const {
    return PositionsMap(rows_ ? head(b, h).positions_data() : nullptr, rows_);
  }

 private:
  // Throws std::out_of_range for a head outside [0, B) x [0, H) (also on an empty view).
  const detail::HeadStore<T>& head(Eigen::Index b, Eigen::Index h) const {
    if (b < 0 || b >= batch_ || h < 0 || h >= n_heads_) {
      throw std::out_of_range("KVView: head (" + std::to_string(b) + ", " + std::to_string(h) +
                              ") out of range");
    }
    return (*heads_)[static_cast<std::size_t>(b * n_heads_ + h)];
  }

  const std::vector<detail::HeadStore<T>>* heads_;
  const T* copy_k_;
  const T* copy_v_;
  Eigen::Index batch_, n_heads_, key_dim_, value_dim_, rows_, new_rows_;
};

}  // namespace veloxquant::cache
