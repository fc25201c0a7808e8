"""The wheels the GPU machine's image lacks, and a check that a folder holds all they need.

    python scripts/gpu_wheels.py pins                        # NAME==VERSION, one a line
    python scripts/gpu_wheels.py check [--wheels .whl]       # against the image's package list
    python scripts/gpu_wheels.py check --installed           # against what this Python has

The GPU machine this project borrows (docs/gpu.md) reaches no package registry: what its image
lacks travels as wheels in the git-ignored ``.whl/`` folder (scripts/fetch-gpu-wheels.sh fills
it from ``PINS``) and scripts/gpu-check.sh installs them with ``pip --no-deps``. So nothing
resolves their requirements there: ``check`` does, here, before anything is carried. It walks
the requirements of rlblocks (pyproject.toml's dependencies and its ``bench`` extra, which
holds TRL) and of every wheel it reaches, with markers evaluated for the machine's CPython 3.12
on x86-64 Linux, and names each requirement that is neither a wheel in the folder nor in the
image (``IMAGE``: the package list of /work/.library/device/KINDS.md as read on 2026-11-17;
``IMAGE_VERSIONS``: the versions a session's ``pip list`` showed there). It also refuses two
versions of one package (pip would stop), a wheel that cannot install on that machine, a wheel
whose version a requirement excludes, and a folder that would take the working tree past the
64 MiB that travel to the GPU machine with the working tree. ``--installed`` checks against this interpreter's own distributions
instead: on the GPU machine, after the install, that is the real check.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20
"""What travels to the GPU machine in one go: the working tree and the wheels together."""

PINS = (
    "trl==1.16.0",  # rlblocks[bench]: benchmarks/grpo_step.py's trl system
    "datasets==5.2.0",  # rlblocks' dependency, and TRL's
    "dill==0.4.1",  # datasets'
    "multiprocess==0.70.19",  # datasets'
    "gguf==0.19.0",  # rlblocks' (transformers reads the built-in SmolLM2's GGUF with it)
    "jsonargparse==4.53.0",  # rlblocks' (YAML run configs)
)

# fmt: off
IMAGE = frozenset(
    canonicalize_name(name)
    for name in (
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal",
    "annotated-doc", "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer",
    "chex", "click", "cloudpickle", "cmake", "colorama", "contourpy", "coverage",
    "cuda-bindings", "cuda-core", "cuda-pathfinder", "cuda-toolkit", "cupy-cuda13x", "cycler",
    "cython", "diffrax", "e3nn", "einops", "equinox", "etils", "execnet", "filelock",
    "flatbuffers", "flax", "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch",
    "grpcio", "h11", "h5py", "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize",
    "hypothesis", "idna", "imageio", "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt",
    "jax-cuda13-plugin", "jaxlib", "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader",
    "lightning", "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml",
    "markdown", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes",
    "mpi4py", "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions",
    "nanobind", "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro",
    "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
    "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver",
    "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13",
    "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime",
    "onnxscript", "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx",
    "optimistix", "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft",
    "pillow", "pip", "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf",
    "psutil", "pyarrow", "pybind11", "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks",
    "pyre-extensions", "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock",
    "pytest-timeout", "pytest-xdist", "python-dateutil", "pytorch-lightning", "pyyaml", "regex",
    "requests", "rich", "sacrebleu", "safetensors", "scikit-build-core", "scikit-image",
    "scikit-learn", "scipy", "seaborn", "sentencepiece", "sentence-transformers", "setuptools",
    "shellingham", "simplejson", "six", "sortedcontainers", "statsmodels", "sympy", "tabulate",
    "tensorboard", "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile",
    "tiktoken", "timm", "tokenizers", "toolz", "torch", "torchaudio", "torchdiffeq",
    "torch-geometric", "torchmetrics", "torchvision", "tqdm", "transformers", "treescope",
    "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop",
    "wadler-lindig", "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
    )
)
# fmt: on

IMAGE_VERSIONS = {
    canonicalize_name(name): Version(version)
    for name, version in {
        "accelerate": "1.15.0",
        "huggingface_hub": "1.33.0",
        "numpy": "2.5.2",
        "safetensors": "0.8.0",
        "sentencepiece": "0.2.2",
        "tokenizers": "0.23.2",
        "torch": "2.11.0",
        "transformers": "5.17.0",
        "triton": "3.6.0",
    }.items()
}

# The GPU machine's interpreter, for requirement markers: CPython 3.12.3 on x86-64 Linux.
TARGET = {
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: Version
    requires: tuple[Requirement, ...]


def read_wheel(path: Path) -> Wheel:
    """Name, version and ``Requires-Dist`` of a wheel, from its ``*.dist-info/METADATA``."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        fields = email.parser.Parser().parsestr(archive.read(metadata).decode())
    requires = tuple(Requirement(line) for line in fields.get_all("Requires-Dist") or [])
    return Wheel(path, canonicalize_name(fields["Name"]), Version(fields["Version"]), requires)


def installable(path: Path) -> bool:
    """Whether pip installs this wheel on the machine: pure Python, or CPython 3.12 /
    abi3 built for manylinux x86-64."""
    _, _, _, tags = parse_wheel_filename(path.name)
    return any(
        tag.interpreter in ("py3", "py312", "cp312", "cp3")
        and tag.abi in ("none", "abi3", "cp312")
        and (
            tag.platform == "any"
            or tag.platform.startswith("manylinux")
            and tag.platform.endswith("x86_64")
        )
        for tag in tags
    )


def roots() -> list[tuple[Requirement, str]]:
    """rlblocks' dependencies, its ``bench`` extra and ``PINS``, each with who asks for it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [(Requirement(r), "rlblocks") for r in project["dependencies"]]
    found += [
        (Requirement(r), "rlblocks[bench]") for r in project["optional-dependencies"]["bench"]
    ]
    return found + [(Requirement(pin), "scripts/gpu_wheels.py PINS") for pin in PINS]


def present(installed: bool) -> dict[str, Version | None]:
    """What the machine already has: name -> version (None where unknown)."""
    if installed:
        return {
            canonicalize_name(d.metadata["Name"]): Version(d.version)
            for d in importlib.metadata.distributions()
        }
    return {name: IMAGE_VERSIONS.get(name) for name in IMAGE}


def problems(folder: Path, *, installed: bool = False) -> tuple[list[Wheel], list[str]]:
    """The wheels in ``folder`` and what is wrong (empty when they are complete)."""
    wheels = [read_wheel(p) for p in sorted(folder.glob("*.whl"))]
    found: list[str] = []
    by_name: dict[str, Wheel] = {}
    for wheel in wheels:
        if wheel.name in by_name:
            found.append(f"two versions of {wheel.name}: {by_name[wheel.name].path.name} and "
                         f"{wheel.path.name}; delete one")  # fmt: skip
        by_name[wheel.name] = wheel
        if not installable(wheel.path):
            found.append(
                f"{wheel.path.name} does not install on CPython 3.12 x86-64 Linux; "
                "download it with scripts/fetch-gpu-wheels.sh's platform flags"
            )
    have = present(installed)
    queue, seen = roots(), set()
    while queue:
        requirement, asker = queue.pop(0)
        if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
            continue
        name = canonicalize_name(requirement.name)
        wheel = by_name.get(name)
        version = wheel.version if wheel else have.get(name)
        where = f"{wheel.path.name}" if wheel else "the machine"
        if wheel is None and name not in have:
            if name not in seen:  # named once, with the first that asks for it
                found.append(f"missing {name} (required by {asker}: {requirement})")
        elif version is not None and not requirement.specifier.contains(version, prereleases=True):
            found.append(
                f"{name} {version} on {where} does not meet {asker}'s {requirement}; "
                "pin a version that does in PINS"
            )
        if wheel is not None and name not in seen:
            queue += [(r, f"{wheel.name} {wheel.version}") for r in wheel.requires]
        seen.add(name)
    return wheels, found


def tree_bytes() -> int:
    """Bytes of the files that travel besides ``carry``: tracked files and
    untracked ones git does not ignore (0 outside a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return 0
    paths = (ROOT / p for p in listed.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def check(folder: Path, installed: bool) -> int:
    wheels, found = problems(folder, installed=installed)
    carried = sum(w.path.stat().st_size for w in wheels)
    tree = tree_bytes()
    listing = ", ".join(f"{w.name} {w.version}" for w in wheels) or "none"
    print(f"gpu_wheels: {len(wheels)} wheels in {folder} ({carried / 2**20:.1f} MiB): {listing}")
    print(f"gpu_wheels: with the working tree ({tree / 2**20:.1f} MiB) "
          f"{(carried + tree) / 2**20:.1f} MiB of the {LIMIT / 2**20:.0f} MiB that travel")  # fmt: skip
    if carried + tree > LIMIT:
        found.append(f"the wheels and the working tree take {(carried + tree) / 2**20:.1f} MiB, "
                     f"over the {LIMIT / 2**20:.1f} MiB that travel to the GPU machine; carry fewer wheels")  # fmt: skip
    for line in found:
        print(f"gpu_wheels: {line}")
    if found:
        fix = "install what is missing" if installed else "run scripts/fetch-gpu-wheels.sh"
        print(f"gpu_wheels: {len(found)} problem(s) with the wheels in {folder}; {fix}")
        return 1
    against = "this Python's packages" if installed else "the image's package list"
    print(f"gpu_wheels: complete against {against}")
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pins", help="print PINS, one a line")
    checking = commands.add_parser("check", help="are the wheels complete?")
    checking.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    checking.add_argument("--installed", action="store_true",
                          help="check against this Python's packages, not the image's list")  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "pins":
        print("\n".join(PINS))
        return 0
    return check(args.wheels, args.installed)


if __name__ == "__main__":
    sys.exit(main())
