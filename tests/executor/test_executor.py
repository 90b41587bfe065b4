"""The executor replays plans exactly: after 5 steps its losses and fp32 weights equal plain PyTorch AdamW
training of the same model on the same data (relative error <= 1e-5), for every schedule family x placement x
alpha (each with one of the two models in turn: `pairwise`), with the SSD tier as real files. Plus
checkpoint/resume across SIGKILL, real data and weights, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import torch
from support.runs import BATCH, PLACEMENTS, SEQ, STEPS, make_plan, reference, rel_err, run

from tierflow.cli import main
from tierflow.executor.data import DataError, TokenData
from tierflow.executor.engine import Executor
from tierflow.executor.models import build_blocks
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.ops.weights import WeightOps
from tierflow.executor.run import (
    ModelDataOptions,
    OptimizerOptions,
    OutputOptions,
)
from tierflow.executor.tiers.ssd_store import ChecksumError, SsdError, SsdStore, check_ssd_dir
from tierflow.planner.core.models import get_model
from tierflow.planner.io.compare import compare
from tierflow.planner.io.planfile import load_plan, write_plan

# -- correctness: every family x placement x alpha -----------------------------------------------------------


MODEL_NAMES = ("tiny-gpt", "tiny-llama")
FAMILIES = ("horizontal", "fuyou", "vertical", "block")


def pairwise(*axes: tuple) -> list[tuple]:
    """Every combination of `axes`, each with one of MODEL_NAMES in turn (by the sum of the combination's
    indices), so that each model meets every value of every axis - and, with two axes, every value of one
    axis meets both models - in half the runs of the full product: the schedules' and placements' logic is
    the model's family's business only through its block, which both models cover."""
    combos: list[tuple] = [()]
    for axis in axes:
        combos = [(*c, (i, v)) for c in combos for i, v in enumerate(axis)]
    return [(MODEL_NAMES[sum(i for i, _ in c) % len(MODEL_NAMES)], *(v for _, v in c)) for c in combos]


@pytest.mark.parametrize("model_name, family, placement, alpha", pairwise(FAMILIES, PLACEMENTS, (0.0, 0.25)))
def test_matches_plain_pytorch_adamw(model_name, family, placement, alpha, tmp_path):
    plan = make_plan(model_name, family, placement, alpha)
    kinds = {t.kind for t in plan.graph.tasks}
    # the plan really exercises what the case is about
    if alpha and placement != "device":
        assert "adam_deferred" in kinds
    if placement == "device":
        assert "adam_gpu" in kinds and "fetch_weights" not in kinds
    if placement in ("states_ssd", "mix"):
        assert {"read_opt_states", "write_opt_states"} <= kinds
    if placement in ("ckpt_ssd", "mix"):
        assert {"write_checkpoint", "read_checkpoint"} <= kinds
    if placement == "mix":
        assert {"read_weights", "write_grads", "read_grads"} <= kinds
    res = run(plan, tmp_path)
    ref_losses, ref_weights = reference(model_name)
    assert len(res.losses) == STEPS
    for got, want in zip(res.losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    for b, (got, want) in enumerate(zip(res.final_master, ref_weights)):
        assert rel_err(got, want) <= 1e-5, f"block {b}"
    # and training moved the weights (the comparison is not trivially between two initial states)
    torch.manual_seed(0)
    init = [torch.cat([p.detach().reshape(-1) for p in b.parameters()])
            for b in build_blocks(get_model(model_name))]
    assert rel_err(res.final_master[1], init[1]) > 1e-4
    if "ssd" in placement or placement == "mix":
        assert res.ssd_bytes_read > 0 and res.ssd_bytes_written > 0


@pytest.mark.parametrize("model_name, family, placement", pairwise(FAMILIES, PLACEMENTS))
def test_matches_plain_pytorch_adamw_on_the_cuda_emulation(model_name, family, placement, tmp_path):
    """The same equivalence with the executor's CUDA logic (streams, events, copy_async, pinned buffers,
    record_stream) on the adversarial emulation of a CUDA device (executor/device/emulated.py): a missing wait
    or record_stream there is a NaN, a wrong loss or an error (tests/executor/device/test_device.py shows each
    one is). Three steps: two rounds (2 + 1 iterations), so the round boundary is crossed."""
    plan = make_plan(model_name, family, placement, 0.25)
    res = run(plan, tmp_path, steps=3, device="cpu-adversarial")
    ref_losses, ref_weights = reference(model_name, steps=3)
    assert max(abs(a - b) / b for a, b in zip(res.losses, ref_losses)) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(res.final_master, ref_weights)) <= 1e-5


@pytest.mark.parametrize("device", ["cpu", "cpu-adversarial"])
# saved activations kept on the device / on SSD
@pytest.mark.parametrize("placement", ["weights_cpu", "ckpt_ssd"])
def test_all_layers_swapped_without_recompute(placement, device, tmp_path):
    plan = make_plan("tiny-llama", "vertical", placement, 0.25, swap_layers=4)
    assert "recompute" not in {t.kind for t in plan.graph.tasks}
    res = run(plan, tmp_path, device=device)
    ref_losses, ref_weights = reference("tiny-llama")
    assert max(abs(a - b) / b for a, b in zip(res.losses, ref_losses)) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(res.final_master, ref_weights)) <= 1e-5


def test_measured_trace_and_compare(tmp_path):
    plan = make_plan("tiny-gpt", "vertical", "states_ssd", 0.25, iterations=3)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    out = tmp_path / "out"
    res = run(load_plan(path), tmp_path, steps=3,
              output=OutputOptions(out=str(out), quiet=True, collect_final=True))
    for f in ("timeline.csv", "trace.json", "gantt.png", "steps.csv"):
        assert (out / f).stat().st_size > 0
    m = res.measured
    assert len(m.graph.tasks) == len(plan.graph.tasks)
    assert np.all(m.end_s >= m.start_s) and not np.isnan(m.start_s).any()
    # a dependency never ends after its dependent starts (the executor waits for deps)
    for t in plan.graph.tasks:
        for d in t.deps:
            assert m.end_s[d] <= m.start_s[t.id] + 1e-6
    c = compare(plan, out / "trace.json")
    assert c.iterations == 3 and c.ops == len(plan.graph.tasks)
    kinds = {r["kind"] for r in c.by_kind}
    assert {"fwd", "bwd", "adam", "adam_deferred", "read_opt_states"} <= kinds
    assert all(r["measured_s"] > 0 for r in c.by_kind)
    # the figure: both timelines on one time axis, a legend of op kinds, a ratio bar per kind
    from tierflow.planner.io.compare import comparison_figure

    fig = comparison_figure(c)
    gantt_pred, gantt_meas, ratios = fig.axes[:3]
    assert gantt_pred.get_xlim() == gantt_meas.get_xlim()
    assert gantt_pred.get_xlim()[1] >= max(c.predicted.end_s.max(), 0.0) * 0.99
    labels = {t.get_text() for t in gantt_pred.get_legend().get_texts()}
    assert {"fwd", "bwd", "adam"} <= labels
    heights = [b.get_height() for b in ratios.patches]
    want = [r["measured_s"] / r["predicted_s"] for r in c.by_kind if r["predicted_s"] > 0]
    assert heights == pytest.approx(want)


def test_queue_order_is_kept(tmp_path):
    """Each resource runs its ops one at a time in the plan's order."""
    plan = make_plan("tiny-gpt", "block", "mix", 0.25, iterations=2)
    res = run(plan, tmp_path, steps=2)
    m = res.measured
    for ids in plan.graph.resource_order().values():
        for a, b in zip(ids, ids[1:]):
            assert m.end_s[a] <= m.start_s[b] + 1e-6


# -- checkpoint and resume -----------------------------------------------------------------------------------


def _cli_run(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierflow.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_sigkill_mid_step_then_resume_gives_the_same_losses(tmp_path):
    plan = make_plan("tiny-gpt", "vertical", "states_ssd", 0.25, iterations=1)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    (tmp_path / "ssd").mkdir()
    common = [str(path), "--device", "cpu", "--ssd-dir", str(tmp_path / "ssd"), "--json"]
    full = _cli_run([*common, "--steps", "8"])
    out, err = full.communicate(timeout=300)
    assert full.returncode == 0, err
    want = {s["step"]: s["loss"] for s in json.loads(out)["steps"]}

    ck = tmp_path / "ck"
    p = _cli_run([*common, "--steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "1"])
    deadline = time.time() + 120
    while time.time() < deadline and not (ck / "step00000003").is_dir():
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)  # somewhere in step 4 (or while writing its checkpoint)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    latest = (ck / "latest").read_text().strip()
    assert latest.startswith("step") and int(latest[4:]) < 8  # killed before the end
    resumed = _cli_run([*common, "--steps", "8", "--checkpoint-dir", str(ck)])
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    got = json.loads(out)
    assert got["first_step"] == int(latest[4:])
    assert got["steps"], "the resumed run trained the remaining steps"
    for s in got["steps"]:
        assert s["loss"] == want[s["step"]], f"step {s['step']}"


def test_checkpoint_of_another_plan_is_refused(tmp_path, capsys):
    p1 = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    p2 = make_plan("tiny-llama", "vertical", "weights_cpu", iterations=1)
    f1, f2 = tmp_path / "a.json", tmp_path / "b.json"
    write_plan(p1, f1)
    write_plan(p2, f2)
    ck = tmp_path / "ck"
    assert main(["run", str(f1), "--steps", "1", "--device", "cpu", "--checkpoint-dir", str(ck),
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(f2), "--steps", "2", "--device", "cpu", "--checkpoint-dir", str(ck)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "another plan" in err and "tiny-gpt" in err


# -- real data and weights -----------------------------------------------------------------------------------


def test_token_files(tmp_path):
    u16 = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(u16)
    d = TokenData.load(str(u16), 256)
    x, y = d.batch(3, 2, 8)
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x[0, 0]) == (3 * 2 * 8) % 256
    txt = tmp_path / "t.txt"
    txt.write_text("hello tierflow " * 20)
    x, _ = TokenData.load(str(txt), 256).batch(0, 1, 5)
    assert bytes(x[0].tolist()) == b"hello"
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        TokenData.load(str(txt), 100)
    with pytest.raises(DataError, match="no such file"):
        TokenData.load(str(tmp_path / "missing.bin"), 256)


def test_batches_are_the_windows_of_their_step_read_at_once_or_row_by_row(tmp_path):
    """TokenData.batch: row i of step s is the window of seq + 1 tokens from ((s * batch + i) * seq) mod
    (n - seq), inputs its first seq tokens and targets its last; a batch whose windows do not wrap is read
    at once, one that wraps row by row: every step of a stream short enough to wrap, from a file and in
    memory."""
    tokens = (np.arange(101, dtype=np.uint16) * 7) % 256
    u16 = tmp_path / "short.bin"
    tokens.tofile(u16)
    batch, seq = 3, 8
    span = len(tokens) - seq
    for data in (TokenData.load(str(u16), 256), TokenData(tokens.astype(np.int64), "memory")):
        for step in range(12):  # 12 * 24 tokens: several wraps of the 93 window starts
            x, y = data.batch(step, batch, seq)
            starts = [((step * batch + i) * seq) % span for i in range(batch)]
            rows = [tokens[a: a + seq + 1].astype(np.int64).tolist() for a in starts]
            assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
            assert x.tolist() == [r[:-1] for r in rows] and y.tolist() == [r[1:] for r in rows]


def test_text_data_trains_on_it(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    plan = make_plan("tiny-gpt", "horizontal", "weights_cpu", iterations=1)
    res = run(plan, tmp_path, steps=8, model_data=ModelDataOptions(data=str(txt)),
              optimizer=OptimizerOptions(lr=1e-2, weight_decay=0.0))
    assert res.losses[-1] < res.losses[0] - 0.5  # a repetitive text is learned quickly


def test_init_from_hf_checkpoint_layer_by_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = get_model("tiny-llama")
    cfg = transformers.LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden,
                                   intermediate_size=spec.ffn_hidden, num_hidden_layers=spec.num_layers,
                                   num_attention_heads=spec.num_heads,
                                   num_key_value_heads=spec.num_kv_heads, max_position_embeddings=SEQ,
                                   rms_norm_eps=1e-5, tie_word_embeddings=spec.tied_embeddings)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="200KB")  # several shards
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    data = TokenData.load(None, spec.vocab_size)
    x, y = data.batch(0, BATCH, SEQ)
    with torch.no_grad():
        want = lm_loss(hf(x).logits, y).item()
    plan = make_plan("tiny-llama", "vertical", "states_ssd", iterations=1, batch=BATCH, micro=BATCH)
    res = run(plan, tmp_path, steps=1, model_data=ModelDataOptions(init=str(tmp_path / "hf")))
    assert abs(res.losses[0] - want) <= 1e-5 * want


def test_init_of_another_model_is_refused(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    plan = make_plan("tiny-llama", "vertical", "weights_cpu", iterations=1)
    f = tmp_path / "plan.json"
    write_plan(plan, f)
    capsys.readouterr()
    assert main(["run", str(f), "--steps", "1", "--device", "cpu", "--init", str(tmp_path / "gpt2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tierflow run: error: --init") and "\n" not in err


# -- the SSD tier --------------------------------------------------------------------------------------------


def test_ssd_store_roundtrip_and_checksum(tmp_path):
    store = SsdStore(tmp_path, warn=lambda m: None)
    t = torch.randn(10_000)
    store.write("master_b3_p0", t)
    assert torch.equal(store.read("master_b3_p0", torch.float32, 10_000), t)
    with open(store.path("master_b3_p0"), "r+b") as f:
        f.seek(1234)
        f.write(b"\x7f")
    with pytest.raises(ChecksumError, match="checksum mismatch in tensor master_b3_p0"):
        store.read("master_b3_p0", torch.float32, 10_000)
    store.close()


def test_o_direct_refused_falls_back_with_one_warning(tmp_path, monkeypatch):
    """Filesystems that refuse O_DIRECT answer EINVAL at open (tmpfs before Linux 6.6, some network
    filesystems). This machine's filesystems may all accept it, so the refusal is injected at os.open."""
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    warnings = []
    store = SsdStore(tmp_path, warn=warnings.append)
    assert not store.direct and len(warnings) == 1 and "refuses O_DIRECT" in warnings[0]
    t = torch.arange(5000, dtype=torch.float32)
    store.write("x", t)
    store.write("y", t * 2)
    assert torch.equal(store.read("y", torch.float32, 5000), t * 2)
    assert len(warnings) == 1
    store.close()


def test_corrupted_ssd_file_mid_run_names_the_tensor(tmp_path, monkeypatch, capsys):
    plan = make_plan("tiny-gpt", "horizontal", "states_ssd", iterations=2)
    f = tmp_path / "plan.json"
    write_plan(plan, f)
    real_write = SsdStore.write
    seen = Counter()

    def corrupting_write(self, name, tensor):
        real_write(self, name, tensor)
        seen[name] += 1
        if name == "adam_v_b2_p0" and seen[name] == 2:  # written back by the first optimizer step
            with open(self.path(name), "r+b") as fh:
                fh.seek(8)
                fh.write(b"\x01\x02\x03\x04")

    monkeypatch.setattr(SsdStore, "write", corrupting_write)
    (tmp_path / "ssd").mkdir()
    code = main(["run", str(f), "--steps", "2", "--device", "cpu", "--ssd-dir", str(tmp_path / "ssd")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "checksum mismatch in tensor adam_v_b2_p0" in err and "\n" not in err


def test_ssd_dir_checked_before_training(tmp_path, monkeypatch, capsys):
    plan = make_plan("tiny-gpt", "vertical", "states_ssd", iterations=1)
    f = tmp_path / "plan.json"
    write_plan(plan, f)
    started = []
    monkeypatch.setattr(Executor, "run_round", lambda self, *a: started.append(1))
    base = ["run", str(f), "--steps", "1", "--device", "cpu"]
    assert main(base) == 2
    assert "no --ssd-dir" in capsys.readouterr().err
    assert main([*base, "--ssd-dir", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else True)
    assert main([*base, "--ssd-dir", str(ro)]) == 2
    assert "not writable" in capsys.readouterr().err
    with pytest.raises(SsdError, match=r"GB free, the plan needs .* GB there"):
        check_ssd_dir(tmp_path, 1e18, "optimizer states")
    assert not started


def test_out_of_memory_names_the_plan_decision(tmp_path, monkeypatch, capsys):
    plan = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    f = tmp_path / "plan.json"
    write_plan(plan, f)

    def oom(self, rs, t):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(WeightOps, "fetch_weights", oom)
    assert main(["run", str(f), "--steps", "1", "--device", "cpu"]) == 3
    err = capsys.readouterr().err.strip()
    assert "gpu out of memory in op" in err and "fetch_weights" in err and "placement.weights" in err
    assert "prefetch_depth 1" in err and "\n" not in err


def test_bad_plans_are_refused(tmp_path, capsys):
    plan = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    f = tmp_path / "plan.json"
    write_plan(plan, f)
    d = json.loads(f.read_text())
    d["version"] = 99
    f.write_text(json.dumps(d))
    assert main(["run", str(f), "--device", "cpu"]) == 2
    assert "unsupported version 99" in capsys.readouterr().err
    d["version"] = 1
    d["ops"][5]["kind"] = "teleport_weights"
    f.write_text(json.dumps(d))
    assert main(["run", str(f), "--device", "cpu"]) == 2
    assert "digest does not match" in capsys.readouterr().err  # an edited op of a written plan
    del d["digest"]  # a plan without a digest (hand-made, or older): the executor still refuses the kind
    f.write_text(json.dumps(d))
    assert main(["run", str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "'teleport_weights' is not implemented" in err

