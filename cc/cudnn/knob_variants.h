// Which engine configurations the engine listing adds to cuDNN's heuristics' (cc/cudnn/engines.cc
// does the cudnn-frontend side): plain data, so the choice is checked without cuDNN
// (tests/kernels/test_knob_variants.py). The heuristics offer one value of each knob per
// configuration; a value they pass over of a knob that trades workspace for speed (WORKSPACE:1, a
// smaller split-K) can be what fits a micro-batch's limit, or what makes more workspace pay.
#ifndef TF_UCUDNN_CC_CUDNN_KNOB_VARIANTS_H_
#define TF_UCUDNN_CC_CUDNN_KNOB_VARIANTS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace tf_ucudnn {

// At most this many values of one knob are tried.
constexpr size_t kMaxValuesPerKnob = 8;
// At most this many variants per kernel and micro-batch size: each is built and timed like the
// heuristics' configurations (milliseconds of host time each).
constexpr size_t kMaxKnobVariants = 32;

// A knob's values as cuDNN describes them: minValue to maxValue, stride apart.
struct KnobRange {
  int64_t type = 0;
  int64_t min_value = 0;
  int64_t max_value = 0;
  int64_t stride = 1;
};

// Knob type -> value: one engine configuration's choices.
using KnobMap = std::map<int64_t, int64_t>;

// An engine as the listing sees it: its first configuration in the heuristics' order, and the
// ranges of its knobs that trade workspace for speed.
struct EngineKnobs {
  int64_t engine = 0;
  KnobMap first;
  std::vector<KnobRange> ranges;
};

struct KnobVariant {
  int64_t engine = 0;
  KnobMap knobs;
};

// The values tried for a knob: all of them where there are at most kMaxValuesPerKnob, else the
// range's ends and the powers of two between, kMaxValuesPerKnob of them spread evenly. Ascending;
// empty for a range that holds no value.
std::vector<int64_t> KnobValuesToTry(const KnobRange& range);

// The text that names a configuration (engine and sorted knobs), for telling configurations apart.
std::string KnobVariantKey(int64_t engine, const KnobMap& knobs);

// The variants to add, in order: each one knob away from its engine's first configuration, set
// to one of KnobValuesToTry of that knob's range; the engines take turns in the order given (a
// variant of each, then a second of each...), none already in `known` (keys of the heuristics'
// configurations), none twice, at most `limit`.
std::vector<KnobVariant> KnobVariants(const std::vector<EngineKnobs>& engines,
                                      std::set<std::string> known,
                                      size_t limit = kMaxKnobVariants);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_KNOB_VARIANTS_H_
