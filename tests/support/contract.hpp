// The contract every cache keeps, as GoogleTest support over support/subjects.hpp: expecting an
// invalid_argument, and driving a cache and its untouched twin through the same valid calls. Used
// by test_contract.cpp (the typed contract suite) and test_bad_inputs.cpp.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <stdexcept>
#include <string>

#include "support/subjects.hpp"

namespace veloxquant::test {

/// Runs `f`, expecting std::invalid_argument; returns its message (and records a failure if
/// nothing or something else was thrown).
inline std::string invalid_argument_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than std::invalid_argument: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw std::invalid_argument";
  return "";
}

/// The same valid call on subject and twin through `api`: same return, same state afterwards.
template <class T>
void valid_call_on_both(Subject<T>& subject, Subject<T>& twin, std::mt19937& rng, Index S, Api api,
                        const std::string& ctx) {
  const Call c = random_call(rng, with_s(kKeys, S), with_s(kValues, S));
  vc::KVPair<T> into_a, into_b;
  const Returned a = invoke(*subject.cache, api, c, into_a);
  const Returned b = invoke(*twin.cache, api, c, into_b);
  EXPECT_TRUE(a == b) << ctx << ": " << api_name(api) << " returned something else than the twin";
  EXPECT_TRUE(snapshot(subject) == snapshot(twin)) << ctx << ": state differs from the twin's";
}

/// Brings subject and twin past their budgets: a 9-token prefill and three decode steps.
template <class T>
void establish(Subject<T>& subject, Subject<T>& twin, std::mt19937& rng, const std::string& ctx) {
  valid_call_on_both(subject, twin, rng, 9, Api::kFetch, ctx + ": prefill");
  for (const Api api : {Api::kView, Api::kFetchInto, Api::kFetchQ}) {
    valid_call_on_both(subject, twin, rng, 1, api, ctx + ": decode");
  }
}

}  // namespace veloxquant::test
