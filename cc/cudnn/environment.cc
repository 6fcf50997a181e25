// environment.h's variables, parsed on first use and then cached: every cuDNN call asks.
#include "cc/cudnn/environment.h"

#include <algorithm>
#include <cstdlib>
#include <string>

namespace tf_ucudnn {

size_t AutomaticWorkspaceLimit() {
  static const size_t limit = [] {
    const char* text = std::getenv("TF_CUDNN_WORKSPACE_LIMIT_IN_MB");
    const long long megabytes = text != nullptr ? std::atoll(text) : 4096;
    return static_cast<size_t>(std::max(0LL, megabytes)) << 20;
  }();
  return limit;
}

namespace {

bool Enabled(const char* variable) {
  const char* text = std::getenv(variable);
  return text != nullptr && std::string(text) == "1";
}

}  // namespace

bool LogCalls() {
  static const bool enabled = Enabled("TF_UCUDNN_LOG_CALLS");
  return enabled;
}

bool RuntimeCompiledEngines() {
  static const bool enabled = Enabled("TF_UCUDNN_RUNTIME_COMPILED_ENGINES");
  return enabled;
}

}  // namespace tf_ucudnn
