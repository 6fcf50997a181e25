"""The command-line options of a memory-planned Keras step, which beyond_memory.py and
memory_trace.py both take and plan with the same way (`tf_ucudnn.keras.plan_keras_step`)."""

import argparse


def add_step_planning_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fuse-batch-norm", nargs="?", const="cudnn",
                        choices=["cudnn", "xla", "ucudnn"],
                        help="train batch normalization with this fused kernel "
                        "(tf_ucudnn.keras.batch_norm_forms; cudnn if none is named)")
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[4, 8],
                        help="micro-batch counts for the first layers, tried when no plan fits "
                        "whole batches")
    parser.add_argument("--stream-conv-bn", type=int, default=0, metavar="N",
                        help="train each widening convolution and the batch normalization after "
                        "it as one op, its backward in N micro-batches "
                        "(tf_ucudnn.keras.streamed_conv_bn)")
    parser.add_argument("--cut", metavar="LAYER",
                        help="the layers up to LAYER in micro-batches (one of --micro-batches), "
                        "never whole: their largest tensors then need no large free chunk of "
                        "the allocator's")
