// Parsing convolution attributes and resolving shapes and padding as TensorFlow's own Conv2D and
// Conv3D do, so that both ops accept and reject the same things.
#include "cc/common/conv_geometry.h"

#include <algorithm>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tf_ucudnn {

const char* KernelName(ConvKernel kernel) {
  switch (kernel) {
    case ConvKernel::kForward:
      return "fwd";
    case ConvKernel::kBackpropInput:
      return "bwd_data";
    case ConvKernel::kBackpropFilter:
      return "bwd_filter";
  }
  return "?";
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status ConvAttrs::Parse(int num_spatial_dims, const std::string& data_format,
                              const std::string& padding, const std::vector<int64_t>& strides,
                              const std::vector<int64_t>& dilations,
                              const std::vector<int64_t>& explicit_paddings, ConvAttrs* attrs) {
  const int rank = num_spatial_dims + 2;
  attrs->num_spatial_dims = num_spatial_dims;
  if (data_format == "NHWC" || data_format == "NDHWC") {
    attrs->channels_last = true;
  } else if (data_format == "NCHW" || data_format == "NCDHW") {
    attrs->channels_last = false;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown data_format ", data_format));
  }
  if (static_cast<int>(data_format.size()) != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_format ", data_format, " is not for a ", num_spatial_dims,
                     "-D convolution"));
  }
  if (padding == "VALID") {
    attrs->padding = PaddingKind::kValid;
  } else if (padding == "SAME") {
    attrs->padding = PaddingKind::kSame;
  } else if (padding == "EXPLICIT") {
    attrs->padding = PaddingKind::kExplicit;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown padding ", padding));
  }
  if (static_cast<int>(strides.size()) != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("strides must have ", rank, " entries, got ", ShapeString(strides)));
  }
  if (static_cast<int>(dilations.size()) != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("dilations must have ", rank, " entries, got ", ShapeString(dilations)));
  }
  const int n = attrs->BatchDim(), c = attrs->ChannelDim();
  if (strides[n] != 1 || strides[c] != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strides in the batch and channel dimensions must be 1, got ", ShapeString(strides)));
  }
  if (dilations[n] != 1 || dilations[c] != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dilations in the batch and channel dimensions must be 1, got ", ShapeString(dilations)));
  }
  attrs->strides.clear();
  attrs->dilations.clear();
  attrs->explicit_before.assign(num_spatial_dims, 0);
  attrs->explicit_after.assign(num_spatial_dims, 0);
  for (int i = 0; i < num_spatial_dims; ++i) {
    const int64_t stride = strides[attrs->SpatialDim(i)];
    const int64_t dilation = dilations[attrs->SpatialDim(i)];
    if (stride < 1 || dilation < 1) {
      return absl::InvalidArgumentError(absl::StrCat("strides and dilations must be >= 1, got ",
                                                     ShapeString(strides), " and ",
                                                     ShapeString(dilations)));
    }
    attrs->strides.push_back(stride);
    attrs->dilations.push_back(dilation);
  }
  if (attrs->padding == PaddingKind::kExplicit) {
    if (static_cast<int>(explicit_paddings.size()) != 2 * rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("explicit_paddings must have ", 2 * rank, " entries with EXPLICIT padding, got ",
                       explicit_paddings.size()));
    }
    for (int dim = 0; dim < rank; ++dim) {
      const int64_t before = explicit_paddings[2 * dim], after = explicit_paddings[2 * dim + 1];
      if (before < 0 || after < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "explicit_paddings must be non-negative, got ", ShapeString(explicit_paddings)));
      }
      if ((dim == n || dim == c) && (before != 0 || after != 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("explicit_paddings in the batch and channel dimensions must be 0, got ",
                         ShapeString(explicit_paddings)));
      }
    }
    for (int i = 0; i < num_spatial_dims; ++i) {
      attrs->explicit_before[i] = explicit_paddings[2 * attrs->SpatialDim(i)];
      attrs->explicit_after[i] = explicit_paddings[2 * attrs->SpatialDim(i) + 1];
    }
  } else if (!explicit_paddings.empty()) {
    return absl::InvalidArgumentError(
        "explicit_paddings must be empty unless padding is EXPLICIT");
  }
  return absl::OkStatus();
}

absl::Status ComputeWindowedSize(int64_t input, int64_t filter, int64_t stride, int64_t dilation,
                                 PaddingKind padding, int64_t explicit_before,
                                 int64_t explicit_after, WindowedSize* size) {
  const int64_t effective_filter = (filter - 1) * dilation + 1;
  *size = WindowedSize();
  if (input < 0) return absl::OkStatus();
  switch (padding) {
    case PaddingKind::kValid:
      size->output = (input - effective_filter + stride) / stride;
      break;
    case PaddingKind::kSame: {
      size->output = (input + stride - 1) / stride;
      const int64_t total =
          std::max<int64_t>((size->output - 1) * stride + effective_filter - input, 0);
      size->pad_before = total / 2;  // TensorFlow puts the odd pixel after.
      size->pad_after = total - size->pad_before;
      break;
    }
    case PaddingKind::kExplicit:
      size->pad_before = explicit_before;
      size->pad_after = explicit_after;
      // As TensorFlow computes it (GetWindowedOutputSizeVerbose): the division truncates toward
      // zero, so a window that does not fit gives 0, not 1 as "(padded - filter) / stride + 1"
      // would.
      size->output =
          (input + explicit_before + explicit_after - effective_filter + stride) / stride;
      break;
  }
  // An output of size 0 is legal, as in TensorFlow: the result is empty.
  if (size->output < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "computed output size would be negative: ", size->output, " (input ", input, ", filter ",
        filter, ", dilation ", dilation, ", stride ", stride, ")"));
  }
  return absl::OkStatus();
}

absl::Status ComputeGroups(int64_t in_channels, int64_t filter_in_channels, int64_t out_channels,
                           int64_t* groups) {
  *groups = 1;
  if (filter_in_channels == in_channels) return absl::OkStatus();
  if (filter_in_channels <= 0 || in_channels % filter_in_channels != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the input's depth ", in_channels, " is not a multiple of the filter's input depth ",
        filter_in_channels, " (a grouped convolution has input depth / filter input depth "
        "groups)"));
  }
  *groups = in_channels / filter_in_channels;
  if (out_channels % *groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the filter's output depth ", out_channels, " is not a multiple of the ", *groups,
        " groups (input depth ", in_channels, " / filter input depth ", filter_in_channels, ")"));
  }
  return absl::OkStatus();
}

absl::Status ComputeConvGeometry(const ConvAttrs& attrs, const std::vector<int64_t>& input_shape,
                                 const std::vector<int64_t>& filter_shape,
                                 ConvGeometry* geometry) {
  const int nd = attrs.num_spatial_dims;
  if (static_cast<int>(input_shape.size()) != nd + 2) {
    return absl::InvalidArgumentError(absl::StrCat("input must be ", nd + 2, "-dimensional, got ",
                                                   ShapeString(input_shape)));
  }
  if (static_cast<int>(filter_shape.size()) != nd + 2) {
    return absl::InvalidArgumentError(absl::StrCat("filter must be ", nd + 2, "-dimensional, got ",
                                                   ShapeString(filter_shape)));
  }
  ConvGeometry g;
  g.channels_last = attrs.channels_last;
  g.batch = input_shape[attrs.BatchDim()];
  g.in_channels = input_shape[attrs.ChannelDim()];
  g.out_channels = filter_shape[nd + 1];
  absl::Status groups = ComputeGroups(g.in_channels, filter_shape[nd], g.out_channels, &g.groups);
  if (!groups.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(groups.message(), "; input ",
                                                   ShapeString(input_shape), ", filter ",
                                                   ShapeString(filter_shape)));
  }
  g.strides = attrs.strides;
  g.dilations = attrs.dilations;
  for (int i = 0; i < nd; ++i) {
    const int64_t in = input_shape[attrs.SpatialDim(i)];
    const int64_t k = filter_shape[i];
    if (k <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("filter has an empty spatial dimension: ", ShapeString(filter_shape)));
    }
    WindowedSize size;
    absl::Status status = ComputeWindowedSize(in, k, attrs.strides[i], attrs.dilations[i],
                                              attrs.padding, attrs.explicit_before[i],
                                              attrs.explicit_after[i], &size);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spatial dimension ", i, ": ", status.message(), "; input ", ShapeString(input_shape),
          ", filter ", ShapeString(filter_shape)));
    }
    g.input_spatial.push_back(in);
    g.filter_spatial.push_back(k);
    g.output_spatial.push_back(size.output);
    g.pad_before.push_back(size.pad_before);
    g.pad_after.push_back(size.pad_after);
  }
  *geometry = std::move(g);
  return absl::OkStatus();
}

absl::Status CheckOutputShape(const ConvGeometry& geometry,
                              const std::vector<int64_t>& out_backprop_shape) {
  const std::vector<int64_t> expected = geometry.OutputShape(geometry.batch);
  if (out_backprop_shape != expected) {
    return absl::InvalidArgumentError(absl::StrCat("out_backprop has shape ",
                                                   ShapeString(out_backprop_shape),
                                                   " but the convolution's output has shape ",
                                                   ShapeString(expected)));
  }
  return absl::OkStatus();
}

namespace {
int64_t Product(const std::vector<int64_t>& values) {
  int64_t product = 1;
  for (int64_t v : values) product *= v;
  return product;
}

std::vector<int64_t> DataShape(bool channels_last, int64_t batch, int64_t channels,
                               const std::vector<int64_t>& spatial) {
  std::vector<int64_t> shape = {batch};
  if (!channels_last) shape.push_back(channels);
  shape.insert(shape.end(), spatial.begin(), spatial.end());
  if (channels_last) shape.push_back(channels);
  return shape;
}
}  // namespace

int64_t ConvGeometry::InputSpatialSize() const { return Product(input_spatial); }
int64_t ConvGeometry::OutputSpatialSize() const { return Product(output_spatial); }
int64_t ConvGeometry::FilterSpatialSize() const { return Product(filter_spatial); }

std::vector<int64_t> ConvGeometry::InputShape(int64_t batch_size) const {
  return DataShape(channels_last, batch_size, in_channels, input_spatial);
}
std::vector<int64_t> ConvGeometry::OutputShape(int64_t batch_size) const {
  return DataShape(channels_last, batch_size, out_channels, output_spatial);
}
std::vector<int64_t> ConvGeometry::FilterShape() const {
  std::vector<int64_t> shape = filter_spatial;
  shape.push_back(GroupInChannels());
  shape.push_back(out_channels);
  return shape;
}

std::vector<int64_t> ConvGeometry::ResultShape(ConvKernel kernel) const {
  switch (kernel) {
    case ConvKernel::kForward:
      return OutputShape(batch);
    case ConvKernel::kBackpropInput:
      return InputShape(batch);
    case ConvKernel::kBackpropFilter:
      return FilterShape();
  }
  return {};
}

std::string ConvGeometry::DebugString() const {
  return absl::StrCat("input ", ShapeString(InputShape(batch)), ", filter ",
                      ShapeString(FilterShape()), ", output ", ShapeString(OutputShape(batch)),
                      ", strides ", ShapeString(strides), ", dilations ", ShapeString(dilations),
                      ", padding ", ShapeString(pad_before), "/", ShapeString(pad_after),
                      groups != 1 ? absl::StrCat(", ", groups, " groups") : "");
}

// [channels_last, batch, in_channels, out_channels, groups, nd, then nd values each of
// input_spatial, filter_spatial, output_spatial, strides, dilations, pad_before, pad_after].
std::vector<int64_t> ConvGeometry::Encode() const {
  std::vector<int64_t> values = {channels_last ? 1 : 0, batch, in_channels, out_channels, groups,
                                 num_spatial_dims()};
  for (const std::vector<int64_t>* field : {&input_spatial, &filter_spatial, &output_spatial,
                                            &strides, &dilations, &pad_before, &pad_after}) {
    values.insert(values.end(), field->begin(), field->end());
  }
  return values;
}

absl::Status ConvGeometry::Decode(const int64_t* values, size_t count, ConvGeometry* geometry) {
  constexpr int kFields = 7;
  constexpr size_t kHeader = 6;
  if (count < kHeader || values[4] < 1 || values[5] < 1 ||
      count != kHeader + kFields * static_cast<size_t>(values[5])) {
    return absl::InvalidArgumentError(
        absl::StrCat("an encoded convolution geometry of ", count, " values is malformed"));
  }
  ConvGeometry g;
  g.channels_last = values[0] != 0;
  g.batch = values[1];
  g.in_channels = values[2];
  g.out_channels = values[3];
  g.groups = values[4];
  const int64_t nd = values[5];
  const int64_t* next = values + kHeader;
  for (std::vector<int64_t>* field : {&g.input_spatial, &g.filter_spatial, &g.output_spatial,
                                      &g.strides, &g.dilations, &g.pad_before, &g.pad_after}) {
    field->assign(next, next + nd);
    next += nd;
  }
  *geometry = std::move(g);
  return absl::OkStatus();
}

}  // namespace tf_ucudnn
