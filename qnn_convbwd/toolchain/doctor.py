"""``qnn-convbwd doctor``: what QNN SDK is in use, and which backends really work.

Every backend is checked for real, each in a fresh child process (a crash in
QNN code then cannot take the doctor down, and a Saver lowering must run in a
child anyway): the HTP compiler lowers a tiny Conv2d for the SoC, the x86-64
HTP simulator runs it and is compared with torch, and the Saver backend records
the same model. The exit code is 0 only when all of them work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

# HTP computes float graphs in fp16 (unit roundoff u = 2**-11 ~ 4.9e-4). Inputs,
# weights and the output are each rounded once, so a correct result is within a
# few u of the output's scale; 2e-3 (~4u) leaves margin for accumulation while a
# wrong layout, padding or stride gives errors of the order of the scale itself.
FP16_RELATIVE_TOLERANCE = 2e-3

PROBE_PREFIX = "QNN_CONVBWD_PROBE "
MODULE = "qnn_convbwd.toolchain.doctor"  # run as a child with ``python -m``
_PROBE_SHAPE = (1, 3, 16, 16)


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--soc", default="SM8650", help="SoC to compile for (default SM8650)")
    parser.add_argument(
        "--sdk-only",
        action="store_true",
        help="only assemble the SDK and build the shim; skip the backend checks",
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds allowed per backend check"
    )


def _probe_model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 8, 3, padding=1).eval()
    return model, (torch.randn(*_PROBE_SHAPE),)


def _emit(stage: str, **data: Any) -> None:
    sys.stdout.write(PROBE_PREFIX + json.dumps({"stage": stage, **data}) + "\n")
    sys.stdout.flush()


def _probe_htp(soc: str) -> int:
    """Child process: compile the probe model for ``soc``, then run it on the simulator."""
    from . import harness

    model, inputs = _probe_model()
    compiled = harness.lower_module(model, inputs, soc)
    _emit(
        "compile",
        seconds=compiled.lower_seconds,
        context_bytes=compiled.context_binary_bytes,
        delegates=harness.delegate_count(compiled.edge),
    )
    start = time.perf_counter()
    out = compiled.run(list(inputs))[0]
    seconds = time.perf_counter() - start
    ref = model(*inputs).detach()
    _emit(
        "run",
        seconds=seconds,
        max_abs_error=float((out - ref).abs().max()),
        scale=float(ref.abs().max()),
    )
    return 0


# A QNN log line on every HTP compile that does not mean failure (see docs/toolchain.md).
_BENIGN = ("unexpected GraphHtpSettings option 66",)


def _failure(proc: subprocess.CompletedProcess) -> str:
    """QNN's own error lines and the last line of the child's stderr."""
    lines = proc.stderr.strip().splitlines()
    qnn = [
        line.strip()
        for line in lines
        if ("[ERROR]" in line or "<E>" in line) and not any(b in line for b in _BENIGN)
    ]
    picked = list(dict.fromkeys(qnn[:6] + lines[-1:]))
    return f"child exit code {proc.returncode}: " + "\n".join(picked)


def check_htp(soc: str, timeout: float) -> list[Check]:
    """HTP compile and HTP simulator run, in one child process."""
    cmd = [sys.executable, "-m", MODULE, "--probe-htp", soc]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        reason = f"no answer within {timeout:.0f} s"
        return [Check("HTP compile", False, reason), Check("HTP simulator", False, reason)]
    stages = {}
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_PREFIX):
            record = json.loads(line[len(PROBE_PREFIX) :])
            stages[record.pop("stage")] = record
    failure = _failure(proc)
    checks = []
    compiled = stages.get("compile")
    if compiled is None:
        checks.append(Check("HTP compile", False, failure))
    elif compiled["delegates"] != 1:
        checks.append(
            Check("HTP compile", False, f"{compiled['delegates']} QNN delegates, expected 1")
        )
    else:
        checks.append(
            Check(
                "HTP compile",
                True,
                f"Conv2d 3->8 3x3 for {soc} in {compiled['seconds']:.1f} s, "
                f"context binary {compiled['context_bytes']} bytes",
                compiled,
            )
        )
    ran = stages.get("run")
    if ran is None:
        reason = failure if compiled is not None else "not run: compile failed"
        checks.append(Check("HTP simulator", False, reason))
    else:
        tolerance = FP16_RELATIVE_TOLERANCE * ran["scale"]
        ok = ran["max_abs_error"] <= tolerance
        checks.append(
            Check(
                "HTP simulator",
                ok,
                f"max abs error {ran['max_abs_error']:.2e} vs torch "
                f"(output scale {ran['scale']:.3g}, tolerance {tolerance:.2e}), "
                f"run {ran['seconds']:.2f} s",
                {**ran, "tolerance": tolerance},
            )
        )
    return checks


def check_saver(soc: str, timeout: float) -> Check:
    import torch

    from . import saver

    model, inputs = _probe_model()
    try:
        graph = saver.record(torch.export.export(model, inputs), soc, timeout=timeout)
    except (saver.SaverError, saver.SaverFormatError) as err:
        return Check("Saver", False, str(err))
    types = [op.type for op in graph.ops]
    if "Conv2d" not in types:
        return Check("Saver", False, f"recording has no Conv2d op: {types}")
    return Check(
        "Saver",
        True,
        f"recorded {len(types)} ops ({', '.join(types)}), "
        f"{graph.static_bytes} static bytes, in {graph.seconds:.1f} s",
        {"ops": types, "static_bytes": graph.static_bytes, "seconds": graph.seconds},
    )


def diagnose(soc: str = "SM8650", *, backends: bool = True, timeout: float = 600) -> dict:
    """Everything ``doctor`` reports, as a JSON-able dict with ``ok`` at the top."""
    from .sdk import SdkUnavailable, ensure_sdk, loaded_build_id

    report: dict[str, Any] = {"soc": soc}
    try:
        info = ensure_sdk()
    except SdkUnavailable as err:
        report.update(ok=False, sdk={"error": str(err)}, checks=[])
        return report
    try:
        loaded = loaded_build_id(info)
    except Exception as err:  # reported, not raised: the doctor must finish
        loaded = f"unreadable: {err}"
    report["sdk"] = {
        "root": str(info.root),
        "source": info.source,
        "real_htp": str(info.real_htp),
        "build_id_file": info.build_id,
        "build_id_loaded": loaded,
        "build_ids_match": loaded == info.build_id,
        "shim": None if info.shim is None else str(info.shim),
        "shim_reason": info.shim_reason,
        "shim_build_seconds": info.shim_build_seconds,
        "saver_shim": None if info.saver_shim is None else str(info.saver_shim),
    }
    checks = [Check("loaded library", loaded == info.build_id, f"build id {loaded}")]
    if backends:
        checks += check_htp(soc, timeout)
        checks.append(check_saver(soc, timeout))
    report["checks"] = [dataclasses.asdict(c) for c in checks]
    report["ok"] = all(c.ok for c in checks)
    return report


def format_report(report: dict) -> str:
    sdk = report["sdk"]
    if "error" in sdk:
        return f"QNN SDK: not usable: {sdk['error']}\nresult: FAIL"
    if sdk["shim"] is None:
        shim = f"not used ({sdk['shim_reason']})"
    else:
        seconds = sdk["shim_build_seconds"]
        how = "cached" if seconds is None else f"built in {seconds:.2f} s"
        shim = f"{sdk['shim']} ({how})\n{'':20}{sdk['shim_reason']}"
    lines = [
        f"{'QNN SDK root':<20}{sdk['root']} (from {sdk['source']})",
        f"{'QAIRT build id':<20}{sdk['build_id_file']} (file {sdk['real_htp']})",
        f"{'loaded build id':<20}{sdk['build_id_loaded']} "
        f"({'matches' if sdk['build_ids_match'] else 'DIFFERS from the file'})",
        f"{'HTP shim':<20}{shim}",
        f"{'Saver shim':<20}{sdk.get('saver_shim') or 'none (the SDK has no libQnnSaver.so)'}",
        f"checks (SoC {report['soc']}, each backend in a child process):",
    ]
    for check in report["checks"]:
        mark = "ok" if check["ok"] else "FAIL"
        detail = check["detail"].replace("\n", "\n" + " " * 24)
        lines.append(f"  [{mark:>4}] {check['name']:<15}{detail}")
    lines.append(f"result: {'all checks pass' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


@contextlib.contextmanager
def _native_stdout_to_stderr():
    """QNN libraries print to file descriptor 1 when loaded; keep stdout for the report."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    with _native_stdout_to_stderr():
        report = diagnose(args.soc, backends=not args.sdk_only, timeout=args.timeout)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe-htp":
        sys.exit(_probe_htp(sys.argv[2]))
    parser = argparse.ArgumentParser(prog="python -m qnn_convbwd.toolchain.doctor")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
