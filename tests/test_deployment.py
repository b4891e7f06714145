"""The Kubernetes manifests in the docs run the image the Dockerfile builds, with args the router
takes: one entrypoint (`trio-pd`), one image name, and every manifest's args parsed by the real
`trio-pd` parser into a RouterConfig (a flag renamed or refused fails here, not in a cluster).

No Docker engine runs where the suite runs, so the image itself is not built here (`make image`
builds it); what is checked is everything a manifest and the Dockerfile must agree on.
"""

import json
import re
from pathlib import Path

import pytest

from trio_pd.cli.main import build_parser, router_config

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_DOCS = ("docs/operations.md", "docs/scaling-out.md")
IMAGE = "your-registry/trio-pd:latest"
# What the manifests take from their Secrets, as the pod's shell would expand it.
ENVIRONMENT = {"CONTROL_PLANE_KEYS": "k1:ops:admin:an-admin-key"}


def entrypoint() -> list[str]:
    match = re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, "the Dockerfile has no exec-form ENTRYPOINT"
    return json.loads(match.group(1))


def flow_list(text: str) -> list[str]:
    """A YAML flow sequence of plain and double-quoted scalars (all the manifests use)."""
    items = [item.strip() for item in text.replace("\n", " ").split(",")]
    return [item[1:-1] if item.startswith('"') else item for item in items if item]


def deployments() -> list[tuple[str, str, list[str]]]:
    """(doc, image, args) of each Deployment in the docs' YAML blocks."""
    found = []
    for doc in MANIFEST_DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", (ROOT / doc).read_text(), re.S):
            if "kind: Deployment" not in block:
                continue
            image = re.search(r"image: (\S+)", block)
            args = re.search(r"args: \[(.*?)\]", block, re.S)
            assert image and args, f"a Deployment in {doc} without image or args"
            found.append((doc, image.group(1), flow_list(args.group(1))))
    return found


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: ENVIRONMENT[m.group(1)], arg)


def test_the_image_runs_trio_pd() -> None:
    assert entrypoint() == ["trio-pd"]
    assert "ENTRYPOINT" in (ROOT / "Dockerfile").read_text()
    assert "docker build -t trio-pd:latest ." in (ROOT / "Makefile").read_text()


def test_every_doc_has_a_deployment() -> None:
    assert {doc for doc, _, _ in deployments()} == set(MANIFEST_DOCS)


@pytest.mark.parametrize(("doc", "image", "args"), deployments(), ids=lambda v: str(v)[:30])
def test_manifest_args_are_a_command_the_router_takes(
    doc: str, image: str, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert image == IMAGE, f"{doc}: the image `make image` builds, tagged for a registry"
    assert args[0] in ("serve", "launch"), f"{doc}: args follow the ENTRYPOINT (trio-pd)"
    # What the pod's environment holds: the in-cluster API server, the Secret's worker key.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("TRIO_PD_API_KEY", "a-worker-key")
    parsed = build_parser().parse_args([expand(a) for a in args])
    config = router_config(parsed)
    assert config.port == 30000
