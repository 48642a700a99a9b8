"""Every ``node.meta`` key the plugin writes, in one module.

Passes set them on the edge graph; the support rules, the partitioner hooks and
the visitors read them. All keys start with ``qnn_convbwd_`` so they cannot
collide with torch's or executorch's own.
"""

from __future__ import annotations

# The name a convolution_backward (or max_pool2d_with_indices_backward) had when
# the transform pass first saw it. executorch's skip_node_id_set names nodes, and
# names do not last: passes after it retrace the graph and number nodes of one op
# in graph order, so a grad_weight half inserted by the split takes the name of
# the next node (measured: ``aten_convolution_backward_default_1`` then named
# another node's half, which was kept on CPU instead). The split halves and the
# lifted nodes keep their metadata, so this name follows the node the user meant.
# Set by passes/canonicalize.py.
NAME_SEEN = "qnn_convbwd_name_seen"

# The support Decision taken on a node before a rewrite made its operands unfit for
# the rules (a 1-D node lifted to 2-D for executorch's CPU kernel reads views of its
# operands). partition.support.decide returns it instead of running the rules again.
PINNED = "qnn_convbwd_pinned_decision"

# The name of the lifted node that this node (or the node itself) belongs to, for
# nodes passes/conv1d.py made to run on executorch's CPU kernels.
ON_CPU = "qnn_convbwd_lifted_on_cpu"

# A static-shape ``full`` standing in for an operand read only for its shape
# (passes/shape_only_operands.py); the value is the original operand's name.
SHAPE_OF = "qnn_convbwd_shape_of"

# A multiplication by 1 / loss_scale at a gradient output (passes/loss_scale.py):
# it stays on CPU, in fp32.
UNSCALE = "qnn_convbwd_unscale"

# The IndexPlane of a max_pool2d_with_indices_backward's indices
# (passes/max_pool_backward.py), read by its visitor.
INDEX_PLANE = "qnn_convbwd_index_plane"

# The output dtypes of a tuple-valued node before executorch's I64toI32 pass
# (passes/tuple_outputs.py).
TUPLE_DTYPES = "qnn_convbwd_tuple_dtypes"

# Set by passes/max_pool_backward.py on a forward max_pool2d_with_indices whose
# indices go to the HTP with every user (its backwards).
INDICES_ON_HTP = "qnn_convbwd_pool_indices_on_htp"

# Set by passes/max_pool_backward.py on the int32 cast between such a pool's indices
# and a backward: delegated with the forward, where it is an identity.
INDICES_CAST = "qnn_convbwd_pool_indices_cast"

# passes/weight_layout.py (``Options.weight_layout``). A trainable convolution weight
# enters the delegate in the QNN filter layout and its gradient leaves in it: on CPU
# a permute of the parameter to that layout (WEIGHT_TO_DEVICE) and of the delegate's
# gradient back to torch's (GRAD_TO_TORCH); in the delegate the permute back to
# torch's layout that the convolutions read (WEIGHT_VIEW) and the permute of their
# grad_weight to the filter layout (GRAD_VIEW), which the visitors fold into their
# own ops. Each value is the weight parameter's name.
WEIGHT_TO_DEVICE = "qnn_convbwd_weight_to_device"
WEIGHT_VIEW = "qnn_convbwd_weight_view"
GRAD_VIEW = "qnn_convbwd_grad_view"
GRAD_TO_TORCH = "qnn_convbwd_grad_to_torch"

# passes/optimizer.py, kept in ``node.meta["custom"]`` (torch carries that dict through
# the decompositions executorch runs, onto every node an op decomposes into; the keys
# above live in ``node.meta`` itself). TRAINED, on the placeholder of a parameter the
# program's own optimizer updates (a mutated buffer): its name; the plugin treats it
# as a trainable parameter (``signature``). OPTIMIZER, on every node of the update:
# the parameter or buffer it updates; the partition rule ``optimizer_on_cpu`` keeps
# the node on CPU.
TRAINED = "qnn_convbwd_trained"
OPTIMIZER = "qnn_convbwd_optimizer"
# passes/filter_storage.py, in ``node.meta["custom"]`` too: on the permute of a
# trainable convolution weight the program stores in the filter layout back to
# torch's layout (``{"weight": name}``), and on the permute of its gradient to the
# filter layout (``{"gradient": name}``); ``passes.weight_layout`` makes them the
# WEIGHT_VIEW and GRAD_VIEW the visitors fold.
STORED_FILTER = "qnn_convbwd_stored_filter"

# passes/quant_boundary.py: a float copy (``aten._to_copy``) the plugin put between a
# quantized tensor and the ops that read it as float. Its visitor
# (builders/op_dequantize.py) builds QNN's Dequantize; on CPU, where executorch's
# FoldQDQ left the tensor float, it is a copy.
DEQUANTIZING_COPY = "qnn_convbwd_dequantizing_copy"

# passes/quant_boundary.py: a float copy (``aten._to_copy``) the plugin put between a
# tensor computed in float and its quantize, before executorch's AnnotateQuantAttrs,
# which then writes the quantization on the copy. Its visitor
# (builders/op_dequantize.py) builds QNN's Quantize of the float tensor.
QUANTIZING_COPY = "qnn_convbwd_quantizing_copy"

ALL = (
    NAME_SEEN,
    PINNED,
    ON_CPU,
    SHAPE_OF,
    UNSCALE,
    INDEX_PLANE,
    TUPLE_DTYPES,
    INDICES_ON_HTP,
    INDICES_CAST,
    WEIGHT_TO_DEVICE,
    WEIGHT_VIEW,
    GRAD_VIEW,
    GRAD_TO_TORCH,
    TRAINED,
    OPTIMIZER,
    STORED_FILTER,
    DEQUANTIZING_COPY,
    QUANTIZING_COPY,
)
