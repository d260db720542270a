"""The documentation: the site builds with no broken link or missing page, the configuration reference is
the one the settings root renders, and the README stays a landing page."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

from hybridgate import config_docs

README_MAX_LINES = 250


def test_site_builds_strict(tmp_path):
    # --strict turns MkDocs' warnings (a link to a missing page or anchor, a page outside the nav) into a failure.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                           "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_configuration_reference_is_current():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert config_docs.render() == committed, \
        "docs/configuration.md is stale: python -m hybridgate.config_docs > docs/configuration.md"


def test_grpc_reference_is_current():
    from hybridgate.v1 import proto_docs

    committed = (ROOT / "docs" / "grpc-reference.md").read_text()
    assert proto_docs.render() == committed, \
        "docs/grpc-reference.md is stale: python -m hybridgate.v1.proto_docs > docs/grpc-reference.md"


def test_grpc_reference_names_every_method_field_and_value_protobuf_knows():
    # The compiled descriptor (protoc's reading of the same file) is the reference for what the API holds.
    from hybridgate.v1 import generation_pb2, proto_docs

    page = proto_docs.render()
    for method in generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods:
        assert f"| `{method.name}` | `{method.input_type.name}` → " in page, method.name
    for message in generation_pb2.DESCRIPTOR.message_types_by_name.values():
        section = page.split(f"## message `{message.name}`\n", 1)[1].split("\n## ", 1)[0]
        for f in message.fields:
            assert re.search(rf"^\| `{f.name}` \| [^|]*= {f.number} \|", section, re.M), (message.name, f.name)
    for enum in generation_pb2.DESCRIPTOR.enum_types_by_name.values():
        section = page.split(f"## enum `{enum.name}`\n", 1)[1].split("\n## ", 1)[0]
        for value in enum.values:
            assert f"| `{value.name}` | {value.number} |" in section, (enum.name, value.name)


def test_grpc_reference_refuses_a_construct_it_does_not_read():
    from hybridgate.v1 import proto_docs

    with pytest.raises(ValueError, match=r":3: not a construct .*map<string, string> labels = 1;"):
        proto_docs.parse("message A {\n  // a map\n  map<string, string> labels = 1;\n}\n")


def test_configuration_reference_names_every_setting():
    from hybridgate.config import select
    from hybridgate.settings import Settings

    page = config_docs.render()
    for spec in select(Settings):
        assert f"| `{spec.flag}` | `{spec.env}` | `{spec.name}` |" in page


def test_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    first_sh = re.search(r"```sh\n(.*?)```", readme, re.S).group(1)
    assert "make serve" in first_sh and "make test" in first_sh
    assert "Python ≥ 3.11" in readme and "C compiler" in readme  # what `make test` needs


# What a first `make install` costs, said in the same words wherever a newcomer meets it (measured on a fresh
# 2-core machine), and the kernel compile of the first start in one range.
INSTALL_TIME = "about three minutes the first time on a 2-core machine"
KERNEL_COMPILE = "10–30 s"
INSTALL_TIME_PLACES = ("README.md", "docs/getting-started.md", "docs/troubleshooting.md", "Makefile")


@pytest.mark.parametrize("place", INSTALL_TIME_PLACES)
def test_install_time_is_one_statement(place):
    text = " ".join((ROOT / place).read_text().replace("#", " ").split())  # across line breaks and comment marks
    assert INSTALL_TIME in text, place
    other = re.findall(r"(?:one to two|a few|two and a half|half a) minutes?|\b\d+(?:\.\d+)? ?min\b|10-30 s", text)
    assert not other, (place, other)
    if place != "Makefile":
        assert KERNEL_COMPILE in text, place


def test_readme_links_point_at_pages_and_headings_that_exist():
    # The README sits outside the site, so the strict build does not check its links: the anchors are the
    # headings' ids as the site's toc extension (Python-Markdown's slugify) makes them.
    from markdown.extensions.toc import slugify

    readme = (ROOT / "README.md").read_text()
    for target, anchor in re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", readme):
        assert (ROOT / target).exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, (target, anchor)
