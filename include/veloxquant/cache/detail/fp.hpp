// veloxquant — products that the compiler may not fuse with a later addition (docs/design.md 7.2).
// GCC and Clang contract a * b + c into an FMA when the target has one (GNU modes default to
// -ffp-contract=fast), so the same source would round differently under -march=x86-64 and
// -march=x86-64-v3. The scalar arithmetic that decides budgets (concentration, budget schedules)
// rounds every product on its own through these helpers, so the decisions are the same in every
// build.
#pragma once

namespace veloxquant::cache::detail {

/// a * b, rounded, and opaque to contraction with whatever it is added to.
inline double product(double a, double b) {
  double p = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(p));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(p));
#else
  volatile double v = p;
  p = v;
#endif
  return p;
}

}  // namespace veloxquant::cache::detail
