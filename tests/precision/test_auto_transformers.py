"""``opt_level="auto"`` on a model nobody here wrote: a tiny Hugging Face BERT whose word embeddings are scaled
by 1e7 (entries up to about 1e5: past float16's 65504). O2 casts the embedding weight to half, so the embedding
stream is inf and every step non-finite; O1 keeps the embedding fp32 and the LayerNorm after it brings the
stream back to unit scale, so it trains. The auto run moves O2/128 -> O1/128 and then equals the manual O1/128
run of the steps after the move, bit for bit."""
import pytest
import torch

import lightning as L

from lightning_amp import AmpAutoPrecision, AmpPrecision, LadderRules
from support.trainer import assert_same_weights, quiet_lightning

transformers = pytest.importorskip("transformers")

STEPS = 10


class TinyBert(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=16, num_labels=3,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForSequenceClassification(config)
        with torch.no_grad():
            self.bert.bert.embeddings.word_embeddings.weight.mul_(1e7)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.bert(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(plugin, steps):
    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12), generator=gen),
                                          torch.randint(0, 3, (8,), generator=gen))
    model = TinyBert()
    trainer = L.Trainer(accelerator="cpu", max_epochs=steps, plugins=[plugin], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with quiet_lightning():
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return model


@pytest.mark.slow
def test_scaled_bert_moves_to_o1_and_equals_the_manual_run(flag_timing):
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=LadderRules(nonfinite_in_a_row=3, snapshot_every=2))
    auto = _fit(plugin, STEPS)
    ladder = plugin.ladder
    assert ladder.changes == 1 and tuple(ladder.rung) == ("O1", 128.0) and ladder.snapshot_step == 0
    manual_plugin = AmpPrecision("O1", dtype="float16", loss_scale=128.0)
    manual = _fit(manual_plugin, STEPS - ladder.moved_at)
    assert manual_plugin.skipped_steps == 0  # O1 trains
    assert_same_weights(auto, manual)
