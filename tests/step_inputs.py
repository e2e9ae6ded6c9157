"""Input factories and a loss for `planc explain --inputs/--loss` tests: models that do not
take one tensor of token ids."""

from __future__ import annotations

import torch


def t5_inputs(model):
    """An encoder-decoder step: encoder and decoder token ids, as keywords (Hugging Face T5)."""
    vocab = model.config.vocab_size
    return {"input_ids": torch.randint(0, vocab, (2, 32)), "decoder_input_ids": torch.randint(0, vocab, (2, 16))}


def image_inputs(model):
    """A vision step: a batch of 3-channel 32x32 images (float input, no labels: output.sum())."""
    return (torch.randn(4, 3, 32, 32),)


def mse_loss(output, example):
    """A regression loss over the whole output."""
    return (output.float() ** 2).mean()


class TinyConvNet(torch.nn.Module):
    """A vision model: two conv blocks and a head."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([
            torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU()),
            torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU())])
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))
