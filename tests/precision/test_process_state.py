"""The process-wide state a run changes (docs/architecture.md, "Process-wide state"), each item gone after
``fit``: torch's default dtype, the functions the cast lists patch, O2's op-policy kernels, the global forward
pre-hook of a recomputing backward, the environment; and Lightning's ThroughputMonitor lookup, wrapped for
our plugins only."""
import gc
import os
import pathlib
import pickle
import threading

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import connector as fabric_connector
from lightning.pytorch.callbacks import throughput_monitor
from lightning.pytorch.trainer.connectors import accelerator_connector as trainer_connector
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from torch.nn.modules import module as torch_module
from torch.utils.checkpoint import checkpoint

from lightning_amp import AmpPrecision, register_float_function
from lightning_amp.amp import casts, function_backward, process_state
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.process_state import ProcessChange
from lightning_amp.amp.runtime import AmpRuntime
from lightning_amp.fabric import FabricAmpO2Precision
from lightning_amp.plugin_base import CONNECTORS_CHANGE, THROUGHPUT_CHANGE, AmpPluginBase
from support.trainer import quiet_lightning

LEVELS = ("O1", "O2", "O3")
ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Net(L.LightningModule):
    """BatchNorm, LayerNorm, an activation-checkpointed block (a recomputing backward) and a BCE loss."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self(x).float().squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g).float()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _held_by_live_plugins():
    """The holds of Lightning's wrapped objects that plugins still alive in this process account for (a test
    session keeps plugins built for parametrizations alive; each holds them until its teardown or collection)."""
    gc.collect()
    counts = {}
    for plugin in (obj for obj in gc.get_objects() if isinstance(obj, AmpPluginBase)):
        hold = getattr(plugin, "_lightning_hold", None)
        if hold is not None and hold.alive:
            for name in plugin.lightning_changes:
                counts[name] = counts.get(name, 0) + 1
    return counts


def _active_beyond_live_plugins():
    """``process_state.active()`` less what live plugins hold (``{}``: as in a fresh process after the run)."""
    held = _held_by_live_plugins()
    active = {name: holds - held.get(name, 0) for name, holds in process_state.active().items()}
    return {name: holds for name, holds in active.items() if holds}


def _snapshot():
    return dict(
        default_dtype=torch.get_default_dtype(),
        functions={(id(m), name): getattr(m, name) for m, name, _ in casts._patch_targets()},
        patch_depth=casts.patch_depth(),
        function_apply=(vars(torch.autograd.Function)["apply"], function_backward.depth()),
        policy_installs=o2_policy.installs(),
        pre_hooks=dict(torch_module._global_forward_pre_hooks),
        environ=dict(os.environ),
        active=_active_beyond_live_plugins(),
    )


@pytest.fixture(scope="module")
def before_and_after():
    """The state before and after one ``fit`` per level (O1 with a registered cast-list function too)."""
    register_float_function(torch, "sigmoid")
    gc.collect()  # plugins of earlier tests no longer referenced give their holds back when they are collected
    try:
        before, after = _snapshot(), {}
        for level in LEVELS:
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, plugins=[AmpPrecision(level, dtype="bfloat16")],
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
            with quiet_lightning():
                trainer.fit(_Net())
            after[level] = _snapshot()
    finally:
        casts.unregister_function(torch, "sigmoid")
    return before, after


@pytest.mark.parametrize("level", LEVELS)
def test_default_dtype_is_restored(before_and_after, level):
    before, after = before_and_after
    assert after[level]["default_dtype"] == before["default_dtype"] == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_patched_functions_are_the_originals_again(before_and_after, level):
    before, after = before_and_after
    assert after[level]["patch_depth"] == 0
    assert after[level]["functions"] == before["functions"]
    assert after[level]["function_apply"] == before["function_apply"]  # torch's Function.apply, no O2 forward open
    assert before["function_apply"][1] == 0


@pytest.mark.parametrize("level", LEVELS)
def test_o2_policy_kernels_are_unregistered(before_and_after, level):
    before, after = before_and_after
    assert after[level]["policy_installs"] == before["policy_installs"] == 0


@pytest.mark.parametrize("level", LEVELS)
def test_no_global_forward_hook_is_left(before_and_after, level):
    before, after = before_and_after
    assert after[level]["pre_hooks"] == before["pre_hooks"]


@pytest.mark.parametrize("level", LEVELS)
def test_environment_is_unchanged(before_and_after, level):
    before, after = before_and_after
    assert after[level]["environ"] == before["environ"]


def test_lightnings_objects_are_wrapped_while_a_plugin_of_ours_is_about_and_counted():
    """The ThroughputMonitor lookup and the constructors of Lightning's connectors (plugin_kinds.py) are process-wide
    changes held by our plugins from their construction to their teardown (or collection), reported by
    ``active()``, and Lightning's own again when the last one is gone; meanwhile Lightning's own plugins get
    Lightning's answer. A plugin unpickled in a spawned process holds them again."""
    assert _active_beyond_live_plugins() == {}
    base = _held_by_live_plugins()  # {} in a fresh process; a session keeps other tests' plugins alive

    def holding(connectors, throughput):
        counts = {CONNECTORS_CHANGE: base.get(CONNECTORS_CHANGE, 0) + connectors,
                  THROUGHPUT_CHANGE: base.get(THROUGHPUT_CHANGE, 0) + throughput}
        return {name: holds for name, holds in counts.items() if holds}

    lightnings = throughput_monitor._plugin_to_compute_dtype
    inits = fabric_connector._Connector.__init__, trainer_connector._AcceleratorConnector.__init__
    plugin = AmpPrecision("O2", dtype="float16")
    lookup = throughput_monitor._plugin_to_compute_dtype
    assert lookup(plugin) == torch.float16 and (lookup is not lightnings or THROUGHPUT_CHANGE in base)
    assert lookup(MixedPrecision("bf16-mixed", "cpu")) == torch.bfloat16 and lookup(HalfPrecision("16-true")) == torch.float16
    fabric_plugin = FabricAmpO2Precision()
    assert process_state.active() == holding(2, 1)
    plugin.teardown()
    assert process_state.active() == holding(1, 0)
    assert throughput_monitor._plugin_to_compute_dtype is lightnings  # as it was before this plugin
    copy = pickle.loads(pickle.dumps(plugin.__class__("O1", dtype="bfloat16")))  # the original is collected at once
    assert process_state.active() == holding(2, 1)
    del copy, fabric_plugin
    assert process_state.active() == holding(0, 0)
    if not base:
        assert throughput_monitor._plugin_to_compute_dtype is lightnings
        assert (fabric_connector._Connector.__init__, trainer_connector._AcceleratorConnector.__init__) == inits


@pytest.mark.parametrize("level", LEVELS)
def test_the_report_of_what_is_active_is_empty_before_and_after_a_run(before_and_after, level):
    before, after = before_and_after
    assert before["active"] == after[level]["active"] == {}


ACTIVE_IN_FORWARD = {
    "O1": {"torch functions patched by the cast lists"},
    "O2": {"torch functions patched by the cast lists", "torch.autograd.Function.apply",
           "O2's op policy: kernels registered on autocast's dispatch keys"},
    "O3": {"torch's default dtype"},
}


@pytest.mark.parametrize("level", LEVELS)
def test_the_report_names_what_a_forward_holds_and_what_a_recomputing_backward_adds(level):
    amp = AmpRuntime(level, dtype="bfloat16", device_type="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    amp.prepare(model, hold_policy=False)
    with amp.forward_context():
        inside = process_state.active()
    with amp.backward_context():
        in_backward = process_state.active()
    amp.release()
    outside = set(_held_by_live_plugins())
    assert set(inside) - outside == ACTIVE_IN_FORWARD[level] and all(holds >= 1 for holds in inside.values())
    assert ("global module forward pre-hooks (a recomputing backward)" in in_backward) == (level != "O1")
    assert _active_beyond_live_plugins() == {}


def test_every_change_the_report_knows_is_in_the_architecture_table():
    process_state.active()  # imports every owner, so every change is registered
    table = (ROOT / "docs" / "architecture.md").read_text().split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    assert len(process_state.CHANGES) >= 5
    assert [name for name in process_state.CHANGES if f"`{name}`" not in table] == []


def test_a_change_is_applied_by_its_first_holder_and_undone_by_its_last_from_any_thread():
    log = []
    change = ProcessChange("a test change", lambda: log.append("apply") or len(log), lambda token: log.append(token))
    try:
        with change.held():
            threads = [threading.Thread(target=change.acquire) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert change.holders == 4 and process_state.active("a test change") == {"a test change": 4}
        for _ in range(3):
            change.release()
        assert log == ["apply", 1] and change.holders == 0 and process_state.active("a test change") == {}
        with pytest.raises(RuntimeError, match="released more often than acquired"):
            change.release()
        with pytest.raises(ValueError, match="already registered"):
            ProcessChange("a test change", lambda: None, lambda token: None)
    finally:
        del process_state.CHANGES["a test change"]


def test_an_apply_that_fails_leaves_nothing_held():
    def fail():
        raise OSError("cannot")

    change = ProcessChange("a failing change", fail, lambda token: None)
    try:
        with pytest.raises(OSError), change.held():
            pass
        assert change.holders == 0
    finally:
        del process_state.CHANGES["a failing change"]


def test_a_finished_run_keeps_nothing_of_it_alive(level="auto"):  # "auto": its ladder watches the gates too
    """Once the user drops them, the model, the optimizer (its params and state) and the plugin of a finished run are
    collected, so the plugin's holds on Lightning's objects are given back: the step gate of each optimizer (what a
    skip-aware scheduler consults) is held weakly. Former code: the global map of gates held each gate strongly, and a
    gate's skip callback held its optimizer, so every Fabric run stayed in memory and its plugin's hold counted on."""
    import weakref

    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_amp.amp.gate import gate_of, make_scheduler_skip_aware
    from lightning_amp.fabric import FabricAmpPrecision

    def fabric_run():
        plugin = FabricAmpPrecision(opt_level=level)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        make_scheduler_skip_aware(scheduler)
        wrapped_model, wrapped_optimizer = fabric.setup(model, optimizer)
        for _ in range(2):
            fabric.backward(wrapped_model(torch.randn(3, 4)).float().sum())
            wrapped_optimizer.step()
            scheduler.step()
        assert gate_of(optimizer) is not None  # consulted during the run
        return [weakref.ref(o) for o in (plugin, model, optimizer)]

    def trainer_run():
        plugin = AmpPrecision(level, **({} if level == "auto" else {"dtype": "bfloat16"}))
        model = BoringModel()
        trainer = L.Trainer(accelerator="cpu", max_steps=2, plugins=[plugin], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        with quiet_lightning():
            trainer.fit(model)
        return [weakref.ref(o) for o in (plugin, model, trainer.optimizers[0])]

    gc.collect()
    before = _active_beyond_live_plugins()
    for run in (fabric_run, trainer_run):
        refs = run()
        gc.collect()
        assert [ref() for ref in refs] == [None] * 3, run.__name__
        assert _active_beyond_live_plugins() == before
