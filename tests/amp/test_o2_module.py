"""O2's model: fp32 Parameters (module_cast.prepare_o2_module_) read through autocast in forward, no Lightning."""
import pytest
import torch
from torch import nn

from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.forward import forward_context
from lightning_amp.amp.levels import resolve_properties
from lightning_amp.amp.module_cast import cast_module_, prepare_o2_module_

HALVES = [torch.float16, torch.bfloat16]


class _Tied(nn.Module):
    """Embedding, BatchNorm, and a head that reads the embedding's weight from the parent's forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.BatchNorm1d(6)
        self.mix = nn.Linear(6, 6)

    def forward(self, idx):
        hidden = self.norm(self.embed(idx))
        return self.mix(hidden) @ self.embed.weight.t()


@pytest.fixture
def policy():
    hold = o2_policy.hold()
    yield
    hold.release()


def _o2(dtype, **overrides):
    return resolve_properties(opt_level="O2", dtype=dtype, device_type="cpu", **overrides)


@pytest.mark.parametrize("dtype", HALVES)
def test_params_become_fp32_parameters_and_buffers_keep_their_dtype(dtype):
    torch.manual_seed(0)
    model = _Tied().to(dtype)  # half params are upcast in place, the Parameter objects survive
    ids = [id(p) for p in model.parameters()]
    model.register_buffer("offset", torch.randn(6))
    model.register_buffer("steps", torch.arange(3))
    prepare_o2_module_(model, dtype, keep_batchnorm_fp32=True)
    assert [id(p) for p in model.parameters()] == ids
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())
    assert model.offset.dtype == torch.float32 and model.steps.dtype == torch.int64
    assert model.norm.running_mean.dtype == torch.float32  # upcast from the half model it was given
    assert not model.norm._forward_pre_hooks  # O2 needs no BatchNorm hooks: autocast feeds it half input


@pytest.mark.parametrize("dtype", HALVES)
def test_half_buffers_and_half_batchnorm_are_asked_for(dtype):
    model = _Tied()
    model.register_buffer("offset", torch.randn(6, dtype=torch.float64))
    prepare_o2_module_(model, dtype, keep_batchnorm_fp32=True, half_buffers=True)
    assert model.offset.dtype == dtype and model.norm.running_var.dtype == torch.float32
    model = prepare_o2_module_(_Tied(), dtype, keep_batchnorm_fp32=False)
    assert model.norm.running_var.dtype == dtype and model.norm.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="`module` must be a torch.nn.Module"):
        prepare_o2_module_("model", dtype, keep_batchnorm_fp32=True)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("keep_batchnorm_fp32", [True, False])
def test_forward_computes_as_the_half_model_and_grads_land_on_the_fp32_params(dtype, keep_batchnorm_fp32, policy):
    """Inside forward every weight is the fp32 Parameter; the output and the fp32 grads equal those of
    the same model cast to half by hand (bf16-true's computation), bit for bit: the embedding, the tied
    head's matmul and the Linear read half copies, BatchNorm computes in fp32 when kept (half otherwise)."""
    torch.manual_seed(0)
    model = prepare_o2_module_(_Tied(), dtype, keep_batchnorm_fp32=keep_batchnorm_fp32)
    ref = _Tied()
    ref.load_state_dict(model.state_dict())
    cast_module_(ref, dtype, keep_batchnorm_fp32=keep_batchnorm_fp32)
    idx = torch.randint(0, 11, (20,), generator=torch.Generator().manual_seed(1))
    seen = []
    model.mix.register_forward_pre_hook(lambda m, a: seen.append((type(m.weight), m.weight.dtype)))
    with forward_context(_o2(dtype, keep_batchnorm_fp32=keep_batchnorm_fp32), "cpu"):
        out = model(idx)
    assert seen == [(nn.Parameter, torch.float32)]
    expected = ref(idx)
    assert out.dtype == dtype and torch.equal(out, expected)
    (out.float() ** 2).mean().backward()
    (expected.float() ** 2).mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        if name == "embed.weight":  # two uses, two casts: their half grads are summed in fp32 here, in half there
            assert ((p.grad - r.grad.float()).abs() <= torch.finfo(dtype).eps * r.grad.float().abs()).all()
        else:
            assert torch.equal(p.grad, r.grad.float()), name


def test_writes_and_requires_grad_changes_reach_the_next_op_inside_forward(policy):
    """Autocast casts the Parameter at each op (no cache): a write to it (an optimizer step, a WGAN
    clip) and toggling requires_grad (``toggle_optimizer``) inside the forward context are seen by the
    next op, through the attribute as through ``parameters()``."""
    torch.manual_seed(0)
    model = prepare_o2_module_(nn.Linear(6, 6), torch.bfloat16, keep_batchnorm_fp32=True)
    x = torch.randn(3, 6)
    with forward_context(_o2(torch.bfloat16), "cpu"):
        with torch.no_grad():
            model.weight.mul_(2.0)
            model.weight.data.clamp_(-0.1, 0.1)
        assert torch.equal(model(x), nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16()))
        model.weight.requires_grad_(False)
        frozen = model(x)
        model.weight.requires_grad_(True)
        trained = model(x)
    frozen.float().sum().backward(retain_graph=True)
    assert model.weight.grad is None and model.bias.grad is not None
    trained.float().sum().backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32


def _bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"  # CPU's flash attention has no double backward
    model = transformers.BertForSequenceClassification(config)
    model.bert.pooler.dense.weight.requires_grad_(False)  # frozen: its cast must not ask for a grad
    return prepare_o2_module_(model, torch.bfloat16, keep_batchnorm_fp32=True)


def _bert_loss(model):
    generator = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (4, 8), generator=generator), torch.randint(0, 3, (4,), generator=generator)
    with forward_context(_o2(torch.bfloat16), "cpu"):
        assert not model.bert.pooler.dense.weight.requires_grad
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    return logits.float().log_softmax(-1).gather(1, labels[:, None]).mean().neg()


def test_the_graph_reaches_the_fp32_parameters(policy):
    """``torch.autograd.grad`` w.r.t. a Parameter (and its double backward) and each Parameter's tensor
    hook, which fires once with the fp32 grad that ``backward`` accumulates: what DDP's hooks and
    gradient penalties need."""
    model = _bert()
    params = [p for p in model.parameters() if p.requires_grad]
    calls = []
    for i, param in enumerate(params):
        param.register_hook(lambda grad, i=i: calls.append((i, grad.dtype)))
    _bert_loss(model).backward()
    assert sorted(calls) == [(i, torch.float32) for i in range(len(params))]
    accumulated = [p.grad for p in params]
    grads = torch.autograd.grad(_bert_loss(model), params, create_graph=True)
    assert all(torch.equal(g, a) for g, a in zip(grads, accumulated))
    penalty = sum(g.square().sum() for g in grads)
    second = torch.autograd.grad(penalty, params[-1])[0]  # through the casts' double backward
    assert second.dtype == torch.float32 and torch.isfinite(second).all() and second.abs().sum() > 0
