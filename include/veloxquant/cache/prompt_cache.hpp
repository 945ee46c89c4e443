// veloxquant — prompt caches on disk: save_prompt_cache / load_prompt_cache (docs/design.md G),
// after mlx-lm's functions of the same names. A saved set is a model's caches (any policies, any
// storage widths), every coordinator they share, and string metadata; a loaded set continues
// exactly where the saved one stood: the same calls give bit-identical results to never having
// saved.
//
// The file is untrusted input: versioned, little-endian, a CRC-32C per section and per head; every
// structural and semantic rule a cache keeps is checked before the set is handed out; a file that
// breaks one raises std::runtime_error naming the part of the file and the problem; the loader
// allocates as data arrives (detail/byte_io.hpp), so a crafted count cannot make it reserve memory
// the file does not hold. The format, field by field, and its compatibility rule are in
// docs/design.md G.
#pragma once

#include <Eigen/Core>
#include <cmath>
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
#include <typeinfo>
#include <utility>
#include <vector>

#include "detail/budgets.hpp"
#include "detail/byte_io.hpp"
#include "detail/checks.hpp"
#include "detail/concentration.hpp"
#include "detail/head_store.hpp"
#include "detail/policy.hpp"
#include "h2o_cache.hpp"
#include "kv_cache.hpp"
#include "kv_cache_config.hpp"
#include "kv_cache_factory.hpp"
#include "pyramidkv_cache.hpp"
#include "snapkv_cache.hpp"
#include "squeeze_cache.hpp"
#include "squeeze_coordinator.hpp"
#include "streaming_llm_cache.hpp"
#include "tova_cache.hpp"

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
/// Version 2 added config field proxy_scoring, version 3 value_norm_power (config_field_since);
/// files of versions 1 and 2 still load, the fields they predate at their defaults.
inline constexpr std::uint32_t kPromptCacheVersion = 3;

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

/// What the loader charges for each object it creates (docs/design.md G, "Memory"), part of the
/// format's rules so that a writer and a reader anywhere agree on which sets fit: a metadata entry,
/// a coordinator, one of its reports, a cache, a head (its bookkeeping beyond the rows).
inline constexpr std::uint64_t kChargeMetadataEntry = 128;
inline constexpr std::uint64_t kChargeCoordinator = 512;
inline constexpr std::uint64_t kChargeReport = 64;
inline constexpr std::uint64_t kChargeCache = 4096;
inline constexpr std::uint64_t kChargeHead = 1024;

/// Type codes of the config fields.
enum class FieldType : std::uint8_t { i32 = 1, f64 = 2, boolean = 3, string = 4, optional_i32 = 5 };

/// The codec: the one place that knows the format (docs/design.md G). A friend of the cache
/// classes and of SqueezeCoordinator, whose state it reads and restores.
template <class T>
class PromptCacheIO {
 public:
  using Caches = std::vector<std::unique_ptr<KVCache<T>>>;
  using Metadata = std::map<std::string, std::string>;

  /// Writes `caches` (and every coordinator their squeeze layers share) with `metadata` to `out`.
  /// Throws std::invalid_argument, before writing anything, for a null cache or one of a class
  /// the format does not know; std::runtime_error when the stream fails.
  static void save(std::ostream& out, const Caches& caches, const Metadata& metadata) {
    const char* api = "save_prompt_cache";
    if (!little_endian_host()) {
      throw std::runtime_error(std::string(api) + ": the format needs a little-endian host");
    }
    // Everything is checked before a byte is written.
    std::vector<const SqueezeCoordinator*> coordinators;  // in order of first use
    std::vector<std::int32_t> coordinator_of(caches.size(), -1);
    for (std::size_t i = 0; i < caches.size(); ++i) {
      const KVCache<T>* c = caches[i].get();
      if (c == nullptr) {
        throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) + " is null");
      }
      if (class_method(*c) == nullptr) {
        throw std::invalid_argument(std::string(api) + ": cache " + std::to_string(i) +
                                    " is of a class derived from the library's (" +
                                    typeid(*c).name() +
                                    "); only the library's own cache "
                                    "classes can be saved");
      }
      if (const auto* sq = dynamic_cast<const SqueezeAttentionCache<T>*>(c)) {
        if (const SqueezeCoordinator* co = sq->coordinator_.get()) {
          std::size_t k = 0;
          while (k < coordinators.size() && coordinators[k] != co) ++k;
          if (k == coordinators.size()) coordinators.push_back(co);
          coordinator_of[i] = static_cast<std::int32_t>(k);
        }
      }
    }
    constexpr std::uint64_t kMaxCount = std::numeric_limits<std::uint32_t>::max();
    if (caches.size() > kMaxCount || metadata.size() > kMaxCount) {
      throw std::invalid_argument(std::string(api) +
                                  ": more than 2^32 - 1 caches or metadata entries");
    }
    // A dry run first: it writes nothing and refuses (std::invalid_argument) a set the loader
    // would refuse for memory (docs/design.md G); then the file.
    ByteWriter dry(nullptr, api);
    write_file(dry, caches, metadata, coordinators, coordinator_of);
    ByteWriter w(&out, api);
    write_file(w, caches, metadata, coordinators, coordinator_of);
  }

  /// Reads one prompt cache from `in`, leaving the stream after it. `source` names the input in
  /// messages; `verify` false skips the checksums (the fuzzer only: it reaches the structure
  /// behind them). Throws std::runtime_error for any file that is not one this library could
  /// have written (docs/design.md G); nothing is returned then.
  static PromptCache<T> load(std::istream& in, const std::string& source = "", bool verify = true) {
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

    r.set_where("coordinator table");
    r.begin_section();
    std::vector<CoordinatorRecord> records;
    for (std::uint32_t i = 0; i < n_coordinators; ++i) {
      r.charge(kChargeCoordinator, "the coordinators");
      records.push_back(read_coordinator(r));
    }
    r.end_section();
    std::vector<std::shared_ptr<SqueezeCoordinator>> coordinators;
    for (std::size_t i = 0; i < records.size(); ++i) {
      r.set_where("coordinator " + std::to_string(i));
      coordinators.push_back(make_coordinator(r, records[i]));
    }

    std::vector<int> uses(coordinators.size(), 0);
    for (std::uint32_t i = 0; i < n_caches; ++i) {
      out.caches.push_back(read_cache(r, i, version, coordinators, uses));
    }
    for (std::size_t i = 0; i < uses.size(); ++i) {
      if (uses[i] == 0) {
        r.set_where("coordinator " + std::to_string(i));
        r.fail("no cache of the file uses it");
      }
    }
    return out;
  }

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
                         const std::vector<const SqueezeCoordinator*>& coordinators,
                         const std::vector<std::int32_t>& coordinator_of) {
    w.begin_section();
    w.bytes(kPromptCacheMagic, sizeof(kPromptCacheMagic));
    w.u32(kPromptCacheVersion);
    w.u8(storage_code<T>());
    for (int i = 0; i < 3; ++i) w.u8(0);
    w.u32(static_cast<std::uint32_t>(caches.size()));
    w.u32(static_cast<std::uint32_t>(coordinators.size()));
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
    for (const SqueezeCoordinator* co : coordinators) write_coordinator(w, *co);
    w.end_section();

    std::vector<Slot> src;
    std::vector<char> buf;
    for (std::size_t i = 0; i < caches.size(); ++i) {
      write_cache(w, *caches[i], i, coordinator_of[i], src, buf);
    }
  }

  /// The method of the library class `c` is exactly (nullptr: a class derived from one).
  static const char* class_method(const KVCache<T>& c) {
    const std::type_info& t = typeid(c);
    if (t == typeid(KVCache<T>)) return "standard";
    if (t == typeid(SqueezeAttentionCache<T>)) return "squeeze";
    if (t == typeid(H2OCache<T>)) return "h2o";
    if (t == typeid(PyramidKVCache<T>)) return "pyramidkv";
    if (t == typeid(TOVACache<T>)) return "tova";
    if (t == typeid(StreamingLLMCache<T>)) return "streaming_llm";
    if (t == typeid(SnapKVCache<T>)) return "snapkv";
    return nullptr;
  }
  /// True for the policies whose rows carry scores (the others' are all 0 and not written).
  static bool scored(RuleKind k) {
    return k == RuleKind::cumulative || k == RuleKind::last_attention || k == RuleKind::prompt;
  }
  static std::string printable(const std::string& s) {
    std::string out;
    for (const char ch : s.substr(0, 64)) out += (ch >= 32 && ch < 127) ? ch : '?';
    return s.size() > 64 ? out + "..." : out;
  }

  // ---- the per-cache descriptor ----------------------------------------------------------------

  /// Everything of a cache but its rows (docs/design.md G, "cache descriptor").
  struct Descriptor {
    KVCacheConfig config;
    bool dims_known = false, has_budget = false, compressed = false;
    std::int32_t budget = 0;
    std::int64_t batch = 0, heads = 0, key_dim = 0, value_dim = 0;
    std::int64_t offset = 0, tokens_seen = 0, rows = 0;
    // squeeze only
    bool has_layer_id = false, calibrated = false, reported = false, adopted = false;
    bool has_sums = false;
    std::int32_t layer_id = 0, coordinator = -1;
    std::uint64_t report_generation = 0;
    double concentration = 0.0;
  };

  enum : std::uint8_t { kDimsKnown = 1, kHasBudget = 2, kCompressed = 4 };
  enum : std::uint8_t {
    kHasLayerId = 1,
    kCalibrated = 2,
    kReported = 4,
    kAdopted = 8,
    kHasSums = 16
  };

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

  struct CoordinatorRecord {
    std::int32_t n_layers = 0, avg_budget = 0, n_sink = 0;
    double strength = 0.0;
    std::uint64_t generation = 0;
    std::vector<std::pair<std::int32_t, double>> reports;
  };

  static void write_coordinator(ByteWriter& w, const SqueezeCoordinator& co) {
    std::map<int, double> reports;
    std::uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lock(co.mutex_);
      reports = co.reports_;
      generation = co.generation_;
    }
    w.charge(kChargeCoordinator, "the coordinators");
    w.i32(co.n_layers_);
    w.i32(co.avg_budget_);
    w.i32(co.n_sink_);
    w.f64(co.strength_);
    w.u64(generation);
    w.u32(static_cast<std::uint32_t>(reports.size()));
    for (const auto& [layer, c] : reports) {
      w.i32(layer);
      w.f64(c);
      w.charge(kChargeReport, "the coordinators' reports");
    }
  }

  static CoordinatorRecord read_coordinator(ByteReader& r) {
    CoordinatorRecord c;
    c.n_layers = r.i32();
    c.avg_budget = r.i32();
    c.n_sink = r.i32();
    c.strength = r.f64();
    c.generation = r.u64();
    const std::uint32_t n = r.u32();
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::int32_t layer = r.i32();
      const double conc = r.f64();
      r.charge(kChargeReport, "the coordinators' reports");
      c.reports.emplace_back(layer, conc);
    }
    return c;
  }

  static std::shared_ptr<SqueezeCoordinator> make_coordinator(ByteReader& r,
                                                              const CoordinatorRecord& c) {
    std::shared_ptr<SqueezeCoordinator> co;
    try {
      co = std::make_shared<SqueezeCoordinator>(c.n_layers, c.avg_budget, c.n_sink, c.strength);
    } catch (const std::invalid_argument& e) {
      r.fail(e.what());
    }
    if (c.reports.size() > static_cast<std::size_t>(c.n_layers)) {
      r.fail(std::to_string(c.reports.size()) + " reports for " + std::to_string(c.n_layers) +
             " layers");
    }
    std::vector<double> concentrations;
    for (std::size_t i = 0; i < c.reports.size(); ++i) {
      const auto [layer, conc] = c.reports[i];
      if (layer < 0 || (i > 0 && layer <= c.reports[i - 1].first)) {
        r.fail("report layer ids are negative, out of order or repeated (layer " +
               std::to_string(layer) + ")");
      }
      if (!std::isfinite(conc))
        r.fail("the report of layer " + std::to_string(layer) + " is not finite");
      co->reports_.emplace_hint(co->reports_.end(), layer, conc);
      concentrations.push_back(conc);
    }
    co->generation_ = c.generation;
    co->finalized_ = static_cast<int>(c.reports.size()) == c.n_layers;
    if (co->finalized_) {
      // The published budgets are a function of the reports (docs/design.md 5.3, 5.4 step 2).
      const std::vector<int> b =
          squeeze_budgets(concentrations, c.avg_budget, c.n_sink, c.strength);
      std::size_t i = 0;
      for (const auto& kv : co->reports_) co->budgets_[kv.first] = b[i++];
    }
    return co;
  }

  // ---- caches ----------------------------------------------------------------------------------

  static Descriptor describe(const KVCache<T>& c, std::int32_t coordinator) {
    Descriptor d;
    d.config = c.config_;
    d.dims_known = c.dims_.known;
    d.has_budget = c.rule_.budget.has_value();
    d.budget = c.rule_.budget.value_or(0);
    d.compressed = c.rule_.compressed;
    d.batch = c.dims_.batch;
    d.heads = c.dims_.heads;
    d.key_dim = c.dims_.key_dim;
    d.value_dim = c.dims_.value_dim;
    d.offset = c.offset_;
    d.tokens_seen = c.tokens_seen_;
    d.rows = c.live_rows();
    if (const auto* sq = dynamic_cast<const SqueezeAttentionCache<T>*>(&c)) {
      d.has_layer_id = sq->layer_id_.has_value();
      d.layer_id = sq->layer_id_.value_or(0);
      d.coordinator = coordinator;
      d.calibrated = sq->calibrated_;
      d.reported = sq->reported_;
      d.adopted = sq->adopted_;
      d.has_sums = !sq->sums_.empty();
      d.report_generation = sq->report_generation_;
      d.concentration = sq->concentration_;
    }
    return d;
  }

  static void write_cache(ByteWriter& w, const KVCache<T>& c, std::size_t index,
                          std::int32_t coordinator, std::vector<Slot>& src,
                          std::vector<char>& buf) {
    const Descriptor d = describe(c, coordinator);
    const std::string name = "cache " + std::to_string(index);
    w.begin_section();
    write_config(w, d.config);
    w.u8(static_cast<std::uint8_t>((d.dims_known ? kDimsKnown : 0) |
                                   (d.has_budget ? kHasBudget : 0) |
                                   (d.compressed ? kCompressed : 0)));
    w.i32(d.budget);
    for (const std::int64_t v :
         {d.batch, d.heads, d.key_dim, d.value_dim, d.offset, d.tokens_seen, d.rows}) {
      w.i64(v);
    }
    if (d.config.method == "squeeze") {
      w.u8(static_cast<std::uint8_t>(
          (d.has_layer_id ? kHasLayerId : 0) | (d.calibrated ? kCalibrated : 0) |
          (d.reported ? kReported : 0) | (d.adopted ? kAdopted : 0) | (d.has_sums ? kHasSums : 0)));
      w.i32(d.layer_id);
      w.i32(d.coordinator);
      w.u64(d.report_generation);
      w.f64(d.concentration);
    }
    w.end_section();
    w.charge(kChargeCache, "the caches");
    // Heads are written when they hold rows (a cache of no rows is loaded without head objects).
    if (!d.dims_known || d.rows == 0) return;
    const auto* sq = dynamic_cast<const SqueezeAttentionCache<T>*>(&c);
    const bool with_scores = scored(c.rule_.kind);
    const HeadStore<T>& first = c.heads_.front();
    const auto slot_bytes =
        static_cast<std::uint64_t>(first.key_stride() + first.value_stride()) * sizeof(T);
    for (std::size_t i = 0; i < c.heads_.size(); ++i) {
      const HeadStore<T>& h = c.heads_[i];
      const ConcentrationSums* sums = d.has_sums ? &sq->sums_[i] : nullptr;
      write_head(w, h, with_scores, sums, slot_bytes, name, src, buf);
    }
  }

  /// One head block: positions, scores, the concentration sums, keys, values, CRC; the rows in
  /// the slot order compact() would leave (HeadStore::compacted_slots).
  static void write_head(ByteWriter& w, const HeadStore<T>& h, bool with_scores,
                         const ConcentrationSums* sums, std::uint64_t slot_bytes,
                         const std::string& name, std::vector<Slot>& src, std::vector<char>& buf) {
    h.compacted_slots(src);
    const std::size_t n = src.size();
    w.begin_section();
    buf.resize(n * sizeof(std::int64_t));
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t p = h.position(src[i]);
      std::memcpy(buf.data() + i * sizeof(p), &p, sizeof(p));
    }
    w.bytes(buf.data(), n * sizeof(std::int64_t));
    if (with_scores) {
      for (std::size_t i = 0; i < n; ++i) {
        const float s = h.score(src[i]);
        std::memcpy(buf.data() + i * sizeof(s), &s, sizeof(s));
      }
      w.bytes(buf.data(), n * sizeof(float));
    }
    if (sums) {
      w.bytes(sums->direction_sum().data(), sums->direction_sum().size() * sizeof(double));
      w.f64(sums->diagonal());
      w.i64(sums->rows());
    }
    if (slot_bytes > w.allowance()) {
      w.refuse(name + ": a row of " + std::to_string(slot_bytes) + " bytes (key and value) is " +
               "more than the loader may allocate at that point of the file (docs/design.md G)");
    }
    write_rows(w, h, src, true);
    write_rows(w, h, src, false);
    w.end_section();
    w.charge(kChargeHead, name + "'s heads");
  }

  /// The stored key (value) rows of slots src[0..n), a run of consecutive slots per write.
  static void write_rows(ByteWriter& w, const HeadStore<T>& h, const std::vector<Slot>& src,
                         bool keys) {
    const Index stride = keys ? h.key_stride() : h.value_stride();
    const auto row_bytes = static_cast<std::size_t>(stride) * sizeof(T);
    for (std::size_t i = 0; i < src.size();) {
      std::size_t j = i + 1;
      while (j < src.size() && src[j] == src[j - 1] + 1) ++j;
      w.bytes(keys ? h.key_ptr(src[i]) : h.value_ptr(src[i]), (j - i) * row_bytes);
      i = j;
    }
  }

  static std::unique_ptr<KVCache<T>> read_cache(
      ByteReader& r, std::uint32_t index, std::uint32_t version,
      const std::vector<std::shared_ptr<SqueezeCoordinator>>& coordinators,
      std::vector<int>& uses) {
    const std::string name = "cache " + std::to_string(index);
    r.set_where(name);
    r.begin_section();
    Descriptor d;
    d.config = read_config(r, version);
    const std::uint8_t flags = r.u8();
    d.budget = r.i32();
    std::int64_t* dims[] = {&d.batch,  &d.heads,       &d.key_dim, &d.value_dim,
                            &d.offset, &d.tokens_seen, &d.rows};
    for (std::int64_t* v : dims) *v = r.i64();
    const bool squeeze = d.config.method == "squeeze";
    std::uint8_t sflags = 0;
    if (squeeze) {
      sflags = r.u8();
      d.layer_id = r.i32();
      d.coordinator = r.i32();
      d.report_generation = r.u64();
      d.concentration = r.f64();
    }
    r.end_section();
    r.charge(kChargeCache, "the caches");
    const std::string label = name + " (" + printable(d.config.method) + ")";
    r.set_where(label);
    if ((flags & ~(kDimsKnown | kHasBudget | kCompressed)) != 0) r.fail("unknown state flags");
    if ((sflags & ~(kHasLayerId | kCalibrated | kReported | kAdopted | kHasSums)) != 0) {
      r.fail("unknown squeeze flags");
    }
    d.dims_known = flags & kDimsKnown;
    d.has_budget = flags & kHasBudget;
    d.compressed = flags & kCompressed;
    d.has_layer_id = sflags & kHasLayerId;
    d.calibrated = sflags & kCalibrated;
    d.reported = sflags & kReported;
    d.adopted = sflags & kAdopted;
    d.has_sums = sflags & kHasSums;
    if (!d.has_budget && d.budget != 0) r.fail("no budget but a budget value");
    if (!d.has_layer_id && d.layer_id != 0) r.fail("no layer id but a layer id value");

    // The cache, built by its own constructor: the configuration is validated as at any
    // construction, and the coordinator table entry is the object it shares.
    std::shared_ptr<SqueezeCoordinator> coordinator;
    if (squeeze && d.coordinator != -1) {
      if (d.coordinator < 0 || static_cast<std::size_t>(d.coordinator) >= coordinators.size()) {
        r.fail("coordinator index " + std::to_string(d.coordinator) + " is not in the table (" +
               std::to_string(coordinators.size()) + " entries)");
      }
      coordinator = coordinators[static_cast<std::size_t>(d.coordinator)];
      ++uses[static_cast<std::size_t>(d.coordinator)];
    }
    std::unique_ptr<KVCache<T>> cache;
    try {
      if (squeeze) {
        const std::optional<int> layer =
            d.has_layer_id ? std::optional<int>(d.layer_id) : std::nullopt;
        cache = std::make_unique<SqueezeAttentionCache<T>>(d.config, layer, coordinator);
      } else {
        cache = KVCacheFactory::create<T>(d.config);
      }
    } catch (const std::invalid_argument& e) {
      r.fail(std::string("its configuration is invalid: ") + e.what());
    }
    check_descriptor(r, d, *cache, coordinator.get());

    std::vector<HeadStore<T>> heads;
    std::vector<ConcentrationSums> sums;
    if (d.dims_known && d.rows > 0) read_heads(r, label, d, *cache, heads, sums);

    // Install: the cache now stands where the saved one stood.
    KVCache<T>& c = *cache;
    c.heads_.swap(heads);
    c.dims_ = LayerDims{d.batch, d.heads, d.key_dim, d.value_dim, d.dims_known};
    c.offset_ = d.offset;
    c.tokens_seen_ = d.tokens_seen;
    c.rule_.budget = d.has_budget ? std::optional<int>(d.budget) : std::nullopt;
    c.rule_.compressed = d.compressed;
    c.rebudget_ = false;
    // The buffer quantized rows leave the cache through (a cache that has made a call with rows
    // holds one; an empty call's view or fetch after the load needs it).
    if (c.storage_.quantized() && d.rows > 0) {
      c.row_buf_.assign(static_cast<std::size_t>(c.row_floats(d.key_dim, d.value_dim)), 0.0f);
    }
    if (auto* sq = dynamic_cast<SqueezeAttentionCache<T>*>(&c)) {
      sq->concentration_ = d.concentration;
      sq->sums_ = std::move(sums);
      sq->calibrated_ = d.calibrated;
      sq->reported_ = d.reported;
      sq->adopted_ = d.adopted;
      sq->report_generation_ = d.report_generation;
    }
    return cache;
  }

  /// The rules every saved cache keeps between calls (docs/design.md G, "what a loader checks"):
  /// the file holds a state the library can reach, or it is refused.
  static void check_descriptor(ByteReader& r, const Descriptor& d, const KVCache<T>& c,
                               const SqueezeCoordinator* coordinator) {
    const Rule& rule = c.rule_;
    const std::string method = d.config.method;
    const bool squeeze = method == "squeeze";
    constexpr std::int64_t kMaxDim = std::numeric_limits<std::int32_t>::max();
    if (!d.dims_known) {
      if (d.batch || d.heads || d.key_dim || d.value_dim || d.offset || d.tokens_seen || d.rows) {
        r.fail("a cache that has seen no call holds dims, rows, tokens or an offset");
      }
    } else {
      for (const std::int64_t v : {d.batch, d.heads, d.key_dim, d.value_dim}) {
        if (v < 1 || v > kMaxDim) {
          r.fail("dims [" + std::to_string(d.batch) + ", " + std::to_string(d.heads) + ", ., " +
                 std::to_string(d.key_dim) + " / " + std::to_string(d.value_dim) +
                 "] are not in [1, 2^31 - 1]");
        }
      }
      // Far beyond any sequence, and room left for the counters to grow without overflow.
      constexpr std::int64_t kMaxCount = std::int64_t{1} << 62;
      if (d.offset > kMaxCount || d.tokens_seen > kMaxCount) {
        r.fail("offset " + std::to_string(d.offset) + " or tokens_seen " +
               std::to_string(d.tokens_seen) + " is beyond 2^62");
      }
      if (d.offset < 0 || d.rows < 0 || d.rows > d.offset || d.rows > kMaxDim) {
        r.fail(std::to_string(d.rows) + " rows per head at offset " + std::to_string(d.offset));
      }
      // tokens_seen is B·H·S summed over calls: B·H times the offset (trim lowers the offset of a
      // standard cache, not tokens_seen).
      const std::int64_t bh = d.batch * d.heads;
      const bool trimmable = method == "standard";
      if (d.tokens_seen < 0 || d.tokens_seen % bh != 0 ||
          (trimmable ? d.tokens_seen / bh < d.offset : d.tokens_seen / bh != d.offset)) {
        r.fail("tokens_seen " + std::to_string(d.tokens_seen) + " does not fit " +
               std::to_string(bh) + " heads at offset " + std::to_string(d.offset));
      }
      const auto divides = [&](int bits, std::int64_t dim, const char* what) {
        if (bits < 16 && dim % d.config.quant_group != 0) {
          r.fail(std::string("quant_group ") + std::to_string(d.config.quant_group) +
                 " does not divide the " + what + " dim " + std::to_string(dim));
        }
      };
      divides(d.config.key_bits, d.key_dim, "key");
      divides(d.config.value_bits, d.value_dim, "value");
    }
    // The budget in force and the retained count it bounds (docs/design.md 4.2, 6).
    if (!squeeze && (d.has_budget != rule.budget.has_value() ||
                     (d.has_budget && d.budget != rule.budget.value_or(0)))) {
      r.fail("its budget is not the one its configuration gives");
    }
    if (d.dims_known && d.rows == 0 && method != "standard") {
      r.fail("no rows after a call: only a trimmed standard cache can hold none");
    }
    if (d.compressed && (method != "snapkv" || !d.dims_known)) {
      r.fail("compressed, but not a SnapKV cache that has seen a call");
    }
    if (method == "snapkv" && !d.compressed && d.rows != d.offset) {
      r.fail("a SnapKV cache that has not compressed holds every row (" + std::to_string(d.rows) +
             " at offset " + std::to_string(d.offset) + ")");
    }
    if (d.has_budget && d.budget < 1) r.fail("budget " + std::to_string(d.budget) + " is below 1");
    // Evictions never take a sink, so a budget below the sinks (an adopted budget from a
    // coordinator with fewer sinks than the layer) leaves the sinks: at most max(budget, sinks).
    const bool bounded = rule.kind == RuleKind::window || rule.kind == RuleKind::cumulative ||
                         rule.kind == RuleKind::last_attention;
    const std::int64_t sinks = std::min<std::int64_t>(rule.n_sink, d.offset);
    if (bounded && d.has_budget && d.rows > std::max<std::int64_t>(d.budget, sinks)) {
      r.fail(std::to_string(d.rows) + " rows per head over its budget of " +
             std::to_string(d.budget));
    }
    if (squeeze) check_squeeze(r, d, c, coordinator);
  }

  static void check_squeeze(ByteReader& r, const Descriptor& d, const KVCache<T>& c,
                            const SqueezeCoordinator* coordinator) {
    const auto& sq = dynamic_cast<const SqueezeAttentionCache<T>&>(c);
    const KVCacheConfig& cfg = d.config;
    const bool coordinated = sq.coordinated();
    const int fallback = sq.fallback_budget();
    if (!std::isfinite(d.concentration)) r.fail("its concentration is not finite");
    if (!d.dims_known && (d.calibrated || d.reported || d.adopted || d.has_sums ||
                          d.report_generation != 0 || d.concentration != 0.0)) {
      r.fail("a cache that has seen no call is calibrated, has reported or holds sums");
    }
    if (d.dims_known && d.calibrated != (d.offset >= cfg.squeeze_calibration_tokens)) {
      r.fail("calibrated is " + std::string(d.calibrated ? "true" : "false") + " at offset " +
             std::to_string(d.offset) + " with squeeze_calibration_tokens " +
             std::to_string(cfg.squeeze_calibration_tokens));
    }
    if (d.has_sums != (d.dims_known && !d.calibrated)) {
      r.fail("the concentration sums are there exactly while a layer calibrates");
    }
    if (d.reported != (d.calibrated && coordinated)) {
      r.fail("reported must be: calibrated, with a coordinator and a layer id");
    }
    if (d.adopted && !d.reported) r.fail("adopted a budget without reporting");
    if (!d.reported && d.report_generation != 0) r.fail("a report generation without a report");
    if (!d.has_budget && !(coordinated && cfg.squeeze_defer && !d.adopted)) {
      r.fail("no budget, but not a deferring layer waiting for its coordinator");
    }
    if (d.has_budget && !d.adopted && d.budget != fallback) {
      r.fail("budget " + std::to_string(d.budget) + " before adoption; the fallback is " +
             std::to_string(fallback));
    }
    if (d.reported && coordinator) {
      const std::uint64_t now = coordinator->generation_;
      if (d.report_generation > now) {
        r.fail("reported in generation " + std::to_string(d.report_generation) +
               " of a coordinator at generation " + std::to_string(now));
      }
      if (d.adopted && d.report_generation == now) {
        // Within a generation the published budgets never change.
        const std::optional<int> b = coordinator->lookup(d.layer_id);
        if (!b || *b != d.budget) {
          r.fail("adopted budget " + std::to_string(d.budget) +
                 " is not the one its coordinator published for layer " +
                 std::to_string(d.layer_id));
        }
      }
    }
  }

  /// The B·H head blocks of a cache, each checked as it comes (docs/design.md G).
  static void read_heads(ByteReader& r, const std::string& name, const Descriptor& d,
                         const KVCache<T>& c, std::vector<HeadStore<T>>& heads,
                         std::vector<ConcentrationSums>& sums) {
    const Rule& rule = c.rule_;
    const RowFormat kf = c.key_format(d.key_dim), vf = c.value_format(d.value_dim);
    const bool with_scores = scored(rule.kind);
    const Index n = d.rows;
    std::vector<std::int64_t> pos;
    std::vector<float> score;
    std::vector<double> sum;
    for (std::int64_t b = 0; b < d.batch; ++b) {
      for (std::int64_t hh = 0; hh < d.heads; ++hh) {
        r.set_where(name + ", head (" + std::to_string(b) + ", " + std::to_string(hh) + ")");
        r.begin_section();
        r.array(pos, static_cast<std::uint64_t>(n));
        if (with_scores) r.array(score, static_cast<std::uint64_t>(n));
        double diag = 0.0;
        std::int64_t sum_rows = 0;
        if (d.has_sums) {
          r.array(sum, static_cast<std::uint64_t>(d.key_dim));
          diag = r.f64();
          sum_rows = r.i64();
        }
        HeadStore<T> head(kf, vf);
        read_rows(r, head, n, true);
        read_rows(r, head, n, false);
        // After the rows: its buffers (one weight per slot, one value row) are then no larger
        // than what the file has already paid for; restore computes the weights.
        if (rule.value_power > 0.0) head.enable_value_weights(rule.value_power);
        r.end_section();
        check_head(r, d, rule, head, pos, with_scores ? &score : nullptr);
        if (d.has_sums) {
          if (sum_rows != d.offset) {
            r.fail("the concentration sums count " + std::to_string(sum_rows) + " rows, not the " +
                   std::to_string(d.offset) + " the layer has seen");
          }
          if (!all_finite(sum.data(), static_cast<Index>(sum.size())) || !std::isfinite(diag)) {
            r.fail("the concentration sums are not finite");
          }
          // Sums of unit vectors (docs/design.md 5.1): no coordinate beyond the row count, and
          // the sum of squared norms in [0, rows].
          const double bound = static_cast<double>(sum_rows) * (1.0 + 1e-9) + 1e-9;
          bool within = diag >= 0.0 && diag <= bound;
          for (const double x : sum) within = within && std::abs(x) <= bound;
          if (!within)
            r.fail("the concentration sums exceed what " + std::to_string(sum_rows) +
                   " rows can add up to");
          sums.push_back(ConcentrationSums::restored(sum, diag, sum_rows));
        }
        r.charge(kChargeHead, "the heads");
        heads.push_back(std::move(head));
      }
    }
  }

  /// n stored key (value) rows of a head, read into its own buffers, which grow no faster than
  /// the reader's allowance (a crafted row count allocates nothing the file does not hold).
  static void read_rows(ByteReader& r, HeadStore<T>& head, Index n, bool keys) {
    if (n == 0) return;
    const auto slot_bytes =
        static_cast<std::uint64_t>(head.key_stride() + head.value_stride()) * sizeof(T);
    if (slot_bytes > r.allowance()) {
      r.fail("a row of " + std::to_string(slot_bytes) + " bytes is more than may be allocated " +
             "this early in the file");
    }
    const Index stride = keys ? head.key_stride() : head.value_stride();
    const auto row_bytes = static_cast<std::size_t>(stride) * sizeof(T);
    Index done = 0;
    while (done < n) {
      if (head.capacity() < n && head.capacity() <= done) {
        const auto room = static_cast<Index>(
            std::min<std::uint64_t>(r.allowance() / slot_bytes, static_cast<std::uint64_t>(n)));
        head.grow_for_restore(std::min(n, std::max(done + room, done + 1)), done);
      }
      const Index upto = std::min(n, head.capacity());
      T* dst = keys ? head.key_ptr(done) : head.value_ptr(done);
      r.bytes(dst, static_cast<std::size_t>(upto - done) * row_bytes);
      done = upto;
    }
  }

  static void check_head(ByteReader& r, const Descriptor& d, const Rule& rule, HeadStore<T>& head,
                         const std::vector<std::int64_t>& pos, const std::vector<float>* score) {
    const Index n = d.rows;
    if (score) {
      // Scores are sums of softmax weights (or the weights themselves): never negative, never
      // infinite; NaN only where keys overflowed float32 (docs/design.md E). K-norm (4.7) writes
      // negative scores (-|k|; -inf for a key whose norm overflows float32); KeyDiff recomputes
      // its weights from the keys before it uses them, whatever the file says.
      const bool signed_scores =
          rule.kind == RuleKind::cumulative && rule.proxy != ProxyScoring::key_as_query;
      for (const float s : *score) {
        if ((s < 0.0f && !signed_scores) || s == std::numeric_limits<float>::infinity()) {
          r.fail("a score (" + std::to_string(s) + ") is negative or infinite");
        }
      }
    }
    if (!head.restore(n, pos.data(), score ? score->data() : nullptr)) {
      r.fail("two rows share a position");
    }
    const auto& order = head.order();
    if (n > 0) {
      const std::int64_t first = head.position(order.front()), last = head.position(order.back());
      if (first < 0 || last >= d.offset) {
        r.fail("positions " + std::to_string(first) + ".." + std::to_string(last) +
               " are not in [0, offset " + std::to_string(d.offset) + ")");
      }
    }
    // Sinks are never evicted: positions 0..min(n_sink, offset) - 1 are all retained.
    if (rule.kind != RuleKind::keep_all) {
      const std::int64_t k = std::min<std::int64_t>(rule.n_sink, d.offset);
      if (k > 0 && (n < k || head.position(order[static_cast<std::size_t>(k - 1)]) != k - 1)) {
        r.fail("a sink (one of the first " + std::to_string(k) + " positions) is missing");
      }
    }
    // Keys are finite (the update calls refuse others); a quantized row's scales and offsets are
    // finite halves (keys and values alike).
    const RowFormat& kf = head.key_format();
    const RowFormat& vf = head.value_format();
    if (!kf.quantized() && n > 0 && !all_finite(head.key_ptr(0), n * kf.dim)) {
      r.fail("a key is not finite");
    }
    for (const bool keys : {true, false}) {
      const RowFormat& f = keys ? kf : vf;
      if (!f.quantized()) continue;
      for (Index s = 0; s < n; ++s) {
        const auto* row =
            reinterpret_cast<const std::uint8_t*>(keys ? head.key_ptr(s) : head.value_ptr(s));
        const auto* meta = reinterpret_cast<const Eigen::half*>(row + f.code_bytes());
        if (!all_finite(meta, 2 * f.groups())) {
          r.fail(std::string("a quantized ") + (keys ? "key" : "value") +
                 " row's scale or offset is not finite");
        }
      }
    }
  }
};

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

}  // namespace veloxquant::cache
