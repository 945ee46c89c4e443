// veloxquant — what every policy does with a call's rows (docs/design.md 4, 6, 7): absorb_head
// hands a head's new rows to its rule's driver. The rules and call plans are in rule.hpp; the
// scored policies' driver in scored_call.hpp, the query-free scorers in proxy_call.hpp, SnapKV's
// ranking in prompt_call.hpp, eviction choices in eviction.hpp and the call's rows in and out
// (queries, attention output, block logits) in call_io.hpp. KVzip's observe and compress, set
// operations rather than a call's, are in observed_call.hpp.
#pragma once

#include <Eigen/Core>

#include "call_io.hpp"
#include "head_store.hpp"
#include "prompt_call.hpp"
#include "proxy_call.hpp"
#include "rule.hpp"
#include "scored_call.hpp"
#include "scratch.hpp"

namespace veloxquant::cache::detail {

/// Absorbs the `count` rows appended at [call_begin(), call_begin() + count) of `head` by `rule`;
/// with `att`, also writes the call's attention output (fused into the scoring where the scoring
/// softmax is the attention's, else by attend_window).
template <class T>
void absorb_head(HeadStore<T>& head, const Rule& rule, const CallPlan& plan, Index count,
                 const HeadQueries& q, const HeadAttend& att, Scratch& sc) {
  const Index first = head.call_begin();
  switch (rule.kind) {
    case RuleKind::cumulative:
      if (!q && rule.proxy != ProxyScoring::key_as_query) {
        absorb_proxy(head, rule, count, sc);  // no queries, so no attention output either
        return;
      }
      [[fallthrough]];
    case RuleKind::last_attention:
      if (att && !plan.gather && head.live() == first) {
        absorb_scored(head, rule, plan, count, q, att, sc);
        return;
      }
      absorb_scored(head, rule, plan, count, q, HeadAttend{}, sc);
      if (att) attend_window(head, count, q, att, sc);
      return;
    case RuleKind::prompt:
      if (plan.compress) {
        compress_prompt(head, rule, count, q, sc);
        if (att) attend_window(head, count, q, att, sc);
        return;
      }
      break;
    case RuleKind::window: {
      for (Index i = 0; i < count; ++i) head.push_live(static_cast<Slot>(first + i));
      const Slot* ord = head.order().data();
      const Index sinks = head.leading_sinks(rule.n_sink);
      const Index excess = head.live() - sinks - rule.window;
      if (excess > 0) {
        for (Index i = sinks; i < sinks + excess; ++i) head.mark_dead(ord[i]);
        head.drop_dead();
      }
      if (att) attend_window(head, count, q, att, sc);
      return;
    }
    case RuleKind::observed:
      // KVzip (SPEC 18): every row stays, unscored until an observe call scores it.
      for (Index i = 0; i < count; ++i) {
        head.push_live(static_cast<Slot>(first + i));
        head.score(first + i) = kUnobserved;
      }
      if (att) attend_window(head, count, q, att, sc);
      return;
    case RuleKind::keep_all:
      break;
  }
  for (Index i = 0; i < count; ++i) head.push_live(static_cast<Slot>(first + i));
  if (att) attend_window(head, count, q, att, sc);
}

}  // namespace veloxquant::cache::detail
