// veloxquant — the seam between a cache's state and the prompt-cache file (docs/design.md G).
//
// Each cache class writes and restores its own state (KVCache::write_state / read_state,
// SqueezeAttentionCache adds its own over them); the file's container (prompt_cache.hpp) frames
// that state and knows none of it. The container hands a class a StateWriter or a StateReader: the
// class puts or takes its descriptor fields, closes the descriptor, then puts or takes one block
// per head; the framing behind those calls (a checksum per descriptor and per head block, the
// loader's allocation charges and row limit, the where-in-the-file of messages) and the table of
// coordinators the caches share (StateLinks) are the container's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "byte_io.hpp"
#include "../head_store.hpp"

namespace veloxquant::cache {
class SqueezeCoordinator;  // squeeze_coordinator.hpp; held here by pointer only
}  // namespace veloxquant::cache

namespace veloxquant::cache::detail {

/// What the loader charges for each object it creates (docs/design.md G, "Memory"), part of the
/// format's rules so that a writer and a reader anywhere agree on which sets fit: a metadata entry,
/// a coordinator, one of its reports, a cache, a head (its bookkeeping beyond the rows).
inline constexpr std::uint64_t kChargeMetadataEntry = 128;
inline constexpr std::uint64_t kChargeCoordinator = 512;
inline constexpr std::uint64_t kChargeReport = 64;
inline constexpr std::uint64_t kChargeCache = 4096;
inline constexpr std::uint64_t kChargeHead = 1024;

/// The coordinators a set's caches share, by their index in the file's coordinator table. Saving,
/// the table is built in order of first use (link); loading, it is the file's table, and a cache
/// takes its entry by index (take), which counts the use.
class StateLinks {
 public:
  StateLinks() = default;
  explicit StateLinks(std::vector<std::shared_ptr<SqueezeCoordinator>> table)
      : table_(std::move(table)), uses_(table_.size(), 0) {}

  /// Saving: the index of `co` in the table, added at its first use; -1 for none.
  std::int32_t link(const SqueezeCoordinator* co) {
    if (co == nullptr) return -1;
    std::size_t k = 0;
    while (k < saved_.size() && saved_[k] != co) ++k;
    if (k == saved_.size()) saved_.push_back(co);
    return static_cast<std::int32_t>(k);
  }
  /// Saving: the table, in order of first use.
  const std::vector<const SqueezeCoordinator*>& saved() const { return saved_; }

  /// Loading: entry `index` of the file's table (null for -1). Throws std::invalid_argument for an
  /// index outside the table.
  std::shared_ptr<SqueezeCoordinator> take(std::int32_t index) {
    if (index == -1) return nullptr;
    if (index < 0 || static_cast<std::size_t>(index) >= table_.size()) {
      throw std::invalid_argument("coordinator index " + std::to_string(index) +
                                  " is not in the table (" + std::to_string(table_.size()) +
                                  " entries)");
    }
    ++uses_[static_cast<std::size_t>(index)];
    return table_[static_cast<std::size_t>(index)];
  }
  /// Forking (docs/design.md 10.1): once link() has seen every coordinator of a set, the table
  /// becomes a copy of each, `copy(co)` making one, so that counterpart(co) is co's copy.
  template <class Copy>
  void copy_saved(const Copy& copy) {
    std::vector<std::shared_ptr<SqueezeCoordinator>> table;
    for (const SqueezeCoordinator* co : saved_) table.push_back(copy(*co));
    table_.swap(table);
    uses_.assign(table_.size(), 0);
  }
  /// Forking: the copy of `co` (null for null).
  std::shared_ptr<SqueezeCoordinator> counterpart(const SqueezeCoordinator* co) {
    return take(link(co));
  }
  /// Loading: the first entry of the table no cache took, or -1.
  std::int64_t first_unused() const {
    for (std::size_t i = 0; i < uses_.size(); ++i) {
      if (uses_[i] == 0) return static_cast<std::int64_t>(i);
    }
    return -1;
  }

 private:
  std::vector<const SqueezeCoordinator*> saved_;
  std::vector<std::shared_ptr<SqueezeCoordinator>> table_;
  std::vector<int> uses_;
};

/// The writing side of a cache's state: fields go to out(); the calls below frame them.
class StateWriter {
 public:
  StateWriter(ByteWriter& out, StateLinks& links) : out_(out), links_(links) {}

  /// The cache being written, for messages ("cache 3").
  void set_name(std::string name) { name_ = std::move(name); }
  ByteWriter& out() { return out_; }
  StateLinks& links() { return links_; }

  /// Closes the cache's descriptor (its checksum, the loader's charge for the cache).
  void end_descriptor() {
    out_.end_section();
    out_.charge(kChargeCache, "the caches");
  }
  /// Opens a head block.
  void begin_head() { out_.begin_section(); }
  /// The positions of slots src (i64 each), in that order.
  template <class T>
  void positions(const HeadStore<T>& h, const std::vector<Slot>& src) {
    put_each<std::int64_t>(src, [&](Slot s) { return h.position(s); });
  }
  /// The scores of slots src (f32 each), in that order.
  template <class T>
  void scores(const HeadStore<T>& h, const std::vector<Slot>& src) {
    put_each<float>(src, [&](Slot s) { return h.score(s); });
  }
  /// The stored key rows of slots src, then their value rows, raw. A row (key and value) larger
  /// than the loader may allocate at this point of the file cannot be saved
  /// (std::invalid_argument, docs/design.md G).
  template <class T>
  void rows(const HeadStore<T>& h, const std::vector<Slot>& src) {
    const std::uint64_t slot_bytes = h.slot_bytes();
    if (slot_bytes > out_.allowance()) {
      out_.refuse(name_ + ": a row of " + std::to_string(slot_bytes) +
                  " bytes (key and value) is more than the loader may allocate at that point of "
                  "the file (docs/design.md G)");
    }
    put_rows(h, src, true);
    put_rows(h, src, false);
  }
  /// Closes a head block (its checksum, the loader's charge for the head).
  void end_head() {
    out_.end_section();
    out_.charge(kChargeHead, name_ + "'s heads");
  }
  /// A buffer for the slot order of a head (HeadStore::compacted_slots), reused between heads.
  std::vector<Slot>& slots() { return src_; }

 private:
  template <class X, class Get>
  void put_each(const std::vector<Slot>& src, Get get) {
    buf_.resize(src.size() * sizeof(X));
    for (std::size_t i = 0; i < src.size(); ++i) {
      const X x = get(src[i]);
      std::memcpy(buf_.data() + i * sizeof(X), &x, sizeof(X));
    }
    out_.bytes(buf_.data(), buf_.size());
  }
  // The stored key (value) rows of slots src, a run of consecutive slots per write.
  template <class T>
  void put_rows(const HeadStore<T>& h, const std::vector<Slot>& src, bool keys) {
    const Index stride = keys ? h.key_stride() : h.value_stride();
    const auto row_bytes = static_cast<std::size_t>(stride) * sizeof(T);
    for (std::size_t i = 0; i < src.size();) {
      std::size_t j = i + 1;
      while (j < src.size() && src[j] == src[j - 1] + 1) ++j;
      out_.bytes(keys ? h.key_ptr(src[i]) : h.value_ptr(src[i]), (j - i) * row_bytes);
      i = j;
    }
  }

  ByteWriter& out_;
  StateLinks& links_;
  std::string name_;
  std::vector<Slot> src_;
  std::vector<char> buf_;
};

/// The reading side: fields come from in(); the calls below frame them. A class reading its state
/// reports a state no cache can be in by throwing std::invalid_argument naming the problem; the
/// container turns that into its own error, naming the part of the file (in().where()).
class StateReader {
 public:
  /// `label` names the cache in messages ("cache 3 (squeeze)").
  StateReader(ByteReader& in, StateLinks& links, std::string label)
      : in_(in), links_(links), label_(std::move(label)) {}

  ByteReader& in() { return in_; }
  StateLinks& links() { return links_; }

  /// Closes the cache's descriptor: compares its checksum, charges the cache.
  void end_descriptor() {
    in_.end_section();
    in_.charge(kChargeCache, "the caches");
    in_.set_where(label_);
  }
  /// Opens the block of head (b, h).
  void begin_head(Index b, Index h) {
    in_.set_where(label_ + ", head (" + std::to_string(b) + ", " + std::to_string(h) + ")");
    in_.begin_section();
  }
  /// n stored key rows, then n value rows, into the head's own buffers, which grow no faster than
  /// the reader's allowance (a crafted row count allocates nothing the file does not hold).
  template <class T>
  void rows(HeadStore<T>& head, Index n) {
    take_rows(head, n, true);
    take_rows(head, n, false);
  }
  /// Closes a head block: compares its checksum.
  void end_head() { in_.end_section(); }
  /// Charges a head the class keeps.
  void keep_head() { in_.charge(kChargeHead, "the heads"); }

 private:
  template <class T>
  void take_rows(HeadStore<T>& head, Index n, bool keys) {
    if (n == 0) return;
    const auto slot_bytes = static_cast<std::uint64_t>(head.slot_bytes());
    if (slot_bytes > in_.allowance()) {
      in_.fail("a row of " + std::to_string(slot_bytes) + " bytes is more than may be allocated " +
               "this early in the file");
    }
    const Index stride = keys ? head.key_stride() : head.value_stride();
    const auto row_bytes = static_cast<std::size_t>(stride) * sizeof(T);
    Index done = 0;
    while (done < n) {
      if (head.capacity() < n && head.capacity() <= done) {
        const auto room = static_cast<Index>(
            std::min<std::uint64_t>(in_.allowance() / slot_bytes, static_cast<std::uint64_t>(n)));
        head.grow_for_restore(std::min(n, std::max(done + room, done + 1)), done);
      }
      const Index upto = std::min(n, head.capacity());
      T* dst = keys ? head.key_ptr(done) : head.value_ptr(done);
      in_.bytes(dst, static_cast<std::size_t>(upto - done) * row_bytes);
      done = upto;
    }
  }

  ByteReader& in_;
  StateLinks& links_;
  std::string label_;
};

}  // namespace veloxquant::cache::detail
