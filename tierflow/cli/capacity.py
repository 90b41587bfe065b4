"""`tierflow capacity`: the largest model of each family that trains on a box, with and without its SSDs, and
whether given models fit."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierflow.cli.args import (
    add_batch_arg,
    add_box_args,
    add_lora_args,
    add_optimizer_states_arg,
    add_seq_arg,
    add_world_args,
    in_state_format,
    lora_of,
    world_of,
)
from tierflow.cli.tables import fmt_table
from tierflow.errors import UsageError
from tierflow.hwprofiles import HardwareProfile, load_hw
from tierflow.planner.core.models import get_model
from tierflow.planner.io.progress import Progress


def add_parser(sub: Any) -> argparse.ArgumentParser:
    ca = sub.add_parser("capacity", help="the largest model of each family that trains on a box")
    add_box_args(ca, model=False)
    add_batch_arg(ca, 16)
    add_seq_arg(ca, "sequence length (default 2048)")
    ca.add_argument("--model", action="append", help="also check whether this model fits (repeatable)")
    ca.add_argument("--json", action="store_true", help="print the result as JSON")
    add_world_args(ca)
    add_optimizer_states_arg(ca)
    add_lora_args(ca)
    return ca


def run(args: argparse.Namespace) -> int:
    from tierflow.planner.core.schedules import check_world
    from tierflow.planner.search.capacity import FAMILIES as CAP_FAMILIES
    from tierflow.planner.search.capacity import largest_all

    hw = load_hw(args.hw, args.set)
    seq = args.seq or 2048
    jobs = len(CAP_FAMILIES) * (2 if hw.ssd.count else 1)
    prog = Progress(jobs, "capacity")
    # check the world once, up front: one line for a bad --gpus / --nodes (not one per worker)
    check_world(hw, args.gpus, args.nodes)
    world = world_of(args)
    if args.batch % world.ranks:
        raise UsageError(f"--batch {args.batch} is not divisible by {world.ranks} ranks (use a multiple of "
                         "it)")
    def step(a: Any) -> None:
        prog.step(f"{a.family} {'with' if a.with_ssd else 'without'} SSDs")

    states = in_state_format(get_model("gpt3-125m"), args).optimizer_states  # checked as for any model
    lora = lora_of(args)
    answers = largest_all(hw, args.batch, seq, gpus=args.gpus, nodes=args.nodes, on_answer=step,
                          optimizer_states=states, lora=lora)
    prog.finish()
    checks = _checks(args, hw, seq)
    if args.json:
        fmt = {"optimizer_states": states} if states else {}  # only when not fp32 (the output as before)
        fmt.update({"lora": lora.to_dict()} if lora else {})
        print(json.dumps({"hw": hw.name, "batch": args.batch, "seq": seq, "world": world.to_dict(), **fmt,
                          "largest": [_answer_json(a) for a in answers], "checks": dict(checks)}, indent=2))
        return 0
    print(f"box: {hw.name}: {hw.summary()}")
    if world.ranks > 1:
        W = world.ranks
        print(f"{W} data-parallel ranks ({args.gpus} GPUs per box x {args.nodes} boxes): each holds its "
              f"1/{W} shard of the states in its 1/{args.gpus} of its box's host memory and SSDs, and runs "
              f"{world.rank_batch(args.batch)} of the {args.batch} sequences")
    print(f"batch {args.batch} x seq {seq}; most frugal plan: vertical, micro-batch 1, states and "
          "checkpoints on the SSDs when used (else in CPU memory)")
    if states:
        print(f"optimizer states: {states}")
    if lora:
        print(f"fine-tuning: {lora.describe()} (the base frozen: read, never written)")
    rows = []
    for a in answers:
        rows.append([a.family, "CPU+GPU+SSD" if a.with_ssd else "CPU+GPU",
                     a.model.describe().split(":")[1].strip() if a.model else a.note,
                     f"{a.params / 1e9:,.1f}B",
                     f"{a.verified.tokens_per_s:,.1f}" if a.verified else "-"])
    print(fmt_table(rows, ["family", "tiers", "largest model", "params", "tokens/s (simulated)"]))
    for name, c in checks:
        print(f"{name}: " + ", ".join(f"{'with' if s else 'without'} SSDs: {'fits' if ok else 'does not fit'}"
                                      for s, ok in c.items()))
    return 0


def _checks(args: argparse.Namespace, hw: HardwareProfile, seq: int) -> list[tuple[str, dict[bool, bool]]]:
    """--model NAME (repeatable): whether it fits, with and without the SSDs."""
    from tierflow.planner.search.capacity import fits

    checks = []
    for name in args.model or []:
        m = in_state_format(get_model(name).with_seq(min(seq, get_model(name).max_positions or seq)), args)
        m = m.with_lora(lora_of(args))
        checks.append((name, {s: fits(m, hw, args.batch, seq, s, args.gpus, args.nodes)
                              for s in (True, False)}))
    return checks


def _answer_json(a: Any) -> dict[str, Any]:
    return {"family": a.family, "with_ssd": a.with_ssd, "model": a.model.describe() if a.model else None,
            "params": a.params, "layers": a.model.num_layers if a.model else None,
            "hidden": a.model.hidden if a.model else None,
            "requirements_bytes": a.requirements,
            "tokens_per_s": a.verified.tokens_per_s if a.verified else None, "note": a.note}
