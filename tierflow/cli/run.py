"""`tierflow run`: train with a plan file on this machine, measuring every op (tierflow.executor.run). Only
argparse here: torch (seconds to import, and a heap that slows the planner's garbage collection) is imported
when the command runs, not when the parser is built."""

from __future__ import annotations

import argparse
from typing import Any

from tierflow.planner.io.argtypes import MAX_STEPS, int_in, non_negative_float, positive_float, positive_int


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run", help="train with a plan file on this machine (GPU or CPU), measuring every op",
        description="Replay a plan file (tierflow plan -o, or tierflow simulate --write-plan) as real "
        "training: the plan's ops run in the plan's order on per-resource workers, tensors live where the "
        "plan puts them (device, pinned host memory, files under --ssd-dir). Prints loss, tokens/s and "
        "TFLOPS per step.")
    p.add_argument("plan", help="plan file (JSON, docs/plan-format.md)")
    p.add_argument("--steps", type=positive_int(MAX_STEPS), default=5,
                   help="training steps in total, counting resumed ones (default 5)")
    p.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda when available); on cpu, transfers are copies but the "
                   "SSD tier is real file I/O")
    p.add_argument("--ssd-dir", default=None, metavar="DIR",
                   help="directory on the SSD (array) for the SSD tier")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="nanoGPT-style uint16 token file (.bin) or a text file (byte tokens); default: "
                   "seeded random tokens")
    p.add_argument("--data-format", default="auto", choices=["auto", "uint16", "text"],
                   help="how to read --data (default: .bin/.u16 = uint16, else text)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="Hugging Face model directory (*.safetensors) to start from, loaded block by block")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the training state here and resume from its latest checkpoint")
    p.add_argument("--checkpoint-every", type=positive_int(MAX_STEPS), default=None, metavar="K",
                   help="steps between checkpoints, >= 1 (default: the plan's iterations per round)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the measured timeline.csv, trace.json (Perfetto), gantt.png and steps.csv "
                   "here")
    p.add_argument("--overwrite", action="store_true", help="let --out write into a non-empty directory")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="after the last step, write the trained fp32 weights as a Hugging Face model "
                   "directory (config.json + model.safetensors) that transformers' from_pretrained loads; "
                   "DIR must be new or empty")
    p.add_argument("--lr", type=positive_float(), default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=non_negative_float(), default=0.1,
                   help="AdamW weight decay (default 0.1)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1, "a non-negative integer"), default=0,
                   help="seed of the random init and synthetic data (default 0)")
    p.add_argument("--profile", action="store_true",
                   help="run under torch.profiler and write its Chrome trace, torch_trace.json, under --out "
                   "(each op in a record_function named after the plan's op, e.g. 'op 123 fwd b3 mb1 it0'); "
                   "needs --out")
    p.add_argument("--resume-fallback", action="store_true",
                   help="if the latest checkpoint is corrupt, truncated or unreadable, resume from the "
                   "previous one that verifies (default: refuse with one line)")
    p.add_argument("--allow-changed-hyper", action="store_true",
                   help="resume although --seed, --lr, --weight-decay or --data differ from the checkpoint's "
                   "(default: refuse, naming what differs)")
    g = p.add_argument_group("several GPUs (a plan made with --gpus/--nodes; or launch with torchrun "
                             "yourself)")
    g.add_argument("--nproc", type=positive_int(1024), default=None, metavar="N",
                   help="start N ranks on this box through torchrun (torch.distributed.run), as `torchrun "
                   "--nproc-per-node N -m tierflow run ...` does; N x --nnodes must be the plan's gpus x "
                   "nodes")
    g.add_argument("--nnodes", type=positive_int(1024), default=1, metavar="M",
                   help="boxes of the run, each starting its --nproc ranks with this same command (default "
                   "1)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the boxes' launchers meet (torchrun's c10d rendezvous); needed with --nnodes "
                   "> 1")
    g.add_argument("--rdzv-id", default="tierflow", metavar="ID",
                   help="the run's rendezvous id (default tierflow)")
    p.add_argument("--json", action="store_true", help="print the steps and the measured summary as JSON")
    # hidden (tests): compute in bf16 on a CPU device too, as on CUDA (bf16 is the default there, fp32 on a
    # CPU)
    p.add_argument("--compute-dtype", choices=["bf16", "fp32"], default=None, help=argparse.SUPPRESS)
    return p


def run(args: argparse.Namespace) -> int:
    from tierflow.executor.run import cmd_run  # torch is imported here, when the command runs

    return cmd_run(args)
