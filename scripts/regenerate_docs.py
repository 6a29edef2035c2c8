"""Rerun the jobs whose numbers the README and docs/getting-started/digits.md
state, and write those numbers into the pages.

    python scripts/regenerate_docs.py            # run the jobs, rewrite the pages (the page says how long)
    python scripts/regenerate_docs.py --check    # run them, print what would change; exit 1 if anything would

What runs, one job at a time, each in a fresh directory as the pages' commands
run it (their times are from the command to its exit, and the pages state each
time only here):

- the digits job: its test accuracy, its images and its time;
- the GPT job's shortened form, the page's own command (the one
  tests/examples/test_example_gpt.py runs): its loss, baseline, first and last
  logged training loss and time; again with torch's kernels for CPUs without AVX
  (``ATEN_CPU_CAPABILITY=default``), with two threads per worker and with
  another seed: the spread that the test's tolerance must cover, and what a
  changed run moves it by;
- the GPT job as the page runs it: its steps, epoch losses, baseline, text and
  time; again with older CPUs' kernels (``ATEN_CPU_CAPABILITY=default
  MKL_CBWR=COMPATIBLE``): how far another CPU moves it;
- the model's size, counted, and the machine, read: its CPU, cores, torch and
  Python, and the commit.

Each number is found in the pages by the words around it (``RULES``); a rule
that matches nothing, or more than once, stops the script, so that a reworded
sentence is noticed rather than left stale.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "getting-started" / "digits.md"
TANDEM_RUN = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", "2"]
# The tolerance that the page states for the shortened form's loss, and the test holds it to.
TOLERANCE = re.compile(r"to the one stated\s+here within \*\*([\d.]+)\*\*")


# ---------------------------------------------------------------------- running the jobs

@dataclass
class Run:
    stdout: str        # rank 0's lines, the "[rank 0] " prefix dropped
    seconds: float     # from the command to its exit
    metrics: list[dict]

    def evals(self) -> list[float]:
        return [r["loss"] for r in self.metrics if r["kind"] == "eval"]

    def trains(self) -> list[float]:
        return [r["loss"] for r in self.metrics if r["kind"] == "train"]

    def printed(self, pattern: str) -> str:
        found = re.findall(pattern, self.stdout)
        if len(found) != 1:
            raise SystemExit(f"expected one match of {pattern!r} in the job's output:\n{self.stdout[-3000:]}")
        return found[0]


def run_job(argv: list[str], output_dir: str, env: dict[str, str] | None = None) -> Run:
    """``tandem run`` of ``argv`` in a fresh directory, timed; fails loudly."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"$ {shown} tandem run --nproc-per-node 2 {' '.join(argv)}".replace("$  ", "$ "), flush=True)
    with tempfile.TemporaryDirectory(prefix="tandem-regenerate-") as cwd:
        started = time.perf_counter()
        proc = subprocess.run(TANDEM_RUN + argv + ["--output-dir", output_dir], cwd=cwd, env=clean,
                              capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"the job exited with {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        lines = (Path(cwd) / output_dir / "metrics.jsonl").read_text().splitlines()
    print(f"  {seconds:.1f} s", flush=True)
    return Run(proc.stdout.replace("[rank 0] ", ""), seconds, [json.loads(line) for line in lines])


def page_command(page: str, prefix: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the job's flags of the page's one command line that starts with ``prefix``."""
    found = re.findall(rf"^((?:\w+=\S+ )*){re.escape(prefix)}(.*)$", page, re.M)
    if len(found) != 1:
        raise SystemExit(f"expected one command `... {prefix} ...` on {PAGE.name}, found {len(found)}")
    env, flags = found[0]
    return dict(v.split("=", 1) for v in env.split()), flags.split()


# ---------------------------------------------------------------------- what is measured

def cpu_name() -> str:
    """The CPU's model and the instruction sets that choose its kernels."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.+)$", info, re.M).group(1).split()) if "flags" in info else set()
    isa = ("AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    isa += ", AVX512-BF16" if "avx512_bf16" in flags else ""
    isa += ", AMX" if "amx_bf16" in flags else ""
    return f"{model.group(1).strip() if model else platform.processor() or 'unknown CPU'}: {isa}"


def count_parameters() -> int:
    """The default GPT's parameters, its vocabulary from the full text."""
    import torch

    from tandem.examples import gpt
    from tandem.examples.gpt_model import GPT, GPTConfig

    args = gpt.parse_args([])
    codec, _, _ = gpt.split_text(gpt.load_text(None))
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=codec.vocab_size, block_size=args.block_size, n_layer=args.layers,
                              n_head=args.heads, n_embd=args.embd))
    return sum(p.numel() for p in model.parameters())


def measure() -> dict[str, str]:
    """Every job run, and each stated number as the pages write it."""
    import torch

    started = time.perf_counter()
    page = PAGE.read_text()
    cores = os.cpu_count() or 1
    tolerance = float(TOLERANCE.findall(page)[0])
    m: dict[str, str] = {}

    digits = run_job(["-m", "tandem.examples.digits", "--no-progress"], "tandem-digits")
    m["digits.accuracy"], m["digits.images"] = digits.printed(r"test accuracy ([\d.]+)% on (\d+) images")
    m["digits.time"] = duration(digits.seconds)

    short_env, short = page_command(page, "tandem run --nproc-per-node 2 -m tandem.examples.gpt ")
    short = ["-m", "tandem.examples.gpt", *short]
    one = run_job(short, "short", short_env)
    without_avx = run_job(short, "short", {**short_env, "ATEN_CPU_CAPABILITY": "default"})
    two_threads = run_job(short, "short", {**short_env, "OMP_NUM_THREADS": "2"})
    seeded = run_job(short + ["--seed", "1"], "short", short_env)
    final = [r.evals()[-1] for r in (one, without_avx, two_threads)]
    spread = max(final) - min(final)
    if spread > tolerance / 5:
        raise SystemExit(f"the shortened form's loss moves by {spread:.6f} across kernel families and threads: "
                         f"more than a fifth of the test's tolerance, {tolerance}; rethink the tolerance")
    m["short.loss"] = f"{final[0]:.4f}"
    m["short.baseline"] = one.printed(r"unigram baseline ([\d.]+),")
    m["short.time"] = duration(one.seconds)
    m["short.exact"], m["short.without_avx"], m["short.two_threads"] = (f"{v:.6f}" for v in final)
    m["short.times_spread"] = f"{tolerance / spread:.0f}" if spread > 0 else "many"
    m["short.seed_loss"] = f"{seeded.evals()[-1]:.6f}"
    m["short.seed_share"] = fraction(tolerance / abs(seeded.evals()[-1] - final[0]))
    m["short.first_train"], m["short.last_train"] = f"{one.trains()[0]:.2f}", f"{one.trains()[-1]:.2f}"
    m["short.eval"] = f"{final[0]:.2f}"

    full = run_job(["-m", "tandem.examples.gpt", "--no-progress"], "tandem-gpt")
    older = run_job(["-m", "tandem.examples.gpt", "--no-progress"], "tandem-gpt",
                    {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"})
    m["full.epochs"], m["full.steps"] = full.printed(r"trained (\d+) epoch\(s\), (\d+) steps")
    m["full.global_batch"] = full.printed(r"global batch (\d+)")
    m["full.time"] = duration(full.seconds)
    for name, run in (("full", full), ("older", older)):
        first, second, *_, last = run.evals()
        m[f"{name}.loss"], m[f"{name}.epoch1"], m[f"{name}.epoch2"] = (f"{v:.4f}" for v in (last, first, second))
    m["older.apart"] = f"{abs(full.evals()[-1] - older.evals()[-1]):.4f}"
    m["full.baseline"] = f"{float(full.printed(r'unigram baseline ([0-9.]+),')):.3f}"
    m["full.threads"] = "one thread" if cores // 2 == 1 else f"{cores // 2} threads"
    train, val = (int(v) for v in full.printed(r"text: (\d+) training and (\d+) validation characters"))
    m["text.thousands"] = f"{round((train + val) / 1000)}"
    m["params.millions"] = f"{count_parameters() / 1e6:.1f}"

    m["machine.date"] = date.today().isoformat()
    git = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True)
    m["machine.commit"] = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    if git(["git", "status", "--porcelain", "--", "tandem"]).stdout.strip():
        print(f"warning: tandem/ has uncommitted changes: these runs are not commit {m['machine.commit']}'s")
    m["machine.torch"] = torch.__version__.split("+")[0]
    m["machine.python"] = platform.python_version_tuple()[0] + "." + platform.python_version_tuple()[1]
    m["machine.cores"] = f"{cores}"
    m["machine.cpu"] = cpu_name()
    m["machine.script_time"] = duration(time.perf_counter() - started)
    return m


def duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s"


def ordinal(n: int) -> str:
    return ["first", "second", "third", "fourth", "fifth", "sixth"][n - 1] if n <= 6 else f"{n}th"


def fraction(x: float) -> str:
    """``x`` (below 1) as "a half", "a third", ... for the page's prose."""
    n = max(2, round(1 / x))
    return {2: "a half", 3: "a third", 4: "a quarter"}.get(n, f"a {ordinal(n)}" if n <= 6 else f"1/{n}")


# ---------------------------------------------------------------------- where the pages state them

@dataclass
class Rule:
    """A sentence of a page, as a regex whose groups are its numbers, in order (a
    space in it is any run of white space: the page may wrap its lines anywhere)."""

    page: Path
    pattern: str
    keys: tuple[str, ...]


RULES = [
    Rule(README, r"with a test accuracy of ([\d.]+)% on (\d+) images, which the tests check",
         ("digits.accuracy", "digits.images")),
    Rule(PAGE, r"\(it ends with a test accuracy of ([\d.]+)% on (\d+) images, in ([\w\s]+) from the command",
         ("digits.accuracy", "digits.images", "digits.time")),
    Rule(PAGE, r"4 blocks of width 128, ([\d.]+)M parameters", ("params.millions",)),
    Rule(PAGE, r"prints; (\d+) thousand characters under\s+Python ([\d.]+),", ("text.thousands", "machine.python")),
    Rule(PAGE, r"\((\w+(?: \w+)?) per\s+worker, as `tandem run` gives them there\): (\d+) epochs, (\d+) steps of "
               r"(\d+) windows,\s+in ([\w\s]+) from the command to its exit, ending at a validation loss of\s+"
               r"([\d.]+) nats per character \(after ([\d.]+) and ([\d.]+) at the first two epochs\)",
         ("full.threads", "full.epochs", "full.steps", "full.global_batch", "full.time", "full.loss",
          "full.epoch1", "full.epoch2")),
    Rule(PAGE, r"MKL_CBWR=COMPATIBLE`\) the same\s+job ends at ([\d.]+) \(after ([\d.]+) and ([\d.]+)\),\s+"
               r"([\d.]+) from", ("older.loss", "older.epoch1", "older.epoch2", "older.apart")),
    Rule(PAGE, r"character frequencies alone\s+\(([\d.]+) nats per character\)", ("full.baseline",)),
    Rule(PAGE, r"\(`tests/examples/test_example_gpt.py`\), takes ([\w\s]+):", ("short.time",)),
    Rule(PAGE, r"It ends at validation loss \*\*([\d.]+)\*\* nats per character \(unigram baseline ([\d.]+)\)",
         ("short.loss", "short.baseline")),
    Rule(PAGE, r"where the command ends at ([\d.]+), the same run\s+ends at ([\d.]+) with torch's kernels for CPUs "
               r"without AVX\s+\(`ATEN_CPU_CAPABILITY=default`\) and at ([\d.]+) with two threads",
         ("short.exact", "short.without_avx", "short.two_threads")),
    Rule(PAGE, r"within \*\*[\d.]+\*\*: (\w+) times that spread", ("short.times_spread",)),
    Rule(PAGE, r"and still ([\w/\s]+?) of what another seed moves it by \(`--seed 1` ends at ([\d.]+)\)",
         ("short.seed_share", "short.seed_loss")),
    Rule(PAGE, r"the loss falls from ([\d.]+) to ([\d.]+) \(evaluation\s+([\d.]+)\)",
         ("short.first_train", "short.last_train", "short.eval")),
    Rule(PAGE, r"which reruns the jobs \(([\w\s]+) on the machine below\)", ("machine.script_time",)),
    Rule(PAGE, r"Last run on ([\d-]+) at commit (\w+), with torch ([\d.]+) and Python ([\d.]+), on\s+(\d+) cores of "
               r"a machine that other work shared\s+\((.+)\)\.\n", ("machine.date", "machine.commit", "machine.torch",
                                                                  "machine.python", "machine.cores", "machine.cpu")),
]


def rewrite(text: str, rules: list[Rule], numbers: dict[str, str]) -> str:
    """``text`` with each rule's groups replaced by its numbers."""
    for rule in rules:
        found = list(re.finditer(rule.pattern.replace(" ", r"\s+"), text))  # across line breaks too
        if len(found) != 1:
            raise SystemExit(f"{rule.page.relative_to(ROOT)}: the words around {', '.join(rule.keys)} "
                             f"match {len(found)} times, not once: update RULES in {Path(__file__).name}")
        match = found[0]
        for group in range(len(rule.keys), 0, -1):  # from the end: earlier offsets stay valid
            text = text[:match.start(group)] + numbers[rule.keys[group - 1]] + text[match.end(group):]
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="print the changes instead of writing them; exit 1 if any")
    args = p.parse_args(argv)
    pages = {rule.page for rule in RULES}
    for page in pages:  # before minutes of runs: a reworded page fails now
        rewrite(page.read_text(), [r for r in RULES if r.page == page], _placeholders())
    numbers = measure()
    print("\n".join(f"  {k:22} {v}" for k, v in numbers.items()))
    changed = False
    for page in sorted(pages):
        old = page.read_text()
        new = rewrite(old, [r for r in RULES if r.page == page], numbers)
        if new == old:
            continue
        changed = True
        name = str(page.relative_to(ROOT))
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), name, name))
        else:
            page.write_text(new)
            print(f"rewrote {name}")
    return 1 if changed and args.check else 0


def _placeholders() -> dict[str, str]:
    return {key: "?" for rule in RULES for key in rule.keys}


if __name__ == "__main__":
    sys.exit(main())
