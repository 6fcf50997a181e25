"""Whether cuDNN runs a strided convolution of few channels faster in space-to-depth blocks:
ResNet-50's stem, AlexNet's first layer and MobileNetV2's, each kernel as it is and as the
stride-1 convolution of its input in blocks of the stride (the `space_to_depth` form of
tf_ucudnn's plans, docs/design.md), timed through PyTorch's cuDNN bindings. It needs PyTorch,
which the lent GPU machines have and tf_ucudnn does not use, so that the form could be judged
before it was built:

    python3 benchmarks/space_to_depth_probe.py      (writes $OUT/s2d_probe.json)
"""

import json
import os

import torch
import torch.nn.functional as F

# (name, input channels, input size, output channels, filter size, stride, padding)
LAYERS = [("resnet_stem", 3, 224, 64, 7, 2, 3), ("alexnet_conv1", 3, 227, 96, 11, 4, 0),
          ("mobilenet_first", 3, 224, 32, 3, 2, 1)]


def timed(function, repeats=20):
    """Milliseconds per call, between CUDA events, after three calls."""
    for _ in range(3):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def kernels(batch, channels, size, out_channels, taps, stride, pad, channels_last):
    """The forward, input-gradient and filter-gradient times of one convolution."""
    x = torch.randn(batch, channels, size, size, device="cuda")
    w = torch.randn(out_channels, channels, taps, taps, device="cuda")
    if channels_last:
        x, w = (t.to(memory_format=torch.channels_last) for t in (x, w))
    y = F.conv2d(x, w, stride=stride, padding=pad)
    dy = torch.randn_like(y)

    def backward(mask):
        return torch.ops.aten.convolution_backward(dy, x, w, None, [stride] * 2, [pad] * 2,
                                                   [1, 1], False, [0, 0], 1, mask)
    return {"fwd": timed(lambda: F.conv2d(x, w, stride=stride, padding=pad)),
            "bwd_data": timed(lambda: backward([True, False, False])),
            "bwd_filter": timed(lambda: backward([False, True, False])),
            "out": list(y.shape)}


def in_blocks(channels, size, taps, stride, pad):
    """The blocked convolution's input channels, input size and filter size, and the output's."""
    out = (size + 2 * pad - taps) // stride + 1
    block_taps = -(-taps // stride)
    return channels * stride * stride, out + block_taps - 1, block_taps, out


def copy_ms(batch, channels, size, stride, pad, blocked_size):
    x = torch.randn(batch, channels, size, size, device="cuda")
    after = blocked_size * stride - size - pad
    return timed(lambda: F.pixel_unshuffle(F.pad(x, (pad, after, pad, after)), stride)
                 .contiguous())


def main():
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    results = {"device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
               "cases": []}
    for name, channels, size, out_channels, taps, stride, pad in LAYERS:
        block_channels, block_size, block_taps, _ = in_blocks(channels, size, taps, stride, pad)
        for batch in (256, 64, 32):
            for channels_last in (False, True):
                direct = kernels(batch, channels, size, out_channels, taps, stride, pad,
                                 channels_last)
                blocks = kernels(batch, block_channels, block_size, out_channels, block_taps, 1,
                                 0, channels_last)
                assert blocks["out"] == direct["out"], (blocks["out"], direct["out"])
                row = {"layer": name, "batch": batch, "channels_last": channels_last,
                       "direct": direct, "space_to_depth": blocks,
                       "blocks_copy_ms": copy_ms(batch, channels, size, stride, pad, block_size)}
                results["cases"].append(row)
                print(json.dumps(row), flush=True)
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "s2d_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
