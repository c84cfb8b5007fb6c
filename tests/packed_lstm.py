"""A stacked LSTM over padded sequences packed with ``enforce_sorted=False`` (import as
``from packed_lstm import packed_lstm``; pytest puts tests/ on the path), shared by the
tests of sizes on two paths (tests/test_uncheckpointable.py) and of packing on meta
(tests/test_meta_host.py)."""

_TEXT = """\
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnns = nn.ModuleList(nn.LSTM(16, 16, batch_first=True) for _ in range(2))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens, lengths):
        x = self.emb(tokens)
        for rnn in self.rnns:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, _ = rnn(packed)
            x, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.head(x)


def build_model():
    return Net()


def make_batch(b):
    tokens = torch.randint(0, 50, (b, 12), generator=torch.Generator().manual_seed(b))
    return tokens, torch.tensor([12 - (i % 3) for i in range(b)])


def training_loss(model, batch):
    return model(*batch).logsumexp(-1).mean()
"""


def packed_lstm(*, lengths_on_cpu: bool = False) -> str:
    """The model file's text; ``lengths_on_cpu``: the lengths passed as ``lengths.cpu()``, as
    a model that packs on a GPU passes them (torch takes them only on the CPU)."""
    if not lengths_on_cpu:
        return _TEXT
    return _TEXT.replace("lengths, batch_first", "lengths.cpu(), batch_first")
