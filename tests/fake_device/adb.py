"""A stand-in for adb: the "device" is a local folder, ``$FAKE_ADB_ROOT``.

``push SRC DST``, ``pull SRC DST`` (a folder lands as ``DST/<its name>``, as adb
does) and ``shell CMD...`` (run by bash with every ``/data/`` path moved under the
root, so ``cd``, ``mkdir``, ``chmod`` and ``./runner`` work on the local copy; the
exit status is the command's, as adb's shell protocol gives it). ``-s`` and ``-H``
are taken and ignored. Every call is appended to ``$FAKE_ADB_ROOT/calls.log``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ["FAKE_ADB_ROOT"])


def local(device_path: str) -> Path:
    if not device_path.startswith("/"):
        raise SystemExit(f"adb: not an absolute device path: {device_path}")
    return ROOT / device_path.lstrip("/")


def main(argv: list[str]) -> int:
    with open(ROOT / "calls.log", "a") as log:
        log.write(" ".join(argv) + "\n")
    while argv[:1] in (["-s"], ["-H"]):
        argv = argv[2:]
    verb, rest = argv[0], argv[1:]
    if verb == "push":
        source, target = Path(rest[0]), local(rest[1])
        if not source.exists():
            print(f"adb: error: cannot stat '{source}': No such file or directory")
            return 1
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        print(f"{source}: 1 file pushed")
        return 0
    if verb == "pull":
        source, target = local(rest[0]), Path(rest[1])
        if not source.exists():
            print(
                f"adb: error: failed to stat remote object '{rest[0]}': No such file or directory"
            )
            return 1
        if source.is_dir():
            shutil.copytree(source, target / source.name, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)
        return 0
    if verb == "shell":
        command = " ".join(rest).replace("/data/", f"{ROOT}/data/")
        done = subprocess.run(
            ["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        sys.stdout.write(done.stdout)
        return done.returncode
    print(f"adb: unknown command {verb}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
