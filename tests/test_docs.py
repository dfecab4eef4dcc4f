"""The documentation: its examples run, its pages are all in mkdocs.yml's nav, and the README
keeps the two commands.

Runnable examples (docs/*.md). A ```python block whose fence follows the line
``<!-- test: run -->`` is run as a script in a fresh interpreter, in an empty temporary folder;
``<!-- test: run nproc=N -->`` runs it as N ranks with the environment torchrun gives them
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the block is
exactly what ``torchrun --nproc-per-node N example.py`` would run. Every process must exit 0
within TIMEOUT seconds. A ```text block whose fence follows ``<!-- test: output -->``, next after
a runnable block, lists lines that must appear, in that order, in what the run printed (rank 0's
output when there are several ranks). Other blocks are illustrations and are not run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyzero.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TIMEOUT = 45.0
MARKER = re.compile(r"<!-- test: (run|output)((?: \w+=\S+)*) -->")


def blocks(path: Path):
    """(line, info string, code, marker or None, marker options) for every fenced block of a page."""
    lines = path.read_text().splitlines()
    found, marker, options, i = [], None, {}, 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.fullmatch(line.strip())
        if m:
            assert marker is None, f"{path.name}:{i + 1}: two markers in a row"
            marker, options = m.group(1), dict(kv.split("=", 1) for kv in m.group(2).split())
        elif line.startswith("```"):
            start, info = i + 1, line[3:].strip()
            i += 1
            code = []
            while not lines[i].startswith("```"):
                code.append(lines[i])
                i += 1
            found.append((start, info, "\n".join(code) + "\n", marker, options))
            marker, options = None, {}
        elif line.strip() and marker is not None:
            raise AssertionError(f"{path.name}:{i + 1}: a test marker must be followed by a fenced block")
        i += 1
    return found


def examples():
    """(id, code, nproc, expected output lines or None) for every runnable block of docs/."""
    out = []
    for page in sorted(DOCS.glob("*.md")):
        bs = blocks(page)
        for k, (line, info, code, marker, options) in enumerate(bs):
            if marker == "output":
                prev = bs[k - 1] if k else None
                assert prev is not None and prev[3] == "run", f"{page.name}:{line}: output block after no example"
            if marker != "run":
                continue
            assert info == "python", f"{page.name}:{line}: runnable blocks are python, got {info!r}"
            nxt = bs[k + 1] if k + 1 < len(bs) else None
            expected = nxt[2].splitlines() if nxt is not None and nxt[3] == "output" else None
            out.append(pytest.param(code, int(options.get("nproc", 0)), expected, id=f"{page.name}:{line}"))
    return out


def run_example(code: str, nproc: int, tmp_path: Path) -> list[str]:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    port = free_port()
    ranks = [dict(env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(nproc)] or [env]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for e in ranks]
    outputs, deadline = [], time.monotonic() + TIMEOUT  # one deadline for all the processes
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"example still running after {TIMEOUT} s:\n" + "\n".join(
            f"--- process {r} ---\n{o[-3000:]}" for r, o in enumerate(outs)))
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not bad, "example failed: " + "\n".join(
        f"--- process {r} (exit {code}) ---\n{outputs[r][-3000:]}" for r, code in bad)
    return outputs


RUNNABLE = examples()


@pytest.mark.parametrize("code,nproc,expected", RUNNABLE)
def test_example(code, nproc, expected, tmp_path):
    printed = run_example(code, nproc, tmp_path)[0].splitlines()
    if expected is None:
        return
    it = iter(printed)
    for want in expected:  # in order, each line somewhere after the one before
        assert any(line.strip() == want.strip() for line in it), \
            f"expected output line {want!r} not found (in order) in:\n" + "\n".join(printed)


def test_the_features_have_runnable_examples():
    pages = {p.id.split(":")[0] for p in RUNNABLE}
    for page in ("getting-started.md", "collectives.md", "data-parallel.md", "zero.md", "checkpoints.md",
                 "troubleshooting.md"):
        assert page in pages, f"{page} has no runnable example"


def test_every_page_is_in_the_nav():
    nav = re.findall(r"^\s*-\s[^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages, f"nav {sorted(nav)} != pages {pages}"


def slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading (what mkdocs links to)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_readme_keeps_the_two_commands_and_links_into_docs():
    readme = (ROOT / "README.md").read_text()
    for command in ("./scripts/demo.sh", "./scripts/test.sh"):
        assert re.search(rf"^{re.escape(command)}\s", readme, re.M), f"README lost the command {command}"
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links, "README links to no docs page"
    for target, anchor in links:
        page = ROOT / target
        assert page.is_file(), f"README links to a missing page {target}"
        if anchor:
            heads = {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}
            assert anchor in heads, f"README links to {target}#{anchor}, which has no such heading"


def test_mkdocs_build_is_strict_and_clean(tmp_path):
    """The site builds with --strict: no broken link or anchor, no page left out of the nav."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed in this environment (scripts/setup_env.sh installs it)")
    r = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
