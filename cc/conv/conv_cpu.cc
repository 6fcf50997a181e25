// CPU kernels: the same micro-batch loop as on the GPU, each micro-batch an im2col followed by one
// matrix product per group (Eigen, on TensorFlow's CPU thread pool). The im2col buffer plays the
// part of the cuDNN workspace: it grows with the micro-batch, up to kMaxPatchBytes.
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
        channels_(g.GroupInChannels()),
        group_outputs_(g.GroupOutChannels()),
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
    std::vector<std::vector<A>> filters = GroupFilters(b.filter);
    ForEachChunk(micro_batches, [&](int64_t first, int64_t count) {
      std::vector<A> patches(count * positions_ * row_);
      std::vector<A> out(count * positions_ * group_outputs_);
      for (int64_t group = 0; group < g_.groups; ++group) {
        Im2Col(b.input, first, count, group, patches.data());
        // Eigen's threaded contraction does not write its result when the contracted dimension
        // is empty; zeros are then the right answer.
        if (row_ > 0) {
          Matrix(out.data(), count * positions_, group_outputs_).device(Device()) =
              Matrix(patches.data(), count * positions_, row_)
                  .contract(Matrix(filters[group].data(), row_, group_outputs_), Dims(1, 0));
        }
        ScatterOutput(out.data(), first, count, group, b.output);
      }
    });
  }

  void BackpropInput(const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> b) {
    std::vector<std::vector<A>> filters = GroupFilters(b.filter);
    ForEachChunk(micro_batches, [&](int64_t first, int64_t count) {
      std::vector<A> patches(count * positions_ * row_);
      for (int64_t group = 0; group < g_.groups; ++group) {
        std::vector<A> out_grad = GatherOutput(b.output, first, count, group);
        if (group_outputs_ > 0) {  // else zeros (see Forward)
          Matrix(patches.data(), count * positions_, row_).device(Device()) =
              Matrix(out_grad.data(), count * positions_, group_outputs_)
                  .contract(Matrix(filters[group].data(), row_, group_outputs_), Dims(1, 1));
        } else {
          std::fill(patches.begin(), patches.end(), A(0));
        }
        Col2Im(patches.data(), first, count, group, b.input);
      }
    });
  }

  void BackpropFilter(const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> b) {
    std::vector<std::vector<A>> filter_grads(g_.groups,
                                             std::vector<A>(row_ * group_outputs_, A(0)));
    ForEachChunk(micro_batches, [&](int64_t first, int64_t count) {
      // An empty output (0 positions) adds nothing; Eigen's contraction over the empty dimension
      // would add an uninitialized buffer instead.
      if (count * positions_ == 0) return;
      std::vector<A> patches(count * positions_ * row_);
      for (int64_t group = 0; group < g_.groups; ++group) {
        Im2Col(b.input, first, count, group, patches.data());
        std::vector<A> out_grad = GatherOutput(b.output, first, count, group);
        auto grad = Matrix(filter_grads[group].data(), row_, group_outputs_);
        grad.device(Device()) = grad + Matrix(patches.data(), count * positions_, row_)
                                           .contract(Matrix(out_grad.data(), count * positions_,
                                                            group_outputs_),
                                                     Dims(0, 0));
      }
    });
    // TensorFlow's filter is [row, out_channels]; group g's columns follow group g - 1's.
    for (int64_t r = 0; r < row_; ++r) {
      for (int64_t k = 0; k < g_.out_channels; ++k) {
        b.filter[r * g_.out_channels + k] = static_cast<T>(
            filter_grads[k / group_outputs_][r * group_outputs_ + k % group_outputs_]);
      }
    }
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

  // Each group's [row, group outputs] matrix, out of TensorFlow's filter [row, out_channels].
  std::vector<std::vector<A>> GroupFilters(const T* filter) const {
    std::vector<std::vector<A>> filters(g_.groups, std::vector<A>(row_ * group_outputs_));
    for (int64_t r = 0; r < row_; ++r) {
      for (int64_t k = 0; k < g_.out_channels; ++k) {
        filters[k / group_outputs_][r * group_outputs_ + k % group_outputs_] =
            static_cast<A>(filter[r * g_.out_channels + k]);
      }
    }
    return filters;
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

  // patches[(n * positions + p), (t * channels + c)] = input[n, group * channels + c, source(p, t)]
  void Im2Col(const T* input, int64_t first, int64_t count, int64_t group, A* patches) {
    ParallelFor(count * positions_, row_, [&](int64_t begin, int64_t end) {
      for (int64_t np = begin; np < end; ++np) {
        const int64_t n = first + np / positions_, p = np % positions_;
        const T* sample =
            input + n * g_.InputSampleSize() + group * channels_ * in_channel_stride_;
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

  // The transpose of Im2Col, summing overlapping taps, into the group's channels of the input
  // gradient; work is split by sample so writes are disjoint.
  void Col2Im(const A* patches, int64_t first, int64_t count, int64_t group, T* input_grad) {
    ParallelFor(count, positions_ * row_, [&](int64_t begin, int64_t end) {
      // [spatial, channels] of one sample, whatever the layout.
      std::vector<A> sample_grad(g_.InputSpatialSize() * channels_);
      for (int64_t local = begin; local < end; ++local) {
        std::fill(sample_grad.begin(), sample_grad.end(), A(0));
        for (int64_t p = 0; p < positions_; ++p) {
          const A* src = patches + (local * positions_ + p) * row_;
          for (int64_t t = 0; t < taps_; ++t, src += channels_) {
            const int64_t source = tap_source_[p * taps_ + t];
            if (source < 0) continue;
            A* dst = sample_grad.data() + source * channels_;
            for (int64_t c = 0; c < channels_; ++c) dst[c] += src[c];
          }
        }
        T* out = input_grad + (first + local) * g_.InputSampleSize() +
                 group * channels_ * in_channel_stride_;
        for (int64_t x = 0; x < g_.InputSpatialSize(); ++x) {
          for (int64_t c = 0; c < channels_; ++c) {
            out[x * in_spatial_stride_ + c * in_channel_stride_] =
                static_cast<T>(sample_grad[x * channels_ + c]);
          }
        }
      }
    });
  }

  // A group's output channels (either layout) <-> a [count * positions, group outputs] matrix.
  void ScatterOutput(const A* matrix, int64_t first, int64_t count, int64_t group, T* output) {
    const int64_t k = group_outputs_;
    for (int64_t np = 0; np < count * positions_; ++np) {
      T* dst = output + (first + np / positions_) * g_.OutputSampleSize() +
               (np % positions_) * out_spatial_stride_ + group * k * out_channel_stride_;
      for (int64_t c = 0; c < k; ++c) dst[c * out_channel_stride_] = static_cast<T>(matrix[np * k + c]);
    }
  }

  std::vector<A> GatherOutput(const T* output, int64_t first, int64_t count, int64_t group) {
    const int64_t k = group_outputs_;
    std::vector<A> matrix(count * positions_ * k);
    for (int64_t np = 0; np < count * positions_; ++np) {
      const T* src = output + (first + np / positions_) * g_.OutputSampleSize() +
                     (np % positions_) * out_spatial_stride_ + group * k * out_channel_stride_;
      for (int64_t c = 0; c < k; ++c) matrix[np * k + c] = static_cast<A>(src[c * out_channel_stride_]);
    }
    return matrix;
  }

  tensorflow::OpKernelContext* ctx_;
  const ConvGeometry& g_;
  const int64_t positions_, taps_;
  const int64_t channels_, group_outputs_;  // of one group
  const int64_t row_;
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

  static absl::Status ToHost(tensorflow::OpKernelContext*, const T* data, int64_t count,
                             std::vector<double>* host) {
    host->resize(count);
    for (int64_t i = 0; i < count; ++i) (*host)[i] = AsDouble(data[i]);
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
