"""The documentation: the site builds with no broken link or missing page, the configuration reference is
the one the settings root renders, and the README stays a landing page."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


def test_readme_links_point_at_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).exists(), target
