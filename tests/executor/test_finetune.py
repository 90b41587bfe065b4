"""Fine-tuning settings: tierflow's per-step losses and final weights equal a plain PyTorch loop's (AdamW with
Hugging Face's decay groups, transformers.get_scheduler, torch.nn.utils.clip_grad_norm_) within 1e-5
relative, for every schedule family, with states on the SSD tier; global clipping is refused where the plan
overlaps the optimizer with the backward; delayed clipping uses the previous step's norm; the settings are
checked on resume; a DeepSpeed config's sections are read."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from support.helpers import accumulate_gradients
from support.runs import HW, SEQ, decay_groups, make_plan, rel_err, run
from transformers import get_scheduler

from tierflow.cli import main
from tierflow.executor.data import TokenData
from tierflow.executor.models import BlockModel, build_blocks
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.optim.adamw import TrainHyper
from tierflow.executor.optim.clipping import clip_coef
from tierflow.executor.optim.decay import decayed
from tierflow.executor.optim.lr_schedule import lr_factor
from tierflow.executor.run import (
    CheckpointOptions,
    EvalOptions,
    OptimizerOptions,
    OutputOptions,
    RunError,
)
from tierflow.planner.core.clipwait import OPTIMIZER_KINDS, grad_ops, wait_for_norm, waits_for_norm
from tierflow.planner.core.models import get_model
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import simulate_graph
from tierflow.planner.io.clipreport import clip_cost
from tierflow.planner.io.deepspeed.train import DsTrainError, ds_training_settings
from tierflow.planner.io.planfile import write_plan

STEPS = 20
BATCH, MICRO = 2, 1  # two micro-batches a step: gradient accumulation, at half test_executor's cost


def options_of(h: TrainHyper) -> OptimizerOptions:
    """The run's optimizer options of the reference's settings `h`."""
    return OptimizerOptions(lr=h.lr, weight_decay=h.weight_decay, betas=(h.beta1, h.beta2), eps=h.eps,
                            schedule=h.schedule, warmup_steps=h.warmup_steps, clip_grad_norm=h.clip_grad_norm,
                            clip=h.clip, total_steps=h.total_steps or None)


@functools.cache
def reference(model_name: str, h: TrainHyper, steps: int = STEPS):
    """Plain PyTorch with the same init, data order, decay groups, schedule and clipping."""
    model = get_model(model_name)
    torch.manual_seed(0)
    ref = BlockModel(model, build_blocks(model))
    opt = torch.optim.AdamW(decay_groups(ref, h.weight_decay), lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps)
    sched = get_scheduler(h.schedule, opt, num_warmup_steps=h.warmup_steps, num_training_steps=steps)
    data = TokenData.load(None, model.vocab_size, seed=0)
    losses, prev_norm = [], None
    for s in range(steps):
        x, y = data.batch(s, BATCH, SEQ)
        opt.zero_grad()
        total = accumulate_gradients(ref, x, y, MICRO)
        if h.clip_grad_norm and h.clip == "global":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), h.clip_grad_norm)
        elif h.clip_grad_norm:  # delayed: the previous step's norm
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
            if prev_norm is not None:
                for p in ref.parameters():
                    p.grad.mul_(clip_coef(h.clip_grad_norm, prev_norm))
            prev_norm = norm
        opt.step()
        sched.step()
        losses.append(total)
    return losses, [torch.cat([p.detach().reshape(-1) for p in b.parameters()]) for b in ref.blocks]


def check_equal(res, ref) -> None:
    ref_losses, ref_weights = ref
    assert len(res.losses) == len(ref_losses)
    for i, (got, want) in enumerate(zip(res.losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {i + 1}: {got} vs {want}"
    for b, (got, want) in enumerate(zip(res.final_master, ref_weights)):
        # the losses within 1e-5 (above); the weights after 20 steps within 3e-5: the executor's head sums the
        # cross-entropy over chunks of the sequence (never the whole fp32 logits), the reference in one piece
        # (tiny-llama's embedding under the vertical mix with global clipping: 2.27e-5 in a fresh environment
        # on 2026-11-28, at the landed code of the day before too)
        assert rel_err(got, want) <= 3e-5, f"block {b}"


@pytest.mark.parametrize("schedule", ["constant_with_warmup", "linear", "cosine"])
def test_lr_factor_is_transformers(schedule):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(schedule, opt, num_warmup_steps=3, num_training_steps=11)
    for step in range(1, 12):
        assert lr_factor(schedule, step, 3, 11) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        sched.step()


# a large clip so that clipping binds at some steps and not at others
CASES = [
    ("tiny-gpt", "horizontal", "states_ssd", 0.0, TrainHyper(lr=3e-3, schedule="cosine", warmup_steps=4,
                                                           total_steps=STEPS, clip_grad_norm=1.0)),
    ("tiny-llama", "horizontal", "device", 0.0, TrainHyper(lr=3e-3, schedule="linear", warmup_steps=3,
                                                          total_steps=STEPS, clip_grad_norm=1.0,
                                                          beta1=0.8, beta2=0.99, eps=1e-6)),
    ("tiny-llama", "fuyou", "states_ssd", 0.0, TrainHyper(lr=3e-3, schedule="cosine", warmup_steps=4,
                                                         total_steps=STEPS, clip_grad_norm=1.0,
                                                         clip="delayed")),
    ("tiny-llama", "vertical", "mix", 0.25, TrainHyper(lr=3e-3, schedule="cosine", warmup_steps=4,
                                                      total_steps=STEPS, clip_grad_norm=1.0)),
    ("tiny-gpt", "block", "weights_cpu", 0.25, TrainHyper(lr=2e-3, schedule="constant_with_warmup",
                                                         warmup_steps=5)),
]


@pytest.mark.parametrize("model_name,family,placement,alpha,h", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[4].clip if c[4].clip_grad_norm else 'noclip'}"
                              for c in CASES])
def test_matches_plain_pytorch_with_schedule_clipping_and_decay_groups(model_name, family, placement, alpha,
                                                                       h, tmp_path):
    plan = make_plan(model_name, family, placement, alpha, batch=BATCH, micro=MICRO)
    res = run(plan, tmp_path, optimizer=options_of(h), steps=STEPS)
    check_equal(res, reference(model_name, h))
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in res.records)
    assert res.records[0].lr == h.lr_at(1)
    if h.clip_grad_norm:  # clipping bound at some step (the test would not see a wrong clip otherwise)
        assert any(r.grad_norm > h.clip_grad_norm for r in res.records)


def test_global_clipping_waits_in_an_overlapped_plan_and_matches(tmp_path):
    """Fuyou overlaps the optimizer with the backward: with global clipping its optimizer steps wait for the
    step's last gradient (the simulator charges it) and the run equals plain PyTorch's clip_grad_norm_."""
    plan = make_plan("tiny-gpt", "fuyou", "states_ssd", batch=BATCH, micro=MICRO)
    assert not waits_for_norm(plan.graph)
    waiting = wait_for_norm(plan.graph)
    assert waits_for_norm(waiting)
    # the simulator charges the wait: with it no optimizer op starts before its step's last gradient op ends,
    # without it some do (the overlap that waiting gives up; the iteration time itself may move either way
    # by a list-scheduling reorder, so the check is on the ops)
    def overlapped(graph) -> int:
        sim, grads = simulate_graph(graph, HW), grad_ops(graph)
        last = {it: max(sim.end_s[g] for g in ids) for it, ids in grads.items()}
        return sum(sim.start_s[t.id] < last[t.iteration] - 1e-12 for t in graph.tasks
                   if t.kind in OPTIMIZER_KINDS and t.iteration in last)

    assert overlapped(plan.graph) > 0
    assert overlapped(waiting) == 0
    h = TrainHyper(lr=3e-3, schedule="linear", warmup_steps=2, total_steps=8, clip_grad_norm=1.0)
    res = run(plan, tmp_path, optimizer=options_of(h), steps=8)
    check_equal(res, reference("tiny-gpt", h, steps=8))
    assert any(r.grad_norm > 1.0 for r in res.records)


def test_global_clipping_is_refused_where_the_plan_cannot_wait(tmp_path):
    """Fuyou as LoHan's code runs it waits for the optimizer's SSD writes before the next layer's weights are
    read for the backward: the step's gradients cannot all come before its first optimizer step."""
    plan = make_plan("tiny-gpt", "fuyou", "mix")
    with pytest.raises(RunError, match="--clip delayed"):
        run(plan, tmp_path, optimizer=OptimizerOptions(clip_grad_norm=1.0), steps=2)


def test_resume_goes_on_with_the_schedule_and_delayed_norm(tmp_path):
    h = TrainHyper(lr=3e-3, schedule="cosine", warmup_steps=2, total_steps=8, clip_grad_norm=1.0,
                   clip="delayed")
    plan = make_plan("tiny-gpt", "fuyou", "weights_cpu", batch=BATCH, micro=MICRO)
    ck = tmp_path / "ck"
    first = run(plan, tmp_path, optimizer=options_of(h), steps=4,
                checkpoint=CheckpointOptions(str(ck), every=2))
    again = TrainHyper(lr=3e-3, schedule="cosine", warmup_steps=2, total_steps=8, clip_grad_norm=1.0,
                       clip="delayed")
    second = run(plan, tmp_path, optimizer=options_of(again), steps=8,
                 checkpoint=CheckpointOptions(str(ck), every=2))
    ref_losses, _ = reference("tiny-gpt", h, steps=8)
    losses = first.losses + second.losses
    assert second.first_step == 4
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    with pytest.raises(RunError, match="--lr-schedule 'cosine' -> 'linear'"):
        linear = TrainHyper(lr=3e-3, schedule="linear", warmup_steps=2, total_steps=8, clip_grad_norm=1.0,
                            clip="delayed")
        run(plan, tmp_path, optimizer=options_of(linear),
            steps=8, checkpoint=CheckpointOptions(str(ck), every=0))


def test_ds_config_sections(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-7,
                                                  "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear",
                                                         "warmup_min_ratio": 0, "cos_min_ratio": 0}},
        "gradient_clipping": 1.5}))
    got, notes = ds_training_settings(cfg)
    assert got == {"lr": 2e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-7, "weight_decay": 0.05,
                   "schedule": "cosine", "warmup_steps": 10, "clip_grad_norm": 1.5}
    assert notes and "cosine" in notes[0]
    cfg.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}))
    with pytest.raises(DsTrainError, match="warmup_type"):
        ds_training_settings(cfg)


def test_cli_flags_reach_the_run(tmp_path, capsys):
    plan = tmp_path / "p.json"
    write_plan(make_plan("tiny-gpt", "fuyou", "weights_cpu"), plan)
    with pytest.raises(SystemExit) as e:
        main(["run", str(plan), "--steps", "3", "--device", "cpu", "--adam-betas", "1.5,0.9"])
    assert e.value.code == 2
    assert "--adam-betas" in capsys.readouterr().err
    code = main(["run", str(plan), "--steps", "3", "--device", "cpu", "--lr-schedule", "linear",
                 "--warmup-steps", "1", "--clip-grad-norm", "0.5", "--clip", "delayed", "--adam-betas",
                 "0.9,0.99", "--json"])
    assert code == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [s["lr"] for s in steps] == pytest.approx([0.0, 1e-3, 5e-4])


def test_finetune_experiment_quick(tmp_path):
    """experiments/finetune.py --quick: stdlib sources, warmup + cosine + clipping; tierflow's losses equal
    plain PyTorch's and the validation loss is reported."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    import finetune

    rows = finetune.run(quick=True, out_dir=tmp_path)
    assert (tmp_path / "finetune.csv").is_file() and (tmp_path / "finetune.png").is_file()
    for r in rows:
        assert abs(r["tierflow_loss"] - r["plain_loss"]) <= 1e-5 * r["plain_loss"]
    assert rows[-1]["tierflow_val"] == pytest.approx(rows[-1]["plain_val"], rel=1e-5)
    assert rows[-1]["tierflow_loss"] < rows[0]["tierflow_loss"]


def trainer_losses(model_name: str, h: TrainHyper, steps: int, out_dir: Path) -> tuple[list[float], set[str]]:
    """Hugging Face's Trainer on the same blocks, data order (a sequential sampler over the steps' sequences),
    schedule, clipping and AdamW settings: its per-step losses (unrounded) and the parameters it decays."""
    from transformers import Trainer, TrainingArguments

    model = get_model(model_name)
    torch.manual_seed(0)
    ref = BlockModel(model, build_blocks(model))
    data = TokenData.load(None, model.vocab_size, seed=0)
    items = []
    for s in range(steps):
        x, y = data.batch(s, BATCH, SEQ)
        items += [{"input_ids": x[i], "labels": y[i]} for i in range(BATCH)]
    micro: list[float] = []

    class Sequential(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = lm_loss(model(inputs["input_ids"]), inputs["labels"])
            micro.append(loss.item())
            return loss

    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=BATCH // MICRO, max_steps=steps, learning_rate=h.lr,
                             adam_beta1=h.beta1, adam_beta2=h.beta2, adam_epsilon=h.eps,
                             weight_decay=h.weight_decay, lr_scheduler_type=h.schedule,
                             warmup_steps=h.warmup_steps, max_grad_norm=h.clip_grad_norm, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                             dataloader_drop_last=False, optim="adamw_torch", remove_unused_columns=False)
    trainer = Sequential(model=ref, args=args, train_dataset=items)
    trainer.train()
    M = BATCH // MICRO
    decays = set(trainer.get_decay_parameter_names(ref))
    return [sum(micro[k * M:(k + 1) * M]) / M for k in range(steps)], decays


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_trainer_gives_the_same_losses(name, tmp_path):
    """A Hugging Face Trainer run (accelerate) of the same training: its decay groups are tierflow's and its
    per-step losses equal the plain loop's (which equal tierflow's, above) within 1e-5 relative."""
    h = TrainHyper(lr=3e-3, schedule="cosine", warmup_steps=4, total_steps=STEPS, clip_grad_norm=1.0)
    got, decays = trainer_losses(name, h, STEPS, tmp_path)
    model = get_model(name)
    ref = BlockModel(model, build_blocks(model))
    assert decays == {n for n, _p in ref.named_parameters() if decayed(n.split(".", 2)[2])}
    want, _ = reference(name, h)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i + 1}: Trainer {a} vs plain {b}"


def test_evaluation_steps_csv_and_tensorboard(tmp_path):
    """--eval-every: the validation loss after step 4 is the plain forward's on the final weights over the
    same held-out batches; steps.csv has the new columns; --log-dir writes TensorBoard event files."""
    pytest.importorskip("tensorboard")
    plan = make_plan("tiny-gpt", "vertical", "mix", 0.25, batch=BATCH, micro=MICRO)
    with pytest.raises(RunError, match="--val-fraction"):
        run(plan, tmp_path, optimizer=OptimizerOptions(), steps=2, evaluation=EvalOptions(every=2))
    res = run(plan, tmp_path, optimizer=OptimizerOptions(), steps=4,
              evaluation=EvalOptions(every=2, val_fraction=0.25, batches=2, log_dir=str(tmp_path / "tb")),
              output=OutputOptions(out=str(tmp_path / "out"), quiet=True, collect_final=True))
    assert [r.val_loss is not None for r in res.records] == [False, True, False, True]
    model = get_model("tiny-gpt")
    ref = BlockModel(model, build_blocks(model))
    for block, w in zip(ref.blocks, res.final_master):
        torch.nn.utils.vector_to_parameters(w, block.parameters())
    _, val = TokenData.load(None, model.vocab_size, seed=0).split(0.25)
    with torch.no_grad():
        want = sum(float(lm_loss(ref(x), y)) for x, y in (val.batch(i, BATCH, SEQ) for i in range(2))) / 2
    assert res.records[-1].val_loss == pytest.approx(want, rel=1e-6)
    head = (tmp_path / "out" / "steps.csv").read_text().splitlines()[0].split(",")
    assert {"lr", "grad_norm", "val_loss", "val_ppl", "ssd_bytes"} <= set(head)
    assert any(f.name.startswith("events.out.tfevents") for f in (tmp_path / "tb").iterdir())


def test_plan_reports_what_clipping_costs():
    """tierflow plan --clip-grad-norm's report (clip_cost): the waiting graph simulated against the plan's, or
    the plan cannot wait and the line names --clip delayed."""
    for placement, can in (("states_ssd", True), ("mix", False)):
        plan = make_plan("tiny-gpt", "fuyou", placement)
        without = simulate_config(plan.model, HW, plan.config, plan.graph)
        cost = clip_cost(plan.model, HW, plan.config, plan.graph, without)
        assert cost.to_dict()["global_possible"] is can
        if can:
            assert waits_for_norm(cost.graph) and cost.result.iteration_s > without.iteration_s
            assert "s without (+" in cost.line()
        else:
            assert cost.graph is plan.graph and "--clip delayed" in cost.line()
