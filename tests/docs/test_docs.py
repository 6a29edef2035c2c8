"""Every code example of the docs (docs/**/*.md, and the README) runs here, so that a renamed
argument or a changed message cannot leave the manual wrong.

A fenced block is read with the HTML comment on the line right before it, its
marker:

- a ```python block without a marker runs in a world of one; ``<!-- run: world=N -->``
  runs it on N gloo ranks; ``<!-- file: NAME -->`` writes it as NAME into the page's
  working directory, where the page's other blocks import or run it, and
  ``<!-- file: NAME, run: world=N -->`` also runs it (a script whose command
  needs more ranks than the docs' tests start, run on fewer);
- a shell block (sh, bash, shell, console, or text with a ``$ tandem`` line) that
  holds a ``tandem`` command is ``<!-- run -->``: each ``$ `` line is run (``tandem
  plan``/``tandem check`` in-process, in the world of one) and the lines after it
  are its expected output; otherwise it must say why not, ``<!-- not run: REASON -->``
  (multi-node, GPU, Slurm, a long job run by another test);
- ``<!-- output -->`` before a text block: the block above it prints exactly this
  (rank 0's output); ``<!-- output: end -->``: its output ends with this.

The blocks of one world size run as cases of one spawned group
(:func:`tandem.testing.run_cases`), each page in a working directory of its own
shared by its ranks, so the whole manual costs one group start-up per world size.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.testing import Case, run_cases

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]  # the README's example runs too

FENCE = re.compile(r"^(\s*)```([\w-]*)\s*$")
MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")
SHELL_LANGS = {"sh", "bash", "shell", "console"}
TANDEM_COMMAND = re.compile(r"(^|[\s$;&|(])(tandem (run|plan|check)|python3? -m tandem\b)")
IN_PROCESS = ("tandem plan", "tandem check")


@dataclass
class Block:
    page: Path
    line: int          # of the opening fence, 1-based
    lang: str
    code: str
    marker: str        # the comment's text, "" without one
    expected: str | None = None
    expected_end: bool = False

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGS or (self.lang in ("text", "") and bool(
            re.search(r"^\$ tandem ", self.code, re.M)))


def parse(page: Path) -> list[Block]:
    """The page's fenced blocks, each with its marker; an output block is
    attached to the block before it, not returned."""
    lines = page.read_text().split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, lang = i, len(m.group(1)), m.group(2)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{start + 1}: a fence that is never closed")
        before = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        marker = before.group(1) if before else ""
        code = "\n".join(line[indent:] for line in lines[start + 1:j]) + "\n"
        block = Block(page, start + 1, lang, code, marker)
        if marker.startswith("output"):
            assert blocks, f"{block.name}: an output block with no block before it"
            blocks[-1].expected = block.code
            blocks[-1].expected_end = marker == "output: end"
        else:
            blocks.append(block)
        i = j + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page)]


def _workdir(root: Path, block: Block) -> Path:
    return root / str(block.page.relative_to(ROOT)).replace("/", "_").removesuffix(".md")


def _world(block: Block) -> int | None:
    """Ranks to run a python block on; None when it does not run in a group."""
    if block.marker.startswith("not run"):
        return None
    if block.marker.startswith("file:"):
        m = re.search(r", run: world=(\d+)$", block.marker)
        return int(m.group(1)) if m else None
    m = re.fullmatch(r"run: world=(\d+)", block.marker)
    if m:
        return int(m.group(1))
    assert block.marker in ("", "run"), f"{block.name}: unknown marker <!-- {block.marker} -->"
    return 1


# What runs inside the ranks (module level: the ranks import it by name).

def _exec_python(rank: int, world_size: int, code: str, name: str, workdir: str) -> str:
    os.chdir(workdir)  # the harness restores the working directory after the case
    sys.path.insert(0, workdir)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        sys.path.remove(workdir)
        for module in [m for m, v in sys.modules.items()
                       if str(getattr(v, "__file__", "") or "").startswith(workdir)]:
            del sys.modules[module]  # a later page's module of the same name is its own
    return out.getvalue()


def _exec_commands(rank: int, world_size: int, commands: list[str], workdir: str) -> list[tuple[int, str]]:
    from tandem.launch.cli import main

    os.chdir(workdir)
    sys.path.insert(0, workdir)
    results = []
    try:
        for command in commands:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(shlex.split(command)[1:])
            results.append((code, out.getvalue()))
    finally:
        sys.path.remove(workdir)
    return results


def _commands(block: Block) -> list[tuple[str, str]]:
    """A run shell block's ``$ `` commands (continuation lines joined), each with
    the output lines shown after it."""
    out: list[tuple[str, list[str]]] = []
    lines = block.code.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            out.append((command, []))
        else:
            assert out, f"{block.name}: output before the first $ command"
            out[-1][1].append(line)
        i += 1
    return [(c, "\n".join(o)) for c, o in out]


@pytest.fixture(scope="module")
def workroot():
    with tempfile.TemporaryDirectory(prefix="tandem-docs-") as d:
        root = Path(d)
        for b in BLOCKS:  # files first: any block of the page may use them
            _workdir(root, b).mkdir(exist_ok=True)
            if b.marker.startswith("file:"):
                name = b.marker.removeprefix("file:").split(",")[0].strip()
                (_workdir(root, b) / name).write_text(b.code)
        yield root


def _cases(root: Path, world: int) -> dict[str, Case]:
    cases = {}
    for b in BLOCKS:
        if b.lang == "python" and _world(b) == world:
            cases[b.name] = Case(_exec_python, args=(b.code, b.name, str(_workdir(root, b))), timeout=90)
        elif world == 1 and b.is_shell and b.marker == "run":
            commands = [c for c, _ in _commands(b)]
            assert all(c.startswith(IN_PROCESS) for c in commands), \
                f"{b.name}: only {' and '.join(IN_PROCESS)} run in-process; mark the others not run"
            cases[b.name] = Case(_exec_commands, args=(commands, str(_workdir(root, b))), timeout=120)
    return cases


@pytest.fixture(scope="module")
def results(workroot):
    """Each world size's blocks as the cases of one spawned group; the groups
    run side by side."""
    worlds = sorted({w for b in BLOCKS if b.lang == "python" for w in [_world(b)] if w is not None} | {1})
    groups = {w: cases for w in worlds for cases in [_cases(workroot, w)] if cases}
    with ThreadPoolExecutor(len(groups)) as pool:
        ran = dict(zip(groups, pool.map(lambda w: run_cases(groups[w], world_size=w), groups)))
    return {name: ran[w] for w, cases in groups.items() for name in cases}


def _compare(block: Block, printed: str) -> None:
    if block.expected is None:
        return
    want = [line.rstrip() for line in block.expected.rstrip("\n").split("\n")]
    got = [line.rstrip() for line in printed.rstrip("\n").split("\n")]
    if block.expected_end:
        got = got[-len(want):]
    assert got == want, f"{block.name}: the docs show\n" + "\n".join(want) + "\nbut it printed\n" + \
        printed


RUN = [b for b in BLOCKS if b.lang == "python" and _world(b) is not None]
SHELL_RUN = [b for b in BLOCKS if b.is_shell and b.marker == "run"]


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_python_block_runs(block, results):
    printed = results[block.name][block.name][0]  # rank 0's; raises the block's own failure
    _compare(block, printed)


@pytest.mark.parametrize("block", SHELL_RUN, ids=lambda b: b.name)
def test_shell_block_runs(block, results):
    ran = results[block.name][block.name][0]
    for (command, shown), (code, printed) in zip(_commands(block), ran):
        expected_code = 1 if re.search(r"^exit 1$", shown, re.M) else 0
        shown = re.sub(r"\nexit \d+$", "", shown)
        assert code == expected_code, f"{block.name}: `{command}` exited with {code}:\n{printed}"
        want = [line.rstrip() for line in shown.split("\n")] if shown else []
        got = [line.rstrip() for line in printed.rstrip("\n").split("\n")]
        assert got == want, f"{block.name}: `{command}` printed\n{printed}\nbut the docs show\n{shown}"


def test_every_tandem_command_is_run_or_says_why_not():
    unmarked = [b.name for b in BLOCKS if b.is_shell and TANDEM_COMMAND.search(b.code)
                and b.marker != "run" and not re.fullmatch(r"not run: \S.*", b.marker)]
    assert not unmarked, f"shell blocks with a tandem command, neither run nor marked: {unmarked}"


def test_markers_are_known():
    for b in BLOCKS:
        assert b.marker == "" or re.fullmatch(
            r"run|run: world=\d+|file: [\w.]+(, run: world=\d+)?|not run: \S.*", b.marker), \
            f"{b.name}: unknown marker <!-- {b.marker} -->"
        if b.lang == "python" and b.marker.startswith("not run"):
            assert len(b.marker) > len("not run: ") + 10, f"{b.name}: say why it does not run"


def test_run_options_page_names_every_option():
    from tandem.launch.cli import build_parser

    page = (DOCS / "reference" / "run-options.md").read_text()
    options = [s for a in build_parser().run._actions for s in a.option_strings
               if s.startswith("--") and "_" not in s]
    missing = [o for o in options if f"`{o}" not in page and f"/`{o}`" not in page and f"{o}`" not in page]
    assert not missing, f"tandem run options missing from reference/run-options.md: {missing}"


def test_every_public_package_has_an_api_page():
    pages = "".join(p.read_text() for p in (DOCS / "reference" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: ([\w.]+)", pages, re.M))
    public = {"tandem", "tandem.checkpoint", "tandem.comm", "tandem.comm_hooks", "tandem.data", "tandem.ddp",
              "tandem.dp", "tandem.fsdp", "tandem.launch", "tandem.nn", "tandem.testing", "tandem.train",
              "tandem.zero", "tandem.planner", "tandem.pipelining", "tandem.dtensor", "tandem.tools.plan",
              "tandem.tools.check"}
    assert public <= documented, f"no API page for {sorted(public - documented)}"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    ci_command = " ".join(ci[ci.index("python3 -m venv"):].replace("\\\n", " ").split())
    readme = [b for b in BLOCKS if b.page.name == "README.md" and "pytest" in b.code]
    assert [" ".join(b.code.split()) for b in readme] == [ci_command], "the README's test command is not .ci/run's"
