"""Every place qnn_convbwd reaches into executorch internals, in one module.

executorch exposes no plugin API for QNN node visitors or passes, so the plugin
uses names that are internal to ``executorch.backends.qualcomm``. Each is listed
in ``INTERNALS`` (and in docs/internals.md). ``check_internals()`` resolves all of them
up front and fails with one message naming the executorch version and every
missing name, instead of an AttributeError deep inside a lowering.

``install()`` / ``uninstall()`` apply and exactly revert the patches; the rest of
the package only calls the functions here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_EXECUTORCH = "1.5.1"
_QC = "executorch.backends.qualcomm"

# (module, attribute path, what the plugin does with it)
INTERNALS: tuple[tuple[str, str, str], ...] = (
    (f"{_QC}.builders.node_visitor", "NodeVisitor", "base class of the visitor"),
    (
        f"{_QC}.builders.node_visitor",
        "NodeVisitor.make_qnn_per_tensor_config",
        "a per-tensor quantization of a static tensor (a weight's integers)",
    ),
    (f"{_QC}.builders.node_visitor_manager", "_node_visitor_dict", "visitor registration"),
    (f"{_QC}.builders.qnn_constants", "OpTranspose", "QNN op/param names"),
    (f"{_QC}.builders.qnn_constants", "OpTransposeConv2d", "QNN op/param names"),
    (f"{_QC}.builders.qnn_constants", "OpTransposeConv3d", "QNN op/param names (3-D)"),
    (f"{_QC}.builders.qnn_constants", "OpPad", "QNN op/param names"),
    (f"{_QC}.builders.qnn_constants", "QNN_OP_PACKAGE_NAME_QTI_AISW", "QNN op package"),
    (f"{_QC}.builders.qnn_constants", "OpReshape", "QNN op names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpStridedSlice", "QNN op/param names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpElementWiseEqual", "QNN op names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpElementWiseNotEqual", "QNN op names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpElementWiseOr", "QNN op names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpElementWiseMultiply", "QNN op names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpCast", "QNN op names (runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpConv2d", "QNN op/param names (grad_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpDepthWiseConv2d", "QNN op/param names (run-time weight)"),
    (f"{_QC}.builders.qnn_constants", "OpConv3d", "QNN op/param names (3-D grad_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpMatMul", "QNN op/param names (pointwise grad_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpReduceSum", "QNN op/param names (grad_bias)"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "TensorWrapper", "static tensors with own names"),
    (f"{_QC}.builders.utils", "get_parameter", "reads static weights"),
    (f"{_QC}.builders.utils", "is_parameter", "static-weight check"),
    (f"{_QC}.builders.utils", "is_param", "patched: answered from a frozen signature"),
    (f"{_QC}.builders.utils", "is_buffer", "patched: answered from a frozen signature"),
    (
        f"{_QC}.builders.utils",
        "is_lifted_tensor_constant",
        "patched: answered from a frozen signature",
    ),
    (f"{_QC}.utils.constants", "QCOM_QUANT_ATTRS", "quantization metadata key"),
    (f"{_QC}.utils.constants", "QCOM_DTYPE", "quantization key (a weight's integers)"),
    (f"{_QC}.utils.constants", "QCOM_SCALE", "quantization key (a weight's integers)"),
    (f"{_QC}.utils.constants", "QCOM_ZERO_POINT", "quantization key (a weight's integers)"),
    (f"{_QC}.utils.constants", "QCOM_QUANT_MIN", "quantization key (a weight's integers)"),
    (f"{_QC}.utils.constants", "QCOM_QUANT_MAX", "quantization key (a weight's integers)"),
    (f"{_QC}.utils.constants", "QCOM_DATA", "scalar param key"),
    (f"{_QC}.utils.constants", "QCOM_ORIG_DTYPE", "I64toI32 output dtype key"),
    (f"{_QC}.utils.utils", "get_soc_to_htp_arch_map", "HTP arch gate"),
    (f"{_QC}.partition.utils", "generate_qnn_executorch_option", "reads compile specs"),
    (f"{_QC}.serialization.qc_schema_serialize", "flatbuffer_to_option", "reads compile specs"),
    (f"{_QC}.serialization.qc_schema", "QnnExecuTorchBackendType", "backend gate"),
    (f"{_QC}.partition.qnn_partitioner", "QnnOperatorSupport.__init__", "patched: keeps specs"),
    (
        f"{_QC}.partition.qnn_partitioner",
        "QnnOperatorSupport.skip_node_id_set",
        "set while judging a convolution_backward (renamed nodes)",
    ),
    (f"{_QC}.partition.qnn_partitioner", "QnnOperatorSupport.is_node_supported", "patched: gates"),
    (f"{_QC}.partition.common_defs", "constant_operator", "constants follow their consumers"),
    (f"{_QC}.partition.common_defs", "allow_list_operator", "verdict: passed before skip options"),
    (f"{_QC}.partition.common_defs", "not_supported_operator", "verdict: reason for CPU"),
    (f"{_QC}.partition.common_defs", "to_be_implemented_operator", "verdict: reason for CPU"),
    (f"{_QC}.utils.constants", "QCOM_FALLBACK_NODE", "verdict: reason for CPU"),
    (
        f"{_QC}.partition.qnn_partitioner",
        "QnnPartitioner.partition",
        "patched: large delegates split; trainable parameters stay top-level (untagged)",
    ),
    (
        f"{_QC}.partition.qnn_partitioner",
        "QnnPartitioner.transform_for_pre_decomposition",
        "patched: train-mode ATen ops rewritten before executorch decomposes the graph",
    ),
    (
        f"{_QC}.partition.qnn_partitioner",
        "QnnPartitioner.tag_nodes",
        "patched: no partition, nothing to tag",
    ),
    (f"{_QC}.utils.constants", "QCOM_AXIS_ORDER", "layout of runtime weights"),
    (f"{_QC}.utils.constants", "QCOM_INSERTED_PERMUTE", "layout of runtime weights"),
    (f"{_QC}._passes.qnn_pass_manager", "QnnPassManager.get_default_pass_activations", "patched"),
    (
        f"{_QC}._passes.qnn_pass_manager",
        "QnnPassManager.get_passes_dependency_for_capture_program",
        "patched",
    ),
    (f"{_QC}._passes", "LayoutTransform", "pass ordering"),
    (f"{_QC}._passes", "CanonicalizeConv", "pass ordering (1-D convs)"),
    ("torchao.quantization.pt2e.utils", "get_new_attr_name_with_prefix", "1-D weight buffers"),
    ("torch._guards", "detect_fake_mode", "1-D weight buffers"),
    (f"{_QC}._passes", "I64toI32", "pass ordering"),
    (f"{_QC}._passes", "AnnotateGetAttr", "pass ordering (constant reads merged before)"),
    (f"{_QC}._passes", "RecomposePadMaxPool2d", "pass ordering (max pool indices plane)"),
    (f"{_QC}.builders.qnn_constants", "OpElementWiseAdd", "QNN op names (max pool backward)"),
    (f"{_QC}.builders.qnn_constants", "OpElementWiseSelect", "QNN op names (max pool backward)"),
    (f"{_QC}.builders.qnn_constants", "OpScatterElements", "QNN op/param names (max pool)"),
    (f"{_QC}.builders.qnn_constants", "OpConcat", "QNN op/param names (max pool, runtime_weight)"),
    (f"{_QC}.builders.qnn_constants", "OpPoolMax2d", "QNN op/param names (forward max pool)"),
    (
        f"{_QC}.builders.qnn_constants",
        "OpElementWiseMaximum",
        "QNN op names (dilated forward max pool)",
    ),
    (f"{_QC}.builders.qnn_constants", "OpDequantize", "QNN op names (quantized to float)"),
    (f"{_QC}.builders.qnn_constants", "OpQuantize", "QNN op names (float to quantized)"),
    (f"{_QC}.builders.qnn_constants", "OpDepthToSpace", "QNN op/param names (stride phases)"),
    (f"{_QC}._passes", "RemoveRedundancy", "pass ordering"),
    (f"{_QC}._passes", "AnnotateQuantAttrs", "pass ordering (quantization passes before it)"),
    (f"{_QC}._passes", "ResolveDebugHandle", "pass ordering"),
    (f"{_QC}._passes.i64_to_i32", "I64toI32._record_original_output_dtype", "patched"),
    (f"{_QC}._passes.i64_to_i32", "I64toI32._preserve_output_dtype", "patched"),
    (f"{_QC}._passes.layout_transform", "LayoutTransform.layout_sensitive_ops", "op added"),
    (f"{_QC}._passes.layout_transform", "LayoutTransform.is_edge_condition", "patched"),
    (f"{_QC}._passes.layout_transform", "LayoutTransform.mark_as_transformed", "patched"),
    (f"{_QC}._passes.layout_transform", "LayoutTransform.call", "patched"),
    (
        f"{_QC}.qnn_preprocess",
        "QnnBackend._build_op_wrappers",
        "patched: delegate outputs built in signature order; observed by capture_qnn_graphs",
    ),
    (f"{_QC}.qnn_preprocess", "QnnBackend.preprocess", "timed by qnn_convbwd_dev.lowering_time"),
    (
        f"{_QC}.qnn_preprocess",
        "QnnBackend.preprocess_multimethod",
        "patched: delegates finalised in forked processes; timed by qnn_convbwd_dev.lowering_time",
    ),
    (f"{_QC}.python.PyQnnManagerAdaptor", "PyQnnOpWrapper", "builds QNN ops"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "Qnn_TensorType_t", "QNN tensor types"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "Qnn_DataType_t", "QNN data types"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "Qnn_QuantizationEncoding_t", "QNN quant encoding"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "PyQnnTensorWrapper", "reads tensor names"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "GetQnnSdkBuildId", "doctor: loaded QAIRT build id"),
    (
        f"{_QC}.qnn_preprocess",
        "get_current_qnn_manager",
        "patched: the manager's Compile goes through the context cache",
    ),
    (f"{_QC}.python.PyQnnManagerAdaptor", "QnnManager.Compile", "context cache: a miss compiles"),
    (f"{_QC}.python.PyQnnManagerAdaptor", "OpWrapper.GetOpConfig", "context cache key"),
    ("executorch.exir.lowered_backend_module", "get_lowered_submodules", "delegate inspection"),
    (f"{_QC}.builders.node_visitor", "QNN_TENSOR_TYPE_MAP", "torch -> QNN dtype"),
    ("executorch.exir.dialects._ops", "ops", "edge dialect op handles"),
    (
        "executorch.exir.emit._emit_program",
        "_get_training_metadata",
        "patched: a joint program's gradient and parameter indices skip buffer mutations",
    ),
    (
        "executorch.exir.emit._emitter",
        "_Emitter._tensor_spec_to_evalue",
        "patched: a named mutable buffer's initial value is never another constant's",
    ),
    (
        "executorch.extension.pybindings.portable_lib",
        "_load_program_from_buffer",
        "training sessions: one loaded program whose methods keep their state",
    ),
    (
        "executorch.extension.pybindings.portable_lib",
        "ExecuTorchMethod.get_attribute",
        "training sessions: updated buffers read and written by name",
    ),
    (
        "executorch.extension.pybindings.portable_lib",
        "ExecuTorchMethod.get_outputs",
        "training sessions: the parameter tensors before the first step",
    ),
    (
        "executorch.extension.pybindings.portable_lib",
        "ExecuTorchProgram.write_etdump_result_to_file",
        "training sessions: the ETDump of a session loaded with etdump=True",
    ),
    (
        "executorch.exir._serialize._program",
        "deserialize_pte_binary",
        "training sessions, device training: the buffers a program updates (names, dtypes, shapes)",
    ),
    ("executorch.exir", "to_edge_transform_and_lower", "lower()"),
    ("executorch.exir", "EdgeProgramManager", "the lowering cache: a stored lowering read back"),
    (
        "executorch.exir",
        "EdgeProgramManager._config_methods",
        "training programs: a constant method added after lowering (stored weight layouts)",
    ),
    ("executorch.exir.serde.serialize", "save", "the lowering cache: an edge program stored"),
    ("executorch.exir.serde.serialize", "load", "the lowering cache: an edge program read back"),
    (f"{_QC}.partition.qnn_partitioner", "QnnPartitioner", "lower()"),
    (f"{_QC}._passes.qnn_pass_manager", "get_qnn_pass_manager_cls", "lower()"),
    (f"{_QC}.utils.qnn_manager_lifecycle", "QnnManagerContext", "lower()"),
    (f"{_QC}.utils.utils", "qnn_edge_config", "lower()"),
)


class ExecutorchIntegrationError(RuntimeError):
    """An executorch internal the plugin relies on is missing or changed."""


def executorch_version() -> str:
    try:
        return importlib.metadata.version("executorch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        if inspect.isclass(obj) and not hasattr(obj, part) and _sets_attribute(obj, part):
            return f"{obj.__name__}().{part}"  # an instance attribute, set by __init__
        obj = getattr(obj, part)
    return obj


def _sets_attribute(cls: type, name: str) -> bool:
    """Whether ``cls.__init__`` assigns ``self.<name>``."""
    try:
        source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
    return f"self.{name} =" in source


def check_internals() -> None:
    """Resolve every entry of INTERNALS; raise one error listing all that are missing."""
    missing = []
    for module, path, why in INTERNALS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError) as err:
            missing.append(f"  {module}.{path} ({why}): {err}")
    if missing:
        raise ExecutorchIntegrationError(
            f"qnn_convbwd was written against executorch {SUPPORTED_EXECUTORCH}; the installed "
            f"executorch {executorch_version()} lacks internals it needs:\n" + "\n".join(missing)
        )


def _listed(path: str, parent: bool = False) -> Any:
    """The listed internal ``path``, or (``parent``) the class or module holding it."""
    for module, entry, _ in INTERNALS:
        if entry != path:
            continue
        holder = entry.rpartition(".")[0]
        try:
            if not parent:
                return _resolve(module, entry)
            return _resolve(module, holder) if holder else importlib.import_module(module)
        except (ImportError, AttributeError) as err:
            raise ExecutorchIntegrationError(
                f"executorch {executorch_version()}: {module}.{entry} is missing ({err}); "
                f"qnn_convbwd needs executorch {SUPPORTED_EXECUTORCH}"
            ) from err
    raise KeyError(f"{path} is not a listed executorch internal")


def get(path: str) -> Any:
    """Resolve one listed internal by its attribute path (e.g. ``"OpTransposeConv2d"``)."""
    return _listed(path)


def add_constant_methods(edge: Any, methods: dict[str, Any]) -> None:
    """Add constant methods to a lowered EdgeProgramManager (``to_edge``'s
    ``constant_methods``, after the fact): executorch keeps them in an attribute its
    ``to_executorch`` emits."""
    _listed("EdgeProgramManager._config_methods", parent=True)
    if not hasattr(edge, "_config_methods"):
        raise ExecutorchIntegrationError(
            f"executorch {executorch_version()}: EdgeProgramManager has no _config_methods; "
            f"qnn_convbwd needs executorch {SUPPORTED_EXECUTORCH}"
        )
    edge._config_methods = {**(edge._config_methods or {}), **methods}


# ---------------------------------------------------------------------------
# Patching with exact restore
# ---------------------------------------------------------------------------


class _Patches:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        old = vars(owner).get(name)
        setattr(owner, name, value)

        def undo() -> None:
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)

        self._undo.append(undo)

    def dict_item(self, mapping: dict, key: Any, value: Any) -> None:
        had = key in mapping
        old = mapping.get(key)
        mapping[key] = value

        def undo() -> None:
            if had:
                mapping[key] = old
            else:
                mapping.pop(key, None)

        self._undo.append(undo)

    def set_add(self, target: set, item: Any) -> None:
        if item in target:
            return
        target.add(item)
        self._undo.append(lambda: target.discard(item))

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()


_patches: _Patches | None = None


def installed() -> bool:
    return _patches is not None


def patch_count() -> int:
    """How many patches ``install`` applied (0 when not installed)."""
    return len(_patches._undo) if _patches is not None else 0


def install(hooks: Hooks) -> None:
    """Register the visitor and apply the patches (no-op when already installed)."""
    global _patches
    if _patches is not None:
        return
    check_internals()
    p = _Patches()
    try:
        _apply(p, hooks)
    except BaseException:
        p.revert()
        raise
    _patches = p


def uninstall() -> None:
    global _patches
    if _patches is None:
        return
    _patches.revert()
    _patches = None


class Hooks:
    """What the plugin contributes at each integration point; filled by qnn_convbwd.api."""

    visitor_targets: dict[str, type]  # "aten.convolution_backward.default" -> visitor class
    layout_sensitive_ops: tuple  # edge ops the layout pass must treat as NHWC
    # (checker, edge_program, compiler_specs, skip_node_id_set, skip_node_op_set)
    on_support_init: Callable[[Any, Any, Any, Any, Any], None]
    # (original, checker, node); original(skip_node_id_set=None) runs executorch's check,
    # with ``skip_node_id_set`` in place of the checker's own when given.
    is_node_supported: Callable[[Callable[..., bool], Any, Any], bool]
    # to_edge transform passes run after executorch's RemoveRedundancy, before its
    # AnnotateQuantAttrs: the quantize / dequantize nodes are still in the graph.
    quantization_passes: tuple[type, ...] = ()
    # Added to QnnPassManager's to_edge transform passes, in this order, before
    # executorch's LayoutTransform and I64toI32.
    transform_passes: tuple[type, ...] = ()
    # to_edge transform passes run after executorch's I64toI32 and LayoutTransform
    # (both re-trace the graph), before AnnotateGetAttr.
    late_transform_passes: tuple[type, ...] = ()
    layout_edge_condition: Callable[[Callable, Any, Any], bool]  # (original, pass, node)
    layout_mark: Callable[[Callable, Any, Any], None]  # (original, pass, node)
    record_output_dtypes: Callable[[Any, Any], None]  # (pass, graph_module)
    preserve_output_dtypes: Callable[[Callable, Any, Any], None]  # (original, pass, gm)
    # Builds a forward convolution in place of executorch's visitor:
    # (original, visitor, node, nodes_to_wrappers) -> op wrapper(s); ``original()``
    # runs executorch's own define_node. None: executorch's visitor as it is.
    conv_define: Callable[[Callable[[], Any], Any, Any, Any], Any] | None = None
    # The same for other executorch visitors, by target (e.g. the forward max pool).
    visitor_wraps: tuple[tuple[str, Callable[[Callable[[], Any], Any, Any, Any], Any]], ...] = ()
    # ATen program -> ATen program, run before executorch's decompositions
    # (``Partitioner.transform_for_pre_decomposition``, which QnnPartitioner inherits).
    pre_decomposition: Callable[[Any], Any] | None = None
    # (original, methods) -> the training metadata executorch emits
    # (``__et_training_*`` methods); ``original(methods)`` is executorch's own.
    training_metadata: Callable[[Callable[[Any], dict], Any], dict] | None = None
    # (original, emitter, spec, *args) -> the EValue executorch's emitter writes for a
    # tensor spec; ``original(*args)`` is executorch's own ``_tensor_spec_to_evalue``.
    tensor_spec_value: Callable[..., Any] | None = None
    # Called after QnnPartitioner.partition has tagged the program: (edge_program,
    # partition_tags), the tags' dict of the PartitionResult (which it may extend).
    after_partition: Callable[[Any, dict[str, Any]], None] | None = None
    # Called with (edge_program, op wrappers) after executorch built a delegate's QNN
    # ops, before they are compiled; returns the op wrappers to compile (reordered).
    after_build: Callable[[Any, list], list] | None = None
    # Called before QnnPartitioner.partition, and before executorch builds a
    # delegate's QNN ops (with its edge_program): progress reports.
    before_partition: Callable[[], None] | None = None
    before_build: Callable[[Any], None] | None = None
    # Stands in for the QNN manager's Compile: (original, compile_specs, graph_names,
    # op_wrapper_lists, edge_programs) -> the context binary; ``original(graph_names,
    # op_wrapper_lists)`` is executorch's; ``edge_programs`` the delegates' programs
    # built since the previous Compile, in build order.
    compile: Callable[[Callable[[Any, Any], Any], Any, Any, Any, list], Any] | None = None
    # Stands in for QnnBackend.preprocess_multimethod: (original, edge_programs,
    # compile_specs, build_observed) -> its result; ``original`` is executorch's, and
    # ``build_observed`` is True while capture_qnn_graphs runs or something wrapped the
    # delegates' build on top of the plugin's (a profiler): it must then run in process.
    preprocess: Callable[[Callable[[Any, Any], Any], Any, Any, bool], Any] | None = None


# executorch's visitor of the forward convolution, wrapped when conv_define is set.
CONV_TARGET = "aten.convolution.default"


def _with_define(base: type, define: Callable[[Callable[[], Any], Any, Any, Any], Any]) -> type:
    """Subclass of executorch's visitor ``base`` whose define_node is ``define``."""

    class Wrapped(base):
        def define_node(self, node, nodes_to_wrappers):
            def original():
                return base.define_node(self, node, nodes_to_wrappers)

            return define(original, self, node, nodes_to_wrappers)

    Wrapped.__name__ = Wrapped.__qualname__ = f"{base.__name__}ForQnnConvBwd"
    return Wrapped


@contextlib.contextmanager
def _skip_node_ids(checker: Any, ids: set) -> Iterator[None]:
    """executorch's QnnOperatorSupport with ``ids`` as its skip_node_id_set, for one check."""
    if not hasattr(checker, "skip_node_id_set"):
        raise ExecutorchIntegrationError(
            f"executorch {executorch_version()}: QnnOperatorSupport has no skip_node_id_set"
        )
    saved = checker.skip_node_id_set
    checker.skip_node_id_set = ids
    try:
        yield
    finally:
        checker.skip_node_id_set = saved


def owner(path: str) -> Any:
    """The class or module holding a listed internal ``path`` (``"Cls.attr"`` -> ``Cls``;
    a module-level ``"name"`` -> its module), resolved as ``get`` resolves it."""
    return _listed(path, parent=True)


# One function per patch point; ``_apply`` runs them in this order.


def _patch_visitors(p: _Patches, hooks: Hooks) -> None:
    """The plugin's node visitors registered, and executorch's wrapped where asked."""
    visitors = get("_node_visitor_dict")
    for target, cls in hooks.visitor_targets.items():
        p.dict_item(visitors, target, cls)
    for wrapped, define in ((CONV_TARGET, hooks.conv_define), *hooks.visitor_wraps):
        if define is None:
            continue
        if wrapped not in visitors:
            raise ExecutorchIntegrationError(
                f"executorch {executorch_version()} registers no visitor for {wrapped}"
            )
        p.dict_item(visitors, wrapped, _with_define(visitors[wrapped], define))


def _patch_layout(p: _Patches, hooks: Hooks) -> None:
    """LayoutTransform: the plugin's layout-sensitive ops, its edge test and marking."""
    sensitive = get("LayoutTransform.layout_sensitive_ops")
    for op in hooks.layout_sensitive_ops:
        p.set_add(sensitive, op)

    layout = owner("LayoutTransform.call")
    orig_edge, orig_mark = layout.is_edge_condition, layout.mark_as_transformed
    orig_call = layout.call

    def is_edge_condition(self, node):
        return hooks.layout_edge_condition(lambda n: orig_edge(self, n), self, node)

    def mark_as_transformed(self, node):
        hooks.layout_mark(lambda n: orig_mark(self, n), self, node)

    def call(self, graph_module):
        # annotate_layout walks the connected layout region depth first, a few Python
        # frames per node: a whole training graph (EfficientNet-B0's joint graph has
        # ~1,900 nodes) exceeds Python's default limit of 1,000 frames.
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 8 * len(graph_module.graph.nodes) + 1000))
        try:
            with signature_frozen(self.edge_program):
                return orig_call(self, graph_module)
        finally:
            sys.setrecursionlimit(limit)

    p.set_attr(layout, "is_edge_condition", is_edge_condition)
    p.set_attr(layout, "mark_as_transformed", mark_as_transformed)
    p.set_attr(layout, "call", call)


def _patch_operator_support(p: _Patches, hooks: Hooks) -> None:
    """QnnOperatorSupport: keeps its compile specs and asks the plugin's rules."""
    support_cls = owner("QnnOperatorSupport.is_node_supported")
    orig_init = support_cls.__init__
    orig_supported = support_cls.is_node_supported

    def support_init(self, edge_program, compiler_specs, *args, **kwargs):
        orig_init(self, edge_program, compiler_specs, *args, **kwargs)
        bound = (
            inspect.signature(orig_init)
            .bind(self, edge_program, compiler_specs, *args, **kwargs)
            .arguments
        )
        hooks.on_support_init(
            self,
            edge_program,
            compiler_specs,
            bound.get("skip_node_id_set"),
            bound.get("skip_node_op_set"),
        )

    def is_node_supported(self, submodules, node):
        def original(skip_node_id_set=None) -> bool:
            if skip_node_id_set is None:
                return orig_supported(self, submodules, node)
            with _skip_node_ids(self, skip_node_id_set):
                return orig_supported(self, submodules, node)

        return hooks.is_node_supported(original, self, node)

    p.set_attr(support_cls, "__init__", support_init)
    p.set_attr(support_cls, "is_node_supported", is_node_supported)


def _patch_partitioner(p: _Patches, hooks: Hooks) -> None:
    """QnnPartitioner: the ATen hook, tagging with no partition, the after-partition hook."""
    partitioner_cls = owner("QnnPartitioner.partition")
    orig_tag_nodes = partitioner_cls.tag_nodes

    def tag_nodes(self, partitions, edge_program):
        # executorch 1.5.1 tags unused constant placeholders with the last partition's
        # tag, unbound when there is no partition (UnboundLocalError): with nothing
        # delegated there is nothing to tag.
        if not partitions:
            return None
        return orig_tag_nodes(self, partitions, edge_program)

    p.set_attr(partitioner_cls, "tag_nodes", tag_nodes)

    if hooks.pre_decomposition is not None:
        orig_pre = partitioner_cls.transform_for_pre_decomposition

        def pre_decomposition(self, exported_program):
            return orig_pre(self, hooks.pre_decomposition(exported_program))

        p.set_attr(partitioner_cls, "transform_for_pre_decomposition", pre_decomposition)

    if hooks.after_partition is not None or hooks.before_partition is not None:
        orig_partition = partitioner_cls.partition

        def partition(self, edge_program):
            if hooks.before_partition is not None:
                hooks.before_partition()
            with signature_frozen(edge_program):
                result = orig_partition(self, edge_program)
            if hooks.after_partition is not None:
                hooks.after_partition(result.tagged_exported_program, result.partition_tags)
            return result

        p.set_attr(partitioner_cls, "partition", partition)


def _patch_training_metadata(p: _Patches, hooks: Hooks) -> None:
    """executorch's emitter: the training metadata of a joint program."""
    if hooks.training_metadata is None:
        return
    emit = owner("_get_training_metadata")
    orig_metadata = emit._get_training_metadata

    def training_metadata(methods):
        return hooks.training_metadata(orig_metadata, methods)

    p.set_attr(emit, "_get_training_metadata", training_metadata)


def _patch_tensor_values(p: _Patches, hooks: Hooks) -> None:
    """executorch's emitter: the value written for each tensor of a program."""
    if hooks.tensor_spec_value is None:
        return
    emitter = owner("_Emitter._tensor_spec_to_evalue")
    orig_value = emitter._tensor_spec_to_evalue

    def tensor_spec_value(self, spec, *args, **kwargs):
        return hooks.tensor_spec_value(lambda: orig_value(self, spec, *args, **kwargs), self, spec)

    p.set_attr(emitter, "_tensor_spec_to_evalue", tensor_spec_value)


def _patch_pass_manager(p: _Patches, hooks: Hooks) -> None:
    """QnnPassManager: the plugin's to_edge transform passes, activated and ordered."""
    pm_cls = owner("QnnPassManager.get_default_pass_activations")
    orig_activations = pm_cls.get_default_pass_activations.__func__
    orig_deps = pm_cls.get_passes_dependency_for_capture_program.__func__
    quantization_passes = hooks.quantization_passes
    plugin_passes = hooks.transform_passes
    late_passes = hooks.late_transform_passes
    added = (*quantization_passes, *plugin_passes, *late_passes)

    def activations(cls):
        return [*orig_activations(cls), *((p, True) for p in added)]

    def dependencies(cls):
        deps = orig_deps(cls)
        earlier = [get("RemoveRedundancy")]
        for quantization_pass in quantization_passes:
            deps[quantization_pass] = list(earlier)
            earlier.append(quantization_pass)
        annotate = get("AnnotateQuantAttrs")
        deps[annotate] = [*deps.get(annotate, []), *quantization_passes]
        # After the graph is cleaned up, before the passes that read operands'
        # layout and dtype; ResolveDebugHandle must stay last.
        # After the padded forward max pool is recomposed: its indices' plane is then final.
        earlier = [get("RemoveRedundancy"), get("CanonicalizeConv"), get("RecomposePadMaxPool2d")]
        for plugin_pass in plugin_passes:
            deps[plugin_pass] = list(earlier)
            earlier.append(plugin_pass)
        for later in ("LayoutTransform", "I64toI32", "ResolveDebugHandle"):
            deps.setdefault(get(later), [])
            deps[get(later)] = [*deps[get(later)], *plugin_passes]
        earlier = [get("I64toI32"), get("LayoutTransform")]
        for late_pass in late_passes:
            deps[late_pass] = list(earlier)
            earlier.append(late_pass)
        for later in ("AnnotateGetAttr", "ResolveDebugHandle"):
            deps.setdefault(get(later), [])
            deps[get(later)] = [*deps[get(later)], *late_passes]
        return deps

    p.set_attr(pm_cls, "get_default_pass_activations", classmethod(activations))
    p.set_attr(pm_cls, "get_passes_dependency_for_capture_program", classmethod(dependencies))


def _patch_int64(p: _Patches, hooks: Hooks) -> None:
    """I64toI32: the output dtypes the plugin's int32 rewrites keep."""
    i64 = owner("I64toI32._preserve_output_dtype")
    orig_preserve = i64._preserve_output_dtype

    def record(self, graph_module):
        hooks.record_output_dtypes(self, graph_module)

    def preserve(self, graph_module):
        hooks.preserve_output_dtypes(lambda gm: orig_preserve(self, gm), self, graph_module)

    p.set_attr(i64, "_record_original_output_dtype", record)
    p.set_attr(i64, "_preserve_output_dtype", preserve)


# executorch's Qualcomm helpers ask, about 30,000 times in a large training graph's
# lowering, whether a node is a parameter, a buffer or a lifted constant; torch answers
# each question by rebuilding the graph signature's name dictionaries (a quarter of a
# profiled MobileNetV3-Small training lowering with its contexts cached). While a
# phase that does not change the signature runs (the partitioner, LayoutTransform, the
# delegates' build), the names are read once and the questions answered from them.
_SIGNATURE_LOOKUPS = ("is_param", "is_buffer", "is_lifted_tensor_constant")


class _FrozenSignatures(threading.local):
    """Per thread: id(program) -> (program, names per lookup in _SIGNATURE_LOOKUPS)."""

    def __init__(self) -> None:
        self.programs: dict[int, tuple[Any, tuple[frozenset, ...]]] = {}


_frozen = _FrozenSignatures()


def _signature_names(program: Any) -> tuple[frozenset, ...]:
    signature = program.graph_signature
    return (
        frozenset(signature.inputs_to_parameters),
        frozenset(signature.inputs_to_buffers),
        frozenset(signature.inputs_to_lifted_tensor_constants),
    )


@contextlib.contextmanager
def signature_frozen(program: Any) -> Iterator[None]:
    """Answer executorch's parameter, buffer and constant checks about ``program`` from
    its graph signature as it is on entry; on exit, check the signature did not change.

    For phases that read the signature and do not change it. Nested scopes over the
    same program share the outer one's names.
    """
    if program is None or id(program) in _frozen.programs:
        yield
        return
    names = _signature_names(program)
    _frozen.programs[id(program)] = (program, names)
    try:
        yield
    finally:
        del _frozen.programs[id(program)]
    if _signature_names(program) != names:
        raise ExecutorchIntegrationError(
            f"executorch {executorch_version()}: the graph signature changed during a phase "
            "whose parameter, buffer and constant checks were answered from it as it was "
            "before; those answers may be stale"
        )


def _patch_signature_lookups(p: _Patches, hooks: Hooks) -> None:
    """builders.utils' parameter, buffer and constant checks: answered from a frozen
    signature inside ``signature_frozen``, by torch as before outside it."""
    utils = owner("is_param")
    for index, name in enumerate(_SIGNATURE_LOOKUPS):
        original = getattr(utils, name)

        def lookup(program, node, _original=original, _index=index):
            entry = _frozen.programs.get(id(program))
            if entry is None or entry[0] is not program:
                return _original(program, node)
            return node.name in entry[1][_index]

        lookup.__name__ = lookup.__qualname__ = name
        p.set_attr(utils, name, lookup)


def _apply(p: _Patches, hooks: Hooks) -> None:
    for patch in (
        _patch_signature_lookups,
        _patch_visitors,
        _patch_layout,
        _patch_operator_support,
        _patch_partitioner,
        _patch_training_metadata,
        _patch_tensor_values,
        _patch_preprocess,
        _patch_pass_manager,
        _patch_int64,
    ):
        patch(p, hooks)


class _BuiltPrograms(threading.local):
    """The edge programs whose QNN ops were built since the last Compile (per thread)."""

    def __init__(self) -> None:
        self.programs: list = []


class _CompilingManager:
    """executorch's QnnManager, its Compile going through ``Hooks.compile``."""

    def __init__(self, manager: Any, compile_specs: Any, hooks: Hooks, built: _BuiltPrograms):
        self._manager = manager
        self._compile_specs = compile_specs
        self._hooks = hooks
        self._built = built

    def Compile(self, graph_names, op_wrapper_lists):  # noqa: N802 (executorch's name)
        programs, self._built.programs = self._built.programs, []
        return self._hooks.compile(
            self._manager.Compile, self._compile_specs, graph_names, op_wrapper_lists, programs
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _patch_preprocess(p: _Patches, hooks: Hooks) -> None:
    """executorch's QnnBackend: its ops' build and the manager's Compile, hooked."""
    if (
        hooks.after_build is None
        and hooks.before_build is None
        and hooks.compile is None
        and hooks.preprocess is None
    ):
        return
    backend = owner("QnnBackend._build_op_wrappers")
    preprocess = owner("get_current_qnn_manager")
    orig_build = backend.__dict__["_build_op_wrappers"].__func__
    built = _BuiltPrograms()

    if hooks.preprocess is not None:
        orig_multimethod = backend.__dict__["preprocess_multimethod"].__func__

        def multimethod(edge_programs, compile_specs):
            # A wrapper on top of the plugin's build, or capture_qnn_graphs entered
            # before the plugin was installed (its wrapper is then underneath).
            observed = capturing_qnn_graphs() or backend.__dict__["_build_op_wrappers"] is not ours
            return hooks.preprocess(orig_multimethod, edge_programs, compile_specs, observed)

        p.set_attr(backend, "preprocess_multimethod", staticmethod(multimethod))

    def build(edge_program, *args, **kwargs):
        if hooks.before_build is not None:
            hooks.before_build(edge_program)
        with signature_frozen(edge_program):
            wrappers = orig_build(edge_program, *args, **kwargs)
        if isinstance(wrappers, list):
            if hooks.after_build is not None:
                wrappers = hooks.after_build(edge_program, wrappers)
            built.programs.append(edge_program)
        return wrappers

    ours = staticmethod(build)
    p.set_attr(backend, "_build_op_wrappers", ours)

    if hooks.compile is None:
        return
    orig_manager = preprocess.get_current_qnn_manager

    def current_manager(backend_type, compile_specs):
        manager = orig_manager(backend_type, compile_specs)
        built.programs = []
        return _CompilingManager(manager, compile_specs, hooks, built)

    p.set_attr(preprocess, "get_current_qnn_manager", current_manager)


# ---------------------------------------------------------------------------
# Observing what executorch compiles
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QnnTensorInfo:
    name: str
    kind: str  # QNN tensor type name, e.g. "QNN_TENSOR_TYPE_STATIC"
    dims: tuple[int, ...]
    nbytes: int

    @property
    def is_static(self) -> bool:
        return self.kind.endswith("STATIC")


@dataclasses.dataclass(frozen=True)
class QnnOpInfo:
    name: str
    op_type: str
    inputs: tuple[QnnTensorInfo, ...]
    outputs: tuple[QnnTensorInfo, ...]


_DTYPE_BYTES = {
    "FLOAT_32": 4,
    "FLOAT_16": 2,
    "INT_32": 4,
    "UINT_32": 4,
    "INT_8": 1,
    "UINT_8": 1,
    "INT_16": 2,
    "UINT_16": 2,
    "BOOL_8": 1,
    "SFIXED_POINT_8": 1,
    "UFIXED_POINT_8": 1,
    "SFIXED_POINT_16": 2,
    "UFIXED_POINT_16": 2,
    "SFIXED_POINT_32": 4,
}


def _tensor_info(tensor: Any) -> QnnTensorInfo:
    v2 = tensor.v2
    dims = tuple(int(d) for d in v2.dimensions)
    width = next((b for k, b in _DTYPE_BYTES.items() if v2.dataType.name.endswith(k)), 4)
    count = 1
    for d in dims:
        count *= d
    return QnnTensorInfo(str(v2.name), v2.type.name, dims, count * width)


def qnn_tensor_names(wrapper: Any) -> tuple[list[str], list[str]]:
    """An op wrapper's (input tensor names, output tensor names)."""
    config = wrapper.GetOpWrapper().GetOpConfig()
    return (
        [_tensor_info(t).name for t in config["inputTensors"]],
        [_tensor_info(t).name for t in config["outputTensors"]],
    )


def qnn_output_names(wrappers: list) -> list[str]:
    """Names of the graph outputs (``output_`` tensors) in the order the ops build them."""
    names: list[str] = []
    for wrapper in wrappers:
        config = wrapper.GetOpWrapper().GetOpConfig()
        for tensor in config["outputTensors"]:
            name = _tensor_info(tensor).name
            if name.startswith("output_") and name not in names:
                names.append(name)
    return names


_captures = 0  # capture_qnn_graphs blocks running


@contextlib.contextmanager
def capture_qnn_graphs() -> Iterator[list[list[QnnOpInfo]]]:
    """Record the QNN ops executorch compiles, one list per partition, while active."""
    backend = owner("QnnBackend._build_op_wrappers")
    original = backend.__dict__["_build_op_wrappers"]
    graphs: list[list[QnnOpInfo]] = []

    def observe(*args, **kwargs):
        wrappers = original.__func__(*args, **kwargs)
        if isinstance(wrappers, list):
            ops = []
            for wrapper in wrappers:
                op = wrapper.GetOpWrapper()
                config = op.GetOpConfig()
                ops.append(
                    QnnOpInfo(
                        op.GetName(),
                        op.GetOpType(),
                        tuple(_tensor_info(t) for t in config["inputTensors"]),
                        tuple(_tensor_info(t) for t in config["outputTensors"]),
                    )
                )
            graphs.append(ops)
        return wrappers

    backend._build_op_wrappers = staticmethod(observe)
    global _captures
    _captures += 1
    try:
        yield graphs
    finally:
        _captures -= 1
        backend._build_op_wrappers = original


def capturing_qnn_graphs() -> bool:
    """Whether a ``capture_qnn_graphs`` block is running (a lowering must then build)."""
    return _captures > 0
