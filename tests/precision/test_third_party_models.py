"""Models nobody in this project wrote, trained at O1/O2/O3 x bf16/fp16 through a real Trainer (CPU).

The matrix a user expects us to have run: Lightning's demo Transformer (its own LightningModule),
tiny randomly initialised ``transformers`` BERT / GPT-2 / Llama / T5 built from their config
classes (no downloads), a BatchNorm CNN and an LSTM/GRU stack. Each cell trains a few steps on
one fixed batch and checks:

* every loss is finite, the last is below the first, and every stepped param moved from its
  value after the cast (O3: >= 90%, pure half rounds some updates away);
* the first step's outputs (logits, and BERT's attention probabilities) are within rounding of
  the fp32 reference's, compared elementwise (same weights, same batch): norm-wise relative
  difference <= ``FIRST_LOGITS_ULPS`` x eps of the half dtype (see ``FIRST_LOGITS_ULPS``);
* the level's semantics: the optimizer steps the module's own params at every level; O1 and O2
  fp32 params (O2's forward sees half copies); O3 half params everywhere.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import nn
from torch.nn.modules.loss import _Loss
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_amp import AmpO1Precision, AmpO2Precision, AmpO3Precision, main_params
from lightning_amp.amp.o2 import policy as o2_policy
from support.trainer import LossRecorder, quiet_lightning

try:
    import transformers
except ImportError:  # only the cells of the `transformers` models need it
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="this cell's model comes from `transformers`")

STEPS = 4
VOCAB, SEQ, BATCH, HIDDEN = 64, 16, 4, 32
PLUGINS = {"O1": AmpO1Precision, "O2": AmpO2Precision, "O3": AmpO3Precision}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

FIRST_LOGITS_ULPS = 4
"""The first step's outputs of a half run (logits, and attention probabilities where returned) may
differ from fp32 by this many eps of the half dtype (norm-wise relative, the worst part).

Rounding the weights and the inputs to the half dtype moves each by <= eps/2 (relative); a few
layers of half matmuls and activations add a few such roundings more. Measured over this matrix
(2026-11-23, fresh build of every cell): <= 1.34 eps (BERT fp16), 0.2-1.0 eps elsewhere: 4 eps
leaves a margin of 3x. What it must catch, measured on the fp32 models: a dropped attention mask
moves BERT's attention probabilities by 0.23 relative (30 bf16 eps; its logits by only 1.5e-3, which
is why the attentions are compared), a zeroed position table moves BERT's / GPT-2's logits by
0.93 / 0.72, halved word embeddings move the transformers models' logits by 0.41-0.65.
"""


def _first_logits_tolerance(dtype: torch.dtype) -> float:
    return FIRST_LOGITS_ULPS * torch.finfo(dtype).eps


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


# ---------------------------------------------------------------------------------------- models


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _adamw(params, lr: float) -> torch.optim.Optimizer:
    # eps 1e-4: the default 1e-8 is 0 in float16, and O3 steps fp16 params directly (the plugin warns)
    return torch.optim.AdamW(params, lr=lr, eps=1e-4)


class DemoTransformer(LightningTransformer):
    """Lightning's demo LightningModule, unchanged but for a tiny model and no WikiText2 download."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, ninp=HIDDEN, nhead=2, nhid=HIDDEN, nlayers=2, dropout=0.0)

    def prepare_data(self) -> None:
        pass

    @staticmethod
    def batch():
        return _tokens(1), _tokens(2)


class HFModule(L.LightningModule):
    """A Hugging Face model as users wrap it: ``training_step`` returns ``model(**batch).loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self):
        return _adamw(self.parameters(), lr=3e-3)


def _bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * HIDDEN,
        max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",  # returns its attention probabilities
    )
    # the attention probabilities are compared too: a dropped mask moves the (tiny, random) model's
    # logits by ~1e-3 relative, below half rounding, but its attention by ~0.23
    batch = {"input_ids": _tokens(1), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
             "labels": torch.tensor([0, 1, 2, 1]), "output_attentions": True}
    batch["attention_mask"][0, -3:] = 0  # padding: the mask takes part in the half forward
    return HFModule(transformers.BertForSequenceClassification(config)), batch


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    tokens = _tokens(1)
    return HFModule(transformers.GPT2LMHeadModel(config)), {"input_ids": tokens, "labels": tokens}


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
    )
    tokens = _tokens(1)
    return HFModule(transformers.LlamaForCausalLM(config)), {"input_ids": tokens, "labels": tokens}


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // 2, d_ff=2 * HIDDEN, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    batch = {"input_ids": _tokens(1), "labels": _tokens(2)}
    return HFModule(transformers.T5ForConditionalGeneration(config)), batch


class _FloatClassifier(L.LightningModule):
    """Cross-entropy on ``forward(x)`` for a batch ``(float inputs, labels)``; subclasses build ``forward``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    lr = 1e-2

    def configure_optimizers(self):
        return _adamw(self.parameters(), lr=self.lr)


class BatchNormCNN(_FloatClassifier):
    """conv -> BatchNorm -> ReLU twice, pooled into a linear classifier (float images in the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )

    def forward(self, x):
        return self.net(x)

    @staticmethod
    def batch():
        return torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])


class RecurrentTagger(_FloatClassifier):
    """A 2-layer LSTM feeding a GRU and a linear head (float sequences in the batch)."""

    # Its grads (~1e-3) square below fp16's smallest subnormal, so O3 fp16's fp16 Adam state holds 0
    # and steps of lr * m / eps overshoot; 1e-2 made the 4-step fp16 O3 loss rise on step 4.
    lr = 3e-3

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, HIDDEN, num_layers=2, batch_first=True)
        self.gru = nn.GRU(HIDDEN, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        hidden, _ = self.lstm(x)
        hidden, _ = self.gru(hidden)
        return self.head(hidden[:, -1])

    @staticmethod
    def batch():
        return torch.randn(BATCH, SEQ, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 1])


def _own_batch(cls) -> Callable:
    def build():
        model = cls()
        return model, model.batch()

    return build


MODELS: Dict[str, Callable] = {
    "demo_transformer": _own_batch(DemoTransformer),
    "bert": _bert,
    "gpt2": _gpt2,
    "llama": _llama,
    "t5": _t5,
    "bn_cnn": _own_batch(BatchNormCNN),
    "lstm": _own_batch(RecurrentTagger),
}


HF_MODELS = ("bert", "gpt2", "llama", "t5")


def _cells(names):
    return [pytest.param(name, marks=needs_transformers) if name in HF_MODELS else name for name in names]


def _build(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


# ---------------------------------------------------------------------------------------- running


def _output_module(model: L.LightningModule) -> nn.Module:
    """The module whose output is the model's logits: the wrapped model, else the last child (the head)."""
    return getattr(model, "model", None) or list(model.children())[-1]


def _logits(output) -> List[torch.Tensor]:
    """The logits, and the attention probabilities where the model returns them, as fp32 copies."""
    parts = [output.logits if hasattr(output, "logits") else output] + list(getattr(output, "attentions", None) or ())
    return [part.detach().float().clone() for part in parts]


def _output_error(got: List[torch.Tensor], reference: List[torch.Tensor]) -> float:
    """The largest norm-wise relative difference among the output parts."""
    return max(((g - r).norm() / r.norm()).item() for g, r in zip(got, reference))


class _FirstStep(L.Callback):
    """The stepped params once cast and connected (``before``), the first forward's logits (``logits``),
    their dtype as the model computed them (``logits_dtype``) and whether autocast was on (``autocast``)."""

    def on_train_start(self, trainer, pl_module):
        self.before = [p.detach().float().clone() for p in main_params(trainer.optimizers[0])]
        self._hook = _output_module(pl_module).register_forward_hook(self._first_output)

    def _first_output(self, module, args, output):
        self.logits = _logits(output)
        self.logits_dtype = (output.logits if hasattr(output, "logits") else output).dtype
        self.autocast = torch.is_autocast_enabled("cpu")
        self._hook.remove()


def _train(model: L.LightningModule, batch, plugin, first: L.Callback = None) -> List[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, plugins=[plugin], callbacks=[recorder] + ([first] if first else []),
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader([batch] * STEPS, batch_size=None))
    return recorder.losses


@pytest.fixture(scope="module")
def fp32_first_logits() -> Callable[[str], List[torch.Tensor]]:
    """The fp32 logits of each model's first step (same seed, same batch), computed once per model."""
    cache: Dict[str, List[torch.Tensor]] = {}

    def first_logits(name: str) -> List[torch.Tensor]:
        if name not in cache:
            model, batch = _build(name)
            seen = []
            _output_module(model).register_forward_hook(lambda m, a, out: seen.append(_logits(out)))
            with torch.no_grad():
                model.training_step(batch, 0)
            cache[name] = seen[0]
        return cache[name]

    return first_logits


def _check_level(level: str, dtype: torch.dtype, model: nn.Module, optimizer) -> None:
    stepped = list(main_params(optimizer))
    module_params = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in stepped) or level == "O3"
    assert {id(p) for p in stepped} == {id(p) for p in module_params}  # one set of params at every level
    if level in ("O1", "O2"):  # O2: autocast gave forward half copies of these fp32 params
        assert all(p.dtype == torch.float32 for p in module_params)
        return
    for p in module_params:
        assert p.dtype == dtype, (level, p.shape, p.dtype)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("level", list(PLUGINS))
@pytest.mark.parametrize("name", _cells(MODELS))
def test_third_party_model_trains_at_every_level(name, level, dtype_name, fp32_first_logits):
    dtype = DTYPES[dtype_name]
    model, batch = _build(name)
    plugin, first = PLUGINS[level](dtype=dtype), _FirstStep()

    losses = _train(model, batch, plugin, first)

    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    assert plugin.skipped_steps < STEPS - 1
    stepped = list(main_params(model.trainer.optimizers[0]))  # the module's own params, in its order
    # compared with the values the steps started from (after the cast): the cast alone moves nothing
    moved = [not torch.equal(b, p.detach().float()) for b, p in zip(first.before, stepped)]
    # pure half (O3) loses updates below half an ulp, e.g. on LayerNorm weights near 1.0 (seen: <= 3 of 67)
    assert len(stepped) == len(first.before) and sum(moved) >= (0.9 * len(moved) if level == "O3" else len(moved)), moved
    assert all(torch.isfinite(p).all() for p in model.parameters())
    reference = fp32_first_logits(name)
    error = _output_error(first.logits, reference)
    assert error <= _first_logits_tolerance(dtype), (error, _first_logits_tolerance(dtype))
    _check_level(level, dtype, model, model.trainer.optimizers[0])
    if level == "O2":  # under autocast, as bf16-mixed, with the activations half up to the logits
        assert first.autocast and first.logits_dtype == dtype, (first.autocast, first.logits_dtype)


@pytest.mark.parametrize("name", _cells(["demo_transformer", "llama"]))
def test_o2_checkpoint_loads_into_the_plain_fp32_model(name, tmp_path):
    model, batch = _build(name)
    _train(model, batch, AmpO2Precision(dtype=torch.bfloat16))
    path = tmp_path / "o2.ckpt"
    model.trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]

    plain, _ = _build(name)
    plain.load_state_dict(state, strict=True)  # nothing built in forward leaked into the state
    trained = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert all(torch.equal(p, m) for p, m in zip(plain.parameters(), trained))
    with torch.no_grad():
        assert torch.isfinite(plain.training_step(batch, 0))


# ------------------------------------------------------------------ O2's forward under CUDA's autocast lists

#: the ops a TorchDispatchMode sees for O2's policy table rows that CUDA's autocast upcasts (after their
#: CompositeImplicit decompositions)
_DECOMPOSED = {"layer_norm": "native_layer_norm", "group_norm": "native_group_norm", "softmax": "_softmax",
               "log_softmax": "_log_softmax"}


def _cuda_upcast_ops():
    names = {name.split("::")[1].split(".")[0] for name, rule, cuda, *_ in o2_policy.table() if cuda != "fallthrough"}
    return names | {_DECOMPOSED[name] for name in names if name in _DECOMPOSED}


class _DtypeSpy(TorchDispatchMode):
    """Records (op, floating input dtypes, its result's dtype) of every op run outside a loss module."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[tuple] = []
        self.in_loss = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_loss:
            def floats(tree):
                return [t.dtype for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            outs = floats(out)  # the first is the result; others are auxiliary (an attention's fp32 logsumexp)
            self.ops.append((func.overloadpacket.__name__, set(floats((args, kwargs))), set(outs[:1])))
        return out


class _SpiedStep(HFModule):
    """The first ``training_step`` runs under a :class:`_DtypeSpy` (loss modules' ops left out)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.spy, self.loss_dtype = _DtypeSpy(), None

    def training_step(self, batch, batch_idx):
        if self.loss_dtype is not None:
            return super().training_step(batch, batch_idx)
        spy = self.spy
        enter = register_module_forward_pre_hook(lambda m, a: setattr(spy, "in_loss", spy.in_loss + isinstance(m, _Loss)))
        leave = register_module_forward_hook(lambda m, a, o: setattr(spy, "in_loss", spy.in_loss - isinstance(m, _Loss)))
        try:
            with spy:
                loss = super().training_step(batch, batch_idx)
        finally:
            enter.remove()
            leave.remove()
        self.loss_dtype = loss.dtype
        return loss


def _sdpa_bert():
    """BERT as Hugging Face builds it by default (SDPA attention: the padding mask goes into the fused op)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * HIDDEN,
        max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        hidden_act="gelu_new",  # GPT-2's tanh GELU: pow(x, 3) and tanh, which CUDA's autocast upcasts
    )
    batch = {"input_ids": _tokens(1), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
             "labels": torch.tensor([0, 1, 2, 1])}
    batch["attention_mask"][0, -3:] = 0
    return transformers.BertForSequenceClassification(config), batch


@needs_transformers
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_o2_bert_forward_stays_half_under_cuda_autocast_lists(dtype_name, monkeypatch):
    """With CUDA's autocast lists on the CPU (``LIGHTNING_AMP_O2_POLICY_MODE``), O2's BERT forward feeds
    LayerNorm, pow, ... half activations and no op turns a half tensor into fp32 outside the loss; with ``norm_policy="fp32"`` (what ``bf16-mixed`` does on a GPU) the same
    spy sees LayerNorm upcast."""
    monkeypatch.setenv(o2_policy.MODE_ENV, "cuda-lists-on-cpu")
    dtype = DTYPES[dtype_name]
    upcast_by_cuda = _cuda_upcast_ops()
    spies = {}
    for norm_policy in ("half", "fp32"):
        bert, batch = _sdpa_bert()
        model = _SpiedStep(bert)
        plugin = AmpO2Precision(dtype=dtype, norm_policy=norm_policy)
        hold = o2_policy.hold() if norm_policy == "fp32" else None  # bf16-mixed's kernels: torch's CUDA lists
        try:
            losses = _train(model, batch, plugin)
        finally:
            if hold is not None:
                hold.release()
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
        assert model.loss_dtype == torch.float32  # the loss module ran in fp32
        spies[norm_policy] = model.spy.ops

    listed = [(name, ins) for name, ins, _ in spies["half"] if name in upcast_by_cuda and ins]
    assert {"native_layer_norm", "pow"} <= {name for name, _ in listed}  # the spy saw them
    assert [(name, ins) for name, ins in listed if ins != {dtype}] == []
    upcast = [(name, ins, outs) for name, ins, outs in spies["half"] if dtype in ins and torch.float32 in outs]
    assert upcast == []  # half end to end: the logits become fp32 only inside the loss (autocast's loss policy)
    fp32_norms = [ins for name, ins, _ in spies["fp32"] if name == "native_layer_norm"]
    assert fp32_norms and all(ins == {torch.float32} for ins in fp32_norms)


class _MaskInForward(HFModule):
    """Builds BERT's additive mask inside forward the way models that read their dtype from their
    parameters do (fp32 under O2, ``finfo(float32).min`` on masked keys), and passes it by keyword."""

    def training_step(self, batch, batch_idx):
        batch = dict(batch)
        keep = batch.pop("attention_mask")[:, None, None, :].to(self.dtype)  # LightningModule.dtype: fp32
        mask = (1.0 - keep) * torch.finfo(self.dtype).min
        return self.model(attention_mask=mask.expand(-1, 1, SEQ, SEQ), **batch).loss


@needs_transformers
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_o2_casts_an_fp32_mask_passed_by_keyword_and_keeps_fully_masked_rows_finite(dtype_name):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    bert, batch = _bert()
    batch["attention_mask"][1] = 0  # sample 1 attends to nothing: every row of its attention fully masked
    model, reference = _MaskInForward(bert.model), _MaskInForward(_bert()[0].model)
    model.load_state_dict(reference.state_dict())
    seen = []
    _output_module(reference).register_forward_hook(lambda m, a, out: seen.append(_logits(out)))
    with torch.no_grad():
        reference.training_step(batch, 0)
    first = _FirstStep()

    losses = _train(model, batch, AmpO2Precision(dtype=dtype), first)

    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert all(torch.isfinite(part).all() for part in first.logits)
    uniform = torch.full((SEQ,), 1.0 / SEQ)
    assert all(torch.allclose(att[1], uniform.expand_as(att[1])) for att in first.logits[1:])  # as in fp32
    assert _output_error(first.logits, seen[0]) <= _first_logits_tolerance(dtype)
