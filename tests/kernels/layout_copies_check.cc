// CudnnLayout's copies checked on the CPU (tests/kernels/test_layout_copies.py builds and runs
// this): for each case, a naive convolution of cuDNN's view of the tensors (the input, filter and
// output gradient copied as the layout says, cuDNN's strides and padding) equals the naive
// convolution of the op's own, for the forward pass and both gradients copied back. The copies
// run on the host as cc/cudnn/strided_copy.h describes them, and through the GPU kernel's own
// per-element code (cc/cudnn/strided_copy_kernel.h: its dim order, divisions and bound checks) with
// 32- and 64-bit indices, which must write the same.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cc/cudnn/layout.h"
#include "cc/cudnn/strided_copy_kernel.h"

namespace tf_ucudnn {
namespace {

// Copies, this case so far, where the kernel's code wrote otherwise than the description says.
int kernel_mismatches = 0;

template <typename Index>
std::vector<float> KernelCopy(const StridedCopy& copy, const float* src, std::vector<float> dst) {
  const DeviceCopy<Index> device = MakeDeviceCopy<Index>(DestinationOrdered(copy));
  int64_t total = 1;
  for (int d = 0; d < copy.rank; ++d) total *= copy.dims[d];
  for (int64_t linear = 0; linear < total; ++linear) {
    CopyElement<float, Index>(device, static_cast<Index>(linear), src, dst.data());
  }
  return dst;
}

void DescribedCopy(const StridedCopy& copy, const float* src, float* dst) {
  int64_t total = 1;
  for (int d = 0; d < copy.rank; ++d) total *= copy.dims[d];
  for (int64_t linear = 0; linear < total; ++linear) {
    int64_t rest = linear, index[kMaxCopyRank] = {};
    for (int d = copy.rank - 1; d >= 0; --d) {
      index[d] = rest % copy.dims[d];
      rest /= copy.dims[d];
    }
    int64_t src_offset = copy.src.offset, dst_offset = copy.dst.offset;
    int64_t src_at[kMaxCopyRank], dst_at[kMaxCopyRank];
    for (int a = 0; a < kMaxCopyRank; ++a) {
      src_at[a] = copy.src.starts[a];
      dst_at[a] = copy.dst.starts[a];
    }
    for (int d = 0; d < copy.rank; ++d) {
      src_offset += index[d] * copy.src.strides[d];
      dst_offset += index[d] * copy.dst.strides[d];
      src_at[copy.src.axes[d]] += index[d] * copy.src.steps[d];
      dst_at[copy.dst.axes[d]] += index[d] * copy.dst.steps[d];
    }
    const auto inside = [](int64_t at, int64_t bound) {
      return bound <= 0 || (at >= 0 && at < bound);
    };
    bool read = true, write = true;
    for (int a = 0; a < kMaxCopyRank; ++a) {
      read = read && inside(src_at[a], copy.src.bounds[a]);
      write = write && inside(dst_at[a], copy.dst.bounds[a]);
    }
    if (write) dst[dst_offset] = read ? src[src_offset] : 0.f;
  }
}

void HostCopy(const StridedCopy& copy, const float* src, std::vector<float>& dst) {
  const std::vector<float> before = dst;
  DescribedCopy(copy, src, dst.data());
  kernel_mismatches += KernelCopy<int32_t>(copy, src, before) != dst;
  kernel_mismatches += KernelCopy<int64_t>(copy, src, before) != dst;
}

// A tensor [N, C, H, W] stored channels-last or not; a filter [K, C, R, S] in TensorFlow's layout
// [R, S, C, K] or cuDNN's (KCRS, or KRSC channels-last).
struct Tensor {
  int64_t n, c, h, w;
  bool channels_last;
  int64_t At(int64_t a, int64_t b, int64_t y, int64_t x) const {
    return channels_last ? ((a * h + y) * w + x) * c + b : ((a * c + b) * h + y) * w + x;
  }
  int64_t Size() const { return n * c * h * w; }
};
struct Filter {
  int64_t k, c, h, w;
  bool tensorflow, channels_last;
  int64_t At(int64_t o, int64_t i, int64_t y, int64_t x) const {
    if (tensorflow) return ((y * w + x) * c + i) * k + o;
    return channels_last ? ((o * h + y) * w + x) * c + i : ((o * c + i) * h + y) * w + x;
  }
  int64_t Size() const { return k * c * h * w; }
};
struct Window {
  int64_t stride[2], pad[2];
};

enum class Kernel { kForward, kBackpropInput, kBackpropFilter };

// The form's name without micro_batch_plan.cc, whose messages need absl's libraries.
const char* Name(ConvForm form) {
  return form == ConvForm::kSpaceToDepth    ? "space_to_depth"
         : form == ConvForm::kSubsampled    ? "subsampled"
         : form == ConvForm::kChannelsFirst ? "channels_first"
                                            : "direct";
}

// One naive loop for the three kernels: y = conv(x, w), dx += dy * w, dw += dy * x.
void Naive(Kernel kernel, const Tensor& X, float* x, const Filter& W, float* w, const Tensor& Y,
           float* y, const Window& s) {
  float* result = kernel == Kernel::kForward ? y : kernel == Kernel::kBackpropInput ? x : w;
  std::fill(result, result + (kernel == Kernel::kForward ? Y.Size()
                              : kernel == Kernel::kBackpropInput ? X.Size() : W.Size()), 0.f);
  for (int64_t n = 0; n < Y.n; ++n)
    for (int64_t o = 0; o < Y.c; ++o)
      for (int64_t oy = 0; oy < Y.h; ++oy)
        for (int64_t ox = 0; ox < Y.w; ++ox)
          for (int64_t i = 0; i < X.c; ++i)
            for (int64_t ky = 0; ky < W.h; ++ky)
              for (int64_t kx = 0; kx < W.w; ++kx) {
                const int64_t iy = oy * s.stride[0] + ky - s.pad[0];
                const int64_t ix = ox * s.stride[1] + kx - s.pad[1];
                if (iy < 0 || iy >= X.h || ix < 0 || ix >= X.w) continue;
                float& xi = x[X.At(n, i, iy, ix)];
                float& wi = w[W.At(o, i, ky, kx)];
                float& yi = y[Y.At(n, o, oy, ox)];
                if (kernel == Kernel::kForward) yi += xi * wi;
                if (kernel == Kernel::kBackpropInput) xi += yi * wi;
                if (kernel == Kernel::kBackpropFilter) wi += yi * xi;
              }
}

double MaxDifference(const std::vector<float>& a, const std::vector<float>& b) {
  double most = 0;
  for (size_t i = 0; i < a.size(); ++i) most = std::max(most, double(std::fabs(a[i] - b[i])));
  return most;
}

// Input n x c x h x w, k filters of kh x kw, one stride, padding top/bottom/left/right.
bool Check(ConvForm form, bool channels_last, bool float64, int64_t n, int64_t c, int64_t h,
           int64_t w, int64_t k, int64_t kh, int64_t kw, int64_t stride, int64_t top,
           int64_t bottom, int64_t left, int64_t right) {
  kernel_mismatches = 0;
  ConvGeometry g;
  g.channels_last = channels_last;
  g.batch = n;
  g.in_channels = c;
  g.out_channels = k;
  g.input_spatial = {h, w};
  g.filter_spatial = {kh, kw};
  g.strides = {stride, stride};
  g.dilations = {1, 1};
  g.pad_before = {top, left};
  g.pad_after = {bottom, right};
  g.output_spatial = {(h + top + bottom - kh) / stride + 1, (w + left + right - kw) / stride + 1};
  const CudnnLayout layout(g, float64, form);
  const Tensor X{n, c, h, w, channels_last};
  const Tensor Y{n, k, g.output_spatial[0], g.output_spatial[1], channels_last};
  const Filter W{k, c, kh, kw, true, false};
  const auto in = layout.InputDims(n), out = layout.OutputDims(n), f = layout.FilterDims();
  const bool last = layout.channels_last();
  const Tensor Xc{in[0], in[1], in[2], in[3], last}, Yc{out[0], out[1], out[2], out[3], last};
  const Filter Wc{f[0], f[1], f[2], f[3], false, last};
  const Window window{{stride, stride}, {top, left}};
  const Window cudnn{{layout.strides()[0], layout.strides()[1]},
                     {layout.symmetric_padding()[0], layout.symmetric_padding()[1]}};
  std::mt19937 generator(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(X.Size()), wt(W.Size()), dy(Y.Size());
  for (auto* v : {&x, &wt, &dy}) {
    std::generate(v->begin(), v->end(), [&] { return normal(generator); });
  }
  // cuDNN's operands, as the layout copies them (the output only where it is transposed).
  std::vector<float> xc(Xc.Size(), 7.f), wc(Wc.Size(), 7.f), dyc = dy;
  HostCopy(layout.InputCopy(n, /*to_cudnn=*/true), x.data(), xc);
  HostCopy(layout.FilterToCudnn(), wt.data(), wc);
  if (layout.transposed()) HostCopy(layout.OutputCopy(n, /*to_cudnn=*/true), dy.data(), dyc);

  std::vector<float> y(Y.Size()), yc(Yc.Size()), y_back = yc;
  Naive(Kernel::kForward, X, x.data(), W, wt.data(), Y, y.data(), window);
  Naive(Kernel::kForward, Xc, xc.data(), Wc, wc.data(), Yc, yc.data(), cudnn);
  if (layout.transposed()) {
    HostCopy(layout.OutputCopy(n, /*to_cudnn=*/false), yc.data(), y_back);
  } else {
    y_back = yc;
  }
  std::vector<float> dx(X.Size()), dxc(Xc.Size()), dx_back(X.Size(), 9.f);
  Naive(Kernel::kBackpropInput, X, dx.data(), W, wt.data(), Y, dy.data(), window);
  Naive(Kernel::kBackpropInput, Xc, dxc.data(), Wc, wc.data(), Yc, dyc.data(), cudnn);
  if (!layout.covers_input()) std::fill(dx_back.begin(), dx_back.end(), 0.f);
  HostCopy(layout.InputCopy(n, /*to_cudnn=*/false), dxc.data(), dx_back);
  std::vector<float> dw(W.Size()), dwc(Wc.Size()), dw_back(W.Size(), 9.f);
  Naive(Kernel::kBackpropFilter, X, x.data(), W, dw.data(), Y, dy.data(), window);
  Naive(Kernel::kBackpropFilter, Xc, xc.data(), Wc, dwc.data(), Yc, dyc.data(), cudnn);
  HostCopy(layout.FilterFromCudnn(), dwc.data(), dw_back);

  // The filter as XLA would lay it out for the custom call (FilterMinorToMajor): exactly
  // cuDNN's filter, element for element; no such order for a filter in blocks.
  const std::vector<int64_t> minor_to_major = layout.FilterMinorToMajor();
  bool filter_order = minor_to_major.empty() == (form == ConvForm::kSpaceToDepth);
  if (!minor_to_major.empty()) {
    const int64_t dims[4] = {kh, kw, c, k};  // TensorFlow's [R, S, C, K]
    int64_t strides[4], stride = 1;
    for (int64_t d : minor_to_major) {
      strides[d] = stride;
      stride *= dims[d];
    }
    std::vector<float> laid_out(W.Size(), 9.f);
    for (int64_t r = 0; r < kh; ++r)
      for (int64_t s = 0; s < kw; ++s)
        for (int64_t i = 0; i < c; ++i)
          for (int64_t o = 0; o < k; ++o)
            laid_out[r * strides[0] + s * strides[1] + i * strides[2] + o * strides[3]] =
                wt[W.At(o, i, r, s)];
    filter_order = laid_out == wc;
  }

  const double forward = MaxDifference(y, y_back), data = MaxDifference(dx, dx_back),
               filter = MaxDifference(dw, dw_back);
  const bool same = forward < 1e-3 && data < 1e-3 && filter < 1e-3 && kernel_mismatches == 0 &&
                    filter_order;
  std::printf("%s %s %s n%lld c%lld %lldx%lld k%lld filter %lldx%lld stride %lld pad %lld,%lld,"
              "%lld,%lld: forward %.1e, input gradient %.1e, filter gradient %.1e, kernel's copies "
              "differing %d, filter order for XLA %s %s\n",
              Name(form), channels_last ? "NHWC" : "NCHW", float64 ? "float64" : "float32",
              (long long)n, (long long)c, (long long)h, (long long)w, (long long)k, (long long)kh,
              (long long)kw, (long long)stride, (long long)top, (long long)bottom,
              (long long)left, (long long)right, forward, data, filter, kernel_mismatches,
              minor_to_major.empty() ? "none" : filter_order ? "right" : "wrong",
              same ? "ok" : "WRONG");
  return same;
}

// Copies no 2-D layout makes, through the kernel's code against the description: every rank up to
// kMaxCopyRank (3-D convolutions copy rank 5), random dims and storage orders on both sides,
// sources starting before their tensor and ending past it. Returns the mismatches, each printed.
int RandomCopyMismatches() {
  std::mt19937 generator(5);
  int mismatches = 0;
  for (int trial = 0; trial < 300; ++trial) {
    StridedCopy copy;
    copy.rank = 1 + trial % kMaxCopyRank;
    int64_t src_dims[kMaxCopyRank];
    for (int d = 0; d < copy.rank; ++d) {
      copy.dims[d] = 1 + generator() % 4;
      src_dims[d] = std::max<int64_t>(1, copy.dims[d] - static_cast<int64_t>(generator() % 3));
    }
    int64_t elements[2] = {1, 1};
    for (int side = 0; side < 2; ++side) {
      CopySide& s = side == 0 ? copy.src : copy.dst;
      const int64_t* dims = side == 0 ? src_dims : copy.dims;
      int order[kMaxCopyRank];
      std::iota(order, order + copy.rank, 0);
      std::shuffle(order, order + copy.rank, generator);
      for (int i = copy.rank - 1; i >= 0; --i) {
        s.strides[order[i]] = elements[side];
        elements[side] *= dims[order[i]];
      }
      for (int d = 0; d < copy.rank; ++d) {
        s.axes[d] = d;
        s.steps[d] = 1;
      }
    }
    for (int d = 0; d < copy.rank; ++d) {
      copy.src.starts[d] = -static_cast<int64_t>(generator() % 2);
      copy.src.bounds[d] = src_dims[d];
      copy.src.offset += copy.src.starts[d] * copy.src.strides[d];
    }
    std::vector<float> src(elements[0]);
    std::iota(src.begin(), src.end(), 1.f);
    std::vector<float> dst(elements[1], -7.f);
    const std::vector<float> before = dst;
    DescribedCopy(copy, src.data(), dst.data());
    for (bool wide : {false, true}) {
      const auto written = wide ? KernelCopy<int64_t>(copy, src.data(), before)
                                : KernelCopy<int32_t>(copy, src.data(), before);
      if (written != dst && ++mismatches <= 5) {
        std::printf("random copy %d of rank %d, %d-bit indices WRONG\n", trial, copy.rank,
                    wide ? 64 : 32);
      }
    }
  }
  return mismatches;
}

// The kernel's division by a dim as multiply and shift against integer division, over the
// dividends its 32-bit path takes ([0, 2^31)): every divisor below 5000 and some far above, at
// the edges and at random. Returns the mismatches, each printed.
int FastDivisorMismatches() {
  std::mt19937 generator(11);
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d < 5000; ++d) divisors.push_back(d);
  for (uint32_t d : {51529u, 65535u, 65536u, 65537u, 1u << 20, 123457u, (1u << 31) - 1}) {
    divisors.push_back(d);
  }
  int mismatches = 0;
  for (uint32_t d : divisors) {
    const FastDivisor divisor(d);
    std::vector<uint32_t> dividends = {0, 1, d - 1, d, d + 1, (1u << 31) - 1, (1u << 31) - 2,
                                       ((1u << 31) - 1) / d * d, ((1u << 31) - 1) / d * d - 1};
    for (int i = 0; i < 200; ++i) dividends.push_back(generator() & 0x7fffffffu);
    for (uint32_t n : dividends) {
      if (n >= (1u << 31) || divisor.Quotient(n) == n / d) continue;
      if (++mismatches <= 5) {
        std::printf("fast divisor %u of %u: %u, not %u WRONG\n", d, n, divisor.Quotient(n),
                    n / d);
      }
    }
  }
  return mismatches;
}

}  // namespace
}  // namespace tf_ucudnn

int main() {
  using tf_ucudnn::Check;
  using tf_ucudnn::ConvForm;
  const ConvForm blocks = ConvForm::kSpaceToDepth, direct = ConvForm::kDirect,
                 subsampled = ConvForm::kSubsampled, channels_first = ConvForm::kChannelsFirst;
  int wrong = 0;
  for (bool channels_last : {false, true}) {
    for (bool float64 : {false, true}) {
      const auto check = [&](ConvForm form, int64_t c, int64_t h, int64_t w, int64_t k,
                             int64_t kh, int64_t kw, int64_t stride, int64_t top, int64_t bottom,
                             int64_t left, int64_t right) {
        wrong += !Check(form, channels_last, float64, 2, c, h, w, k, kh, kw, stride, top, bottom,
                        left, right);
      };
      check(blocks, 3, 16, 16, 8, 7, 7, 2, 3, 3, 3, 3);   // ResNet's stem, small
      check(blocks, 3, 27, 27, 6, 11, 11, 4, 0, 0, 0, 0); // AlexNet's first layer, small
      check(blocks, 4, 9, 11, 6, 3, 3, 2, 1, 1, 0, 1);    // SAME, odd sizes
      check(blocks, 2, 10, 9, 4, 5, 3, 2, 2, 1, 0, 2);    // asymmetric padding
      check(blocks, 2, 18, 18, 4, 3, 3, 4, 0, 0, 0, 0);   // rows and columns no output reads
      check(blocks, 3, 40, 40, 4, 7, 7, 2, 0, 0, 0, 0);   // pre-padded, as Keras's stem
      check(direct, 3, 16, 16, 8, 7, 7, 2, 3, 3, 3, 3);
      check(direct, 4, 9, 11, 6, 3, 3, 2, 1, 1, 0, 1);    // asymmetric: padded in the copy
      check(direct, 2, 10, 9, 4, 5, 3, 1, 2, 1, 0, 2);
      check(subsampled, 8, 10, 10, 6, 1, 1, 2, 0, 0, 0, 0);
      check(subsampled, 8, 9, 11, 6, 1, 1, 3, 0, 0, 0, 0);
      if (channels_last) {  // channels-first copies of channels-last tensors
        check(channels_first, 4, 9, 11, 6, 3, 3, 2, 1, 1, 0, 1);
        check(channels_first, 2, 10, 9, 4, 5, 3, 1, 2, 1, 0, 2);
      }
    }
  }
  wrong += tf_ucudnn::RandomCopyMismatches() > 0;
  wrong += tf_ucudnn::FastDivisorMismatches() > 0;
  std::printf(wrong ? "%d cases WRONG\n" : "all cases right\n", wrong);
  return wrong ? 1 : 0;
}
