// veloxquant — the C ABI (include/veloxquant/veloxquant.h) over the C++ library: every function
// catches what the library throws and turns it into a status and this thread's message
// (docs/c_abi.md; the decisions: docs/design.md I). Compiled into veloxquant_c (static and
// shared); with the caches' templates instantiated once in src/veloxquant.cpp.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iomanip>
#include <locale>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <veloxquant/cache.hpp>

#include "veloxquant/veloxquant.h"

namespace vc = veloxquant::cache;

// The header gives the enums a fixed underlying type in C++ (VQ_INT_BASE): any int a C caller passes
// is then a value of the type, read without undefined behaviour, and each function refuses one
// outside its enum (layout_of, check_tensor, new_set; vq_status_name says "unknown").
static_assert(std::is_same_v<std::underlying_type_t<vq_status>, int> &&
                  std::is_same_v<std::underlying_type_t<vq_storage>, int> &&
                  std::is_same_v<std::underlying_type_t<vq_layout>, int> &&
                  std::is_same_v<std::underlying_type_t<vq_dtype>, int>,
              "the C ABI's enums are ints");

struct vq_config {
  vc::KVCacheConfig config;
};

struct vq_pool {
  explicit vq_pool(std::size_t max_bytes) : pool(max_bytes) {}
  vc::MemoryPool pool;
};

// A set of one storage type T lives in Set<T>; the handle knows which (storage).
struct vq_caches {
  explicit vq_caches(vq_storage s) : storage(s) {}
  virtual ~vq_caches() = default;
  vq_caches(const vq_caches&) = delete;
  vq_caches& operator=(const vq_caches&) = delete;

  const vq_storage storage;
  std::map<std::string, std::string> metadata;
};

namespace {

template <class T>
struct Set final : vq_caches {
  using type = T;
  Set(std::vector<std::unique_ptr<vc::KVCache<T>>> c, vq_storage s)
      : vq_caches(s), caches(std::move(c)), views(caches.size()) {}
  std::vector<std::unique_ptr<vc::KVCache<T>>> caches;
  // The returned window of each layer's last vq_update, until its next call (vq_fetch).
  std::vector<std::optional<vc::KVView<T>>> views;

  void forget_views() {
    for (auto& v : views) v.reset();
  }
};

template <class T>
constexpr vq_storage storage_of() {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return VQ_HALF;
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return VQ_BFLOAT16;
  } else {
    return VQ_FLOAT;
  }
}

// ---- errors ------------------------------------------------------------------------------------

thread_local std::string last_error;

// Set by the C pool wrapper on the thread whose call enters the engine's parallel-for: a call
// that fails after that has had its layer reset by the library (VQ_ECALLBACK). Per thread, not
// per set: a fork carries its source's pool (KVCacheBuilder::fork copies it), and the calling
// thread is the one that runs a call's parallel-for.
thread_local bool pool_entered = false;

// An argument the C side got wrong, reported as VQ_EINVAL (the C++ library's own
// std::invalid_argument maps to the same status).
struct CError {
  vq_status status;
  std::string message;
};

[[noreturn]] void fail(vq_status status, std::string message) {
  throw CError{status, std::move(message)};
}

vq_status set_error(vq_status status, const char* api, const std::string& message) noexcept {
  try {
    last_error = std::string(api) + ": " + message;
  } catch (...) {
    // No memory for the message: keep the status, say what we can.
    last_error.clear();
  }
  return status;
}

// Runs f, turning every exception into a status (`logic` is the status of a std::logic_error
// other than invalid_argument: the set's state refused the call, or the engine's parallel-for
// failed, depending on the call). Returns VQ_OK when f returns.
template <class F>
vq_status guarded(const char* api, vq_status logic, F&& f) noexcept {
  try {
    f();
    return VQ_OK;
  } catch (const CError& e) {
    return set_error(e.status, api, e.message);
  } catch (const std::invalid_argument& e) {
    return set_error(VQ_EINVAL, api, e.what());
  } catch (const std::out_of_range& e) {
    return set_error(VQ_EINVAL, api, e.what());
  } catch (const std::bad_alloc&) {
    return set_error(VQ_ENOMEM, api, "out of memory");
  } catch (const vc::detail::FloorsDoNotFit& e) {
    return set_error(VQ_ENOROOM, api, e.what());
  } catch (const std::length_error& e) {
    return set_error(VQ_ENOMEM, api, e.what());
  } catch (const std::logic_error& e) {
    return set_error(logic, api, e.what());
  } catch (const std::exception& e) {
    return set_error(logic, api, e.what());
  } catch (...) {
    return set_error(logic, api, "an unknown exception");
  }
}

void need(const void* p, const char* what) {
  if (p == nullptr) fail(VQ_EINVAL, std::string(what) + " is NULL");
}

// Calls f(Set<T>&) with the set's own T.
template <class F>
decltype(auto) visit(vq_caches& s, F&& f) {
  switch (s.storage) {
    case VQ_HALF:
      return f(static_cast<Set<Eigen::half>&>(s));
    case VQ_BFLOAT16:
      return f(static_cast<Set<Eigen::bfloat16>&>(s));
    default:
      return f(static_cast<Set<float>&>(s));
  }
}
template <class F>
decltype(auto) visit(const vq_caches& s, F&& f) {
  return visit(const_cast<vq_caches&>(s), std::forward<F>(f));
}

int layer_count(const vq_caches& s) {
  return visit(s, [](auto& set) { return static_cast<int>(set.caches.size()); });
}

void check_layer(const vq_caches& s, int layer) {
  const int n = layer_count(s);
  if (layer < 0 || layer >= n) {
    fail(VQ_EINVAL, "layer " + std::to_string(layer) + " is out of range (the set has " +
                        std::to_string(n) + " layers)");
  }
}

// Every call on one layer takes this path: under guarded(api, logic), the handle ("caches is
// NULL"), the call's own arguments (`checks()`), the layer's range, then body(set, cache) with
// the set's Set<T> and the layer's KVCache<T>.
template <class Handle, class Checks, class Body>
vq_status on_layer(const char* api, vq_status logic, Handle* s, int layer, Checks&& checks,
                   Body&& body) noexcept {
  return guarded(api, logic, [&] {
    need(s, "caches");
    checks();
    check_layer(*s, layer);
    visit(*s, [&](auto& set) { body(set, *set.caches[static_cast<std::size_t>(layer)]); });
  });
}

// A value of one layer, read by get(cache); `on_error` when the handle or the layer is bad (or
// get throws), with the message set.
template <class R, class Get>
R layer_value(const char* api, const vq_caches* s, int layer, R on_error, Get&& get) noexcept {
  R value = on_error;
  (void)on_layer(
      api, VQ_EINVAL, s, layer, [] {},
      [&](auto&, const auto& cache) { value = static_cast<R>(get(cache)); });
  return value;
}

// SqueezeAttentionCache::concentration(); 0.0 for a layer of another method, which measures none.
template <class T>
double concentration_of(const vc::KVCache<T>& cache) {
  const auto* squeeze = dynamic_cast<const vc::SqueezeAttentionCache<T>*>(&cache);
  return squeeze == nullptr ? 0.0 : squeeze->concentration();
}

// ---- inputs
// --------------------------------------------------------------------------------------

vc::Layout layout_of(vq_layout l, const char* what) {
  if (l == VQ_HEAD_MAJOR) return vc::Layout::head_major;
  if (l == VQ_TOKEN_MAJOR) return vc::Layout::token_major;
  fail(VQ_EINVAL, std::string(what) + ": layout " + std::to_string(static_cast<int>(l)) +
                      " is not VQ_HEAD_MAJOR or VQ_TOKEN_MAJOR");
}

void check_tensor(const vq_tensor* t, const char* what) {
  need(t, what);
  if (t->data == nullptr) fail(VQ_EINVAL, std::string(what) + "->data is NULL");
  const int dtype = static_cast<int>(t->dtype);
  if (dtype < VQ_F16 || dtype > VQ_F64) {
    fail(VQ_EINVAL, std::string(what) + "->dtype " + std::to_string(dtype) + " is not a vq_dtype");
  }
  (void)layout_of(t->layout, what);
}

template <class R>
struct element_of;
template <class U>
struct element_of<vc::TensorRef<U>> {
  using type = U;
};

template <class U>
vc::TensorRef<U> ref_of(const vq_tensor& t, const char* what) {
  return vc::TensorRef<U>(static_cast<const U*>(t.data), t.batch, t.heads, t.seq, t.dim,
                          layout_of(t.layout, what));
}

// Calls f(TensorRef<U>) with the tensor's element type U.
template <class F>
decltype(auto) with_ref(const vq_tensor& t, const char* what, F&& f) {
  switch (t.dtype) {
    case VQ_F16:
      return f(ref_of<Eigen::half>(t, what));
    case VQ_BF16:
      return f(ref_of<Eigen::bfloat16>(t, what));
    case VQ_F32:
      return f(ref_of<float>(t, what));
    default:
      return f(ref_of<double>(t, what));
  }
}

// The engine's C thread pool as a vc::ParallelFor. The C pool gets this thread's PoolCall as
// its context: it outlives the call, so a task the pool runs after returning (a misbehaving
// pool) finds the call closed and does nothing, as the library's task ledger would; the wrapper
// waits for tasks still running before it returns. A task's exception cannot cross the C pool's
// frames: the first is kept and thrown once the pool returns (the cache then resets, as for any
// failing parallel-for).
struct PoolCall {
  const std::function<void(int)>* task = nullptr;
  std::atomic<bool> open{false};
  std::atomic<int> running{0};
  std::mutex mutex;
  std::exception_ptr first;
};
thread_local PoolCall pool_call;

void run_pool_task(void* ctx, int i) {
  auto* c = static_cast<PoolCall*>(ctx);
  c->running.fetch_add(1);  // before looking at `open`: the closing side waits for it
  if (c->open.load()) {
    try {
      (*c->task)(i);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(c->mutex);
      if (!c->first) c->first = std::current_exception();
    }
  }
  c->running.fetch_sub(1);
}

vc::ParallelFor c_pool(vq_parallel_for_fn fn, void* pool_ctx) {
  return [fn, pool_ctx](int tasks, const std::function<void(int)>& task) {
    pool_entered = true;
    PoolCall& call = pool_call;
    call.task = &task;
    call.first = nullptr;
    call.open.store(true);
    fn(pool_ctx, tasks, run_pool_task, &call);
    call.open.store(false);
    while (call.running.load() != 0) std::this_thread::yield();
    call.task = nullptr;
    std::exception_ptr first = std::move(call.first);
    call.first = nullptr;
    if (first) std::rethrow_exception(first);
  };
}

// ---- configuration fields
// ------------------------------------------------------------------------

std::vector<std::string> field_names() {
  std::vector<std::string> names;
  vc::KVCacheConfig c;
  vc::detail::for_each_config_field(c, [&](const char* name, auto&) { names.emplace_back(name); });
  return names;
}

const std::vector<std::string>& all_fields() {
  static const std::vector<std::string> names = field_names();
  return names;
}

template <class I>
I parse_int(const std::string& field, const std::string& text) {
  I v{};
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc::result_out_of_range) {
    fail(VQ_EINVAL, field + ": \"" + text + "\" is out of range of the field's type");
  }
  if (ec != std::errc() || p != end || text.empty()) {
    fail(VQ_EINVAL, field + ": \"" + text + "\" is not an integer");
  }
  return v;
}

// Floating-point text without the locale: std::from_chars / to_chars where the standard library
// has them for double (libstdc++ 11+), else a stream imbued with the classic locale.
#if defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L
#define VQ_DETAIL_FLOAT_CHARCONV 1
#else
#define VQ_DETAIL_FLOAT_CHARCONV 0
#endif

double parse_double(const std::string& field, const std::string& text) {
  double v = 0.0;
  bool ok = !text.empty(), range = true;
#if VQ_DETAIL_FLOAT_CHARCONV
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v, std::chars_format::general);
  range = ec != std::errc::result_out_of_range;
  ok = ok && ec == std::errc() && p == end;
#else
  std::istringstream in(text);
  in.imbue(std::locale::classic());
  in >> v;
  ok = ok && !in.fail() && in.peek() == std::char_traits<char>::eof();
  range = !(in.fail() && (v == HUGE_VAL || v == -HUGE_VAL));
#endif
  if (!range) fail(VQ_EINVAL, field + ": \"" + text + "\" is out of range of a double");
  if (!ok) {
    fail(VQ_EINVAL, field + ": \"" + text + "\" is not a number (C locale: \"0.95\", \"1e-3\")");
  }
  return v;
}

void parse_into(const std::string& /*field*/, const std::string& text, std::string& out) {
  out = text;
}
void parse_into(const std::string& field, const std::string& text, int& out) {
  out = parse_int<int>(field, text);
}
void parse_into(const std::string& field, const std::string& text, double& out) {
  out = parse_double(field, text);
}
void parse_into(const std::string& field, const std::string& text, bool& out) {
  if (text == "true" || text == "1") {
    out = true;
  } else if (text == "false" || text == "0") {
    out = false;
  } else {
    fail(VQ_EINVAL, field + ": \"" + text + "\" is not a boolean (true, false, 1, 0)");
  }
}
void parse_into(const std::string& field, const std::string& text, std::optional<int>& out) {
  if (text == "none") {
    out.reset();
  } else {
    out = parse_int<int>(field, text);
  }
}

std::string format(const std::string& v) { return v; }
std::string format(int v) { return std::to_string(v); }
std::string format(bool v) { return v ? "true" : "false"; }
std::string format(double v) {  // the shortest text that reads back as v
#if VQ_DETAIL_FLOAT_CHARCONV
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
#else
  std::string text;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream out;
    out.imbue(std::locale::classic());
    out << std::setprecision(digits) << v;
    text = out.str();
    std::istringstream back(text);
    back.imbue(std::locale::classic());
    double w = 0.0;
    if (back >> w && w == v) break;
  }
  return text;
#endif
}
std::string format(const std::optional<int>& v) { return v ? std::to_string(*v) : "none"; }

// ---- the set's calls
// -----------------------------------------------------------------------------

// Runs one call of a layer. The layer's fetch window (a view into the cache's storage) is kept
// only when the call was refused as bad input (std::invalid_argument: thrown before the call
// reserves storage, which may move rows); after a success or any other failure it is dropped. A
// failure after the call entered the pool is VQ_ECALLBACK, naming the reset.
template <class T, class F>
auto layer_call(Set<T>& set, int layer, F&& call) -> decltype(call()) {
  auto& view = set.views[static_cast<std::size_t>(layer)];
  pool_entered = false;
  try {
    if constexpr (std::is_void_v<decltype(call())>) {
      call();
      view.reset();
    } else {
      auto result = call();
      return result;
    }
  } catch (const CError&) {
    throw;
  } catch (const std::invalid_argument&) {
    throw;
  } catch (...) {
    view.reset();
    if (!pool_entered) throw;
    std::string what = "the engine's parallel-for failed";
    try {
      throw;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    fail(VQ_ECALLBACK, what + " (layer " + std::to_string(layer) + " was reset)");
  }
}

template <class T>
void attend_typed(Set<T>& set, int layer, const vq_tensor& q, const vq_tensor& k,
                  const vq_tensor& v, float* out, vc::Layout out_layout) {
  if (k.dtype != v.dtype) fail(VQ_EINVAL, "keys and values must have the same dtype");
  vc::KVCache<T>& cache = *set.caches[static_cast<std::size_t>(layer)];
  with_ref(q, "q", [&](auto qr) {
    with_ref(k, "k", [&](auto kr) {
      using U = typename element_of<decltype(kr)>::type;
      const vc::TensorRef<U> vr = ref_of<U>(v, "v");
      layer_call(set, layer, [&] { cache.attend(qr, kr, vr, out, out_layout); });
    });
  });
}

// KVCache::observe of layer `layer` with queries q and, unless null, the re-read's keys k.
template <class T>
void observe_typed(Set<T>& set, int layer, const vq_tensor& q, const vq_tensor* k) {
  vc::KVCache<T>& cache = *set.caches[static_cast<std::size_t>(layer)];
  with_ref(q, "q", [&](auto qr) {
    if (k == nullptr) {
      layer_call(set, layer, [&] { cache.observe(qr); });
      return;
    }
    with_ref(*k, "k", [&](auto kr) { layer_call(set, layer, [&] { cache.observe(qr, kr); }); });
  });
}

template <class T>
std::int64_t update_typed(Set<T>& set, int layer, const vq_tensor& k, const vq_tensor& v,
                          const vq_tensor* q) {
  if (k.dtype != v.dtype) fail(VQ_EINVAL, "keys and values must have the same dtype");
  vc::KVCache<T>& cache = *set.caches[static_cast<std::size_t>(layer)];
  auto& view = set.views[static_cast<std::size_t>(layer)];
  return with_ref(k, "k", [&](auto kr) -> std::int64_t {
    using U = typename element_of<decltype(kr)>::type;
    const vc::TensorRef<U> vr = ref_of<U>(v, "v");
    std::optional<vc::KVView<T>> fresh;
    if (q == nullptr) {
      fresh.emplace(layer_call(set, layer, [&] { return cache.update_and_view(kr, vr); }));
    } else {
      with_ref(*q, "q", [&](auto qr) {
        fresh.emplace(layer_call(set, layer, [&] { return cache.update_and_view(kr, vr, qr); }));
      });
    }
    view = std::move(fresh);
    // Adaptive heads may differ (docs/design.md 4.9): the longest head's rows.
    if (!view->ragged()) return static_cast<std::int64_t>(view->rows());
    Eigen::Index most = 0;
    for (Eigen::Index b = 0; b < view->batch(); ++b) {
      for (Eigen::Index h = 0; h < view->heads(); ++h) most = std::max(most, view->rows(b, h));
    }
    return static_cast<std::int64_t>(most);
  });
}

// Copies rows [B, H, n, D] of a view into out in `layout` as float, each head's rows in ascending
// position (the order update_and_fetch returns; a view keeps the retained rows in storage order).
template <class T, class Rows>
void copy_rows(const vc::KVView<T>& view, Rows rows_of, Eigen::Index dim, float* out,
               vc::Layout layout) {
  const Eigen::Index B = view.batch(), H = view.heads(), n = view.rows();
  if (n == 0) return;  // nothing to copy (B and H may be anything a seq-0 call passed)
  std::vector<Eigen::Index> order(static_cast<std::size_t>(n));
  for (Eigen::Index b = 0; b < B; ++b) {
    for (Eigen::Index h = 0; h < H; ++h) {
      const auto m = rows_of(b, h);
      const auto pos = view.positions(b, h);
      for (Eigen::Index r = 0; r < n; ++r) order[static_cast<std::size_t>(r)] = r;
      std::sort(order.begin(), order.end(),
                [&](Eigen::Index x, Eigen::Index y) { return pos(x) < pos(y); });
      for (Eigen::Index i = 0; i < n; ++i) {
        const Eigen::Index r = order[static_cast<std::size_t>(i)];
        const Eigen::Index at = layout == vc::Layout::head_major ? ((b * H + h) * n + i) * dim
                                                                 : ((b * n + i) * H + h) * dim;
        for (Eigen::Index d = 0; d < dim; ++d) out[at + d] = static_cast<float>(m(r, d));
      }
    }
  }
}

std::unique_ptr<vq_caches> load_set(const char* path, vq_pool* pool = nullptr) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    fail(VQ_EIO, std::string("cannot open '") + path + "': " + std::strerror(errno));
  }
  // The storage type is the header's byte 12 (docs/design.md G); a file too short or foreign to
  // have one is read as half, whose loader names the problem.
  unsigned char head[13] = {};
  in.read(reinterpret_cast<char*>(head), sizeof(head));
  if (in.bad()) fail(VQ_EIO, std::string("cannot read '") + path + "'");
  const unsigned char code = in.gcount() == sizeof(head) ? head[12] : 1;
  in.clear();
  in.seekg(0);
  const std::string source = std::string("'") + path + "'";
  auto load = [&](auto tag) -> std::unique_ptr<vq_caches> {
    using T = decltype(tag);
    vc::PromptCache<T> pc;
    try {
      pc = vc::detail::PromptCacheIO<T>::load(in, source);
      vc::detail::PromptCacheIO<T>::expect_end(in, source);
    } catch (const std::runtime_error& e) {
      if (in.bad()) fail(VQ_EIO, std::string("cannot read '") + path + "'");
      fail(VQ_EFORMAT, e.what());
    }
    if (pool != nullptr) pool->pool.attach(pc.caches, "vq_load_pooled");
    auto set = std::make_unique<Set<T>>(std::move(pc.caches), storage_of<T>());
    set->metadata = std::move(pc.metadata);
    return set;
  };
  if (code == 2) return load(Eigen::bfloat16{});
  if (code == 3) return load(float{});
  return load(Eigen::half{});
}

// vq_caches_new and vq_caches_new_dims: `build(tag)` makes the std::vector of caches for T.
template <class Build>
vq_status new_set(const char* api, const vq_config* c, int n_layers, vq_storage storage,
                  vq_caches** out, Build&& build) {
  if (out != nullptr) *out = nullptr;
  return guarded(api, VQ_EINVAL, [&] {
    need(out, "out");
    need(c, "config");
    if (n_layers < 1) {
      fail(VQ_EINVAL, "n_layers (" + std::to_string(n_layers) + ") must be >= 1");
    }
    auto make = [&](auto tag) -> vq_caches* {
      using T = decltype(tag);
      return new Set<T>(build(tag), storage);
    };
    switch (storage) {
      case VQ_HALF:
        *out = make(Eigen::half{});
        break;
      case VQ_BFLOAT16:
        *out = make(Eigen::bfloat16{});
        break;
      case VQ_FLOAT:
        *out = make(float{});
        break;
      default:
        fail(VQ_EINVAL, "storage " + std::to_string(static_cast<int>(storage)) +
                            " is not VQ_HALF, VQ_BFLOAT16 or VQ_FLOAT");
    }
  });
}

}  // namespace

// ---- the ABI
// -------------------------------------------------------------------------------------

extern "C" {

int vq_abi_version(void) { return VQ_ABI_VERSION; }

const char* vq_library_version(void) { return "0.1.0"; }

const char* vq_last_error(void) { return last_error.c_str(); }

const char* vq_status_name(vq_status s) {
  switch (s) {
    case VQ_OK:
      return "VQ_OK";
    case VQ_EINVAL:
      return "VQ_EINVAL";
    case VQ_ENOMEM:
      return "VQ_ENOMEM";
    case VQ_EIO:
      return "VQ_EIO";
    case VQ_EFORMAT:
      return "VQ_EFORMAT";
    case VQ_ESTATE:
      return "VQ_ESTATE";
    case VQ_ECALLBACK:
      return "VQ_ECALLBACK";
    case VQ_ENOROOM:
      return "VQ_ENOROOM";
  }
  return "unknown";
}

vq_config* vq_config_new(void) {
  vq_config* c = nullptr;
  if (guarded("vq_config_new", VQ_ENOMEM, [&] { c = new vq_config(); }) != VQ_OK) return nullptr;
  return c;
}

void vq_config_free(vq_config* c) { delete c; }

vq_config* vq_config_copy(const vq_config* c) {
  vq_config* out = nullptr;
  (void)guarded("vq_config_copy", VQ_ENOMEM, [&] {
    need(c, "config");
    out = new vq_config(*c);
  });
  return out;
}

vq_status vq_config_set(vq_config* c, const char* field, const char* value) {
  return guarded("vq_config_set", VQ_EINVAL, [&] {
    need(c, "config");
    need(field, "field");
    need(value, "value");
    const std::string name(field), text(value);
    if (name == "budget") {
      c->config.set_budget(parse_int<int>(name, text));
      return;
    }
    vc::KVCacheConfig next = c->config;  // assigned only once the value parsed
    bool found = false;
    vc::detail::for_each_config_field(next, [&](const char* f, auto& member) {
      if (!found && name == f) {
        found = true;
        parse_into(name, text, member);
      }
    });
    if (!found) fail(VQ_EINVAL, "unknown field \"" + name + "\"");
    c->config = std::move(next);
  });
}

vq_status vq_config_get(const vq_config* c, const char* field, char* buf, size_t size,
                        size_t* needed) {
  return guarded("vq_config_get", VQ_EINVAL, [&] {
    need(c, "config");
    need(field, "field");
    const std::string name(field);
    std::optional<std::string> text;
    vc::KVCacheConfig copy = c->config;
    vc::detail::for_each_config_field(copy, [&](const char* f, auto& member) {
      if (!text && name == f) text = format(member);
    });
    if (!text) {
      fail(VQ_EINVAL, "unknown field \"" + name + "\"" +
                          (name == "budget" ? " (\"budget\" can be set, not read: read the "
                                              "method's own budget field)"
                                            : ""));
    }
    if (needed != nullptr) *needed = text->size() + 1;
    if (buf == nullptr || size < text->size() + 1) {
      fail(VQ_EINVAL, "buf holds " + std::to_string(buf == nullptr ? 0 : size) + " bytes; \"" +
                          name + "\" needs " + std::to_string(text->size() + 1));
    }
    std::memcpy(buf, text->c_str(), text->size() + 1);
  });
}

int vq_config_field_count(void) {
  int n = 0;
  (void)guarded("vq_config_field_count", VQ_ENOMEM,
                [&] { n = static_cast<int>(all_fields().size()); });
  return n;
}

const char* vq_config_field_name(int i) {
  const char* name = nullptr;
  (void)guarded("vq_config_field_name", VQ_ENOMEM, [&] {
    const auto& names = all_fields();
    if (i >= 0 && static_cast<std::size_t>(i) < names.size()) {
      name = names[static_cast<std::size_t>(i)].c_str();
    }
  });
  return name;
}

vq_status vq_config_validate(const vq_config* c) {
  return guarded("vq_config_validate", VQ_EINVAL, [&] {
    need(c, "config");
    c->config.validate();
  });
}

vq_status vq_caches_new(const vq_config* c, int n_layers, vq_storage storage, vq_caches** out) {
  return new_set("vq_caches_new", c, n_layers, storage, out, [&](auto tag) {
    using T = decltype(tag);
    return vc::KVCacheBuilder::for_model<T>(n_layers, c->config);
  });
}

vq_status vq_caches_new_pooled(const vq_config* c, int n_layers, vq_storage storage,
                               vq_pool* pool, vq_caches** out) {
  if (pool == nullptr) {
    if (out != nullptr) *out = nullptr;
    return set_error(VQ_EINVAL, "vq_caches_new_pooled", "pool is NULL");
  }
  return new_set("vq_caches_new_pooled", c, n_layers, storage, out, [&](auto tag) {
    using T = decltype(tag);
    return vc::KVCacheBuilder::for_model<T>(n_layers, c->config, pool->pool);
  });
}

vq_status vq_caches_new_dims(const vq_config* c, const int* head_dims, int n_layers,
                             vq_storage storage, vq_caches** out) {
  if (head_dims == nullptr) {
    if (out != nullptr) *out = nullptr;
    return set_error(VQ_EINVAL, "vq_caches_new_dims", "head_dims is NULL");
  }
  return new_set("vq_caches_new_dims", c, n_layers, storage, out, [&](auto tag) {
    using T = decltype(tag);
    std::vector<std::optional<int>> dims(static_cast<std::size_t>(n_layers));
    for (int i = 0; i < n_layers; ++i) {
      const int d = head_dims[i];
      if (d < 0) {
        fail(VQ_EINVAL, "head_dims[" + std::to_string(i) + "] (" + std::to_string(d) +
                            ") must be >= 0 (0: a layer without attention)");
      }
      if (d > 0) dims[static_cast<std::size_t>(i)] = d;
    }
    return vc::KVCacheBuilder::for_model<T>(dims, c->config);
  });
}

void vq_caches_free(vq_caches* s) { delete s; }

int vq_layers(const vq_caches* s) {
  if (s == nullptr) {
    set_error(VQ_EINVAL, "vq_layers", "caches is NULL");
    return -1;
  }
  return layer_count(*s);
}

vq_status vq_storage_of(const vq_caches* s, vq_storage* out) {
  return guarded("vq_storage_of", VQ_EINVAL, [&] {
    need(s, "caches");
    need(out, "out");
    *out = s->storage;
  });
}

vq_status vq_attend(vq_caches* s, int layer, const float* q, const float* k, const float* v,
                    float* out, int batch, int q_heads, int kv_heads, int seq, int head_dim,
                    vq_layout layout) {
  return on_layer(
      "vq_attend", VQ_ESTATE, s, layer,
      [&] {
        need(q, "q");
        need(k, "k");
        need(v, "v");
        need(out, "out");
      },
      [&](auto& set, auto& cache) {
        const vc::Layout l = layout_of(layout, "vq_attend");
        if (seq == 0 && batch >= 0 && q_heads >= 0 && kv_heads >= 0 && head_dim >= 0) return;
        layer_call(set, layer, [&] {
          cache.attend(vc::TensorRef<float>(q, batch, q_heads, seq, head_dim, l),
                       vc::TensorRef<float>(k, batch, kv_heads, seq, head_dim, l),
                       vc::TensorRef<float>(v, batch, kv_heads, seq, head_dim, l), out, l);
        });
      });
}

vq_status vq_attend_ex(vq_caches* s, int layer, const vq_tensor* q, const vq_tensor* k,
                       const vq_tensor* v, float* out, vq_layout out_layout) {
  return on_layer(
      "vq_attend_ex", VQ_ESTATE, s, layer,
      [&] {
        check_tensor(q, "q");
        check_tensor(k, "k");
        check_tensor(v, "v");
        need(out, "out");
      },
      [&](auto& set, auto&) {
        const vc::Layout l = layout_of(out_layout, "out_layout");
        const vq_tensor* all[] = {q, k, v};
        bool empty = true;
        for (const vq_tensor* t : all) {
          empty = empty && t->seq == 0 && t->batch >= 0 && t->heads >= 0 && t->dim >= 0;
        }
        if (empty) return;
        attend_typed(set, layer, *q, *k, *v, out, l);
      });
}

vq_status vq_update(vq_caches* s, int layer, const vq_tensor* k, const vq_tensor* v,
                    const vq_tensor* q, int64_t* rows) {
  return on_layer(
      "vq_update", VQ_ESTATE, s, layer,
      [&] {
        check_tensor(k, "k");
        check_tensor(v, "v");
        if (q != nullptr) check_tensor(q, "q");
        need(rows, "rows");
      },
      [&](auto& set, auto&) { *rows = update_typed(set, layer, *k, *v, q); });
}

vq_status vq_fetch(const vq_caches* s, int layer, float* keys, float* values, vq_layout layout) {
  return on_layer(
      "vq_fetch", VQ_ESTATE, s, layer, [] {},
      [&](auto& set, auto&) {
        const vc::Layout l = layout_of(layout, "vq_fetch");
        const auto& view = set.views[static_cast<std::size_t>(layer)];
        if (!view) {
          fail(VQ_ESTATE, "layer " + std::to_string(layer) +
                              " has no window to fetch: no vq_update since the set was built, "
                              "reset, loaded, forked or rolled back, or a vq_attend after it");
        }
        if (view->ragged()) {
          fail(VQ_EINVAL, "layer " + std::to_string(layer) +
                              ": its heads hold different numbers of rows (adaptive head "
                              "budgets or a compress), which one dense buffer cannot return; use "
                              "vq_attend");
        }
        if (keys != nullptr) {
          copy_rows(
              *view, [&](Eigen::Index b, Eigen::Index h) { return view->keys(b, h); },
              view->key_dim(), keys, l);
        }
        if (values != nullptr) {
          copy_rows(
              *view, [&](Eigen::Index b, Eigen::Index h) { return view->values(b, h); },
              view->value_dim(), values, l);
        }
      });
}

int64_t vq_offset(const vq_caches* s, int layer) {
  return layer_value("vq_offset", s, layer, std::int64_t{-1},
                     [](const auto& cache) { return cache.offset(); });
}

int vq_layer_budget(const vq_caches* s, int layer) {
  return layer_value("vq_layer_budget", s, layer, -1,
                     [](const auto& cache) { return cache.layer_budget(); });
}

int64_t vq_rows(const vq_caches* s, int layer) {
  return layer_value("vq_rows", s, layer, std::int64_t{-1},
                     [](const auto& cache) { return cache.max_head_rows(); });
}

int64_t vq_head_rows(const vq_caches* s, int layer, int b, int h) {
  return layer_value("vq_head_rows", s, layer, std::int64_t{-1}, [&](const auto& cache) {
    if (cache.batch() == 0) return std::int64_t{0};  // before the layer's first call
    if (b < 0 || b >= cache.batch() || h < 0 || h >= cache.heads()) {
      fail(VQ_EINVAL, "head (" + std::to_string(b) + ", " + std::to_string(h) +
                          ") is outside layer " + std::to_string(layer) + "'s " +
                          std::to_string(cache.batch()) + " x " + std::to_string(cache.heads()) +
                          " heads");
    }
    return cache.head_rows(b, h);
  });
}

size_t vq_kept_bytes(const vq_caches* s) {
  std::size_t bytes = 0;
  (void)guarded("vq_kept_bytes", VQ_EINVAL, [&] {
    need(s, "caches");
    visit(*s, [&](auto& set) {
      for (const auto& c : set.caches) bytes += c->kept_bytes();
    });
  });
  return bytes;
}

size_t vq_layer_kept_bytes(const vq_caches* s, int layer) {
  return layer_value("vq_layer_kept_bytes", s, layer, std::size_t{0},
                     [](const auto& cache) { return cache.kept_bytes(); });
}

size_t vq_layer_full_seq_bytes(const vq_caches* s, int layer) {
  return layer_value("vq_layer_full_seq_bytes", s, layer, std::size_t{0},
                     [](const auto& cache) { return cache.full_seq_bytes(); });
}

double vq_layer_compression_ratio(const vq_caches* s, int layer) {
  return layer_value("vq_layer_compression_ratio", s, layer, -1.0,
                     [](const auto& cache) { return cache.compression_ratio(); });
}

int64_t vq_layer_tokens_seen(const vq_caches* s, int layer) {
  return layer_value("vq_layer_tokens_seen", s, layer, std::int64_t{-1},
                     [](const auto& cache) { return cache.tokens_seen(); });
}

int64_t vq_layer_tokens_kept(const vq_caches* s, int layer) {
  return layer_value("vq_layer_tokens_kept", s, layer, std::int64_t{-1},
                     [](const auto& cache) { return cache.tokens_kept(); });
}

int vq_layer_is_trimmable(const vq_caches* s, int layer) {
  return layer_value("vq_layer_is_trimmable", s, layer, -1,
                     [](const auto& cache) { return cache.is_trimmable() ? 1 : 0; });
}

double vq_layer_concentration(const vq_caches* s, int layer) {
  return layer_value("vq_layer_concentration", s, layer, std::nan(""),
                     [](const auto& cache) { return concentration_of(cache); });
}

void vq_reset(vq_caches* s) {
  if (s == nullptr) return;
  (void)guarded("vq_reset", VQ_ESTATE, [&] {
    visit(*s, [&](auto& set) {
      set.forget_views();
      vc::KVCacheBuilder::reset(set.caches);
    });
  });
}

vq_status vq_fork(const vq_caches* s, vq_caches** out) {
  if (out != nullptr) *out = nullptr;
  return guarded("vq_fork", VQ_ESTATE, [&] {
    need(s, "caches");
    need(out, "out");
    *out = visit(*s, [&](auto& set) -> vq_caches* {
      using T = typename std::decay_t<decltype(set)>::type;
      auto copy = std::make_unique<Set<T>>(vc::KVCacheBuilder::fork(set.caches), set.storage);
      copy->metadata = set.metadata;
      return copy.release();
    });
  });
}

vq_status vq_fork_pooled(const vq_caches* s, vq_pool* pool, vq_caches** out) {
  if (out != nullptr) *out = nullptr;
  return guarded("vq_fork_pooled", VQ_ESTATE, [&] {
    need(s, "caches");
    need(pool, "pool");
    need(out, "out");
    *out = visit(*s, [&](auto& set) -> vq_caches* {
      using T = typename std::decay_t<decltype(set)>::type;
      auto copy =
          std::make_unique<Set<T>>(vc::KVCacheBuilder::fork(set.caches, pool->pool), set.storage);
      copy->metadata = set.metadata;
      return copy.release();
    });
  });
}

vq_status vq_checkpoint(vq_caches* s) {
  return guarded("vq_checkpoint", VQ_ESTATE, [&] {
    need(s, "caches");
    visit(*s, [&](auto& set) { vc::KVCacheBuilder::checkpoint(set.caches); });
  });
}

vq_status vq_rollback(vq_caches* s) {
  return guarded("vq_rollback", VQ_ESTATE, [&] {
    need(s, "caches");
    visit(*s, [&](auto& set) {
      vc::KVCacheBuilder::rollback(set.caches);
      set.forget_views();
    });
  });
}

vq_status vq_observe(vq_caches* s, int layer, const vq_tensor* q) {
  return on_layer(
      "vq_observe", VQ_ESTATE, s, layer, [&] { check_tensor(q, "q"); },
      [&](auto& set, auto&) { observe_typed(set, layer, *q, nullptr); });
}

vq_status vq_observe_keys(vq_caches* s, int layer, const vq_tensor* q, const vq_tensor* k) {
  return on_layer(
      "vq_observe_keys", VQ_ESTATE, s, layer,
      [&] {
        check_tensor(q, "q");
        check_tensor(k, "k");
      },
      [&](auto& set, auto&) { observe_typed(set, layer, *q, k); });
}

vq_status vq_compress(vq_caches* s, double keep) {
  return guarded("vq_compress", VQ_ESTATE, [&] {
    need(s, "caches");
    visit(*s, [&](auto& set) {
      vc::KVCacheBuilder::compress(set.caches, keep);
      set.forget_views();
    });
  });
}

vq_status vq_set_parallel_for(vq_caches* s, vq_parallel_for_fn fn, void* pool_ctx, int workers) {
  return guarded("vq_set_parallel_for", VQ_EINVAL, [&] {
    need(s, "caches");
    if (fn != nullptr && workers < 1) {
      fail(VQ_EINVAL, "workers (" + std::to_string(workers) + ") must be >= 1");
    }
    visit(*s, [&](auto& set) {
      const vc::ParallelFor run = fn == nullptr ? vc::ParallelFor() : c_pool(fn, pool_ctx);
      for (auto& c : set.caches) c->set_parallel_for(run, fn == nullptr ? 1 : workers);
    });
  });
}

vq_status vq_metadata_set(vq_caches* s, const char* key, const char* value) {
  return guarded("vq_metadata_set", VQ_EINVAL, [&] {
    need(s, "caches");
    need(key, "key");
    if (value == nullptr) {
      s->metadata.erase(key);
    } else {
      std::string k(key), v(value);  // allocated before the map changes
      s->metadata.insert_or_assign(std::move(k), std::move(v));
    }
  });
}

vq_status vq_metadata_get(const vq_caches* s, const char* key, const char** value) {
  if (value != nullptr) *value = nullptr;
  return guarded("vq_metadata_get", VQ_EINVAL, [&] {
    need(s, "caches");
    need(key, "key");
    need(value, "value");
    const auto it = s->metadata.find(key);
    if (it != s->metadata.end()) *value = it->second.c_str();
  });
}

int vq_metadata_count(const vq_caches* s) {
  if (s == nullptr) {
    set_error(VQ_EINVAL, "vq_metadata_count", "caches is NULL");
    return -1;
  }
  return static_cast<int>(s->metadata.size());
}

vq_status vq_metadata_at(const vq_caches* s, int i, const char** key, const char** value) {
  return guarded("vq_metadata_at", VQ_EINVAL, [&] {
    need(s, "caches");
    need(key, "key");
    need(value, "value");
    if (i < 0 || static_cast<std::size_t>(i) >= s->metadata.size()) {
      fail(VQ_EINVAL, "entry " + std::to_string(i) + " is out of range (the set has " +
                          std::to_string(s->metadata.size()) + ")");
    }
    auto it = s->metadata.begin();
    std::advance(it, i);
    *key = it->first.c_str();
    *value = it->second.c_str();
  });
}

vq_status vq_save(const vq_caches* s, const char* path) {
  return guarded("vq_save", VQ_EIO, [&] {
    need(s, "caches");
    need(path, "path");
    visit(*s, [&](auto& set) {
      try {
        vc::save_prompt_cache(std::string(path), set.caches, set.metadata);
      } catch (const std::runtime_error& e) {
        fail(VQ_EIO, e.what());
      }
    });
  });
}

vq_status vq_load_pooled(const char* path, vq_pool* pool, vq_caches** out) {
  if (out != nullptr) *out = nullptr;
  return guarded("vq_load_pooled", VQ_EFORMAT, [&] {
    need(path, "path");
    need(pool, "pool");
    need(out, "out");
    *out = load_set(path, pool).release();
  });
}

vq_status vq_pool_new(size_t max_bytes, vq_pool** out) {
  if (out != nullptr) *out = nullptr;
  return guarded("vq_pool_new", VQ_EINVAL, [&] {
    need(out, "out");
    *out = new vq_pool(max_bytes);
  });
}

void vq_pool_free(vq_pool* p) { delete p; }

size_t vq_pool_max_bytes(const vq_pool* p) { return p ? p->pool.max_bytes() : 0; }
size_t vq_pool_used_bytes(const vq_pool* p) { return p ? p->pool.used_bytes() : 0; }
size_t vq_pool_floor_bytes(const vq_pool* p) { return p ? p->pool.floor_bytes() : 0; }
int vq_pool_sequences(const vq_pool* p) {
  return p ? static_cast<int>(std::min<std::size_t>(p->pool.sequences(), INT_MAX)) : -1;
}

vq_status vq_pool_release(vq_caches* s) {
  return guarded("vq_pool_release", VQ_EINVAL, [&] {
    need(s, "caches");
    visit(*s, [&](auto& set) {
      for (auto& c : set.caches) c->leave_pool();
    });
  });
}

vq_status vq_load(const char* path, vq_caches** out) {
  if (out != nullptr) *out = nullptr;
  return guarded("vq_load", VQ_EFORMAT, [&] {
    need(path, "path");
    need(out, "out");
    *out = load_set(path).release();
  });
}

}  // extern "C"
