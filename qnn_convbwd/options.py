"""Switches of the lowering, set through ``qnn_convbwd.enable(**options)``."""

from __future__ import annotations

import dataclasses

# How TransposeConv's padding and output padding are expressed
# (geometry.conv.plan_input_gradient):
#   "auto"      TransposeConv2d: the parameter where the HTP computes it right, else
#               "fold"; TransposeConv3d: "crop";
#   "parameter" always the parameters (reproduces the HTP defects; for tests);
#   "fold"      never the output_padding parameter;
#   "crop"      neither pad_amount nor output_padding: the op yields its full extent
#               and a StridedSlice cuts grad_input out of it.
OUTPUT_PADDING_MODES = ("auto", "parameter", "fold", "crop")

# How a stride > 1 of the forward convolution is expressed in grad_input
# (2-D and 1-D; 3-D keeps TransposeConv3d's stride, see geometry.conv):
#   "zero_insert" grad_output upsampled with zeros, then a stride-1 TransposeConv2d,
#                 the output padding folded into its end crop;
#   "parameter"   TransposeConv2d's stride parameter (``output_padding`` applies).
#   "phases"      one stride-1 TransposeConv2d per output phase, its filter a StridedSlice
#                 of the shared HWOI filter, the phases interleaved (Concat/Reshape/Pad)
#                 and cropped: the forward's multiply-adds, none on zeros
#                 (geometry/phases.py); where it does not apply (3-D, dilated)
#                 "zero_insert".
# Measured with QAIRT 2.51: for a strided TransposeConv2d the HTP compiler stores
# per-phase copies of the filter, static (1.8x a 3x3 stride-2 weight) or prepared
# from a runtime filter (+0.10x); with stride 1 it stores none. "phases" (the
# default) does the ideal multiply-adds and stores 4-8 KiB more context than
# "zero_insert", which does s^2 times the multiply-adds (docs/weight_bytes.md).
STRIDE_MODES = ("zero_insert", "parameter", "phases")

# How grad_input is built: keys of builders.input_gradient.FORMULATIONS.
#   "runtime_weight" stores a weight shared with a forward Conv2d once (the filter
#                    of both ops is computed at run time);
#   "transpose_conv" keeps static filters and stores the weight twice.
INPUT_GRADIENT_FORMULATIONS = ("runtime_weight", "transpose_conv")

# How eval-mode batch norm (aten._native_batch_norm_legit_no_training) is lowered:
#   "fold"       passes.conv_batch_norm: one after a frozen convolution is folded into
#                its weight and bias on the host (the backward's grad_input reads the
#                folded weight; MobileNetV3-Small's logits: 0.95x torch fp16's error,
#                "decompose" 2.5x; docs/zoo.md). One after a convolution whose weight
#                trains is folded on the device each step (weight * scale, the
#                backward rewritten to match) where that does less element-wise work
#                than the batch norm it replaces (weight-sized ops for
#                activation-sized ones: the early, wide-spatial layers), else kept as
#                "decompose" (resnet18 fully trained at 32 px: within fidelity and a
#                step ~20x cheaper on the simulator than "fold_device"; docs/numerics.md).
#                The batch norms not after a convolution as "decompose";
#   "fold_device" as "fold", every pair of a trained convolution folded on the device;
#   "fold_frozen" only the pairs of a frozen convolution are folded;
#   "decompose"  passes.batch_norm: (x - mean) * scale + b with the node's epsilon;
#   "executorch" executorch's QNN Batchnorm visitor, whose epsilon is hard-coded
#                to 1e-9 (wrong for channels with a small running variance;
#                docs/numerics.md).
BATCH_NORM_MODES = ("fold", "fold_device", "fold_frozen", "decompose", "executorch")

# How aten.sigmoid is lowered:
#   "tanh"       passes.sigmoid: 0.5 * tanh(0.5 * x) + 0.5 (at torch fp16's accuracy
#                on the HTP; QNN's Sigmoid is 2.4x less accurate, docs/numerics.md);
#   "executorch" executorch's QNN Sigmoid visitor.
SIGMOID_MODES = ("tanh", "executorch")

# How a multiplication by a sum with a scalar constant, mul(a, add(z, k)), is lowered:
#   "distribute" passes.distribute_mul: a * z + a * k (the HTP's Mul of an Add of a
#                constant is biased by ~+1.8e-4 of the output, which accumulates
#                over a network's SiLU and gates; docs/numerics.md);
#   "keep"       as the graph has it.
MUL_OVER_ADD_MODES = ("distribute", "keep")

# How hardswish and hardsigmoid (the ops, or autograd's decomposition
# x * clamp(x + 3, 0, 6) / 6 of a training graph) are lowered:
#   "centred"    passes.hardswish: x / 2 + x * clamp(x / 6, -1/2, 1/2) and
#                clamp(x / 6, -1/2, 1/2) + 1/2 (1.1x torch fp16's error on the HTP;
#                the decomposition is 1.5x and biased low, QNN's HardSwish 1.57x,
#                docs/numerics.md);
#   "executorch" as the graph has it (the decomposition, or QNN's ops).
HARDSWISH_MODES = ("centred", "executorch")

# How a multiplication or division by a one-element constant fp16 cannot hold
# exactly (x * (1/6), x / 3) is lowered:
#   "paired"     passes.scalar_constants: (x * a) * b with fp16 factors whose product
#                is the constant to ~1e-6 (one fp16 constant is up to 4.9e-4 off on
#                every element: a gain that accumulates through a network, not noise;
#                MobileNetV3's hardswish, docs/numerics.md);
#   "keep"       as the graph has it.
SCALAR_CONSTANT_MODES = ("paired", "keep")

# The layout in which a trainable convolution weight enters a delegate and its
# gradient leaves it (passes/weight_layout.py):
#   "hwio"  the default: the QNN filter layout [*k, I, O]; the parameter is permuted
#           on CPU before the delegate and grad_weight back to torch's layout after it
#           (exact; the program's parameters and gradients keep torch's layout);
#   "torch" torch's OIHW, permuted inside the delegate.
# QAIRT finalises a graph with a run-time [O, I, kH, kW] tensor slowly (its last dim
# is small): measured with QAIRT 2.51 (docs/lowering_time.md), a training step of
# one 512x512 3x3 convolution finalised in 1.0 s with "hwio" against 27 s with
# "torch" (1x1: 0-0.8 s against 19 s).
WEIGHT_LAYOUTS = ("torch", "hwio")

# How a training program (training.lower_for_training) stores those weights, with
# weight_layout "hwio" (passes/filter_storage.py):
#   "filter" the default: in the filter layout the delegate reads, so no permute runs
#            on CPU in a step; sessions show parameters, gradients and optimizer state
#            in torch's layout;
#   "torch"  in torch's layout, permuted on CPU every step (passes/weight_layout.py).
WEIGHT_STORAGES = ("filter", "torch")

# QAIRT's graph finalize optimization level for the HTP graphs compiled (the HTP
# shim replaces executorch's hard-coded 3, htp_shim.c): a lower level finalises a
# large graph much faster (docs/toolchain.md has the measured times and results).
HTP_OPTIMIZATION_LEVELS = (2, 3)

# The compiled-context cache's default bound on its total size (context_cache.py).
CONTEXT_CACHE_BYTES = 2 * 1024**3

# The largest finite float16: the loss scale seeds the backward as an fp16 tensor.
FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class Options:
    output_padding: str = "auto"
    stride: str = "phases"
    input_gradient: str = "runtime_weight"
    batch_norm: str = "fold"
    sigmoid: str = "tanh"
    mul_over_add: str = "distribute"
    hardswish: str = "centred"
    scalar_constants: str = "paired"
    weight_layout: str = "hwio"
    weight_storage: str = "filter"
    # Static loss scale S (passes.loss_scale): the backward is seeded with S and each
    # gradient output multiplied by 1 / S on CPU in fp32. A power of two keeps the
    # unscale exact; at most 2**15 (2**16 is not a float16). 1.0: no scaling, the
    # default: larger scales overflow fp16 in some backwards (docs/numerics.md).
    loss_scale: float = 1.0
    htp_optimization: int = 3
    # Split each delegate of more than this many ops into pieces of at most this many
    # (partition.split; cut only where float tensors alone cross). None: one delegate
    # per partition, as executorch makes them. A smaller graph finalises much faster
    # in QAIRT (docs/zoo.md); each cut adds delegate inputs and outputs.
    max_delegate_ops: int | None = None
    # How many of a program's delegates are built and finalised at once, each in a
    # process forked from the lowering (parallel_finalize). None: as many as the
    # cores this process may use, at most 4; 1: in process, one after another.
    finalize_workers: int | None = None
    # Seed of the train-mode dropout masks (passes.dropout): each draw's hash keys
    # derive from it. None: drawn from torch's RNG when the program is lowered
    # (``torch.manual_seed`` then makes a lowering reproducible).
    dropout_seed: int | None = None
    # Reuse the context binary of a QNN graph lowered before (context_cache.py; the
    # environment variable QNN_CONVBWD_CONTEXT_CACHE=0 turns it off too), stored in
    # context_cache_dir (None: <cache>/contexts, $QNN_CONVBWD_CACHE or
    # ~/.cache/qnn_convbwd), at most context_cache_bytes in all (least recently used
    # entries evicted first).
    context_cache: bool = True
    context_cache_dir: str | None = None
    context_cache_bytes: int = CONTEXT_CACHE_BYTES
    # Reuse a whole lowering: ``lower()`` of a program it lowered before, with the same
    # options, compile specs and toolchain, returns the stored edge program and report
    # (lowering_cache.py). Its entries live beside the context binaries, under their
    # bound, and context_cache=False turns both off.
    lowering_cache: bool = True

    def __post_init__(self) -> None:
        for field, choices in (
            ("output_padding", OUTPUT_PADDING_MODES),
            ("stride", STRIDE_MODES),
            ("input_gradient", INPUT_GRADIENT_FORMULATIONS),
            ("batch_norm", BATCH_NORM_MODES),
            ("sigmoid", SIGMOID_MODES),
            ("mul_over_add", MUL_OVER_ADD_MODES),
            ("hardswish", HARDSWISH_MODES),
            ("scalar_constants", SCALAR_CONSTANT_MODES),
            ("weight_layout", WEIGHT_LAYOUTS),
            ("weight_storage", WEIGHT_STORAGES),
        ):
            value = getattr(self, field)
            if value not in choices:
                raise ValueError(
                    f"qnn_convbwd option {field}={value!r} is not one of {', '.join(choices)}"
                )
        if type(self.htp_optimization) is not int or (
            self.htp_optimization not in HTP_OPTIMIZATION_LEVELS
        ):
            raise ValueError(
                f"qnn_convbwd option htp_optimization={self.htp_optimization!r} is not one of "
                f"{', '.join(map(str, HTP_OPTIMIZATION_LEVELS))}"
            )
        if self.max_delegate_ops is not None and (
            type(self.max_delegate_ops) is not int or self.max_delegate_ops < 1
        ):
            raise ValueError(
                f"qnn_convbwd option max_delegate_ops={self.max_delegate_ops!r} must be None "
                "or a positive int"
            )
        if self.finalize_workers is not None and (
            type(self.finalize_workers) is not int or self.finalize_workers < 1
        ):
            raise ValueError(
                f"qnn_convbwd option finalize_workers={self.finalize_workers!r} must be None "
                "or a positive int"
            )
        if self.dropout_seed is not None and (
            type(self.dropout_seed) is not int or not 0 <= self.dropout_seed < 2**63
        ):
            raise ValueError(
                f"qnn_convbwd option dropout_seed={self.dropout_seed!r} must be None or an "
                "int in [0, 2**63)"
            )
        if type(self.context_cache_bytes) is not int or self.context_cache_bytes < 1:
            raise ValueError(
                f"qnn_convbwd option context_cache_bytes={self.context_cache_bytes!r} must be a "
                "positive int"
            )
        if isinstance(self.loss_scale, int) and not isinstance(self.loss_scale, bool):
            object.__setattr__(self, "loss_scale", float(self.loss_scale))  # 256 as 256.0
        if not (0 < self.loss_scale <= FP16_MAX):
            raise ValueError(
                f"qnn_convbwd option loss_scale={self.loss_scale!r} must be > 0 and at most "
                f"{FP16_MAX:g} (the seed is an fp16 tensor on the HTP)"
            )


current = Options()


def update(**overrides: object) -> Options:
    """Apply ``overrides`` to the current options.

    Unknown names raise TypeError, unknown values ValueError (naming the choices).
    """
    global current
    current = dataclasses.replace(current, **overrides)
    return current
