// The engine listing's knob variants (cc/cudnn/knob_variants.h) for fixed cases, printed for
// tests/kernels/test_knob_variants.py to compare: one line per case.
#include <cstdio>
#include <string>

#include "cc/cudnn/knob_variants.h"

namespace tf_ucudnn {
namespace {

void PrintValues(int64_t min_value, int64_t max_value, int64_t stride) {
  std::printf("values %lld %lld %lld:", static_cast<long long>(min_value),
              static_cast<long long>(max_value), static_cast<long long>(stride));
  for (int64_t v : KnobValuesToTry({7, min_value, max_value, stride})) {
    std::printf(" %lld", static_cast<long long>(v));
  }
  std::printf("\n");
}

void PrintVariants(const char* name, const std::vector<EngineKnobs>& engines, size_t limit) {
  std::set<std::string> known;
  for (const EngineKnobs& engine : engines) {
    known.insert(KnobVariantKey(engine.engine, engine.first));
  }
  std::printf("variants %s:", name);
  for (const KnobVariant& variant : KnobVariants(engines, known, limit)) {
    std::printf(" %s", KnobVariantKey(variant.engine, variant.knobs).c_str());
  }
  std::printf("\n");
}

}  // namespace
}  // namespace tf_ucudnn

int main() {
  using namespace tf_ucudnn;  // NOLINT: a test driver
  PrintValues(0, 2, 1);
  PrintValues(0, 7, 1);
  PrintValues(1, 1000, 1);
  PrintValues(1, 100, 3);
  PrintValues(-1, 64, 1);
  PrintValues(5, 5, 1);
  PrintValues(0, 4, 0);
  PrintValues(3, 2, 1);
  // Engine 30: two split-K knobs (types 12 and 17) beside a tile size (type 2) kept as it is;
  // engine 68: WORKSPACE (type 22) 0 to 1, its first configuration at 0.
  const std::vector<EngineKnobs> engines = {
      {30, {{2, 5}, {12, 20}, {17, 21}}, {{12, 1, 3, 1}, {17, 2, 4, 2}}},
      {68, {{2, 1}, {22, 0}}, {{22, 0, 1, 1}}},
  };
  PrintVariants("all", engines, kMaxKnobVariants);
  PrintVariants("limit3", engines, 3);
  PrintVariants("none", {}, kMaxKnobVariants);
  return 0;
}
