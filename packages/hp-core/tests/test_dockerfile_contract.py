"""Contract test of docker/Dockerfile: no container engine runs here, so the image is not built; the file is
parsed (dockerfile-parse) and checked for what the rest of hp relies on: a CUDA PyTorch base matching the
torch scripts/setup.sh pins, exactly the five distributions installed from sources the build context
(docker/Dockerfile.dockerignore) lets in, a non-root user matching the manifests' runAsUser, entrypoint `hp`,
and the image name and tag that `hp k8s manifest` references by default."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from hp.core.schedulers.k8s.manifest import DEFAULT_IMAGE, IMAGE_NAME, IMAGE_TAG, RUN_AS_UID

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DISTRIBUTIONS = {"hp-core", "hp-elastic", "hp-checkpointless", "hp-tiered-ckpt", "hp-chaos"}


@pytest.fixture(scope="module")
def parsed() -> DockerfileParser:
    parser = DockerfileParser(path=str(DOCKERFILE))
    assert parser.structure, "docker/Dockerfile parses to no instructions"
    return parser


def _instructions(parsed: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in parsed.structure if i["instruction"] == name]


def _setup_torch() -> str:
    match = re.search(r'HP_TORCH=\$\{HP_TORCH:-torch==([0-9.]+)\}', (REPO / "scripts" / "setup.sh").read_text())
    assert match, "scripts/setup.sh no longer pins torch as HP_TORCH=${HP_TORCH:-torch==X}"
    return match.group(1)


def test_one_stage_on_a_cuda_pytorch_runtime_base_with_setups_torch(parsed):
    assert len(_instructions(parsed, "FROM")) == 1
    base = parsed.baseimage
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn(\d+)-runtime", base)
    assert match, f"not a CUDA-enabled pytorch/pytorch runtime tag: {base}"
    torch, cuda, cudnn = match.groups()
    assert torch == _setup_torch()
    assert tuple(map(int, cuda.split("."))) >= (12, 0) and int(cudnn) >= 9
    assert parsed.labels["org.opencontainers.image.base.name"] == f"docker.io/{base}"


def _pip_install_targets(parsed: DockerfileParser) -> list[str]:
    targets = []
    for run in _instructions(parsed, "RUN"):
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:4] == ["python", "-m", "pip", "install"]:
                rest = words[4:]
                i = 0
                while i < len(rest):
                    if rest[i] in ("--constraint", "-c"):
                        i += 2
                        continue
                    assert not rest[i].startswith("-"), f"unexpected pip option {rest[i]}"
                    targets.append(rest[i].strip('"'))
                    i += 1
    return targets


def test_installs_exactly_the_five_distributions_from_copied_sources(parsed):
    targets = _pip_install_targets(parsed)
    copies = {}
    for value in _instructions(parsed, "COPY"):
        src, dst = value.split()
        copies[dst] = src
    installed = set()
    for target in targets:
        path = target.split("[")[0]
        assert path in copies, f"pip installs {path}, which no COPY puts there"
        meta = tomllib.loads((REPO / copies[path] / "pyproject.toml").read_text())
        installed.add(meta["project"]["name"])
        extras = re.findall(r"\[(.*)\]", target)
        for extra in (extras[0].split(",") if extras else []):
            assert extra in meta["project"]["optional-dependencies"], f"{target}: no extra {extra!r}"
    assert installed == DISTRIBUTIONS and len(targets) == 5
    assert "kubernetes" in targets[0]  # the backend works inside pods
    run = " ".join(_instructions(parsed, "RUN"))
    assert "--constraint /tmp/hp/constraints.txt" in run and "torch.__version__" in run  # keeps the CUDA torch


def test_non_root_user_matches_the_manifests_and_entrypoint_is_hp(parsed):
    assert _instructions(parsed, "USER")[-1] == f"{RUN_AS_UID}:{RUN_AS_UID}"
    assert f"--uid {RUN_AS_UID}" in " ".join(_instructions(parsed, "RUN"))
    assert json.loads(_instructions(parsed, "ENTRYPOINT")[-1]) == ["hp"]
    last_user = max(i for i, ins in enumerate(parsed.structure) if ins["instruction"] == "USER")
    assert all(ins["instruction"] != "RUN" for ins in parsed.structure[last_user:])  # nothing runs as root after


def test_the_image_the_manifests_reference_is_this_one(parsed):
    labels = parsed.labels
    assert (labels["org.opencontainers.image.title"], labels["org.opencontainers.image.version"]) == (IMAGE_NAME, IMAGE_TAG)
    assert DEFAULT_IMAGE == f"{IMAGE_NAME}:{IMAGE_TAG}"
    version = tomllib.loads((REPO / "packages" / "hp-core" / "pyproject.toml").read_text())["project"]["version"]
    assert IMAGE_TAG == version
    assert f"docker build -f docker/Dockerfile -t {DEFAULT_IMAGE} ." in DOCKERFILE.read_text()


def test_shm_and_nccl_efa_settings_are_documented():
    text = DOCKERFILE.read_text()
    for word in ("/dev/shm", "--shm-size", "emptyDir", "NCCL_SOCKET_IFNAME", "FI_PROVIDER=efa", "aws-ofi-nccl"):
        assert word in text, word


def _excluded(path: str, rules: list[str]) -> bool:
    """Docker's .dockerignore matching (last matching rule wins; ``!`` re-includes; a rule matching a
    directory matches what is under it), enough for the patterns used here."""
    excluded = False
    for rule in rules:
        negate, pattern = rule.startswith("!"), rule.lstrip("!")
        regex = "".join(".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
                        for tok in re.findall(r"\*\*|\*|\?|[^*?]+", pattern)) + r"\Z"
        parts = path.split("/")
        if any(re.match(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_the_build_context_holds_what_the_install_needs():
    rules = [line.strip() for line in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    for dist in DISTRIBUTIONS:
        root = REPO / "packages" / dist
        for needed in ("pyproject.toml", "README.md", *(str(p.relative_to(root)) for p in (root / "src").rglob("*.py"))):
            assert not _excluded(f"packages/{dist}/{needed}", rules), f"packages/{dist}/{needed} is left out"
        assert _excluded(f"packages/{dist}/tests/test_x.py", rules)
    for path in (".venv/bin/python", "results/demo.json", "packages/hp-core/src/hp/core/__pycache__/a.pyc"):
        assert _excluded(path, rules), path
    # the vendored CRDs are package data of hp-core: they must reach the image too
    assert not _excluded("packages/hp-core/src/hp/core/schedulers/k8s/crds/jobset.x-k8s.io_jobsets_v1alpha2.json", rules)
