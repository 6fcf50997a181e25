// CPU kernels: the same micro-batch loop as on the GPU, each micro-batch an im2col followed by one
// matrix product (Eigen, on TensorFlow's CPU thread pool). The im2col buffer plays the part of the
// cuDNN workspace: it grows with the micro-batch, up to kMaxPatchBytes.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cc/conv/conv_op_kernel.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_ucudnn {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

// Larger micro-batches are processed in chunks of samples so the patch matrix stays bounded.
constexpr int64_t kMaxPatchBytes = int64_t{256} << 20;

// Half and bfloat16 accumulate in float, as TensorFlow's CPU convolutions do.
template <typename T>
using Accum = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A>
using RowMajorMatrix = Eigen::TensorMap<Eigen::Tensor<A, 2, Eigen::RowMajor, Eigen::DenseIndex>>;

template <typename T>
class CpuConvolution {
 public:
  using A = Accum<T>;

  CpuConvolution(tensorflow::OpKernelContext* ctx, const ConvGeometry& g)
      : ctx_(ctx),
        g_(g),
        positions_(g.OutputSpatialSize()),
        taps_(g.FilterSpatialSize()),
        channels_(g.in_channels),
        row_(taps_ * channels_),
        in_channel_stride_(g.channels_last ? 1 : g.InputSpatialSize()),
        in_spatial_stride_(g.channels_last ? g.in_channels : 1),
        out_channel_stride_(g.channels_last ? 1 : g.OutputSpatialSize()),
        out_spatial_stride_(g.channels_last ? g.out_channels : 1) {
    BuildTapTable();
  }

  // Samples per chunk of a micro-batch.
  int64_t ChunkSize() const {
    const int64_t per_sample = std::max<int64_t>(1, positions_ * row_ * int64_t(sizeof(A)));
    return std::max<int64_t>(1, kMaxPatchBytes / per_sample);
  }

  void Forward(const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> b) {
    std::vector<A> filter = Convert(b.filter, g_.FilterSize());
    ForEachChunk(micro_batches, [&](int64_t first, int64_t count) {
      std::vector<A> patches(count * positions_ * row_);
      Im2Col(b.input, first, count, patches.data());
      std::vector<A> out(count * positions_ * g_.out_channels);
      // Eigen's threaded contraction does not write its result when the contracted dimension is
      // empty; the zeros `out` starts with are then the right answer.
      if (row_ > 0) {
        Matrix(out.data(), count * positions_, g_.out_channels).device(Device()) =
            Matrix(patches.data(), count * positions_, row_)
                .contract(Matrix(filter.data(), row_, g_.out_channels), Dims(1, 0));
      }
      ScatterOutput(out.data(), first, count, b.output);
    });
  }

  void BackpropInput(const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> b) {
    std::vector<A> filter = Convert(b.filter, g_.FilterSize());
    ForEachChunk(micro_batches, [&](int64_t first, int64_t count) {
      std::vector<A> out_grad = GatherOutput(b.output, first, count);
      std::vector<A> patches(count * positions_ * row_);
      if (g_.out_channels > 0) {  // else the zeros patches starts with (see Forward)
        Matrix(patches.data(), count * positions_, row_).device(Device()) =
            Matrix(out_grad.data(), count * positions_, g_.out_channels)
                .contract(Matrix(filter.data(), row_, g_.out_channels), Dims(1, 1));
      }
      Col2Im(patches.data(), first, count, b.input);
    });
  }

  void BackpropFilter(const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> b) {
    std::vector<A> filter_grad(g_.FilterSize(), A(0));
    ForEachChunk(micro_batches, [&](int64_t first, int64_t count) {
      // An empty output (0 positions) adds nothing; Eigen's contraction over the empty dimension
      // would add an uninitialized buffer instead.
      if (count * positions_ == 0) return;
      std::vector<A> patches(count * positions_ * row_);
      Im2Col(b.input, first, count, patches.data());
      std::vector<A> out_grad = GatherOutput(b.output, first, count);
      auto grad = Matrix(filter_grad.data(), row_, g_.out_channels);
      grad.device(Device()) = grad + Matrix(patches.data(), count * positions_, row_)
                                         .contract(Matrix(out_grad.data(), count * positions_,
                                                          g_.out_channels),
                                                   Dims(0, 0));
    });
    for (int64_t i = 0; i < g_.FilterSize(); ++i) b.filter[i] = static_cast<T>(filter_grad[i]);
  }

 private:
  static RowMajorMatrix<A> Matrix(A* data, int64_t rows, int64_t cols) {
    return RowMajorMatrix<A>(data, rows, cols);
  }
  static Eigen::array<Eigen::IndexPair<int>, 1> Dims(int a, int b) {
    return {Eigen::IndexPair<int>(a, b)};
  }
  const CPUDevice& Device() const { return ctx_->eigen_cpu_device(); }

  void ParallelFor(int64_t total, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    ctx_->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(total, cost, fn);
  }

  template <typename Fn>
  void ForEachChunk(const std::vector<MicroBatch>& micro_batches, Fn fn) {
    const int64_t chunk = ChunkSize();
    for (const MicroBatch& mb : micro_batches) {
      for (int64_t first = mb.offset; first < mb.offset + mb.size; first += chunk) {
        fn(first, std::min(chunk, mb.offset + mb.size - first));
      }
    }
  }

  static std::vector<A> Convert(const T* data, int64_t n) {
    std::vector<A> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<A>(data[i]);
    return out;
  }

  // For each (output position, filter tap): the input position it reads, or -1 in the padding.
  void BuildTapTable() {
    const int nd = g_.num_spatial_dims();
    tap_source_.assign(positions_ * taps_, -1);
    std::vector<int64_t> out_index(nd, 0);
    for (int64_t p = 0; p < positions_; ++p) {
      std::vector<int64_t> tap_index(nd, 0);
      for (int64_t t = 0; t < taps_; ++t) {
        int64_t source = 0;
        bool inside = true;
        for (int i = 0; i < nd; ++i) {
          const int64_t x =
              out_index[i] * g_.strides[i] - g_.pad_before[i] + tap_index[i] * g_.dilations[i];
          inside = inside && x >= 0 && x < g_.input_spatial[i];
          source = source * g_.input_spatial[i] + x;
        }
        if (inside) tap_source_[p * taps_ + t] = source;
        Increment(&tap_index, g_.filter_spatial);
      }
      Increment(&out_index, g_.output_spatial);
    }
  }

  static void Increment(std::vector<int64_t>* index, const std::vector<int64_t>& dims) {
    for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
      if (++(*index)[i] < dims[i]) return;
      (*index)[i] = 0;
    }
  }

  // patches[(n * positions + p), (t * channels + c)] = input[n, c, source(p, t)]
  void Im2Col(const T* input, int64_t first, int64_t count, A* patches) {
    ParallelFor(count * positions_, row_, [&](int64_t begin, int64_t end) {
      for (int64_t np = begin; np < end; ++np) {
        const int64_t n = first + np / positions_, p = np % positions_;
        const T* sample = input + n * g_.InputSampleSize();
        A* dst = patches + np * row_;
        for (int64_t t = 0; t < taps_; ++t, dst += channels_) {
          const int64_t source = tap_source_[p * taps_ + t];
          if (source < 0) {
            std::fill(dst, dst + channels_, A(0));
            continue;
          }
          const T* src = sample + source * in_spatial_stride_;
          for (int64_t c = 0; c < channels_; ++c) dst[c] = static_cast<A>(src[c * in_channel_stride_]);
        }
      }
    });
  }

  // The transpose of Im2Col, summing overlapping taps; work is split by sample so writes are disjoint.
  void Col2Im(const A* patches, int64_t first, int64_t count, T* input_grad) {
    ParallelFor(count, positions_ * row_, [&](int64_t begin, int64_t end) {
      std::vector<A> sample_grad(g_.InputSampleSize());
      for (int64_t local = begin; local < end; ++local) {
        std::fill(sample_grad.begin(), sample_grad.end(), A(0));
        for (int64_t p = 0; p < positions_; ++p) {
          const A* src = patches + (local * positions_ + p) * row_;
          for (int64_t t = 0; t < taps_; ++t, src += channels_) {
            const int64_t source = tap_source_[p * taps_ + t];
            if (source < 0) continue;
            A* dst = sample_grad.data() + source * in_spatial_stride_;
            for (int64_t c = 0; c < channels_; ++c) dst[c * in_channel_stride_] += src[c];
          }
        }
        T* out = input_grad + (first + local) * g_.InputSampleSize();
        for (int64_t i = 0; i < g_.InputSampleSize(); ++i) out[i] = static_cast<T>(sample_grad[i]);
      }
    });
  }

  // Output tensors (either layout) <-> a [count * positions, out_channels] matrix.
  void ScatterOutput(const A* matrix, int64_t first, int64_t count, T* output) {
    const int64_t k = g_.out_channels;
    for (int64_t np = 0; np < count * positions_; ++np) {
      T* dst = output + (first + np / positions_) * g_.OutputSampleSize() +
               (np % positions_) * out_spatial_stride_;
      for (int64_t c = 0; c < k; ++c) dst[c * out_channel_stride_] = static_cast<T>(matrix[np * k + c]);
    }
  }

  std::vector<A> GatherOutput(const T* output, int64_t first, int64_t count) {
    const int64_t k = g_.out_channels;
    std::vector<A> matrix(count * positions_ * k);
    for (int64_t np = 0; np < count * positions_; ++np) {
      const T* src = output + (first + np / positions_) * g_.OutputSampleSize() +
                     (np % positions_) * out_spatial_stride_;
      for (int64_t c = 0; c < k; ++c) matrix[np * k + c] = static_cast<A>(src[c * out_channel_stride_]);
    }
    return matrix;
  }

  tensorflow::OpKernelContext* ctx_;
  const ConvGeometry& g_;
  const int64_t positions_, taps_, channels_, row_;
  const int64_t in_channel_stride_, in_spatial_stride_;
  const int64_t out_channel_stride_, out_spatial_stride_;
  std::vector<int64_t> tap_source_;
};

}  // namespace

template <typename T>
struct ConvLauncher<CPUDevice, T> {
  static absl::Status Run(tensorflow::OpKernelContext* ctx, ConvKernel kernel,
                          const ConvGeometry& geometry,
                          const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> buffers) {
    // The CPU has one algorithm; the plan's algorithm numbers were validated when it was parsed.
    CpuConvolution<T> conv(ctx, geometry);
    switch (kernel) {
      case ConvKernel::kForward:
        conv.Forward(micro_batches, buffers);
        break;
      case ConvKernel::kBackpropInput:
        conv.BackpropInput(micro_batches, buffers);
        break;
      case ConvKernel::kBackpropFilter:
        conv.BackpropFilter(micro_batches, buffers);
        break;
    }
    return absl::OkStatus();
  }
};

#define REGISTER_CPU(T)                                                                        \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("UcudnnConv2D").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),              \
      (UcudnnConvOp<CPUDevice, T, ConvKernel::kForward, 2>));                                  \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("UcudnnConv2DBackpropInput").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      (UcudnnConvOp<CPUDevice, T, ConvKernel::kBackpropInput, 2>));                            \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("UcudnnConv2DBackpropFilter").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),\
      (UcudnnConvOp<CPUDevice, T, ConvKernel::kBackpropFilter, 2>));                           \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("UcudnnConv3D").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),              \
      (UcudnnConvOp<CPUDevice, T, ConvKernel::kForward, 3>));                                  \
  REGISTER_KERNEL_BUILDER(Name("UcudnnConv3DBackpropInput")                                    \
                              .Device(tensorflow::DEVICE_CPU)                                  \
                              .TypeConstraint<T>("T"),                                         \
                          (UcudnnConvOp<CPUDevice, T, ConvKernel::kBackpropInput, 3>));        \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("UcudnnConv3DBackpropFilter").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),\
      (UcudnnConvOp<CPUDevice, T, ConvKernel::kBackpropFilter, 3>));

REGISTER_CPU(Eigen::half);
REGISTER_CPU(tensorflow::bfloat16);
REGISTER_CPU(float);
REGISTER_CPU(double);

}  // namespace tf_ucudnn
