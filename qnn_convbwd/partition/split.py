"""Split large delegates into pieces of at most ``options.max_delegate_ops`` ops.

QAIRT's HTP graph preparation grows faster than linearly with a graph's size: a
fully trained EfficientNet-B0 joint graph did not finalise in 2 h as one delegate
(docs/zoo.md). Splitting the partitioner's delegate into smaller ones bounds the
size of each QNN graph compiled.

A piece is a run of consecutive nodes of one partition in a topological order:
the graph's, except that a node which reads only the delegate's inputs and may not
cross a cut (the labels' int32 cast) comes just before its first reader. Edges
only go forward in that order, so the pieces cannot form a cycle, and a piece of
a convex partition is convex: a path between two of its nodes that leaves it
would leave the original partition too.

A cut is made only where every value crossing it is one floating-point tensor.
A delegate boundary is exact for those (QNN's fp16 values leave as fp32 and come
back as fp16). Integer tensors (a forward max pool's indices: int32 in QNN,
int64 in the program) and multi-output nodes (their getitems stay with them) do
not cross. Where no such cut exists within the limit, the piece grows to the
next one that does, and the piece's size is logged.

Constants and parameters are re-tagged as executorch's partitioner tags them:
with the one piece that reads them, or the first (by tag) of those that do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

TAG = "delegation_tag"


def split(edge_program: Any, partition_tags: dict[str, Any], max_ops: int) -> dict[str, int]:
    """Re-tag every partition of more than ``max_ops`` call_function nodes as pieces.

    ``partition_tags`` (tag -> delegation spec) gains the new pieces' tags.
    Returns the tags of the pieces made, each with its node count (empty if no
    partition was split).
    """
    graph = edge_program.graph_module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    made: dict[str, int] = {}
    for tag in sorted(partition_tags):
        members = [n for n in graph.nodes if n.op == "call_function" and n.meta.get(TAG) == tag]
        if len(members) <= max_ops:
            continue
        # Nodes that read no other node (full, scalar_tensor, ...) go with their first
        # reader: a shape-only full crossing a cut would be a delegate input that the
        # QNN graph never reads (passes.shape_only_operands), which executorch rejects.
        sources = [n for n in members if not n.all_input_nodes]
        members = _readers_first([n for n in members if n.all_input_nodes])
        pieces = _pieces(members, max_ops)
        if len(pieces) == 1:
            logger.warning(
                "%s: %d ops, not split: no value crossing a cut would be one float tensor",
                tag,
                len(members),
            )
            continue
        spec = partition_tags[tag]
        piece_tags = set()
        for index, (start, stop) in enumerate(pieces):
            piece_tag = tag if index == 0 else f"{tag}_{index}"
            partition_tags[piece_tag] = spec
            for node in members[start:stop]:
                node.meta[TAG] = piece_tag
            made[piece_tag] = stop - start
            piece_tags.add(piece_tag)
        for node in sources:
            readers = [u for u in node.users if u.meta.get(TAG) in piece_tags]
            node.meta[TAG] = min(readers, key=order.get).meta[TAG] if readers else tag
        sizes = ", ".join(str(stop - start) for start, stop in pieces)
        logger.info(
            "%s: %d ops split into %d delegates (%s ops)", tag, len(members), len(pieces), sizes
        )
        _retag_inputs(graph, tag, piece_tags)
    return made


def _readers_first(members: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """``members`` with each value that may not cross a cut and is computed from the
    delegate's inputs alone moved to just before its first reader.

    A joint graph casts the labels to int32 at its start and reads them in the loss,
    after the forward: in graph order that one value spans the whole forward, which
    then admits no cut. Such a node reads no member, so the order stays topological.
    """
    inside = set(members)
    movable = {
        node
        for node in members
        if not _crosses_exactly(node)
        and not any(i in inside for i in node.all_input_nodes)
        and any(u in inside for u in node.users)
    }
    if not movable:
        return members
    before: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    position = {node: i for i, node in enumerate(members)}
    for node in movable:
        first = min((u for u in node.users if u in inside), key=position.__getitem__)
        before.setdefault(first, []).append(node)
    ordered: list[torch.fx.Node] = []
    for node in members:
        if node in movable:
            continue
        ordered.extend(sorted(before.get(node, ()), key=position.__getitem__))
        ordered.append(node)
    return ordered


def _pieces(members: list[torch.fx.Node], max_ops: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``members``, each cut where ``_cuttable`` allows."""
    cuttable = _cuttable(members)
    pieces = []
    start = 0
    while len(members) - start > max_ops:
        allowed = [k for k in range(start + 1, start + max_ops + 1) if cuttable[k]]
        if allowed:
            cut = allowed[-1]
        else:
            later = [k for k in range(start + max_ops + 1, len(members)) if cuttable[k]]
            if not later:
                break
            cut = later[0]
            logger.info(
                "piece of %d ops (limit %d): no cut allowed before %s",
                cut - start,
                max_ops,
                members[cut].name,
            )
        pieces.append((start, cut))
        start = cut
    pieces.append((start, len(members)))
    return pieces


def _cuttable(members: list[torch.fx.Node]) -> list[bool]:
    """cuttable[k]: a cut before members[k] is crossed by float tensors only."""
    index = {node: i for i, node in enumerate(members)}
    blocked = [0] * (len(members) + 1)  # difference array over cut positions
    for i, node in enumerate(members):
        last = max((index[u] for u in node.users if u in index), default=i)
        if last > i and not _crosses_exactly(node):
            blocked[i + 1] += 1
            blocked[last + 1] -= 1
    cuttable = [False] * (len(members) + 1)
    open_ = 0
    for k in range(len(members) + 1):
        open_ += blocked[k]
        cuttable[k] = 0 < k < len(members) and open_ == 0
    return cuttable


def _crosses_exactly(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _retag_inputs(graph: torch.fx.Graph, tag: str, piece_tags: set[str]) -> None:
    """Placeholders and get_attrs tagged ``tag`` follow the pieces that read them."""
    first = min(piece_tags)
    for node in graph.nodes:
        if node.op not in ("placeholder", "get_attr") or node.meta.get(TAG) != tag:
            continue
        readers = {u.meta.get(TAG) for u in node.users} & piece_tags
        node.meta[TAG] = min(readers) if readers else first
