"""Steps run on the tagged program after executorch's QnnPartitioner has partitioned it.

Each step takes ``(edge_program, partition_tags)``: the program whose nodes carry
their ``delegation_tag``, and the tags' dict of the ``PartitionResult`` (a step may
add tags). ``pipeline`` lists them in the order they run.
"""

from __future__ import annotations

import logging
from typing import Any

from . import integration, options, progress, signature
from .meta import INDICES_ON_HTP
from .partition import max_pool, split
from .passes import int64_constants

logger = logging.getLogger(__name__)


def split_large_delegates(edge_program: Any, partition_tags: dict) -> None:
    """Delegates of more than ``max_delegate_ops`` ops become several (``partition.split``)."""
    if options.current.max_delegate_ops is not None:
        split.split(edge_program, partition_tags, options.current.max_delegate_ops)


def report_delegates(edge_program: Any, partition_tags: dict) -> None:
    """The progress display learns how many delegates there are."""
    progress.partitioned(len(partition_tags))


def keep_trainable_parameters_as_inputs(edge_program: Any, partition_tags: dict) -> None:
    """Trainable parameters stay top-level tensors that the delegate reads at run time.

    executorch tags a parameter whose users are all delegated into the delegate,
    which then bakes its values into the QNN context. A parameter the joint graph
    returns a gradient for must instead stay a program input: ExecuTorch's
    training runtime updates it in place.
    """
    quant_key = integration.get("QCOM_QUANT_ATTRS")
    for node in signature.trainable_placeholders(edge_program):
        if "delegation_tag" not in node.meta:
            continue
        if any(n.meta.get(quant_key) for n in (node, *node.users)):
            # Quantized (by its metadata): the delegate takes it only as an encoded
            # constant, so it stays baked and will not see optimizer updates.
            logger.warning(
                "%s: trainable but quantized: baked into the delegate as a constant "
                "(training a quantized program does not update it)",
                node.name,
            )
            continue
        del node.meta["delegation_tag"]
        logger.debug("%s: trainable, kept as a delegate input", node.name)


def restore_int64_constants(edge_program: Any, partition_tags: dict) -> None:
    """int64 constants left on CPU keep their stored dtype (``passes.int64_constants``)."""
    int64_constants.restore_cpu_constant_dtypes(edge_program)


def keep_buffer_values(edge_program: Any, partition_tags: dict) -> None:
    """Mutated buffers (running statistics, counters) keep their values in the program.

    executorch serialises only the shape and dtype of a buffer the program mutates,
    unless its placeholder is marked ``et_init_buffer``: a running variance would
    start at zero instead of one. The partition rules keep a mutated buffer's reads
    and writes on CPU (``program_state_on_cpu``); one tagged into a delegate anyway
    would stop being a buffer of the program, so that is an error here rather than a
    program that silently stops updating it.
    """
    graph_signature = edge_program.graph_signature
    mutated = set(graph_signature.buffers_to_mutate.values())
    to_buffer = graph_signature.inputs_to_buffers  # torch builds it on each read
    for node in edge_program.graph.nodes:
        buffer = to_buffer.get(node.name)
        if node.op != "placeholder" or buffer not in mutated:
            continue
        node.meta["et_init_buffer"] = True
        if "delegation_tag" in node.meta:
            raise RuntimeError(
                f"{node.name}: the mutated buffer {buffer} was tagged into "
                f"{node.meta['delegation_tag']}: its updates would be lost (report this graph)"
            )


def check_pool_indices_stay_inside(edge_program: Any, partition_tags: dict) -> None:
    """A forward pool delegated with its indices must share its delegate with every
    reader of them: they are int32 in QNN but int64 in the program, so crossing
    between delegates would hand one delegate's int32 bytes to an int64 tensor.
    The partition rule makes this so; this is the check that it did."""
    for node in edge_program.graph.nodes:
        if not node.meta.get(INDICES_ON_HTP) or "delegation_tag" not in node.meta:
            continue
        tag = node.meta["delegation_tag"]
        for user in max_pool.indices_users(node):
            if user.meta.get("delegation_tag") != tag:
                raise RuntimeError(
                    f"{max_pool.FORWARD_OP} {node.name}: delegated with its indices in "
                    f"{tag}, but {user.name} reads them in "
                    f"{user.meta.get('delegation_tag', 'the CPU program')}: the int32 "
                    "indices would cross delegates as int64 (report this graph)"
                )
