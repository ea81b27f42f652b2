"""One rank of tests/fabric/test_fabric_world.py's tp_fused test: the tiny GPT of examples/fabric_tiny_gpt.py with two
SGD optimizers over disjoint params (the blocks; the embeddings, final norm and head) that share one fp32
``main_grad`` buffer, under ``Fabric(strategy="tp_fused", precision="32-true")`` and, in the same process, a plain
fp32 loop on the unconverted model. Per pattern (see PATTERNS) it saves both models' full weights as
``<out>/<pattern>.rank<r>.pt``. Started as torchrun would (LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

import lightning_amp  # noqa: F401  (registers "tp_fused")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))
import fabric_tiny_gpt as gpt  # noqa: E402

# each pattern: a list of ("backward", batch) | ("step", "blocks"|"rest") | ("zero", "blocks"|"rest")
PATTERNS = {
    # backward, no step, zero_grad: those grads must not reach the next step
    "zero_without_step": [("backward", 0), ("zero", "blocks"), ("zero", "rest"), ("backward", 1),
                          ("step", "blocks"), ("step", "rest")],
    # two synced backwards, one step: the grads are the sum of both
    "two_backwards": [("backward", 0), ("backward", 1), ("step", "blocks"), ("step", "rest")],
    # one optimizer steps: the other's grads wait for its own step (GAN-style alternation)
    "one_optimizer_steps": [("backward", 0), ("step", "blocks"), ("zero", "blocks"), ("backward", 1),
                            ("step", "blocks"), ("step", "rest")],
}


def _groups(model):
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return {"blocks": torch.optim.SGD(blocks, lr=0.5), "rest": torch.optim.SGD(rest, lr=0.5)}


def _run(pattern, model, optimizers, backward):
    batches = torch.randint(64, (2, 4, 17), generator=torch.Generator().manual_seed(1))
    for action, arg in pattern:
        if action == "backward":
            rows = batches[arg]
            backward(F.cross_entropy(model(rows[:, :-1]).float().reshape(-1, 64), rows[:, 1:].reshape(-1)))
        elif action == "step":
            optimizers[arg].step()
        else:
            optimizers[arg].zero_grad()


if __name__ == "__main__":
    torch.set_num_threads(1)  # 2 ranks on 2 shared cores
    out = Path(sys.argv[1])
    for name, pattern in PATTERNS.items():
        fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="tp_fused",
                          precision="32-true")
        fabric.launch()
        fabric.seed_everything(0)
        reference = gpt.TinyGPT()
        model = gpt.TinyGPT()
        model.load_state_dict(reference.state_dict())
        optimizers = _groups(model)
        model, *wrapped = fabric.setup(model, *optimizers.values())
        _run(pattern, model, dict(zip(optimizers, wrapped)), fabric.backward)
        _run(pattern, reference, _groups(reference), lambda loss: loss.backward())
        result = {"tp": {k: v.float() for k, v in fabric.strategy.get_module_state_dict(model.module).items()},
                  "plain": {k: v.detach().clone() for k, v in reference.state_dict().items()},
                  "converted": model.module.blocks[0].attn.q_proj.weight.shape != reference.blocks[0].attn.q_proj.weight.shape}
        torch.save(result, out / f"{name}.rank{os.environ['LOCAL_RANK']}.pt")
