"""The repository's front door: the README a newcomer reads, the test command CI runs, what a
fork needs (licence, citation, `pip install -e .`)."""
import re
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TEST_COMMAND = "python tests/setup_extras.py && python -m pytest -q"


def test_the_readme_is_a_five_minute_read():
    words = len(README.split())          # as `wc -w README.md` counts
    assert words <= 1500, f"README.md has {words} words; move detail to docs/"


def test_the_first_screen_holds_the_set_up_the_run_the_tests_and_the_table():
    top = "\n".join(README.splitlines()[:40])
    for needed in ("-m venv .venv", "activate", "pip install -r requirements.txt",
                   "download.pytorch.org/whl/cpu", "python train.py", TEST_COMMAND, "2608.12253"):
        assert needed in top, needed
    assert re.search(r"^\| Base \|.*0\.314", top, re.M), "the default run's table"


def test_ci_runs_exactly_the_readmes_test_command_last():
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == TEST_COMMAND
    assert "pip install -q -r requirements.txt" in " ".join(commands)


def test_setup_extras_pins_are_the_ones_the_error_messages_name():
    sys.path.insert(0, str(REPO / "tests"))
    import setup_extras
    hints = (REPO / "minscope" / "checkpoints.py").read_text() + (REPO / "minscope" / "envs" / "tau2.py").read_text()
    for pin in setup_extras.NO_DEPS:
        assert f"pip install --no-deps {pin}" in hints, pin
    for pin in setup_extras.WITH_DEPS:
        assert f"pip install {pin}" in hints, pin


def test_the_installed_extras_are_the_pinned_ones():
    sys.path.insert(0, str(REPO / "tests"))
    import setup_extras
    from importlib.metadata import PackageNotFoundError, version
    for pin in setup_extras.NO_DEPS + setup_extras.WITH_DEPS:
        name, wanted = pin.split("==")
        try:
            assert version(name) == wanted, pin
        except PackageNotFoundError:          # the extras are not installed here: nothing to compare
            pass


def test_the_package_ships_every_data_file_minscope_reads():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["name"] == "minscope"
    setuptools = project["tool"]["setuptools"]
    packages = setuptools["packages"]
    package_dirs = {p: REPO / p.replace(".", "/") for p in packages}
    found = {str(p.relative_to(REPO / "minscope").parent) for p in (REPO / "minscope").rglob("__init__.py")}
    assert {f"minscope.{d}" if d != "." else "minscope" for d in found} <= set(packages)
    data = [f for f in (REPO / "minscope").rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc")
            and "__pycache__" not in f.parts]
    assert data, "minscope has data files (the shipped toy models)"
    for f in data:
        owner = max((p for p, d in package_dirs.items() if d in f.parents), key=len)
        rel = f.relative_to(package_dirs[owner]).as_posix()
        globs = setuptools["package-data"].get(owner, [])
        assert any(fnmatch(rel, g.replace("**/", "*")) for g in globs), f"{f} is not package data"


def test_a_fork_has_a_licence_and_a_citation():
    assert "MIT License" in (REPO / "LICENSE").read_text()
    citation = (REPO / "CITATION.cff").read_text()
    assert "2608.12253" in citation and "preferred-citation:" in citation
    assert "[LICENSE](LICENSE)" in README


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_lead_somewhere():
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        assert (REPO / path).exists(), target
        if anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, target


def test_train_py_runs_from_the_repo_root_without_an_install():
    run = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "usage" in run.stdout.lower(), run.stderr[-1000:]
