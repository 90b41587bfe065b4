"""The README's figures that come from a command, generated from that command's output: the default demo's
block (what `tierflow simulate` prints), the paragraph under it (its PCIe and SSD traffic ratios, GPU busy
shares, and the tokens/s of two variants of the demo: `--batch 16 --micro-batch 1` and `--set ssd.count=2`)
and the demo's row of "Results at a glance". tests/system/test_readme_demo.py runs the same commands and fails
when the README differs from what this script makes of them.

    python experiments/readme_demo.py            # rewrite the README's generated parts
    python experiments/readme_demo.py --check    # exit 1, naming the part, when the README differs

The three commands run at once (three processes); about 10 s each on one core. They are simulations, so their
output is the same on every machine.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from expcommon import generated_block, script_main, write_generated_block  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DEMO_BLOCK = "demo (experiments/readme_demo.py from tierflow simulate)"
PROSE_BLOCK = "demo figures (experiments/readme_demo.py from tierflow simulate and two variants)"
GLANCE_ROW = "| default demo: GPT-3 175B, batch 64 |"  # the row of "Results at a glance" this script writes
# the commands whose output the README quotes: name -> tierflow's arguments
COMMANDS = {"demo": ["simulate"], "batch16": ["simulate", "--batch", "16", "--micro-batch", "1"],
            "ssd2": ["simulate", "--set", "ssd.count=2"]}
SCHEDULES = ("horizontal", "fuyou", "vertical")


def run_commands(commands: dict[str, list[str]] = COMMANDS) -> dict[str, str]:
    """Each command's stdout (all started at once); a failure raises with its stderr."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "tierflow.cli", *args], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, args in commands.items()}
    outs = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"tierflow {' '.join(commands[name])} exited {p.returncode}: {err.strip()}")
        outs[name] = out
    return outs


def summary(text: str) -> dict[str, dict[str, str]]:
    """The summary table of `tierflow simulate`'s output: row label -> schedule -> cell."""
    lines = text.splitlines()
    head = next(i for i, x in enumerate(lines) if x.split() == list(SCHEDULES))
    table = {}
    for line in lines[head + 2:]:
        if not line.strip():
            break
        label, *cells = re.split(r"\s{2,}", line.strip())
        table[label] = dict(zip(SCHEDULES, cells))
    return table


def _number(cell: str) -> float:
    return float(re.match(r"[\d,.]+", cell).group(0).replace(",", ""))


def _ratio(t: dict, rows: tuple[str, ...], slow: str, fast: str = "vertical") -> str:
    total = {s: sum(_number(t[r][s]) for r in rows) for s in (slow, fast)}
    return f"{total[slow] / total[fast]:.1f}x"


def demo_block(outs: dict[str, str]) -> str:
    return f"```\n{outs['demo'].rstrip()}\n```"


def prose(outs: dict[str, str]) -> str:
    """The paragraph under the demo, every figure from the commands' output."""
    t, b16, s2 = (summary(outs[k]) for k in ("demo", "batch16", "ssd2"))
    pcie, ssd = ("bytes cpu->gpu", "bytes gpu->cpu"), ("bytes ssd->cpu",)
    busy = t["busy gpu"]
    text = (f"Vertical scheduling moves {_ratio(t, pcie, 'horizontal')} fewer bytes over PCIe than the "
            f"horizontal schedule here and {_ratio(t, pcie, 'fuyou')} fewer than Fuyou's, and "
            f"{_ratio(t, ssd, 'horizontal')} and {_ratio(t, ssd, 'fuyou')} fewer from the SSDs (the "
            "horizontal "
            f"schedule keeps part of the weights in CPU memory), which keeps the GPU {busy['vertical']} busy "
            "where Fuyou's schedule, run as LoHan's code runs it (no weight prefetch in the backward, its "
            "training thread waiting for each optimizer read and write), reaches "
            f"{busy['fuyou']} and ZeRO-Infinity, run as DeepSpeed runs it (NVMe parameters fetched on "
            f"demand, optimizer sub-groups swapped one at a time), {busy['horizontal']}: at `--batch 16 "
            "--micro-batch 1` "
            f"it simulates {_tokens(b16)}, and with two SSDs instead of twelve (`--set ssd.count=2`) "
            f"{_tokens(s2)}.")
    return textwrap.fill(text, width=114, break_long_words=False, break_on_hyphens=False)


def _tokens(t: dict) -> str:
    row = t["tokens/s"]
    return f"{row['vertical']} tokens/s against {row['horizontal']} (horizontal) and {row['fuyou']} (fuyou)"


def glance_row(outs: dict[str, str]) -> str:
    t = summary(outs["demo"])
    it = t["iteration time"]["vertical"].replace(" s", "").split(".")[0]
    fastest = re.search(r"^fastest: vertical \(([\d.]+x) horizontal\)$", outs["demo"], re.M).group(1)
    return (f"{GLANCE_ROW} vertical {it} s per iteration, {fastest} horizontal, GPU "
            f"{t['busy gpu']['vertical']} busy | RTX 4090 + 12 SSDs (`rtx4090-lohan`) | simulated | "
            "[the default demo](#the-default-demo) |")


def readme_glance_row(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(GLANCE_ROW))


def drift(outs: dict[str, str], readme: Path = README) -> list[str]:
    """The README's generated parts that differ from what the commands print now (their names)."""
    bad = [name for name, want in ((DEMO_BLOCK, demo_block(outs)), (PROSE_BLOCK, prose(outs)))
           if generated_block(readme, name) != want]
    if readme_glance_row(readme.read_text()) != glance_row(outs):
        bad.append("the demo's row of Results at a glance")
    return bad


def write(outs: dict[str, str], readme: Path = README) -> None:
    write_generated_block(readme, DEMO_BLOCK, demo_block(outs))
    write_generated_block(readme, PROSE_BLOCK, prose(outs))
    text = readme.read_text()
    readme.write_text(text.replace(readme_glance_row(text), glance_row(outs)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only say whether the README matches (exit 1 if not)")
    args = ap.parse_args(argv)
    outs = run_commands()
    if args.check:
        bad = drift(outs)
        for name in bad:
            print(f"README.md: {name} differs from the command's output; run python "
                  "experiments/readme_demo.py", file=sys.stderr)
        return 1 if bad else 0
    write(outs)
    print(f"wrote the demo block, its paragraph and its row of Results at a glance in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
