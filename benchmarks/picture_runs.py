"""The runs behind the docs' pictures (``benchmarks/draw_pictures.py`` draws them): small, seeded CPU runs whose
per-step data is read from the run itself, returned as plain JSON-ready dicts.

* :func:`ladder_run`: a float16 ``opt_level="auto"`` Trainer run of ``GainSum`` (its unnormalised sum overflows
  float16 at O2 once training has grown its activations; at O1 the product is fp32), Adam with a per-step LR
  schedule. Per optimizer step: the training loss, the loss scale and rung the step ran at, its LR, whether its grads
  were non-finite (a skipped step), and the ladder's state after it (moves, rollback point, snapshots).
* :func:`scale_run`: a float16 O2 run with a dynamic loss scale and a short ``growth_interval`` on a small MLP whose
  every ``big_every``-th batch is ``big_factor`` times larger: per step the scale it ran at and whether it was skipped.
* :func:`tp_ranks` / :func:`finish_tp_ranks`: ``tp_fused``'s plan at ``tensor_parallel_size=2`` applied to a
  tiny ``transformers`` Llama on two gloo ranks (this process is rank 0, a child process rank 1), as the strategy
  does at setup: the plan (:func:`~lightning_amp.parallel.plan.build_plan`), the plan report, which slice of each
  original weight every rank holds (found by comparing the shard with the unconverted weight), the collectives each
  rank issued in one forward and backward and in which module, and how far the ranks' logits are from one process's.

Units: steps are optimizer steps counted from 1 (step ``t`` is the ``t``-th optimizer step; the ladder's ``moved_at``
and ``snapshot_step`` count the same way, a snapshot at step ``s`` holding the state after ``s`` steps); a loss scale
is the factor the step's backward ran at; a learning rate is the one the step used; losses are what
``training_step`` returned (fp32; ``inf`` where the forward overflowed).

Importing this file imports no torch (so a rank can be started first); ``python benchmarks/picture_runs.py
--tp-rank R --tp-init FILE --tp-out FILE`` is one rank of the tensor-parallel run (what :func:`tp_ranks` starts).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

#: the ladder run: GainSum's gain, steps, batch, Adam's lr and its per-step decay, the rules, the seeds
LADDER = {"gain": 2000.0, "steps": 100, "batch": 32, "lr": 1e-2, "decay": 0.98, "nonfinite_in_a_row": 3,
          "snapshot_every": 10, "model_seed": 0, "data_seed": 1}
#: the loss-scale run: O2 float16, a dynamic scale from init_scale doubled after growth_interval clean steps
SCALE = {"steps": 150, "batch": 32, "lr": 1e-3, "init_scale": 2.0**16, "growth_interval": 10, "big_every": 25,
         "big_factor": 30.0, "model_seed": 0, "data_seed": 1}
#: the tensor-parallel run: a tiny Llama (4 query heads, 2 key/value heads) of which `block` is drawn
TP = {"tp": 2, "block": "model.layers.0", "tokens": [2, 8], "seed": 0,
      "llama": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}}
TP_TIMEOUT_S = 300


def run_facts() -> dict:
    """What every picture's footer names: the checkout's commit (``+dirty`` with local changes), the date (UTC),
    torch and Lightning."""
    import lightning
    import torch

    from lightning_amp.bench.meta import commit

    return {"commit": commit(), "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "torch": torch.__version__, "lightning": lightning.__version__}


# ------------------------------------------------------------------ the Trainer runs


@functools.cache
def _lightning_classes() -> SimpleNamespace:
    """The callback and the two LightningModules (defined on first use: importing this file imports no torch)."""
    import lightning as L
    import torch
    from torch import nn

    def adam(module, lr, decay=None):
        optimizer = torch.optim.Adam(module.parameters(), lr=lr)
        if decay is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: decay ** step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class StepRecorder(L.Callback):
        """Reads the precision plugin around every optimizer step into ``rows`` (units: the module docstring)."""

        def __init__(self) -> None:
            self.rows: list = []
            self.now: dict = {}

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            plugin = trainer.precision_plugin
            self.now = {"scale": plugin.loss_scale}
            if getattr(plugin, "ladder", None) is not None:
                self.now["rung"] = plugin.ladder.index

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # the grads are unscaled here
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.now["nonfinite"] = not all(bool(torch.isfinite(g).all()) for g in grads)
            self.now["lr"] = optimizer.param_groups[0]["lr"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            plugin = trainer.precision_plugin
            row = dict(self.now, step=trainer.global_step, loss=float(outputs["loss"]),
                       skipped_total=plugin.skipped_steps, scale_after=plugin.loss_scale)
            ladder = getattr(plugin, "ladder", None)
            if ladder is not None:
                good = ladder.snapshots.good
                row.update(ladder_steps=ladder.steps, rung_after=ladder.index, changes=ladder.changes,
                           moved_at=ladder.moved_at, snapshot_step=ladder.snapshot_step,
                           good_snapshot=None if good is None else good.step)
            self.rows.append(row)

    class GainSum(L.LightningModule):
        """fc -> relu -> x gain (an fp32 Parameter of LADDER["gain"]) -> unnormalised sum of 64 terms -> head;
        Adam with LADDER's per-step decay."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(LADDER["model_seed"])
            self.fc, self.head = nn.Linear(16, 64), nn.Linear(1, 1)
            self.gain = nn.Parameter(torch.full((64,), LADDER["gain"]))

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.head((torch.relu(self.fc(x)) * self.gain).sum(-1, keepdim=True) * 1e-5)
            return nn.functional.mse_loss(out.float(), y)

        def configure_optimizers(self):
            return adam(self, LADDER["lr"], LADDER["decay"])

    class SmallMLP(L.LightningModule):
        """16 -> 64 -> GELU -> 1 on the summed (not averaged) squared error; Adam at SCALE["lr"]."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SCALE["model_seed"])
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x).float() - y).pow(2).sum()

        def configure_optimizers(self):
            return adam(self, SCALE["lr"])

    return SimpleNamespace(StepRecorder=StepRecorder, GainSum=GainSum, SmallMLP=SmallMLP)


def _fit(module, plugin, data, steps: int, batch: int) -> tuple:
    """Train ``module`` on ``data`` (a TensorDataset, in order) for ``steps`` optimizer steps on the CPU under
    ``plugin``, single-threaded; returns the recorder's rows and the messages of the warnings the run issued."""
    import lightning as L
    import torch

    torch.set_num_threads(1)  # the steps that overflow must not depend on the machine's core count
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    recorder = _lightning_classes().StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], callbacks=[recorder],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch))
    return recorder.rows, [str(w.message) for w in caught]


def ladder_run() -> dict:
    """The float16 ``opt_level="auto"`` run of ``GainSum`` (module docstring), one fresh batch per step (inputs in
    [1, 2), targets in [0, 1)). ``rows``: one dict per optimizer step (``step``, ``loss``, ``scale``, ``rung`` (index
    into ``rungs``) and ``lr`` the step ran at, ``nonfinite``, and after it ``skipped_total``, ``scale_after``,
    ``ladder_steps``, ``rung_after``, ``changes``, ``moved_at``, ``snapshot_step``, ``good_snapshot``); ``final``:
    the plugin's state after the run; ``warnings``: the ladder's."""
    import torch

    from lightning_amp import AmpAutoPrecision, LadderRules

    c = LADDER
    gen = torch.Generator().manual_seed(c["data_seed"])
    n = c["steps"] * c["batch"]
    data = torch.utils.data.TensorDataset(torch.rand(n, 16, generator=gen) + 1.0, torch.rand(n, 1, generator=gen))
    rules = LadderRules(nonfinite_in_a_row=c["nonfinite_in_a_row"], snapshot_every=c["snapshot_every"])
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=rules)
    rows, messages = _fit(_lightning_classes().GainSum(), plugin, data, c["steps"], c["batch"])
    ladder = plugin.ladder
    return {"config": c, "rows": rows, "rungs": [str(r) for r in ladder.rungs],
            "final": {"rung": ladder.index, "changes": ladder.changes, "moved_at": ladder.moved_at,
                      "snapshot_step": ladder.snapshot_step, "reason": ladder.reason, "steps": ladder.steps,
                      "skipped_steps": plugin.skipped_steps},
            "warnings": [m for m in messages if "ladder:" in m]}


def scale_run() -> dict:
    """The float16 O2 dynamic-scale run of ``SmallMLP`` (module docstring), one fresh standard-normal batch per
    step; ``rows`` as :func:`ladder_run`'s without the ladder's fields; ``big_steps``: the steps whose batch was
    ``big_factor`` times larger; ``skipped_steps``: the plugin's count after the run; ``scaler``: its scaler's rule
    (growth and back-off factors, growth interval, hysteresis, floor and ceiling)."""
    import torch

    from lightning_amp import AmpO2Precision

    c = SCALE
    gen = torch.Generator().manual_seed(c["data_seed"])
    n = c["steps"] * c["batch"]
    x, y = torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen)
    big = [step for step in range(1, c["steps"] + 1) if step % c["big_every"] == 0]
    for step in big:  # the batch of optimizer step `step`
        x[(step - 1) * c["batch"]:step * c["batch"]] *= c["big_factor"]
    plugin = AmpO2Precision(dtype="float16", loss_scale="dynamic", init_scale=c["init_scale"],
                         growth_interval=c["growth_interval"])
    data = torch.utils.data.TensorDataset(x, y)
    rows, _ = _fit(_lightning_classes().SmallMLP(), plugin, data, c["steps"], c["batch"])
    scaler = plugin.scalers[0]
    rule = {k: getattr(scaler, k) for k in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                                            "min_loss_scale", "max_loss_scale")}
    return {"config": c, "rows": rows, "big_steps": big, "skipped_steps": plugin.skipped_steps, "scaler": rule}


# ------------------------------------------------------------------ the tensor-parallel run


def tiny_llama():
    """The seeded ``transformers`` Llama of :data:`TP` (built from its config class: no download), in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(TP["seed"])
    return LlamaForCausalLM(LlamaConfig(**TP["llama"])).eval()


def held_slice(full, shard) -> dict:
    """Which part of ``full`` (a Linear's ``[out, in]`` weight) ``shard`` is, found by comparing values: ``dim``
    "rows" (output features), "columns" (input features) or "whole"; ``ranges``: the ``[start, stop)`` index
    ranges of that dim it holds, in the shard's order; ``of``: that dim's full size; ``shape``: the shard's shape.
    ValueError when ``shard`` is none of these."""
    import torch

    shape = list(shard.shape)
    if shard.shape == full.shape and torch.equal(shard, full):
        return {"dim": "whole", "ranges": [[0, full.shape[0]]], "of": full.shape[0], "shape": shape}
    for dim, part, whole in (("rows", shard, full), ("columns", shard.t(), full.t())):
        if part.shape[1] != whole.shape[1]:
            continue
        match = (part[:, None, :] == whole[None, :, :]).all(-1)
        if bool((match.sum(1) == 1).all()):
            ranges: list = []
            for index in match.float().argmax(1).tolist():
                if ranges and ranges[-1][1] == index:
                    ranges[-1][1] = index + 1
                else:
                    ranges.append([index, index + 1])
            return {"dim": dim, "ranges": ranges, "of": whole.shape[0], "shape": shape}
    raise ValueError(f"a shard of shape {shape} is neither whole rows nor whole columns of a {list(full.shape)} weight")


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


@contextlib.contextmanager
def watched(model):
    """Watch one forward and backward of ``model``: yields a namespace whose ``order`` lists its leaf modules in the
    order their forwards ran and whose ``calls`` lists every ``torch.distributed`` collective as ``{"phase", "module",
    "op", "shape"}`` (forward: the innermost module running; backward, after ``phase`` is set to "backward": the leaf
    whose output's autograd node is running, known through the node's public hooks, or, for a collective between two
    leaves' nodes, the leaf whose node ran last: the column layers of a unit share one input collective, which runs
    once their nodes are done). The collectives are wrapped inside the block only."""
    import torch.distributed as dist

    seen = SimpleNamespace(order=[], calls=[], phase="forward", stack=[], node=None, last=None)
    handles = []

    def pre(name, leaf):
        def hook(module, args):
            seen.stack.append(name)
            if leaf:
                seen.order.append(name)
        return hook

    def post(name, leaf):
        def hook(module, args, output):
            seen.stack.pop()
            node = getattr(output, "grad_fn", None)
            if leaf and node is not None:
                node.register_prehook(lambda grads: setattr(seen, "node", name) or setattr(seen, "last", name))
                node.register_hook(lambda grad_inputs, grad_outputs: setattr(seen, "node", None))
        return hook

    for name, module in model.named_modules():
        leaf = not list(module.children())
        handles += [module.register_forward_pre_hook(pre(name, leaf)), module.register_forward_hook(post(name, leaf))]

    def wrap(op, original):
        def recorded(tensor, *args, **kwargs):
            where = (seen.stack[-1] if seen.stack else None) if seen.phase == "forward" else seen.node or seen.last
            seen.calls.append({"phase": seen.phase, "module": where, "op": op, "shape": list(tensor.shape)})
            return original(tensor, *args, **kwargs)
        return recorded

    originals = {op: getattr(dist, op) for op in _COLLECTIVES}
    for op, original in originals.items():
        setattr(dist, op, wrap(op, original))
    try:
        yield seen
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
        for handle in handles:
            handle.remove()


def tp_rank(rank: int, init_file: str) -> dict:
    """One rank of the tensor-parallel run: a gloo group of ``TP["tp"]`` ranks met through ``init_file``; the plan
    built and applied as ``tp_fused`` does at setup (:func:`~lightning_amp.parallel.plan.build_plan`, then
    :func:`~lightning_amp.parallel.convert.convert` with this rank's slices of the same seeded weights); one
    forward and backward of a seeded batch of tokens watched (:func:`watched`). Returns the plan's units, the plan
    report (as a dict and as text), per converted layer the slice this rank holds (:func:`held_slice`), the
    collectives, the leaf modules in forward order with their classes before and after, and the largest difference
    of this rank's logits from the unconverted model's (``max_abs_diff``; ``logits_scale`` their largest magnitude)."""
    import torch
    import torch.distributed as dist

    from lightning_amp.parallel import TensorParallelConfig
    from lightning_amp.parallel.convert import PARALLEL_LAYERS, convert as apply_checked_plan
    from lightning_amp.parallel.plan import build_plan

    torch.set_num_threads(1)
    tp = TP["tp"]
    dist.init_process_group("gloo", init_method=Path(init_file).absolute().as_uri(), rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))
    try:
        model = tiny_llama()
        tokens = torch.randint(TP["llama"]["vocab_size"], TP["tokens"], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            reference = model(tokens).logits
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        before = {name: type(module).__name__ for name, module in model.named_modules()}
        plan = build_plan(model, "auto", tp)
        report = apply_checked_plan(model, plan, None, TensorParallelConfig(tensor_parallel_size=tp))
        with watched(model) as seen:
            logits = model(tokens).logits
            seen.phase = "backward"
            logits.float().pow(2).mean().backward()
        units = [{"family": u.family, "found_by": u.found_by, "columns": list(u.columns), "rows": list(u.rows),
                  "replicated": sorted(u.replicated_heads),
                  "heads": None if u.attention_shape is None else dataclasses.asdict(u.attention_shape)}
                 for u in plan.units]
        return {"rank": rank, "tp": tp, "order": seen.order, "calls": seen.calls, "units": units,
                "decisions": dict(plan.decisions), "whole": dict(plan.whole), "report": dataclasses.asdict(report),
                "report_text": report.format(), "classes_before": before,
                "classes_after": {name: type(module).__name__ for name, module in model.named_modules()},
                "shards": {name: held_slice(full[f"{name}.weight"], module.weight.detach())
                           for name, module in model.named_modules() if isinstance(module, PARALLEL_LAYERS)},
                "max_abs_diff": float((logits.detach() - reference).abs().max()),
                "logits_scale": float(reference.abs().max())}
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def tp_ranks(folder: str):
    """Start ranks 1.. of the tensor-parallel run as child processes (they wait for rank 0 at a rendezvous file in
    ``folder`` and write their results there) and yield them for :func:`finish_tp_ranks`, which runs rank 0; a child
    still running when the block ends (rank 0 never came: an error before it) is killed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    children = [subprocess.Popen([sys.executable, __file__, "--tp-rank", str(rank),
                                  "--tp-init", os.path.join(folder, "rendezvous"),
                                  "--tp-out", os.path.join(folder, f"rank{rank}.json")], env=env)
                for rank in range(1, TP["tp"])]
    try:
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def finish_tp_ranks(folder: str, children: list) -> dict:
    """Run rank 0 in this process and wait for ``children`` (:func:`tp_ranks`); returns ``{"config": TP, "ranks":
    [rank 0's :func:`tp_rank` dict, rank 1's, ...]}``. RuntimeError naming the rank when a child fails."""
    ranks = [tp_rank(0, os.path.join(folder, "rendezvous"))]
    for rank, child in enumerate(children, start=1):
        if child.wait(timeout=TP_TIMEOUT_S) != 0:
            raise RuntimeError(f"tensor-parallel rank {rank} exited with {child.returncode}")
        ranks.append(json.loads(Path(folder, f"rank{rank}.json").read_text()))
    return {"config": TP, "ranks": ranks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one rank of the pictures' tensor-parallel run")
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--tp-init", required=True, help="the rendezvous file every rank names")
    parser.add_argument("--tp-out", required=True, help="where this rank writes its JSON")
    args = parser.parse_args(argv)
    Path(args.tp_out).write_text(json.dumps(tp_rank(args.tp_rank, args.tp_init)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
