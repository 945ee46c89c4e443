// veloxquant — the byte layer of the prompt-cache format (docs/design.md G): little-endian fields
// and raw blocks to and from a standard stream, a CRC-32C per section, and reads that never
// allocate ahead of the data by more than a fixed grant plus what has already been read, so a count
// field of 2^62 in a crafted file costs nothing before the file runs out.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "crc32c.hpp"

namespace veloxquant::cache::detail {

/// True on a little-endian host: the format's byte order, in which blocks of rows, positions and
/// scores are written exactly as they lie in memory.
inline bool little_endian_host() {
  const std::uint16_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

/// Bytes read or written per step of a large block: the stream copies a piece, then the CRC reads
/// it while it is still in cache (L2), at its own speed instead of memory's (measured on 1 GB: 256
/// KiB pieces 145 ms, 64 KiB 151 ms, 16 KiB 167 ms, CRC before the copy 182 ms; memcpy 83 ms).
inline constexpr std::size_t kIoChunk = std::size_t{1} << 18;

/// What the loader may allocate beyond what the file's bytes pay for (docs/design.md G, "Memory"):
/// reads allocate at most this plus the bytes read so far ahead of their data, and the objects it
/// creates (metadata entries, coordinators, caches, heads) are charged against the same amount.
inline constexpr std::uint64_t kLoadGrant = std::uint64_t{1} << 20;

/// Little-endian fields and raw blocks to a stream; the CRC-32C of the section in progress.
/// Throws std::runtime_error(`api`: ...) when the stream fails. Without a stream it only counts
/// (a dry run: the save checks the loader's memory rules on it before writing a byte).
class ByteWriter {
 public:
  ByteWriter(std::ostream* out, const char* api) : out_(out), api_(api) {}

  void u8(std::uint8_t v) { put(&v, 1); }
  void u32(std::uint32_t v) { le(v); }
  void i32(std::int32_t v) { le(static_cast<std::uint32_t>(v)); }
  void u64(std::uint64_t v) { le(v); }
  void i64(std::int64_t v) { le(static_cast<std::uint64_t>(v)); }
  void f32(float v) {
    std::uint32_t b;
    std::memcpy(&b, &v, 4);
    le(b);
  }
  void f64(double v) {
    std::uint64_t b;
    std::memcpy(&b, &v, 8);
    le(b);
  }
  /// A u32 length, then the bytes. Throws std::invalid_argument beyond 2^32 - 1 bytes.
  void string(const std::string& s, const char* what) {
    if (s.size() > std::numeric_limits<std::uint32_t>::max()) {
      throw std::invalid_argument(std::string(api_) + ": " + what +
                                  " is longer than 2^32 - 1 bytes");
    }
    u32(static_cast<std::uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  /// Raw bytes (blocks already in the format's byte order).
  void bytes(const void* p, std::size_t n) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const std::size_t k = std::min(n, kIoChunk);
      put(c, k);
      c += k;
      n -= k;
    }
  }

  /// Starts a section: its CRC covers every byte written until end_section().
  void begin_section() { crc_ = 0; }
  /// Writes the section's CRC-32C (u32, not itself part of any section).
  void end_section() {
    const std::uint32_t c = crc_;
    le(c);
  }
  std::uint64_t written() const { return written_; }

  /// What the loader may allocate at this point of the file (ByteReader::allowance()).
  std::uint64_t allowance() const { return kLoadGrant + written_; }
  /// The loader's charge for an object it creates here (ByteReader::charge): a set it would
  /// refuse cannot be saved (std::invalid_argument naming `what`).
  void charge(std::uint64_t bytes, const std::string& what) {
    charged_ += bytes;
    if (charged_ > allowance()) {
      refuse(what + " would hold more memory when loaded than the file's data allows (" +
             std::to_string(charged_) + " bytes charged against " + std::to_string(allowance()) +
             ", docs/design.md G)");
    }
  }
  [[noreturn]] void refuse(const std::string& why) const {
    throw std::invalid_argument(std::string(api_) + ": this set cannot be saved: " + why);
  }

 private:
  template <class U>
  void le(U v) {
    unsigned char b[sizeof(U)];
    for (std::size_t i = 0; i < sizeof(U); ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    put(b, sizeof(U));
  }
  void put(const void* p, std::size_t n) {
    if (out_ == nullptr) {
      written_ += n;
      return;
    }
    out_->write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
    if (!*out_) {
      throw std::runtime_error(std::string(api_) + ": writing failed after " +
                               std::to_string(written_) + " bytes");
    }
    // After the copy: the piece is in cache now, where the CRC runs at its own speed.
    crc_ = crc32c(crc_, p, n);
    written_ += n;
  }

  std::ostream* out_;
  const char* api_;
  std::uint32_t crc_ = 0;
  std::uint64_t written_ = 0;
  std::uint64_t charged_ = 0;
};

/// Little-endian fields and raw blocks from a stream, with the CRC-32C of the section in progress
/// and a running count of the bytes read. Every failure is a std::runtime_error naming the part of
/// the file being read (where()).
class ByteReader {
 public:
  /// `verify`: compare each section's CRC (false only in the fuzzer, to reach the structure
  /// behind the checksums).
  /// `source` names the input in messages (a path, or empty for a stream).
  ByteReader(std::istream& in, bool verify, std::string source = "")
      : in_(in), verify_(verify), source_(std::move(source)) {}

  /// The part of the file being read, for messages ("cache 3, head (0, 5)").
  void set_where(std::string where) { where_ = std::move(where); }
  const std::string& where() const { return where_; }
  [[noreturn]] void fail(const std::string& problem) const {
    throw std::runtime_error("load_prompt_cache: " + (source_.empty() ? "" : source_ + ": ") +
                             where_ + ": " + problem);
  }

  std::uint8_t u8() {
    std::uint8_t v;
    get(&v, 1);
    return v;
  }
  std::uint32_t u32() { return le<std::uint32_t>(); }
  std::int32_t i32() { return static_cast<std::int32_t>(le<std::uint32_t>()); }
  std::uint64_t u64() { return le<std::uint64_t>(); }
  std::int64_t i64() { return static_cast<std::int64_t>(le<std::uint64_t>()); }
  float f32() {
    const std::uint32_t b = le<std::uint32_t>();
    float v;
    std::memcpy(&v, &b, 4);
    return v;
  }
  double f64() {
    const std::uint64_t b = le<std::uint64_t>();
    double v;
    std::memcpy(&v, &b, 8);
    return v;
  }
  /// A u32 length, then that many bytes, allocated as they arrive.
  std::string string() {
    const std::uint32_t n = u32();
    std::string s;
    while (s.size() < n) {
      const std::size_t at = s.size();
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n - at, allowance()));
      s.resize(at + k);
      get(&s[at], k);
    }
    return s;
  }
  /// `count` elements of X (raw, the format's byte order) into v, allocated as they arrive.
  template <class X>
  void array(std::vector<X>& v, std::uint64_t count) {
    static_assert(std::is_trivially_copyable_v<X>, "raw elements");
    v.clear();
    while (v.size() < count) {
      const std::size_t at = v.size();
      const std::uint64_t room = std::max<std::uint64_t>(1, allowance() / sizeof(X));
      const auto k = static_cast<std::size_t>(std::min<std::uint64_t>(count - at, room));
      v.resize(at + k);
      get(v.data() + at, k * sizeof(X));
    }
  }
  /// Exactly n raw bytes into p.
  void bytes(void* p, std::size_t n) {
    auto* c = static_cast<char*>(p);
    while (n > 0) {
      const std::size_t k = std::min(n, kIoChunk);
      get(c, k);
      c += k;
      n -= k;
    }
  }

  /// Bytes a read may allocate now ahead of its data: kLoadGrant plus the bytes read so far.
  std::uint64_t allowance() const { return kLoadGrant + consumed_; }
  /// Charges `bytes` for an object the loader creates here (a metadata entry, a coordinator, a
  /// cache, a head): all charges together may not exceed allowance(), so a file of many empty
  /// objects cannot make the loader hold far more memory than the file's size.
  void charge(std::uint64_t bytes, const std::string& what) {
    charged_ += bytes;
    if (charged_ > allowance()) {
      fail(what + " would hold more memory than the file's data allows (" +
           std::to_string(charged_) + " bytes charged against " + std::to_string(allowance()) +
           ")");
    }
  }

  /// Starts a section (its CRC covers every byte read until end_section()).
  void begin_section() { crc_ = 0; }
  /// Reads the section's stored CRC-32C and compares it with the bytes read.
  void end_section() {
    const std::uint32_t computed = crc_;
    const std::uint32_t stored = u32();
    if (verify_ && stored != computed) {
      fail("checksum mismatch (the file is corrupt: CRC-32C " + hex(computed) + ", stored " +
           hex(stored) + ")");
    }
  }

 private:
  static std::string hex(std::uint32_t v) {
    static const char* digits = "0123456789abcdef";
    std::string s = "0x";
    for (int i = 7; i >= 0; --i) s += digits[(v >> (4 * i)) & 0xFu];
    return s;
  }
  template <class U>
  U le() {
    unsigned char b[sizeof(U)];
    get(b, sizeof(U));
    U v = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(b[i]) << (8 * i);
    return v;
  }
  void get(void* p, std::size_t n) {
    if (n == 0) return;
    in_.read(static_cast<char*>(p), static_cast<std::streamsize>(n));
    const auto got = static_cast<std::size_t>(in_.gcount());
    if (got != n) {
      fail("the file ends early (after " + std::to_string(consumed_ + got) + " bytes, " +
           std::to_string(n - got) + " more expected here)");
    }
    crc_ = crc32c(crc_, p, n);
    consumed_ += n;
  }

  std::istream& in_;
  bool verify_;
  std::string source_;
  std::string where_ = "header";
  std::uint32_t crc_ = 0;
  std::uint64_t consumed_ = 0;
  std::uint64_t charged_ = 0;
};

}  // namespace veloxquant::cache::detail
