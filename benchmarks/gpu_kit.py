"""`make gpu-kit`: the wheels a bare GPU machine lacks to run rlctl, in one folder (`.gpu-kit/`, git-ignored).

The lent GPU machine (Python 3.12, x86-64, no network) has the packages listed in
benchmarks/gpu_image_packages.txt. This script walks rlctl's own requirements (and those of the extras
named with --extra, megatron by default) through the metadata of the environment it runs in, keeps every
distribution the image lacks, and downloads each at the version installed here (the version CI tests) as
a wheel for CPython 3.12 / manylinux x86-64. benchmarks/gpu_check.sh installs them there with
``pip install --no-index --no-deps --target``; rlctl itself travels as source (the working tree).

    python benchmarks/gpu_kit.py [--out .gpu-kit] [--extra megatron] [--limit-mib 48]

Also written: ``kit.json`` (distribution -> version, wheel, top-level modules), which
tests/bench/test_gpu_kit.py reads to check that every module the ranks import is in the image or the kit.
The folder is refused (exit 1) when it is larger than --limit-mib: the working tree and every carried path
travel to the GPU machine within 64 MiB in all.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "benchmarks" / "gpu_image_packages.txt"
TARGET_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_LIST) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {norm(line) for line in lines if line}


def requirements(dist: str, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """The requirements of ``dist`` that apply on the GPU machine (Python 3.12), with ``extras`` on."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in ("", *extras)):
            out.append(req)
    return out


def missing_distributions(image: set[str], extras: tuple[str, ...]) -> dict[str, str]:
    """Every distribution rlctl needs (transitively) that the image lacks: name -> version installed here."""
    need: dict[str, str] = {}
    todo = requirements("rlctl", extras)
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if name in image or name in need:
            continue
        try:
            need[name] = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"gpu_kit: {req.name} (needed by rlctl) is not installed here; run `make install` first"
            ) from None
        todo.extend(requirements(req.name, tuple(req.extras)))
    return need


def top_level_modules(dist: str) -> list[str]:
    """The importable top-level names a distribution provides (from its installed files)."""
    names = set()
    for f in metadata.distribution(dist).files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__"):
            continue
        stem = first[:-3] if first.endswith(".py") else first.split(".")[0]
        if stem.isidentifier():
            names.add(stem)
    return sorted(names)


def download(name: str, version: str, out: Path) -> Path:
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS + ["any"]:
        cmd += ["--platform", p]
    result = subprocess.run([*cmd, f"{name}=={version}"], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"gpu_kit: no wheel of {name}=={version} for CPython 3.12 / manylinux x86-64: {tail}")
    new = set(out.glob("*.whl")) - before
    return next(iter(new)) if new else next(out.glob(f"{re.sub('-', '_', name)}-{version}-*.whl"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".gpu-kit")
    ap.add_argument("--extra", action="append", default=None, help="rlctl extras to include (default: megatron)")
    ap.add_argument("--limit-mib", type=float, default=48.0)
    args = ap.parse_args()
    extras = tuple(args.extra if args.extra is not None else ["megatron"])
    need = missing_distributions(image_packages(), extras)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    kit = {}
    for name, version in sorted(need.items()):
        wheel = download(name, version, args.out)
        kit[name] = {"version": version, "wheel": wheel.name, "modules": top_level_modules(name)}
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    (args.out / "kit.json").write_text(json.dumps({"extras": list(extras), "distributions": kit}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 2**20
    print(f"{args.out}: {len(kit)} wheels, {size:.1f} MiB (limit {args.limit_mib:g} MiB)")
    if size > args.limit_mib:
        raise SystemExit(f"gpu_kit: {size:.1f} MiB is over --limit-mib {args.limit_mib:g}; drop an extra (--extra)")


if __name__ == "__main__":
    main()
