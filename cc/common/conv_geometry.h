// Convolution attributes, geometry and buffers shared by the op shape functions, the CPU kernels
// and the cuDNN kernels. Dimension-generic: 2-D (NHWC/NCHW) and 3-D (NDHWC/NCDHW) alike.
#ifndef TF_UCUDNN_CC_COMMON_CONV_GEOMETRY_H_
#define TF_UCUDNN_CC_COMMON_CONV_GEOMETRY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tf_ucudnn {

enum class ConvKernel { kForward, kBackpropInput, kBackpropFilter };

// "fwd", "bwd_data", "bwd_filter": the names the profiles and plans use.
const char* KernelName(ConvKernel kernel);

enum class PaddingKind { kValid, kSame, kExplicit };

// Attributes of a convolution op, reduced to the spatial dimensions.
struct ConvAttrs {
  int num_spatial_dims = 2;
  bool channels_last = true;  // NHWC / NDHWC
  PaddingKind padding = PaddingKind::kValid;
  std::vector<int64_t> strides;          // spatial only
  std::vector<int64_t> dilations;        // spatial only
  std::vector<int64_t> explicit_before;  // spatial only, EXPLICIT padding
  std::vector<int64_t> explicit_after;

  // Parses the raw attribute values, in TensorFlow's conventions (strides, dilations and
  // explicit_paddings over all dimensions in data_format order).
  static absl::Status Parse(int num_spatial_dims, const std::string& data_format,
                            const std::string& padding, const std::vector<int64_t>& strides,
                            const std::vector<int64_t>& dilations,
                            const std::vector<int64_t>& explicit_paddings, ConvAttrs* attrs);

  // Index, in a full shape of this data format, of the batch, channel and i-th spatial dimension.
  int BatchDim() const { return 0; }
  int ChannelDim() const { return channels_last ? num_spatial_dims + 1 : 1; }
  int SpatialDim(int i) const { return channels_last ? 1 + i : 2 + i; }
};

// Output size and padding of one spatial dimension; `output` is -1 when the input is unknown (-1).
struct WindowedSize {
  int64_t output = -1;
  int64_t pad_before = 0;
  int64_t pad_after = 0;
};
absl::Status ComputeWindowedSize(int64_t input, int64_t filter, int64_t stride, int64_t dilation,
                                 PaddingKind padding, int64_t explicit_before,
                                 int64_t explicit_after, WindowedSize* size);

// The fully resolved shape of one convolution. Filters are in TensorFlow's layout:
// spatial..., in_channels / groups, out_channels. As in TensorFlow's Conv2D, the groups come from
// the shapes: group g's out_channels / groups outputs read its in_channels / groups inputs.
struct ConvGeometry {
  bool channels_last = true;
  int64_t batch = 0;
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int64_t groups = 1;
  std::vector<int64_t> input_spatial;
  std::vector<int64_t> filter_spatial;
  std::vector<int64_t> output_spatial;
  std::vector<int64_t> strides;
  std::vector<int64_t> dilations;
  std::vector<int64_t> pad_before;
  std::vector<int64_t> pad_after;

  int num_spatial_dims() const { return static_cast<int>(input_spatial.size()); }
  int64_t InputSpatialSize() const;
  int64_t OutputSpatialSize() const;
  int64_t FilterSpatialSize() const;
  int64_t InputSampleSize() const { return in_channels * InputSpatialSize(); }
  int64_t OutputSampleSize() const { return out_channels * OutputSpatialSize(); }
  int64_t GroupInChannels() const { return in_channels / groups; }    // the filter's in_channels
  int64_t GroupOutChannels() const { return out_channels / groups; }
  int64_t FilterSize() const { return FilterSpatialSize() * GroupInChannels() * out_channels; }
  bool SymmetricPadding() const { return pad_before == pad_after; }

  // Full shapes in the data format (input, output) and TensorFlow's filter layout.
  std::vector<int64_t> InputShape(int64_t batch_size) const;
  std::vector<int64_t> OutputShape(int64_t batch_size) const;
  std::vector<int64_t> FilterShape() const;
  // The shape of what `kernel` computes: the output, the input's gradient or the filter's.
  std::vector<int64_t> ResultShape(ConvKernel kernel) const;

  std::string DebugString() const;

  // As a flat list of integers and back, to travel in an XLA custom call's attributes.
  std::vector<int64_t> Encode() const;
  static absl::Status Decode(const int64_t* values, size_t count, ConvGeometry* geometry);
};

// Memory of one convolution, typed for the CPU kernels and untyped (T = void) for cuDNN's. The
// kernel being run writes one of them: output (forward), input (backprop input) or filter
// (backprop filter).
template <typename T>
struct ConvBuffers {
  T* input;
  T* filter;
  T* output;
};

// The groups of a convolution, as TensorFlow's Conv2D takes them from the depths: the input's
// over the filter's input depth, which must divide it, as the groups must divide the output's.
absl::Status ComputeGroups(int64_t in_channels, int64_t filter_in_channels, int64_t out_channels,
                           int64_t* groups);

// Resolves the geometry from the input and filter shapes (each num_spatial_dims + 2 long).
absl::Status ComputeConvGeometry(const ConvAttrs& attrs, const std::vector<int64_t>& input_shape,
                                 const std::vector<int64_t>& filter_shape, ConvGeometry* geometry);

// Checks that a gradient with respect to the output has the shape the geometry implies.
absl::Status CheckOutputShape(const ConvGeometry& geometry,
                              const std::vector<int64_t>& out_backprop_shape);

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_COMMON_CONV_GEOMETRY_H_
