// veloxquant — per-layer budget schedules: squeeze_budgets (docs/design.md 5.3) and pyramid_budgets
// (docs/design.md 6).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "fp.hpp"

namespace veloxquant::cache::detail {

/// Round to nearest, ties to even, independent of the floating-point environment.
inline double round_half_even(double x) {
  const double f = std::floor(x);
  const double diff = x - f;
  if (diff < 0.5) return f;
  if (diff > 0.5) return f + 1.0;
  return std::fmod(f, 2.0) == 0.0 ? f : f + 1.0;
}

/// n_sink + 1 without overflow (the smallest budget a layer can get).
inline int floor_budget_of(int n_sink) {
  return n_sink >= std::numeric_limits<int>::max() ? std::numeric_limits<int>::max() : n_sink + 1;
}

/// Clamp a rounded budget to int range and apply the floor.
inline int to_budget(double v, int floor_budget) {
  const double r = round_half_even(v);
  const double hi = static_cast<double>(std::numeric_limits<int>::max());
  const int b = r >= hi ? std::numeric_limits<int>::max() : static_cast<int>(std::max(r, -hi));
  return std::max(b, floor_budget);
}

/// SqueezeAttention reallocation (docs/design.md 5.3): broad layers (low concentration) get more.
inline std::vector<int> squeeze_budgets(const std::vector<double>& concentrations, int avg_budget,
                                        int n_sink, double strength) {
  if (!(strength >= 0.0 && strength <= 1.0)) {
    std::ostringstream os;
    os << "squeeze_budgets: strength (" << strength << ") must be in [0, 1]";
    throw std::invalid_argument(os.str());
  }
  const std::size_t n = concentrations.size();
  if (n == 0) return {};
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(concentrations[i])) {
      std::ostringstream os;
      os << "squeeze_budgets: concentration " << i << " (" << concentrations[i]
         << ") must be finite";
      throw std::invalid_argument(os.str());
    }
  }
  const int floor_budget = floor_budget_of(n_sink);
  if (n == 1) return {std::max(avg_budget, floor_budget)};
  std::vector<double> raw(n);
  double sum = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double c = std::clamp(concentrations[i], 0.0, 1.0);
    raw[i] = 1.0 - c;
    sum += raw[i];
  }
  const double nd = static_cast<double>(n);
  std::vector<int> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double w = sum <= 0.0 ? 1.0 : raw[i] * nd / sum;
    const double b = product(static_cast<double>(avg_budget), (1.0 - strength) + product(strength, w));
    out[i] = to_budget(b, floor_budget);
  }
  return out;
}

/// PyramidKV taper with water-filling to the average (docs/design.md 6).
inline std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink, double beta) {
  if (!(beta >= 1.0 && beta <= 1e6)) {  // kMaxPyramidBeta (kv_cache_config.hpp)
    std::ostringstream os;
    os << "pyramid_budgets: beta (" << beta << ") must be in [1, 1e6]";
    throw std::invalid_argument(os.str());
  }
  if (n_layers <= 0) return {};
  const int floor_budget = floor_budget_of(n_sink);
  if (n_layers == 1) return {std::max(avg_budget, floor_budget)};
  const auto n = static_cast<std::size_t>(n_layers);
  const double avg = avg_budget;
  const double fl = floor_budget;
  const double span = product(avg - fl, beta - 1.0);
  const double top = avg + span;
  const double bottom = avg - span;
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = top + product(bottom - top, static_cast<double>(i)) / static_cast<double>(n - 1);
  }
  std::vector<bool> clamped(n, false);
  for (std::size_t pass = 0; pass < n; ++pass) {
    for (std::size_t i = 0; i < n; ++i) {
      if (v[i] < fl) {
        v[i] = fl;
        clamped[i] = true;
      }
    }
    double total = 0.0;
    for (double x : v) total += x;
    const double excess = total - product(avg, static_cast<double>(n));
    if (excess <= 1e-9) break;
    double slack = 0.0;
    bool any_free = false;
    for (std::size_t i = 0; i < n; ++i) {
      if (!clamped[i]) {
        any_free = true;
        slack += v[i] - fl;
      }
    }
    if (!any_free || slack <= 1e-9) break;
    for (std::size_t i = 0; i < n; ++i) {
      if (!clamped[i]) v[i] -= product(excess, v[i] - fl) / slack;
    }
  }
  std::vector<int> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = to_budget(v[i], floor_budget);
  return out;
}

}  // namespace veloxquant::cache::detail
