"""The bench's lowering modes and their labels, shared by its parts."""

MODES = ("plugin", "kept_on_cpu", "plain")
MODE_LABELS = {
    "plugin": "plugin",
    "kept_on_cpu": "plugin, conv_bwd kept on CPU",
    "plain": "plain executorch 1.5.1",
}
SCALING_MODES = ("plugin", "kept_on_cpu")
