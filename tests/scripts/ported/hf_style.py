"""hf_style_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed.

    invoke train --script tests/scripts/ported/hf_style.py
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset

import hvdhetero as hh  # hh:

VOCAB, PAD = 40, 0


def make_examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(8, 25, (1,), generator=g))
        ids = torch.randint(30, VOCAB, (length,), generator=g)
        label = int(torch.randint(0, 2, (1,), generator=g))
        marked = torch.rand(length, generator=g) < 0.4
        negative = (torch.rand(length, generator=g) < (0.25 if label else 0.75)).long()
        ids[marked] = (torch.randint(10, 20, (length,), generator=g) + 10 * negative)[marked]
        examples.append({"input_ids": ids.tolist(), "labels": label})
    return examples


class Reviews(Dataset):
    def __init__(self, n, seed):
        self.examples = make_examples(n, seed)

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate_with_padding(features):
    """Pad to the longest sequence of the batch, as transformers' DataCollatorWithPadding does."""
    longest = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), longest), PAD)
    attention_mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        input_ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        attention_mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": torch.tensor([f["labels"] for f in features])}


@dataclass
class SequenceClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class TinyForSequenceClassification(nn.Module):
    def __init__(self, vocab_size=VOCAB, hidden_size=64, num_labels=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=PAD)
        self.encoder = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.LayerNorm(hidden_size))
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden = self.encoder(self.embeddings(input_ids))
        mask = attention_mask.unsqueeze(-1).float() if attention_mask is not None else torch.ones_like(hidden[..., :1])
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.classifier(pooled)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return LambdaLR(optimizer, lr_lambda)


job = hh.init()  # hh:
torch.manual_seed(0)
train_dataset, eval_dataset = Reviews(2000, seed=1), Reviews(500, seed=2)
train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=32, collate_fn=collate_with_padding)
eval_dataloader = DataLoader(eval_dataset, batch_size=64, collate_fn=collate_with_padding)

model = TinyForSequenceClassification()
optimizer = AdamW(model.parameters(), lr=3e-3)
num_epochs = 4
num_training_steps = num_epochs * len(train_dataloader)
lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=20, num_training_steps=num_training_steps)

device = job.device  # hh:
model.to(device)
model, optimizer, train_dataloader = job.prepare(model, optimizer, train_dataloader, scheduler=lr_scheduler)  # hh:

for epoch in job.epochs(num_epochs):  # hh:
    model.train()
    for batch in train_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        job.backward(loss)  # hh:
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

    model.eval()
    correct = total = 0
    for batch in eval_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            outputs = model(**batch)
        predictions = torch.argmax(outputs.logits, dim=-1)
        correct += int((predictions == batch["labels"]).sum())
        total += len(predictions)
    print(f"epoch {epoch}: eval accuracy {correct / total:.4f}, lr {lr_scheduler.get_last_lr()[0]:.6f}")
