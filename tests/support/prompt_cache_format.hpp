// An independent reader of the prompt-cache format, written from its description in
// docs/design.md G and nothing else (no library code): it walks a file and records where every
// field and section lies, so a test can change one field, seal the checksums again and see what
// the library's loader makes of the result ("crafted" files). That it can walk every file the
// library writes is itself a test of the document. No GoogleTest here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace veloxquant::test::format {

/// CRC-32C, bit by bit (slow and obviously right; independent of the library's).
inline std::uint32_t crc32c_bitwise(const unsigned char* p, std::size_t n) {
  std::uint32_t r = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    r ^= p[i];
    for (int k = 0; k < 8; ++k) r = (r >> 1) ^ (0x82F63B78u & (0u - (r & 1u)));
  }
  return ~r;
}

/// Where a field lies: [offset, offset + size).
struct Field {
  std::size_t offset = 0, size = 0;
};

/// A file's map: fields by name ("header.version", "cache0.rows", "cache0.config.squeeze_budget",
/// "cache0.head1.positions", "coord0.report0.layer", ...) and every section's span, its CRC in
/// the 4 bytes after it.
struct FileMap {
  std::map<std::string, Field> fields;
  std::vector<Field> sections;

  const Field& at(const std::string& name) const {
    const auto it = fields.find(name);
    if (it == fields.end()) throw std::runtime_error("format walker: no field " + name);
    return it->second;
  }
  bool has(const std::string& name) const { return fields.count(name) != 0; }
};

class Walker {
 public:
  /// `elem`: bytes of the file's storage type T (2 or 4), needed for the row strides.
  Walker(const std::string& bytes, std::size_t elem) : b_(bytes), elem_(elem) {}

  FileMap walk() {
    begin();
    take("header.magic", 8);
    take("header.version", 4);
    take("header.storage", 1);
    take("header.reserved", 3);
    const auto caches = u32("header.caches");
    const auto coords = u32("header.coordinators");
    const auto meta = u32("header.metadata");
    end();
    begin();
    for (std::uint32_t i = 0; i < meta; ++i) {
      const std::string p = "meta" + std::to_string(i);
      take(p + ".key", u32(p + ".key_length"));
      take(p + ".value", u32(p + ".value_length"));
    }
    end();
    begin();
    for (std::uint32_t i = 0; i < coords; ++i) {
      const std::string p = "coord" + std::to_string(i);
      take(p + ".n_layers", 4);
      take(p + ".avg_budget", 4);
      take(p + ".n_sink", 4);
      take(p + ".strength", 8);
      take(p + ".generation", 8);
      const auto reports = u32(p + ".reports");
      for (std::uint32_t k = 0; k < reports; ++k) {
        take(p + ".report" + std::to_string(k) + ".layer", 4);
        take(p + ".report" + std::to_string(k) + ".concentration", 8);
      }
    }
    end();
    for (std::uint32_t i = 0; i < caches; ++i) cache("cache" + std::to_string(i));
    if (at_ != b_.size()) throw std::runtime_error("format walker: bytes after the last cache");
    return std::move(map_);
  }

 private:
  void cache(const std::string& p) {
    begin();
    const auto n_fields = u32(p + ".config_fields");
    std::map<std::string, std::int64_t> ints;
    std::string method, head_budgets = "uniform";
    for (std::uint32_t f = 0; f < n_fields; ++f) {
      const std::size_t len = byte();
      const std::string name = b_.substr(at_, len);
      at_ += len;
      const std::string q = p + ".config." + name;
      const int type = byte();
      map_.fields[q + ".type"] = Field{at_ - 1, 1};
      switch (type) {
        case 1:
          ints[name] = static_cast<std::int32_t>(u32(q));
          break;
        case 2:
          take(q, 8);
          break;
        case 3:
          take(q, 1);
          break;
        case 4: {
          const auto n = u32(q + ".length");
          method = name == "method" ? b_.substr(at_, n) : method;
          head_budgets = name == "head_budgets" ? b_.substr(at_, n) : head_budgets;
          take(q, n);
          break;
        }
        case 5:
          take(q + ".present", 1);
          take(q, 4);
          break;
        default:
          throw std::runtime_error("format walker: type code " + std::to_string(type));
      }
    }
    const int flags = static_cast<int>(le(at_, 1));
    take(p + ".flags", 1);
    take(p + ".budget", 4);
    const std::int64_t batch = i64(p + ".batch"), heads = i64(p + ".heads");
    const std::int64_t key_dim = i64(p + ".key_dim"), value_dim = i64(p + ".value_dim");
    take(p + ".offset", 8);
    take(p + ".tokens_seen", 8);
    const std::int64_t rows = i64(p + ".rows");
    bool sums = false;
    if (method == "squeeze") {
      sums = (le(at_, 1) & 16) != 0;
      take(p + ".squeeze_flags", 1);
      take(p + ".layer_id", 4);
      take(p + ".coordinator", 4);
      take(p + ".report_generation", 8);
      take(p + ".concentration", 8);
    }
    end();
    if (!(flags & 1) || rows == 0) return;  // head sections only for a cache holding rows
    const bool h2o_core = method == "squeeze" || method == "h2o" || method == "pyramidkv";
    const bool scored = h2o_core || method == "tova" || method == "snapkv" || method == "kvzip";
    // Adaptive heads (version 4) and KVzip heads (version 6): each head section starts with its
    // own row count.
    const bool adaptive = (h2o_core && head_budgets == "adaptive") || method == "kvzip";
    const auto stride = [&](std::int64_t bits, std::int64_t dim) -> std::size_t {
      if (bits == 16) return static_cast<std::size_t>(dim) * elem_;
      const std::int64_t g = ints.at("quant_group"), groups = dim / g;
      const std::int64_t bytes = groups * (bits == 8 ? g : (g + 1) / 2) + 4 * groups;
      return static_cast<std::size_t>((bytes + static_cast<std::int64_t>(elem_) - 1) /
                                      static_cast<std::int64_t>(elem_)) *
             elem_;
    };
    const std::size_t ks = stride(ints.at("key_bits"), key_dim);
    const std::size_t vs = stride(ints.at("value_bits"), value_dim);
    for (std::int64_t h = 0; h < batch * heads; ++h) {
      const std::string q = p + ".head" + std::to_string(h);
      begin();
      const auto n = static_cast<std::size_t>(adaptive ? i64(q + ".rows") : rows);
      take(q + ".positions", n * 8);
      if (scored) take(q + ".scores", n * 4);
      if (sums) {
        take(q + ".sums", static_cast<std::size_t>(key_dim) * 8);
        take(q + ".diagonal", 8);
        take(q + ".sum_rows", 8);
      }
      take(q + ".keys", n * ks);
      take(q + ".values", n * vs);
      end();
    }
  }

  std::uint64_t le(std::size_t at, std::size_t n) const {
    if (at + n > b_.size()) throw std::runtime_error("format walker: past the end");
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= std::uint64_t{static_cast<unsigned char>(b_[at + i])} << (8 * i);
    return v;
  }
  void take(const std::string& name, std::size_t n) {
    if (at_ + n > b_.size()) throw std::runtime_error("format walker: " + name + " past the end");
    map_.fields[name] = Field{at_, n};
    at_ += n;
  }
  std::uint32_t u32(const std::string& name) {
    const auto v = static_cast<std::uint32_t>(le(at_, 4));
    take(name, 4);
    return v;
  }
  std::int64_t i64(const std::string& name) {
    const auto v = static_cast<std::int64_t>(le(at_, 8));
    take(name, 8);
    return v;
  }
  int byte() {
    const int v = static_cast<int>(le(at_, 1));
    ++at_;
    return v;
  }
  void begin() { start_ = at_; }
  void end() {
    map_.sections.push_back(Field{start_, at_ - start_});
    const auto stored = static_cast<std::uint32_t>(le(at_, 4));
    const std::uint32_t computed =
        crc32c_bitwise(reinterpret_cast<const unsigned char*>(b_.data()) + start_, at_ - start_);
    if (stored != computed) throw std::runtime_error("format walker: a section's CRC differs");
    at_ += 4;
  }

  const std::string& b_;
  std::size_t elem_;
  std::size_t at_ = 0, start_ = 0;
  FileMap map_;
};

/// The map of a file of storage type T.
template <class T>
FileMap walk(const std::string& bytes) {
  return Walker(bytes, sizeof(T)).walk();
}

/// Writes `v` little-endian over field `f` (whose size must be sizeof(U)).
template <class U>
void patch(std::string& bytes, const Field& f, U v) {
  if (f.size != sizeof(U)) throw std::runtime_error("format walker: patch of the wrong size");
  unsigned char raw[sizeof(U)];
  std::memcpy(raw, &v, sizeof(U));  // little-endian host (as the format's tests require)
  for (std::size_t i = 0; i < sizeof(U); ++i) bytes[f.offset + i] = static_cast<char>(raw[i]);
}

/// Seals every section of `m` again (after a patch that kept every field where it was).
inline void reseal(std::string& bytes, const FileMap& m) {
  for (const Field& s : m.sections) {
    const std::uint32_t c =
        crc32c_bitwise(reinterpret_cast<const unsigned char*>(bytes.data()) + s.offset, s.size);
    patch(bytes, Field{s.offset + s.size, 4}, c);
  }
}

/// `bytes` (this library's format) as format `version` holds the same set: every cache's config
/// fields newer than `version` taken out (`since(name)`: the version that first stored a field,
/// the library's config_field_since), the version set and the checksums sealed again.
template <class T, class Since>
std::string as_version(const std::string& bytes, std::uint32_t version, Since since) {
  std::string out = bytes;
  const FileMap map = walk<T>(out);
  std::uint32_t caches = 0;
  std::memcpy(&caches, out.data() + map.at("header.caches").offset, 4);
  FileMap moved;  // the sections where they lie once the fields are out
  moved.sections = map.sections;
  // The fields that came after version 1, the last in a config first: earlier offsets stay valid.
  const char* newer[] = {"pool_floor_rows",   "kvzip_n_sink", "quant_block",
                         "value_axis",        "key_axis",     "head_budget_floor",
                         "head_budgets",      "value_norm_power", "proxy_scoring"};
  for (std::uint32_t i = caches; i-- > 0;) {  // the last cache first, for the same reason
    const std::string p = "cache" + std::to_string(i);
    std::uint32_t removed = 0;
    for (const char* name : newer) {
      if (since(name) <= version) continue;
      const Field type = map.at(p + ".config." + name + ".type");
      const Field value = map.at(p + ".config." + name);
      const std::size_t begin = type.offset - 1 - std::strlen(name);
      const std::size_t len = value.offset + value.size - begin;
      out.erase(begin, len);
      ++removed;
      for (Field& sec : moved.sections) {
        if (sec.offset > begin) {
          sec.offset -= len;
        } else if (sec.offset + sec.size > begin) {
          sec.size -= len;
        }
      }
    }
    std::uint32_t fields = 0;
    std::memcpy(&fields, out.data() + map.at(p + ".config_fields").offset, 4);
    patch(out, map.at(p + ".config_fields"), fields - removed);
  }
  patch(out, map.at("header.version"), version);
  reseal(out, moved);
  (void)walk<T>(out);  // the independent reader finds every checksum right
  return out;
}

}  // namespace veloxquant::test::format
