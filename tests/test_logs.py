"""Quiet by default: executorch's loggers follow the application's configuration, known
harmless warnings are hidden unless asked for, and the CLI's filter of native output
drops exactly the chatter (also when the process crashes)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from qnn_convbwd import logs

PARTITIONER = "executorch.backends.qualcomm.partition.qnn_partitioner"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    forced = {name: logging.getLogger(name).level for name in logs.FORCED_DEBUG_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, value in forced.items():
        logging.getLogger(name).setLevel(value)


def test_executorch_loggers_follow_the_application(restore_logging, caplog):
    import executorch.backends.qualcomm.partition.qnn_partitioner  # noqa: F401

    partitioner = logging.getLogger(PARTITIONER)
    partitioner.setLevel(logging.DEBUG)  # what the module does at import
    executorch_root = logging.StreamHandler()
    executorch_root.setFormatter(logging.Formatter(logs.EXECUTORCH_ROOT_FORMAT))
    logging.getLogger().addHandler(executorch_root)  # convert_mha_to_sha's basicConfig
    logs.quiet_libraries()
    assert partitioner.level == logging.NOTSET
    assert executorch_root not in logging.getLogger().handlers
    caplog.clear()  # whatever the import logged
    with caplog.at_level(logging.WARNING):
        partitioner.info("[QnnPartitioner] aten.relu.default | True")
    assert not caplog.records
    with caplog.at_level(logging.INFO):  # an application asking for INFO gets it back
        partitioner.info("[QnnPartitioner] aten.relu.default | True")
    assert [r.getMessage() for r in caplog.records] == ["[QnnPartitioner] aten.relu.default | True"]


def test_known_harmless_warnings_show_only_at_info(restore_logging, caplog):
    logs.quiet_libraries()
    pass_manager = logging.getLogger("executorch.exir.pass_manager")
    with caplog.at_level(logging.WARNING):
        pass_manager.warning("PassManager is deprecated. Please use ExportedProgramPassManager")
        pass_manager.warning("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="executorch.exir.pass_manager"):
        pass_manager.warning("PassManager is deprecated. Please use ExportedProgramPassManager")
    assert len(caplog.records) == 1


# The child loads logs.py alone (stdlib only), not the package with torch and executorch.
CHILD = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("logs", sys.argv[2])
logs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(logs)

with logs.filtered_native_output((2,)):
    for line in (
        "[INFO] [Qnn ExecuTorch]: Destroy Qnn context",
        "[ERROR] [Qnn ExecuTorch]:  <E> unexpected GraphHtpSettings option 66",
        "[WARNING] [Qnn ExecuTorch]: Qnn API version 2.40.0 is used.",
        "[ERROR] [Qnn ExecuTorch]: Cannot Open QNN library libQnnHtp.so",
        "[WARNING] [Qnn ExecuTorch]: Qnn API version 2.40.0 is used.",
        "[cpuinfo_utils.cpp:87] Failed to open midr file /sys/devices/soc0/image_version",
    ):
        os.write(2, (line + "\\n").encode())
    print("python's own stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "crash":
        os.write(2, b"last words before the crash\\n")
        os.abort()
print("after the filter", file=sys.stderr)
"""


@pytest.mark.parametrize("ending", ["normal", "crash"])
def test_native_filter_drops_the_chatter_and_keeps_errors(ending):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), ending, logs.__file__],
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = [
        "[WARNING] [Qnn ExecuTorch]: Qnn API version 2.40.0 is used.",  # once
        "[ERROR] [Qnn ExecuTorch]: Cannot Open QNN library libQnnHtp.so",
        "python's own stderr",
    ]
    if ending == "crash":
        assert proc.returncode != 0
        expected.append("last words before the crash")
    else:
        assert proc.returncode == 0, proc.stderr
        expected.append("after the filter")
    assert proc.stderr.splitlines() == expected
