"""infra/ works as written, checked without Docker or Kubernetes: every path the RayJob,
RayCluster and compose files reference is in the image (COPY) or mounted, the images they
name are the ones the Dockerfile builds, and the GPU build (a CUDA base without Python)
installs Python."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
INFRA = REPO / "infra"
ABS_PATH = re.compile(r"(?<![\w:/.$-])(/[A-Za-z0-9_.\-/]+)")


class Image:
    """What the Dockerfile puts where: WORKDIR, COPY sources -> destinations, RUN lines, ENV."""

    def __init__(self, path: Path):
        text = re.sub(r"\\\n", " ", path.read_text())
        self.ignore = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
        self.copies: list[tuple[str, str, int]] = []  # (repo src, image dst, instruction index)
        self.runs: list[tuple[str, int]] = []
        self.env: dict[str, str] = {}
        self.args: dict[str, str] = {}
        workdir = "/"
        for i, line in enumerate(l.strip() for l in text.splitlines()):
            if not line or line.startswith("#"):
                continue
            op, _, rest = line.partition(" ")
            op = op.upper()
            if op == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                self.args[k.strip()] = v.strip()
            elif op == "WORKDIR":
                workdir = rest.strip()
            elif op == "ENV":
                for tok in shlex.split(rest):
                    if "=" in tok:
                        k, v = tok.split("=", 1)
                        self.env[k] = v
            elif op == "COPY":
                *srcs, dst = shlex.split(rest)
                into_dir = dst.endswith("/") or dst in (".", "./") or len(srcs) > 1
                dst = dst if dst.startswith("/") else f"{workdir.rstrip('/')}/{dst}"
                dst = re.sub(r"/\.?/?$", "", dst.replace("/./", "/")) or "/"
                for src in srcs:
                    src = src.rstrip("/") or "."
                    # A file copied into a directory lands under its own name there.
                    target = f"{dst}/{Path(src).name}" if into_dir and (REPO / src).is_file() else dst
                    self.copies.append((src, target, i))
            elif op == "RUN":
                self.runs.append((rest, i))

    def ignored(self, rel: str) -> bool:
        parts = rel.split("/")
        return any(
            fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat.lstrip("*/")) or pat.lstrip("*/") in parts
            for pat in self.ignore
        )

    def source_of(self, image_path: str, before: int | None = None) -> Path | None:
        """The repo file or directory that provides ``image_path`` (None if nothing does)."""
        image_path = image_path.rstrip("/")
        for src, dst, i in reversed(self.copies):
            if before is not None and i >= before:
                continue
            base = REPO / src if src != "." else REPO
            if image_path == dst:
                cand = base
            elif image_path.startswith(dst.rstrip("/") + "/") and base.is_dir():
                cand = base / image_path[len(dst.rstrip("/")) + 1 :]
            else:
                continue
            if cand is not None and cand.exists() and not self.ignored(str(cand.relative_to(REPO))):
                return cand
        return None


@pytest.fixture(scope="module")
def image() -> Image:
    return Image(DOCKERFILE)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_specs(doc: dict):
    """(pod spec, container) pairs of a RayCluster / RayJob."""
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    for g in groups:
        pod = g["template"]["spec"]
        for c in pod["containers"]:
            yield g is spec["headGroupSpec"], pod, c


def _module_file(module: str) -> str:
    return "/app/" + module.replace(".", "/") + ".py"


def _check_command(words: list[str], image: Image, mounts: list[str], where: str) -> list[str]:
    problems = []
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words):
            mod = words[i + 1]
            if image.source_of(_module_file(mod)) is None:
                problems.append(f"{where}: module {mod} ({_module_file(mod)}) is not copied into the image")
        for p in ABS_PATH.findall(w):
            if not any(p == m or p.startswith(m.rstrip("/") + "/") for m in mounts) and image.source_of(p) is None:
                problems.append(f"{where}: {p} is neither copied into the image nor mounted")
    return problems


def test_dockerfile_copies_exist_and_setup_runs_after_its_inputs(image):
    assert image.copies, "no COPY instructions parsed"
    for src, dst, _ in image.copies:
        assert (REPO / src).exists(), f"COPY source {src} missing from the repo"
        assert not image.ignored(src) or src == ".", f"COPY source {src} is excluded by .dockerignore"
    # Everything setup.sh reads (pyproject, the packages for the editable install) is in the
    # image before the RUN that calls it.
    (setup_run,) = [(cmd, i) for cmd, i in image.runs if "scripts/setup.sh" in cmd]
    for needed in ("/app/scripts/setup.sh", "/app/pyproject.toml", "/app/README.md", "/app/atlas/__init__.py",
                   "/app/model/__init__.py", "/app/pipelines/__init__.py"):
        assert image.source_of(needed, before=setup_run[1]) is not None, f"{needed} not copied before setup.sh runs"
    # The venv setup.sh creates is the one on PATH (ray / atlas / python in commands).
    assert image.env["ATLAS_VENV"] + "/bin" in image.env["PATH"].split(":")
    assert 'VENV="${ATLAS_VENV:-' in (REPO / "scripts" / "setup.sh").read_text()


def test_gpu_build_installs_python(image):
    header = DOCKERFILE.read_text()
    gpu_base = re.search(r"BASE=(nvidia/cuda:[\w.\-]+)", header)
    assert gpu_base, "the Dockerfile documents no GPU base image"
    # nvidia/cuda images ship no Python: a RUN must install it (with venv support, which
    # setup.sh uses) when python3 is missing, before setup.sh runs.
    setup_idx = next(i for cmd, i in image.runs if "scripts/setup.sh" in cmd)
    installs = [cmd for cmd, i in image.runs if i < setup_idx and re.search(r"apt-get install[^;&|]*\bpython3-venv\b", cmd)]
    assert installs, "no RUN installs python3 + python3-venv before setup.sh"
    cmd = installs[0]
    assert re.search(r"apt-get install[^;&|]*\bpython3\b", cmd) and "python3-dev" in cmd
    assert "command -v python3" in cmd  # only where the base has none (python:* keeps its own)
    # Ubuntu 24.04 (the CUDA 12.8 base) has Python 3.12: the project must accept it.
    requires = re.search(r'requires-python\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert "3.12" in SpecifierSet(requires) and "ubuntu24.04" in gpu_base.group(1)
    assert re.search(r'^gpu\s*=\s*\[', (REPO / "pyproject.toml").read_text(), re.M), "no gpu extra"
    assert 'EXTRA="${ATLAS_EXTRA:-cpu}"' in (REPO / "scripts" / "setup.sh").read_text()


@pytest.mark.parametrize("manifest", sorted((INFRA / "kuberay").glob("*.yaml")), ids=lambda p: p.name)
def test_kuberay_paths_are_in_the_image_or_mounted(manifest, image):
    docs = _docs(manifest)
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    readme = (INFRA / "README.md").read_text()
    problems = []
    ray_docs = [d for d in docs if d["kind"] in ("RayCluster", "RayJob")]
    assert ray_docs
    for doc in ray_docs:
        head_mounts: list[str] = []
        for is_head, pod, c in _pod_specs(doc):
            where = f"{manifest.name}:{c['name']}"
            assert f"-t {c['image']}" in readme, f"{where}: image {c['image']} is not built as documented in infra/README.md"
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            mounts = []
            for m in c.get("volumeMounts", []):
                vol = volumes.get(m["name"])
                assert vol, f"{where}: mount {m['name']} has no volume"
                if "configMap" in vol:
                    assert vol["configMap"]["name"] in config_maps, f"{where}: ConfigMap {vol['configMap']['name']} not defined"
                mounts.append(m["mountPath"])
            if is_head:
                head_mounts = mounts
                mount_files = {
                    f"{m['mountPath'].rstrip('/')}/{key}"
                    for m in c.get("volumeMounts", [])
                    if "configMap" in volumes[m["name"]]
                    for key in config_maps[volumes[m["name"]]["configMap"]["name"]]
                }
            for field in ("command", "args"):
                problems += _check_command(list(c.get(field, [])), image, mounts, where)
        if doc["kind"] == "RayJob":
            # The job's driver runs on the head: its files must be in the image or mounted there.
            words = shlex.split(doc["spec"]["entrypoint"])
            problems += _check_command(words, image, head_mounts, f"{manifest.name}:entrypoint")
            for p in ABS_PATH.findall(doc["spec"]["entrypoint"]):
                if any(p.startswith(m) for m in head_mounts):
                    assert p in mount_files, f"{manifest.name}: {p} is not a key of the mounted ConfigMap"
                    yaml.safe_load(config_maps[next(iter(config_maps))][p.rsplit("/", 1)[-1]])  # valid YAML
    assert not problems, "\n".join(problems)


def test_compose_paths_and_ports(image):
    compose_path = INFRA / "local" / "docker-compose.yaml"
    compose = yaml.safe_load(compose_path.read_text())
    declared_volumes = set(compose.get("volumes") or {})
    problems = []
    for name, svc in compose["services"].items():
        if "build" in svc:
            ctx = (compose_path.parent / svc["build"]["context"]).resolve()
            assert ctx == REPO, f"{name}: build context {ctx} is not the repository"
            assert (ctx / svc["build"].get("dockerfile", "Dockerfile")).is_file()
            words = shlex.split(svc["command"]) if isinstance(svc.get("command"), str) else svc.get("command", [])
            assert words[0] in ("ray", "atlas", "python"), f"{name}: {words[0]} is not on the image's PATH"
            problems += _check_command(words, image, [], f"compose:{name}")
        for v in svc.get("volumes", []):
            src = v.split(":", 1)[0]
            if src.startswith((".", "/")):
                assert (compose_path.parent / src).exists(), f"{name}: bind mount source {src} missing"
            else:
                assert src in declared_volumes, f"{name}: volume {src} not declared"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: port {port} is published beyond 127.0.0.1"
    assert not problems, "\n".join(problems)


def test_checker_catches_a_missing_file(image):
    """The checks above can fail: an unmounted config path and an uncopied module are reported."""
    bad = _check_command(shlex.split("python -m pipelines.nope --config /app/run.yaml"), image, [], "x")
    assert any("pipelines.nope" in p for p in bad) and any("/app/run.yaml" in p for p in bad)
    assert _check_command(shlex.split("python -m pipelines.run_atlas --config /etc/atlas/run.yaml"), image, ["/etc/atlas"], "x") == []
