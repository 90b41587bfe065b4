"""Text tables of the commands' output: the aligned table and the summary of simulated schedules side by
side (`tierflow simulate`, `tierflow simulate --ds-config`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from tierflow.planner.core.simulator import SimResult
from tierflow.planner.core.timefmt import fmt_s


def gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def fmt_table(rows: list[list[str]], header: list[str]) -> str:
    """Rows under a header: the first column left-aligned, the others right-aligned, a dashed rule between."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _busy(k: str, r: SimResult) -> str:
    return f"{100 * r.busy.get(k, 0.0):.0f}%"


def _link(k: str, r: SimResult) -> str:
    return gb(r.link_bytes.get(k, 0.0))


def _peak(k: str, r: SimResult) -> str:
    return f"{gb(r.peak_bytes[k])} / {r.graph.capacity_bytes[k] / 1e9:,.0f}"


def summary_table(results: dict[str, SimResult | Exception]) -> str:
    """One column per schedule (a "-" where it did not fit): throughput, busy fractions, bytes per link and
    the peak of each memory tier; per GPU and the collectives' link too when a result has several ranks."""
    names = list(results)
    many = any(isinstance(r, SimResult) and r.ranks > 1 for r in results.values())
    rows = []
    for label, fn in _metrics(many):
        rows.append([label] + [fn(results[n]) if isinstance(results[n], SimResult) else "-" for n in names])
    return fmt_table(rows, ["", *names])


def _metrics(many: bool) -> list[tuple[str, Callable[[SimResult], str]]]:
    """The summary's rows: (label, the cell of a result)."""
    metrics: list[tuple[str, Callable[[SimResult], str]]] = [
        ("iteration time", lambda r: fmt_s(r.iteration_s, 1)),
        ("tokens/s", lambda r: f"{r.tokens_per_s:,.0f}"),
        ("model TFLOPS", lambda r: f"{r.model_tflops:.1f}"),
        ("hardware TFLOPS", lambda r: f"{r.hw_tflops:.1f}"),
    ]
    if many:  # several ranks: the figures above are the world's; per GPU, and the collectives' link
        metrics += [("tokens/s per GPU", lambda r: f"{r.per_gpu()['tokens_per_s_per_gpu']:,.0f}"),
                    ("hardware TFLOPS per GPU", lambda r: f"{r.per_gpu()['hw_tflops_per_gpu']:.1f}")]
    busy = ("gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu") + (("net",) if many else ())
    links = ("cpu->gpu", "gpu->cpu", "ssd->cpu", "cpu->ssd") + (("gpu<->gpu",) if many else ())
    metrics += [(f"busy {k}", partial(_busy, k)) for k in busy]
    metrics += [(f"bytes {k}", partial(_link, k)) for k in links]
    metrics += [(f"peak {k}", partial(_peak, k)) for k in ("gpu", "cpu", "ssd")]
    return metrics
