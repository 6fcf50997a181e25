// Plans parsed and checked without cuDNN's headers, so that a bad plan is rejected on any device
// when its op is built.
#include "cc/common/micro_batch_plan.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tf_ucudnn {
namespace {

const char* const kMathNames[] = {"default", "tensor_op", "tensor_op_allow_conversion", "fma"};
constexpr ConvForm kForms[] = {ConvForm::kDirect, ConvForm::kSubsampled, ConvForm::kSpaceToDepth,
                                ConvForm::kChannelsFirst};

// Knob names as plan.py takes them: an upper-case letter, then upper-case letters, digits, '_'.
bool IsKnobName(absl::string_view name) {
  if (name.empty() || !absl::ascii_isupper(name[0])) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isupper(c) || absl::ascii_isdigit(c) || c == '_';
  });
}

const char* AlgorithmEnumName(ConvKernel kernel) {
  switch (kernel) {
    case ConvKernel::kForward:
      return "cudnnConvolutionFwdAlgo_t";
    case ConvKernel::kBackpropInput:
      return "cudnnConvolutionBwdDataAlgo_t";
    case ConvKernel::kBackpropFilter:
      return "cudnnConvolutionBwdFilterAlgo_t";
  }
  return "?";
}

}  // namespace

const char* FormName(ConvForm form) {
  switch (form) {
    case ConvForm::kDirect:
      return "direct";
    case ConvForm::kSubsampled:
      return "subsampled";
    case ConvForm::kSpaceToDepth:
      return "space_to_depth";
    case ConvForm::kChannelsFirst:
      return "channels_first";
  }
  return "?";
}

bool FormFromName(absl::string_view name, ConvForm* form) {
  for (ConvForm candidate : kForms) {
    if (name == FormName(candidate)) {
      *form = candidate;
      return true;
    }
  }
  return false;
}

int AlgorithmCount(ConvKernel kernel) {
  switch (kernel) {
    case ConvKernel::kForward:
      return 8;
    case ConvKernel::kBackpropInput:
      return 6;
    case ConvKernel::kBackpropFilter:
      return 7;
  }
  return 0;
}

absl::Status AlgorithmSpec::Parse(const std::string& text, ConvKernel kernel,
                                  AlgorithmSpec* spec) {
  *spec = AlgorithmSpec();
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  if (trimmed == "auto") return absl::OkStatus();
  const auto syntax_error = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot parse algorithm '", text, "': ", why,
        " (expected 'auto', 'algo=N[,math=NAME]' or 'engine=N[,knobs=NAME:V/NAME:V...]', "
        "either followed by ',subsampled=1', ',space_to_depth=1' or ',channels_first=1')"));
  };
  std::map<std::string, std::string> fields;
  for (absl::string_view item : absl::StrSplit(trimmed, ',')) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    const std::string key(absl::StripAsciiWhitespace(kv.first));
    if (item.find('=') == absl::string_view::npos) return syntax_error("missing '='");
    if (!fields.emplace(key, std::string(absl::StripAsciiWhitespace(kv.second))).second) {
      return syntax_error(absl::StrCat("'", key, "' given twice"));
    }
  }
  for (ConvForm form : kForms) {
    auto flag = fields.find(FormName(form));
    if (form == ConvForm::kDirect || flag == fields.end()) continue;
    if (flag->second != "1") {
      return syntax_error(absl::StrCat(flag->first, " must be 1 where given"));
    }
    if (spec->form != ConvForm::kDirect) return syntax_error("more than one form given");
    fields.erase(flag);
    spec->form = form;
  }
  if (spec->form != ConvForm::kDirect && fields.empty()) {
    return syntax_error(absl::StrCat(FormName(spec->form), " needs an algorithm or engine"));
  }
  // An algo makes it a legacy algorithm, as in plan.py ("algo=1,engine=2" has an unknown key).
  const bool engine_form = fields.count("engine") > 0 && fields.count("algo") == 0;
  for (const auto& [key, value] : fields) {
    const bool known = engine_form ? key == "engine" || key == "knobs"
                                   : key == "algo" || key == "math";
    if (!known) return syntax_error(absl::StrCat("unknown key '", key, "'"));
  }
  if (engine_form) return ParseEngine(fields, syntax_error, spec);
  auto algo = fields.find("algo");
  if (algo == fields.end()) return syntax_error("no 'algo'");
  int number;
  if (!absl::SimpleAtoi(algo->second, &number)) return syntax_error("algo is not an integer");
  if (number < 0 || number >= AlgorithmCount(kernel)) {
    return absl::InvalidArgumentError(absl::StrCat("algorithm ", number, " is not a ",
                                                   AlgorithmEnumName(kernel), " (0..",
                                                   AlgorithmCount(kernel) - 1, ")"));
  }
  spec->automatic = false;
  spec->algo = number;
  auto math = fields.find("math");
  if (math != fields.end()) {
    bool known = false;
    for (int m = 0; m < 4; ++m) {
      if (math->second == kMathNames[m]) {
        spec->math = static_cast<MathMode>(m);
        known = true;
      }
    }
    if (!known) return syntax_error(absl::StrCat("unknown math mode '", math->second, "'"));
  }
  return absl::OkStatus();
}

absl::Status AlgorithmSpec::ParseEngine(
    const std::map<std::string, std::string>& fields,
    const std::function<absl::Status(absl::string_view)>& syntax_error, AlgorithmSpec* spec) {
  int64_t engine;
  if (!absl::SimpleAtoi(fields.at("engine"), &engine)) {
    return syntax_error("engine is not an integer");
  }
  if (engine < 0) return syntax_error("engine must be non-negative");
  auto knobs = fields.find("knobs");
  if (knobs != fields.end()) {
    for (absl::string_view item : absl::StrSplit(knobs->second, '/')) {
      std::pair<absl::string_view, absl::string_view> nv =
          absl::StrSplit(item, absl::MaxSplits(':', 1));
      const absl::string_view name = absl::StripAsciiWhitespace(nv.first);
      int64_t value;
      if (item.find(':') == absl::string_view::npos ||
          !absl::SimpleAtoi(absl::StripAsciiWhitespace(nv.second), &value)) {
        return syntax_error(absl::StrCat("knob '", item, "' is not NAME:INTEGER"));
      }
      if (!IsKnobName(name)) {
        return syntax_error(absl::StrCat("knob name '", name, "' is not a KnobType_t name"));
      }
      spec->knobs.emplace_back(std::string(name), value);
    }
  }
  std::sort(spec->knobs.begin(), spec->knobs.end());
  for (size_t i = 1; i < spec->knobs.size(); ++i) {
    if (spec->knobs[i].first == spec->knobs[i - 1].first) {
      return syntax_error(absl::StrCat("knob '", spec->knobs[i].first, "' given twice"));
    }
  }
  spec->automatic = false;
  spec->engine = engine;
  return absl::OkStatus();
}

std::string AlgorithmSpec::ToString() const {
  if (automatic && !is_engine()) return "auto";
  std::string text;
  if (is_engine()) {
    text = absl::StrCat("engine=", engine);
    if (!knobs.empty()) {
      absl::StrAppend(&text, ",knobs=",
                      absl::StrJoin(knobs, "/", absl::PairFormatter(":")));
    }
  } else {
    text = absl::StrCat("algo=", algo);
    if (math != MathMode::kFromTensorFlow) {
      absl::StrAppend(&text, ",math=", kMathNames[static_cast<int>(math)]);
    }
  }
  if (form != ConvForm::kDirect) absl::StrAppend(&text, ",", FormName(form), "=1");
  return text;
}

absl::Status CheckForm(const ConvGeometry& g, ConvForm form) {
  const int nd = g.num_spatial_dims();
  bool strided = false, one_tap_unpadded = true, one_tap = true, undilated = true;
  for (int i = 0; i < nd; ++i) {
    one_tap_unpadded = one_tap_unpadded && g.filter_spatial[i] == 1 && g.pad_before[i] == 0 &&
                       g.pad_after[i] == 0;
    one_tap = one_tap && g.filter_spatial[i] == 1;
    strided = strided || g.strides[i] > 1;
    undilated = undilated && g.dilations[i] == 1;
  }
  switch (form) {
    case ConvForm::kDirect:
      return absl::OkStatus();
    case ConvForm::kSubsampled:
      if (strided && one_tap_unpadded) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(
          "a subsampled convolution needs a 1x1 filter, no padding and a stride above 1, not ",
          g.DebugString()));
    case ConvForm::kSpaceToDepth:
      if (nd == 2 && g.strides[0] > 1 && g.strides[0] == g.strides[1] && !one_tap && undilated &&
          g.groups == 1) {
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "a convolution in space-to-depth blocks needs two spatial dimensions, one stride above "
          "1 in both, a filter of more than one tap, no dilation and no groups, not ",
          g.DebugString()));
    case ConvForm::kChannelsFirst:
      if (g.channels_last) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(
          "a convolution on channels-first copies needs channels-last tensors, not ",
          g.DebugString()));
  }
  return absl::InvalidArgumentError("unknown form");
}

absl::Status PlanForm(const ConvGeometry& g, const std::vector<MicroBatch>& micro_batches,
                      ConvForm* form) {
  *form = micro_batches.empty() ? ConvForm::kDirect : micro_batches[0].algorithm.form;
  for (size_t i = 1; i < micro_batches.size(); ++i) {
    if (micro_batches[i].algorithm.form != *form) {
      return absl::InvalidArgumentError(absl::StrCat(
          "micro-batch ", i, " runs ", FormName(micro_batches[i].algorithm.form),
          " but micro-batch 0 ", FormName(*form), ": all of a plan's micro-batches run in one "
          "form"));
    }
  }
  return CheckForm(g, *form);
}

absl::Status MicroBatchPlan::FromAttrs(ConvKernel kernel, const std::vector<int64_t>& sizes,
                                       const std::vector<std::string>& algorithms,
                                       MicroBatchPlan* plan) {
  *plan = MicroBatchPlan();
  if (sizes.size() != algorithms.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan has ", sizes.size(), " micro-batch sizes but ", algorithms.size(), " algorithms"));
  }
  // Built aside so a rejected plan leaves `plan` empty rather than half filled.
  std::vector<AlgorithmSpec> specs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch ", i, " has size ", sizes[i], "; sizes must be positive"));
    }
    AlgorithmSpec spec;
    absl::Status status = AlgorithmSpec::Parse(algorithms[i], kernel, &spec);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch ", i, ": ", status.message()));
    }
    specs.push_back(spec);
  }
  plan->sizes_ = sizes;
  plan->algorithms_ = std::move(specs);
  return absl::OkStatus();
}

int64_t MicroBatchPlan::total() const {
  int64_t total = 0;
  for (int64_t size : sizes_) total += size;
  return total;
}

absl::Status MicroBatchPlan::Resolve(int64_t batch, std::vector<MicroBatch>* micro_batches) const {
  micro_batches->clear();
  if (sizes_.empty()) {
    if (batch > 0) micro_batches->push_back({0, batch, AlgorithmSpec()});
    return absl::OkStatus();
  }
  if (total() != batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the micro-batch sizes sum to ", total(), " but the batch has ", batch, " samples"));
  }
  int64_t offset = 0;
  for (size_t i = 0; i < sizes_.size(); ++i) {
    micro_batches->push_back({offset, sizes_[i], algorithms_[i]});
    offset += sizes_[i];
  }
  return absl::OkStatus();
}

std::string MicroBatchPlan::DebugString() const {
  if (sizes_.empty()) return "[] (undivided, algorithm chosen at run time)";
  std::vector<std::string> items;
  for (size_t i = 0; i < sizes_.size(); ++i) {
    items.push_back(absl::StrCat(sizes_[i], "@", algorithms_[i].ToString()));
  }
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

}  // namespace tf_ucudnn
