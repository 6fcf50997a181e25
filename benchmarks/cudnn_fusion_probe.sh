#!/usr/bin/env bash
# cuDNN's fp32 fusions of a convolution with batch normalization's work (cudnn_fusion_probe.cc).
#   bash benchmarks/cudnn_fusion_probe.sh build OUT_BINARY   (here: cuDNN's and cudnn-frontend's
#        headers from the wheels .ci/gpu-library-here installs)
#   bash benchmarks/cudnn_fusion_probe.sh run BINARY RESULT.jsonl [MAX_PLANS] [REPEATS]   (on a GPU)
#   bash benchmarks/cudnn_fusion_probe.sh summarize RESULT.jsonl DEVICE OUT.json
#        (each fused graph's fastest time beside its convolution's, cuDNN's reasons where none ran)
set -euo pipefail
case $1 in
  build)
    deps=${TF_UCUDNN_GPU_DEPS:-/tmp/tf_ucudnn-gpu-deps}
    if [ ! -f "$deps/include/cudnn_frontend.h" ]; then
      python3 -m pip install -q --no-deps --target "$deps" \
        "nvidia-cudnn-cu12==${CUDNN_VERSION:-9.14}.*" "nvidia-cudnn-frontend>=1.32" \
        "nvidia-cuda-nvrtc"
    fi
    nvrtc=$(dirname "$(dirname "$(find "$deps/nvidia" -name nvrtc.h | head -1)")")
    nvcc -std=c++17 -O2 -arch=sm_90 -w -I"$deps/include" -I"$deps/nvidia/cudnn/include" \
      -I"$nvrtc/include" "$(dirname "$0")/cudnn_fusion_probe.cc" \
      -L"$deps/nvidia/cudnn/lib" -l:libcudnn.so.9 -L"$nvrtc/lib" -l:libnvrtc.so.13 -o "$2" ;;
  run)
    # The GPU machine's cuDNN 9 and nvrtc, wherever its image keeps them.
    cudnn=$(dirname "$(find / -name 'libcudnn.so.9' -not -path '/proc/*' 2>/dev/null | head -1)")
    nvrtc=$(dirname "$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
    LD_LIBRARY_PATH="$cudnn:$nvrtc:${LD_LIBRARY_PATH:-}" "$2" "${4:-24}" "${5:-5}" | tee "$3" ;;
  summarize)
    python3 - "$2" "$3" "$4" <<'PY'
import json, re, sys
lines, device, out = sys.argv[1:]
rows = [json.loads(line) for line in open(lines)]
header, rows = rows[0], rows[1:]
unfused = {"conv+genstats": "conv", "scale_bias_relu+conv": "conv",
           "scale_bias_relu+conv+genstats": "conv", "dgrad+relu_bwd": "dgrad",
           "scale_bias_relu+wgrad": "wgrad"}
layers = {}
for row in rows:
    graph = {}
    if "best_ms" in row:
        graph = {k: row[k] for k in ("best_ms", "configurations", "runtime_compiled", "best_plan")}
    else:
        # cuDNN's log of each engine's refusal; the checks that failed say why.
        reasons = re.findall(r"Reason: (.*?)(?= Warning:|\s*$)", row.get("error", ""))
        generic = ("finalize", "status", "isSupported", "check_", "getStatus")
        graph["unsupported"] = sorted({r.strip() for r in reasons
                                       if not any(word in r for word in generic)})
    layers.setdefault(row["layer"], {})[row["graph"]] = graph
for graphs in layers.values():
    for fused, base in unfused.items():
        if "best_ms" in graphs.get(fused, {}) and "best_ms" in graphs.get(base, {}):
            graphs[fused]["times_unfused"] = round(
                graphs[fused]["best_ms"] / graphs[base]["best_ms"], 2)
json.dump({"benchmark": "cudnn_fusion_probe", "device": device,
           "cudnn_version": header["cudnn_version"],
           "command": f"bash benchmarks/cudnn_fusion_probe.sh run BINARY RESULT "
                      f"{header['max_plans']} {header['repeats']}",
           "note": "fp32 NHWC, batch 128, ResNet-50's layer shapes. best_ms: the fastest of the "
                   "first max_plans engine configurations cuDNN builds (heuristics A and "
                   "fallback), the best of repeats runs each; times_unfused: that time over the "
                   "graph's convolution alone (conv, dgrad or wgrad).",
           "layers": layers}, open(out, "w"), indent=1)
print(out)
PY
    ;;
  *) echo "usage: $0 build OUT | run BINARY RESULT [MAX_PLANS] [REPEATS] | summarize ..." >&2
     exit 2 ;;
esac
