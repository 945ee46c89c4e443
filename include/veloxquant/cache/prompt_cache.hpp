// veloxquant — prompt caches on disk: save_prompt_cache / load_prompt_cache (docs/design.md G),
// after mlx-lm's functions of the same names. A saved set is a model's caches (any policies, any
// storage widths), every coordinator they share, and string metadata; a loaded set continues
// exactly where the saved one stood: the same calls give bit-identical results to never having
// saved.
//
// The file is untrusted input: versioned, little-endian, a CRC-32C per section and per head; every
// structural and semantic rule a cache keeps is checked before the set is handed out; a file that
// breaks one raises std::runtime_error naming the part of the file and the problem; the loader
// allocates as data arrives (detail/format/byte_io.hpp), so a crafted count cannot make it reserve
// memory the file does not hold. The format, field by field, and its compatibility rule are in
// docs/design.md G.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <istream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "detail/format/byte_io.hpp"
#include "detail/head_store.hpp"
#include "detail/format/state_io.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "kv_cache_factory.hpp"
#include "memory_pool.hpp"
#include "squeeze_cache.hpp"
#include "squeeze_coordinator.hpp"

namespace veloxquant::cache {

/// A loaded prompt cache: one cache per saved cache, in the saved order (squeeze layers that shared
/// a coordinator share one again), and the metadata saved with them.
template <class T>
struct PromptCache {
  std::vector<std::unique_ptr<KVCache<T>>> caches;
  std::map<std::string, std::string> metadata;
};

namespace detail {

/// The first 8 bytes of every file: a non-ASCII byte, "VQKV", CR LF and ^Z (a transfer that
/// rewrites line ends or stops at ^Z shows at once).
inline constexpr unsigned char kPromptCacheMagic[8] = {0x89, 'V', 'Q', 'K', 'V', 0x0D, 0x0A, 0x1A};
/// The format version this library writes and the newest it reads.
/// Version 2 added config field proxy_scoring, version 3 value_norm_power, version 4 head_budgets,
/// head_budget_floor and the rows of each adaptive head, version 5 key_axis, value_axis and
/// quant_block and the channel blocks of each head, version 6 method kvzip, kvzip_n_sink and the
/// state flag "observed", version 7 pool_floor_rows (config_field_since, docs/design.md G); older
/// files still load, the fields they predate at their defaults.
inline constexpr std::uint32_t kPromptCacheVersion = 7;

/// Storage type codes of the header: 1 half, 2 bfloat16, 3 float.
template <class T>
constexpr std::uint8_t storage_code() {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return 1;
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return 2;
  } else {
    return 3;
  }
}
inline const char* storage_code_name(std::uint8_t code) {
  switch (code) {
    case 1:
      return "Eigen::half";
    case 2:
      return "Eigen::bfloat16";
    case 3:
      return "float";
    default:
      return nullptr;
  }
}

/// Type codes of the config fields.
enum class FieldType : std::uint8_t { i32 = 1, f64 = 2, boolean = 3, string = 4, optional_i32 = 5 };

/// The file's container (docs/design.md G): the header, the metadata, the coordinator table,
/// each cache's config, and the framing of the state each cache class writes and restores itself
/// (KVCache::write_state / read_state through detail/format/state_io.hpp): checksums, allocation
/// charges
/// and the untrusted-input rules of the file as a whole. It knows no class's private fields; the
/// class a cache is loaded as is the one the factory builds for its saved config's method.
template <class T>
class PromptCacheIO {
 public:
  using Caches = std::vector<std::unique_ptr<KVCache<T>>>;
  using Metadata = std::map<std::string, std::string>;

  /// Writes `caches` (and every coordinator their squeeze layers share) with `metadata` to `out`.
  /// Throws std::invalid_argument, before writing anything, for a null cache or one of a class
  /// derived from the library's; std::runtime_error when the stream fails.
  static void save(std::ostream& out, const Caches& caches, const Metadata& metadata) {
    const char* api = "save_prompt_cache";
    if (!little_endian_host()) {
      throw std::runtime_error(std::string(api) + ": the format needs a little-endian host");
    }
    // Everything is checked before a byte is written.
    StateLinks links;  // the coordinators, in order of first use
    for (std::size_t i = 0; i < caches.size(); ++i) {
      const KVCache<T>* c = caches[i].get();
      if (c == nullptr) {
        throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) + " is null");
      }
      if (!KVCacheFactory::builds_class_of(*c)) {
        throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) +
                                    " is of a class derived from the library's (method " +
                                    printable(c->config().method) +
                                    "); only the library's own cache classes can be saved");
      }
      c->link_state(links);
    }
    constexpr std::uint64_t kMaxCount = std::numeric_limits<std::uint32_t>::max();
    if (caches.size() > kMaxCount || metadata.size() > kMaxCount) {
      throw std::invalid_argument(std::string(api) +
                                  ": more than 2^32 - 1 caches or metadata entries");
    }
    // A set in a memory pool: the pool takes no rows of it while it is written (SPEC 19).
    std::vector<typename KVCache<T>::PoolTurn> turns;
    turns.reserve(caches.size());
    for (const auto& c : caches) {
      if (c->in_pool()) turns.emplace_back(*c, api);
    }
    // A dry run first: it writes nothing and refuses (std::invalid_argument) a set the loader
    // would refuse for memory (docs/design.md G); then the file.
    ByteWriter dry(nullptr, api);
    write_file(dry, caches, metadata, links);
    ByteWriter w(&out, api);
    write_file(w, caches, metadata, links);
  }

  /// Reads one prompt cache from `in`, leaving the stream after it. `source` names the input in
  /// messages; `verify` false skips the checksums (the fuzzer only: it reaches the structure
  /// behind them). Throws std::runtime_error for any file that is not one this library could
  /// have written (docs/design.md G); nothing is returned then.
  // (Defined after the class, not inline: a TU built against the compiled library does not
  // instantiate the loader behind load_prompt_cache; extern_templates.hpp.)
  static PromptCache<T> load(std::istream& in, const std::string& source = "", bool verify = true);

  /// True when `in` holds no byte more; else throws: a file that goes on after its last cache.
  static void expect_end(std::istream& in, const std::string& source) {
    if (in.peek() != std::char_traits<char>::eof()) {
      throw std::runtime_error(
          "load_prompt_cache: " + (source.empty() ? std::string() : source + ": ") +
          "data follows the last cache (not a prompt cache file, or two "
          "joined)");
    }
  }

 private:
  static_assert(sizeof(HeadStore<float>) + 512 <= kChargeHead,
                "a head's bookkeeping must stay within its charge (docs/design.md G)");
  static_assert(sizeof(SqueezeAttentionCache<float>) + 2048 <= kChargeCache,
                "a cache's bookkeeping must stay within its charge (docs/design.md G)");

  static void write_file(ByteWriter& w, const Caches& caches, const Metadata& metadata,
                         StateLinks& links) {
    w.begin_section();
    w.bytes(kPromptCacheMagic, sizeof(kPromptCacheMagic));
    w.u32(kPromptCacheVersion);
    w.u8(storage_code<T>());
    for (int i = 0; i < 3; ++i) w.u8(0);
    w.u32(static_cast<std::uint32_t>(caches.size()));
    w.u32(static_cast<std::uint32_t>(links.saved().size()));
    w.u32(static_cast<std::uint32_t>(metadata.size()));
    w.end_section();

    w.begin_section();
    for (const auto& [key, value] : metadata) {
      w.string(key, "a metadata key");
      w.string(value, "a metadata value");
      w.charge(kChargeMetadataEntry, "the metadata entries");
    }
    w.end_section();

    w.begin_section();
    for (const SqueezeCoordinator* co : links.saved()) co->write_state(w);
    w.end_section();

    // Per cache: its config, then the state the cache writes itself (docs/design.md G).
    StateWriter state(w, links);
    for (std::size_t i = 0; i < caches.size(); ++i) {
      w.begin_section();
      write_config(w, caches[i]->config());
      state.set_name("cache " + std::to_string(i));
      caches[i]->write_state(state);
    }
  }

  static std::string printable(const std::string& s) {
    std::string out;
    for (const char ch : s.substr(0, 64)) out += (ch >= 32 && ch < 127) ? ch : '?';
    return s.size() > 64 ? out + "..." : out;
  }

  // ---- configs ---------------------------------------------------------------------------------
  static void write_config(ByteWriter& w, const KVCacheConfig& c) {
    std::uint32_t n = 0;
    for_each_config_field(c, [&](const char*, const auto&) { ++n; });
    w.u32(n);
    for_each_config_field(c, [&](const char* name, const auto& v) {
      const auto len = static_cast<std::uint8_t>(std::strlen(name));
      w.u8(len);
      w.bytes(name, len);
      write_value(w, v);
    });
  }
  static void write_value(ByteWriter& w, int v) {
    w.u8(static_cast<std::uint8_t>(FieldType::i32));
    w.i32(v);
  }
  static void write_value(ByteWriter& w, double v) {
    w.u8(static_cast<std::uint8_t>(FieldType::f64));
    w.f64(v);
  }
  static void write_value(ByteWriter& w, bool v) {
    w.u8(static_cast<std::uint8_t>(FieldType::boolean));
    w.u8(v ? 1 : 0);
  }
  static void write_value(ByteWriter& w, const std::string& v) {
    w.u8(static_cast<std::uint8_t>(FieldType::string));
    w.string(v, "a config string");
  }
  static void write_value(ByteWriter& w, const std::optional<int>& v) {
    w.u8(static_cast<std::uint8_t>(FieldType::optional_i32));
    w.u8(v ? 1 : 0);
    w.i32(v.value_or(0));
  }

  // The fields of format `version` come in table order, each once; the fields it predates keep
  // their defaults (config_field_since).
  static KVCacheConfig read_config(ByteReader& r, std::uint32_t version) {
    const std::uint32_t n = r.u32();
    KVCacheConfig c;
    std::uint32_t fields = 0;
    for_each_config_field(c, [&](const char* field, auto&) {
      if (config_field_since(field) <= version) ++fields;
    });
    int last = -1;  // index of the last field read
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint8_t len = r.u8();
      std::string name(len, '\0');
      r.bytes(name.data(), len);
      const auto type = static_cast<FieldType>(r.u8());
      int index = 0;
      bool found = false;
      for_each_config_field(c, [&](const char* field, auto& v) {
        if (!found && name == field) {
          found = true;
          if (config_field_since(field) > version) {
            r.fail("config field '" + name + "' is not in format version " +
                   std::to_string(version));
          }
          if (index <= last) r.fail("config field '" + name + "' is out of order or repeated");
          read_value(r, name, type, v);
          last = index;
        }
        ++index;
      });
      if (!found) {
        r.fail("unknown config field '" + printable(name) + "' (written by a newer veloxquant?)");
      }
    }
    if (n != fields) {
      r.fail("the config holds " + std::to_string(n) + " fields, format version " +
             std::to_string(version) + " has " + std::to_string(fields));
    }
    return c;
  }
  static void expect_type(ByteReader& r, const std::string& name, FieldType got, FieldType want) {
    if (got != want) {
      r.fail("config field '" + name + "' has type code " + std::to_string(static_cast<int>(got)) +
             ", not " + std::to_string(static_cast<int>(want)));
    }
  }
  static bool read_flag(ByteReader& r, const std::string& what) {
    const std::uint8_t b = r.u8();
    if (b > 1) r.fail(what + " is " + std::to_string(b) + ", not 0 or 1");
    return b == 1;
  }
  static void read_value(ByteReader& r, const std::string& name, FieldType t, int& v) {
    expect_type(r, name, t, FieldType::i32);
    v = r.i32();
  }
  static void read_value(ByteReader& r, const std::string& name, FieldType t, double& v) {
    expect_type(r, name, t, FieldType::f64);
    v = r.f64();
  }
  static void read_value(ByteReader& r, const std::string& name, FieldType t, bool& v) {
    expect_type(r, name, t, FieldType::boolean);
    v = read_flag(r, "config field '" + name + "'");
  }
  static void read_value(ByteReader& r, const std::string& name, FieldType t, std::string& v) {
    expect_type(r, name, t, FieldType::string);
    v = r.string();
  }
  static void read_value(ByteReader& r, const std::string& name, FieldType t,
                         std::optional<int>& v) {
    expect_type(r, name, t, FieldType::optional_i32);
    const bool has = read_flag(r, "the presence flag of config field '" + name + "'");
    const std::int32_t x = r.i32();
    if (!has && x != 0) r.fail("config field '" + name + "' is empty but holds a value");
    v = has ? std::optional<int>(x) : std::nullopt;
  }

  // ---- coordinators ----------------------------------------------------------------------------

  /// The coordinator table: every entry read (one section), then each built by
  /// SqueezeCoordinator::from_saved_state, which checks it.
  static std::vector<std::shared_ptr<SqueezeCoordinator>> read_coordinators(ByteReader& r,
                                                                            std::uint32_t n) {
    r.set_where("coordinator table");
    r.begin_section();
    std::vector<SqueezeCoordinator::SavedState> saved;
    for (std::uint32_t i = 0; i < n; ++i) saved.push_back(SqueezeCoordinator::read_state(r));
    r.end_section();
    std::vector<std::shared_ptr<SqueezeCoordinator>> table;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      r.set_where("coordinator " + std::to_string(i));
      try {
        table.push_back(SqueezeCoordinator::from_saved_state(saved[i]));
      } catch (const std::invalid_argument& e) {
        r.fail(e.what());
      }
    }
    return table;
  }

  // ---- caches ----------------------------------------------------------------------------------

  /// One cache: its config, the class that config's method names built from it (by the factory,
  /// so the config is validated as at any construction), and the state that class reads itself.
  static std::unique_ptr<KVCache<T>> read_cache(ByteReader& r, std::uint32_t index,
                                                std::uint32_t version, StateLinks& links) {
    const std::string name = "cache " + std::to_string(index);
    r.set_where(name);
    r.begin_section();
    const KVCacheConfig config = read_config(r, version);
    const std::string label = name + " (" + printable(config.method) + ")";
    // A method is in the versions from its own on (KVzip: version 6), as config fields are.
    if (version < 6 && config.method == detail::method_spec(detail::Method::kvzip).name) {
      r.set_where(label);
      r.fail("method 'kvzip' is not in format version " + std::to_string(version));
    }
    std::unique_ptr<KVCache<T>> cache;
    try {
      cache = KVCacheFactory::create<T>(config);
    } catch (const std::invalid_argument& e) {
      r.set_where(label);
      r.fail(std::string("its configuration is invalid: ") + e.what());
    }
    StateReader state(r, links, label);
    try {
      cache->read_state(state);
    } catch (const std::invalid_argument& e) {
      r.fail(e.what());  // a state no cache can be in, named where it was read
    }
    return cache;
  }
};

template <class T>
PromptCache<T> PromptCacheIO<T>::load(std::istream& in, const std::string& source, bool verify) {
  if (!little_endian_host()) {
    throw std::runtime_error("load_prompt_cache: the format needs a little-endian host");
  }
  ByteReader r(in, verify, source);
  r.set_where("header");
  r.begin_section();
  unsigned char magic[sizeof(kPromptCacheMagic)];
  r.bytes(magic, sizeof(magic));
  if (std::memcmp(magic, kPromptCacheMagic, sizeof(magic)) != 0) {
    r.fail("not a veloxquant prompt cache (the first 8 bytes are not the format's magic)");
  }
  const std::uint32_t version = r.u32();
  if (version > kPromptCacheVersion) {
    r.fail("format version " + std::to_string(version) + " is newer than this library reads (" +
           std::to_string(kPromptCacheVersion) + "); a newer veloxquant wrote it");
  }
  if (version == 0) r.fail("format version 0 does not exist");
  const std::uint8_t storage = r.u8();
  std::uint8_t reserved = 0;
  for (int i = 0; i < 3; ++i) reserved |= r.u8();
  const std::uint32_t n_caches = r.u32(), n_coordinators = r.u32(), n_metadata = r.u32();
  r.end_section();
  if (reserved != 0) r.fail("reserved header bytes are not zero");
  if (storage != storage_code<T>()) {
    const char* name = storage_code_name(storage);
    if (name == nullptr) r.fail("unknown storage type code " + std::to_string(storage));
    r.fail(std::string("the file holds ") + name + " rows; load_prompt_cache<" +
           storage_code_name(storage_code<T>()) + "> reads " +
           storage_code_name(storage_code<T>()) + " rows only (load it with load_prompt_cache<" +
           name + ">)");
  }

  PromptCache<T> out;
  r.set_where("metadata");
  r.begin_section();
  for (std::uint32_t i = 0; i < n_metadata; ++i) {
    std::string key = r.string();
    std::string value = r.string();
    if (!out.metadata.empty() && !(out.metadata.rbegin()->first < key)) {
      r.fail("key '" + printable(key) + "' is out of order or repeated");
    }
    out.metadata.emplace_hint(out.metadata.end(), std::move(key), std::move(value));
    r.charge(kChargeMetadataEntry, "the metadata entries");
  }
  r.end_section();

  StateLinks links(read_coordinators(r, n_coordinators));
  for (std::uint32_t i = 0; i < n_caches; ++i) {
    out.caches.push_back(read_cache(r, i, version, links));
  }
  if (const std::int64_t unused = links.first_unused(); unused >= 0) {
    r.set_where("coordinator " + std::to_string(unused));
    r.fail("no cache of the file uses it");
  }
  return out;
}

}  // namespace detail

/// Saves a model's caches (any methods, storage widths and coordinators) with string `metadata`
/// to `out`, in the format of docs/design.md G, so that load_prompt_cache continues exactly where
/// they stand. The caches are only read (a view an engine holds stays valid). Throws
/// std::invalid_argument before writing anything for a null cache or a class derived from the
/// library's, std::runtime_error when the stream fails (the stream then holds part of a file).
template <class T>
void save_prompt_cache(std::ostream& out, const std::vector<std::unique_ptr<KVCache<T>>>& caches,
                       const std::map<std::string, std::string>& metadata = {}) {
  detail::PromptCacheIO<T>::save(out, caches, metadata);
}

/// save_prompt_cache to the file `path`, replaced atomically: the set is written to a temporary
/// file beside it, which is renamed over `path` once complete (an earlier file at `path` survives
/// any failure). Throws as the stream form, and std::runtime_error naming the path when the file
/// cannot be written or renamed.
template <class T>
void save_prompt_cache(const std::string& path,
                       const std::vector<std::unique_ptr<KVCache<T>>>& caches,
                       const std::map<std::string, std::string>& metadata = {}) {
  std::random_device rd;
  const std::string tmp = path + ".partial-" + std::to_string(rd());
  try {
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) throw std::runtime_error("save_prompt_cache: cannot create '" + tmp + "'");
      detail::PromptCacheIO<T>::save(out, caches, metadata);
      out.close();
      if (!out) throw std::runtime_error("save_prompt_cache: writing '" + tmp + "' failed");
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      throw std::runtime_error("save_prompt_cache: cannot rename '" + tmp + "' to '" + path + "'");
    }
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

/// Reads a prompt cache from `in` (docs/design.md G), leaving the stream after it: the caches in
/// their saved order, with their coordinators shared as saved, and the metadata. The caches have
/// no parallel-for (hand yours to set_parallel_for again). Throws std::runtime_error naming the
/// problem for a file that is truncated, corrupt, of a newer version, of another storage type, or
/// holds a state no cache can be in; it allocates memory only as the file's data arrives.
template <class T>
PromptCache<T> load_prompt_cache(std::istream& in) {
  return detail::PromptCacheIO<T>::load(in);
}

/// load_prompt_cache from the file `path`, which must end with the prompt cache.
template <class T>
PromptCache<T> load_prompt_cache(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("load_prompt_cache: cannot open '" + path + "'");
  PromptCache<T> out = detail::PromptCacheIO<T>::load(in, "'" + path + "'");
  detail::PromptCacheIO<T>::expect_end(in, "'" + path + "'");
  return out;
}

/// load_prompt_cache, the loaded set attached to `pool` (SPEC 19). Throws as the plain form, and
/// std::length_error when the set's floors do not fit beside those of the pool's sets (then
/// nothing is attached, and the loaded caches are dropped).
template <class T>
PromptCache<T> load_prompt_cache(std::istream& in, MemoryPool& pool) {
  PromptCache<T> out = load_prompt_cache<T>(in);
  pool.attach(out.caches, "load_prompt_cache");
  return out;
}
template <class T>
PromptCache<T> load_prompt_cache(const std::string& path, MemoryPool& pool) {
  PromptCache<T> out = load_prompt_cache<T>(path);
  pool.attach(out.caches, "load_prompt_cache");
  return out;
}

}  // namespace veloxquant::cache
