"""A folder of wheels that installs ssl-vit without internet, beside a Python that already has torch.

On a connected machine (any OS with Python >= 3.9 and pip; the target's Python need not be here):

    python tools/wheelhouse.py --out wheelhouse --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --have "torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 timm==1.0.29 accelerate==1.15.0" \\
        --extras deepspeed
    python tools/wheelhouse.py --out wheelhouse --have-file target-freeze.txt    # `pip freeze` of the target

then on the target, offline:

    pip install --no-index --find-links wheelhouse 'ssl-vit[deepspeed]'

How: each package the target has becomes a stub wheel (its name and version, no files, no dependencies) that the
resolution takes in place of the real one, so pip resolves ssl-vit and its extras for the target's Python and
platform from the index's metadata without downloading any of the target's packages; what remains is downloaded
(binary wheels for the target) and the sdists among them (antlr4-python3-runtime, deepspeed) are built into wheels
here (pure-Python ones only). The torch family (torch, torchvision, torchaudio, triton, nvidia-*) is never included
unless --with-torch. A name in --have without a version means the index's newest for the target. `--check PYTHON`
(the target's Python version, here) installs the stubs and then ssl-vit from the folder alone into a fresh venv and
fails if pip would need anything else or touch a package the target has. Writes <out>/wheelhouse.json (target,
assumptions, files and sizes).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_FAMILY = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton.*|nvidia-.*)$")
STUB = "have"  # the stubs' local version label: only they satisfy the pins `name==version+have`
MISSING = re.compile(r"Could not find a version that satisfies the requirement ([^\s;]+)")
DEPENDS = re.compile(r"The conflict is caused by:\n\s+\S+ \S+ depends on ([^\s;]+)")  # an sdist-only dependency
MAX_BUILDS = 12  # sdists built into wheels before giving up (the resolution is retried after each)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def platforms(platform: str) -> list[str]:
    """pip matches --platform exactly: manylinux_2_N_arch for a glibc N also stands for every older N (and the
    legacy aliases), as a target with that glibc accepts them."""
    found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not found:
        return [platform]
    newest, arch = int(found[1]), found[2]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for glibc in range(newest, 4, -1):
        tags.append(f"manylinux_2_{glibc}_{arch}")
        if glibc in legacy:
            tags.append(f"{legacy[glibc]}_{arch}")
    return tags


def target_options(args) -> list[str]:
    major_minor = args.python_version.replace(".", "")
    options = ["--only-binary=:all:", "--python-version", args.python_version, "--implementation", "cp",
               "--abi", f"cp{major_minor}", "--abi", "abi3", "--abi", "none"]
    for tag in platforms(args.platform):
        options += ["--platform", tag]
    return options


def pip(*args: str) -> subprocess.CompletedProcess:
    """pip here, its output without the warnings of index locations this machine lacks."""
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    result.stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("WARNING: Location"))
    return result


def parse_have(args) -> dict[str, str | None]:
    """{normalized name: version or None} of what the target has."""
    entries = args.have.split()
    if args.have_file:
        entries += [line.split("#")[0].strip() for line in Path(args.have_file).read_text().splitlines()]
    have = {}
    for entry in filter(None, entries):
        found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+))?", entry)
        if not found:
            sys.exit(f"wheelhouse: error: --have entry {entry!r} is not NAME or NAME==VERSION")
        have[normalize(found[1])] = found[2].split("+")[0] if found[2] else None
    return have


def newest_version(name: str, options: list[str]) -> str:
    result = pip("index", "versions", name, *options)
    found = re.match(r"\S+ \(([^)]+)\)", result.stdout.strip())
    if result.returncode != 0 or not found:
        sys.exit(f"wheelhouse: error: no release of {name} for the target on the index; give its version "
                 f"({name}==VERSION in --have)")
    return found[1]


def write_stub(name: str, version: str, folder: Path) -> None:
    """A wheel with metadata only: `name` at `version+have`, no dependencies, for the resolution."""
    dist = f"{name.replace('-', '_')}-{version}+{STUB}"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+{STUB}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: ssl-vit-wheelhouse\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = []
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(text.encode())}")
        wheel.writestr(f"{dist}.dist-info/RECORD", "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n")


def build_project(folder: Path) -> Path:
    result = pip("wheel", "--no-deps", "-q", "-w", str(folder), str(ROOT))
    if result.returncode != 0:
        sys.exit(f"wheelhouse: error: building ssl-vit's wheel failed:\n{result.stderr[-2000:]}")
    return next(folder.glob("ssl_vit-*.whl"))


def build_sdist(requirement: str, folder: Path) -> None:
    """An sdist-only requirement (e.g. antlr4-python3-runtime, deepspeed) built into a wheel here; only a
    pure-Python one can serve another platform."""
    before = set(folder.glob("*.whl"))
    result = pip("wheel", "--no-deps", "-q", "-w", str(folder), requirement)
    built = set(folder.glob("*.whl")) - before
    if result.returncode != 0 or not built:
        sys.exit(f"wheelhouse: error: {requirement} has no wheel for the target and building one failed:\n"
                 f"{result.stderr[-2000:]}")
    impure = [path.name for path in built if not path.name.endswith("-none-any.whl")]
    if impure:
        sys.exit(f"wheelhouse: error: {requirement} has no wheel for the target and builds only for this machine "
                 f"({impure[0]}); build it on the target's platform")


def resolve(requirement: str, options: list[str], links: list[Path], constraints: Path, work: Path) -> list[dict]:
    """pip's install report for the target, building sdists into wheels where it meets one."""
    built = []
    for _ in range(MAX_BUILDS):
        report = work / "report.json"
        result = pip("install", "--dry-run", "--ignore-installed", "--report", str(report), "--target",
                     str(work / "target"), *options, *(f"--find-links={link}" for link in links), "-c",
                     str(constraints), requirement)
        if result.returncode == 0:
            return json.loads(report.read_text())["install"]
        missing = MISSING.search(result.stderr) or DEPENDS.search(result.stdout)
        if not missing or missing[1] in built:
            why = [line for line in (result.stdout + result.stderr).splitlines() if "conflict" in line.lower()
                   or line.startswith(("ERROR", "    ", "  The user requested"))]
            sys.exit(f"wheelhouse: error: pip cannot resolve {requirement} for the target:\n" + "\n".join(why[-30:]))
        print(f"building {missing[1]} (no wheel for the target on the index)", flush=True)
        build_sdist(missing[1], links[-1])
        built.append(missing[1])
    sys.exit(f"wheelhouse: error: still unresolved after building {MAX_BUILDS} sdists")


def fetch(item: dict, out: Path) -> Path:
    url = item["download_info"]["url"]
    path = out / url.rsplit("/", 1)[-1].split("#")[0]
    with urllib.request.urlopen(url) as response, open(path, "wb") as file:
        shutil.copyfileobj(response, file)
    expected = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
    if expected and hashlib.sha256(path.read_bytes()).hexdigest() != expected:
        path.unlink()
        sys.exit(f"wheelhouse: error: {url} does not match its sha256 {expected}")
    return path


def check(out: Path, stubs: Path, requirement: str, python: str, work: Path) -> list[str]:
    """Install the stubs, then ssl-vit from `out` alone, into a fresh venv of `python`: what pip installed."""
    venv = work / "check-venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    isolated = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": os.devnull}  # no index, no links but the folder
    run = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir"]
    subprocess.run([*run, "--no-deps", *map(str, stubs.glob("*.whl"))], check=True, env=isolated)
    report = work / "check.json"
    result = subprocess.run([*run, "--report", str(report), "--find-links", str(out), requirement],
                            capture_output=True, text=True, env=isolated)
    if result.returncode != 0:
        sys.exit(f"wheelhouse: check failed: the folder alone does not install {requirement}:\n"
                 f"{result.stderr[-3000:]}")
    installed = {normalize(item["metadata"]["name"]): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    touched = sorted(set(installed) & {normalize(path.name.split("-")[0]) for path in stubs.glob("*.whl")})
    if touched:
        sys.exit(f"wheelhouse: check failed: installing from the folder replaces what the target has: {touched}")
    return [f"{name}=={version}" for name, version in installed.items()]

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wheelhouse", help="the folder of wheels (made afresh)")
    parser.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the target's Python, e.g. 3.12")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64",
                        help="the target's platform tag (manylinux_2_N_ARCH stands for every older glibc too)")
    parser.add_argument("--have", default="", help="what the target has: 'NAME==VERSION NAME ...'")
    parser.add_argument("--have-file", help="what the target has, as `pip freeze` prints it there")
    parser.add_argument("--extras", default="", help="ssl-vit's extras to include, e.g. 'deepspeed,hf'")
    parser.add_argument("--with-torch", action="store_true", help="include the torch family the target lacks")
    parser.add_argument("--check", metavar="PYTHON", help="a Python of the target's version here: install from the "
                        "folder alone into a fresh venv of it, with the target's packages as stubs")
    args = parser.parse_args(argv)
    options = target_options(args)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stubs, built = work / "stubs", work / "built"
        stubs.mkdir()
        built.mkdir()
        have = {name: version or newest_version(name, options) for name, version in parse_have(args).items()}
        for name, version in have.items():
            write_stub(name, version, stubs)
        constraints = work / "constraints.txt"
        constraints.write_text("".join(f"{name}=={version}+{STUB}\n" for name, version in have.items()))
        project = build_project(built)
        extras = ",".join(filter(None, re.split(r"[,\s]+", args.extras)))
        requirement = f"{project}[{extras}]" if extras else str(project)
        files, left_out = [], []
        for item in resolve(requirement, options, [stubs, built], constraints, work):
            name, version = normalize(item["metadata"]["name"]), item["metadata"]["version"]
            if version.endswith(f"+{STUB}"):
                continue
            if TORCH_FAMILY.match(name) and not args.with_torch:
                left_out.append(f"{name}=={version}")
                continue
            url = item["download_info"]["url"]
            source = Path(urllib.request.url2pathname(url.removeprefix("file://")))
            if url.startswith("file://") and source.parent == built:
                files.append(Path(shutil.copy(source, out)))
            else:
                files.append(fetch(item, out))
        installed = check(out, stubs, f"ssl-vit[{extras}]" if extras else "ssl-vit", args.check, work) \
            if args.check else None
    return report(out, args, have, files, left_out, installed)


def report(out: Path, args, have: dict, files: list[Path], left_out: list[str], installed) -> int:
    sizes = {path.name: path.stat().st_size for path in sorted(files)}
    total = sum(sizes.values())
    manifest = {"python_version": args.python_version, "platform": args.platform, "extras": args.extras,
                "have": have, "left_out": left_out, "files": sizes, "total_bytes": total,
                "checked_install": installed}
    (out / "wheelhouse.json").write_text(json.dumps(manifest, indent=2) + "\n")
    width = max(map(len, sizes), default=10)
    for name, size in sizes.items():
        print(f"{name:<{width}}  {size / 2**20:7.2f} MiB")
    print(f"{'total: ' + str(len(sizes)) + ' wheels':<{width}}  {total / 2**20:7.2f} MiB  -> {out}")
    if left_out:
        print(f"left out (the torch family; --with-torch includes it): {' '.join(left_out)}")
    if installed is not None:
        print(f"checked: pip install --no-index --find-links {out} installs {len(installed)} packages from it alone "
              "and none the target has")
    return 0


if __name__ == "__main__":
    sys.exit(main())
