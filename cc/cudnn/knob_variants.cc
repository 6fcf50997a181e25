// See knob_variants.h.
#include "cc/cudnn/knob_variants.h"

#include <algorithm>

namespace tf_ucudnn {

std::vector<int64_t> KnobValuesToTry(const KnobRange& range) {
  if (range.stride <= 0 || range.max_value < range.min_value) return {};
  const int64_t count = (range.max_value - range.min_value) / range.stride + 1;
  const int64_t last = range.min_value + (count - 1) * range.stride;
  std::set<int64_t> values = {range.min_value, last};
  if (count <= static_cast<int64_t>(kMaxValuesPerKnob)) {
    for (int64_t v = range.min_value; v <= last; v += range.stride) values.insert(v);
  } else {
    for (int64_t power = 1; power > 0 && power < last; power *= 2) {
      if (power > range.min_value && (power - range.min_value) % range.stride == 0) {
        values.insert(power);
      }
    }
  }
  const std::vector<int64_t> all(values.begin(), values.end());
  if (all.size() <= kMaxValuesPerKnob) return all;
  std::vector<int64_t> spread;
  for (size_t i = 0; i < kMaxValuesPerKnob; ++i) {
    spread.push_back(all[i * (all.size() - 1) / (kMaxValuesPerKnob - 1)]);
  }
  return spread;
}

std::string KnobVariantKey(int64_t engine, const KnobMap& knobs) {
  std::string key = std::to_string(engine);
  for (const auto& [type, value] : knobs) {
    key += "," + std::to_string(type) + ":" + std::to_string(value);
  }
  return key;
}

std::vector<KnobVariant> KnobVariants(const std::vector<EngineKnobs>& engines,
                                      std::set<std::string> known, size_t limit) {
  std::vector<std::vector<KnobVariant>> by_engine;
  size_t rounds = 0;
  for (const EngineKnobs& engine : engines) {
    auto& variants = by_engine.emplace_back();
    for (const KnobRange& range : engine.ranges) {
      for (int64_t value : KnobValuesToTry(range)) {
        KnobVariant variant{engine.engine, engine.first};
        variant.knobs[range.type] = value;
        variants.push_back(std::move(variant));
      }
    }
    rounds = std::max(rounds, variants.size());
  }
  std::vector<KnobVariant> chosen;
  for (size_t round = 0; round < rounds && chosen.size() < limit; ++round) {
    for (const auto& variants : by_engine) {
      if (round >= variants.size() || chosen.size() == limit) continue;
      const KnobVariant& variant = variants[round];
      if (known.insert(KnobVariantKey(variant.engine, variant.knobs)).second) {
        chosen.push_back(variant);
      }
    }
  }
  return chosen;
}

}  // namespace tf_ucudnn
