"""Losses with the bytes of the ones training engines run, for model files to call: a
compiled cross-entropy (:func:`compiled_cross_entropy`) and torchtitan 0.3's chunked head and
loss (:func:`chunked_cross_entropy`, after the compiled one below).

``torch.compile`` changes what a cross-entropy over a large vocabulary holds. Eager
``F.cross_entropy(logits.float(), targets)`` makes an fp32 copy of the logits, saves its
fp32 log-softmax for the backward, and there makes an fp32 gradient of each before casting
it back: several fp32 copies of a tensor of tokens × vocabulary at once (for Llama 3.1 8B,
16,384 tokens × 128,256 words: 8.4 GB each). Inductor fuses the cast, the log-softmax and
the reduction into reductions over each row: read with torch 2.13's own output code
(``TORCH_LOGS=output_code``) for ``cross_entropy(pred.flatten(0, 1).float(), labels)``, its
forward allocates two fp32 values per row (the row's maximum and its log-sum-exp) and
scalars, saves the logits as they came (bf16), the targets and those two per-row values, and
its backward allocates one per-row fp32 buffer and the gradient in the logits' dtype; no
fp32 tensor of tokens × vocabulary exists at any moment.

torchtitan compiles its loss this way whenever ``training.compile`` is on
(torchtitan/components/loss.py ``build_cross_entropy_loss``, e7c0cae, June 2025); in
December 2024 it did not (train.py at 9dec370: "compiling loss function causes CUDA errors,
turning off for now").

memplan's probe runs on meta and on CPU, where inductor cannot compile for the target GPU,
so :func:`compiled_cross_entropy` computes the same loss and gradient in eager ops that
allocate what inductor's kernels allocate: it saves exactly those tensors and writes the
gradient straight into one buffer of the logits' dtype, working through the rows in chunks
whose fp32 scratch stays under ``CHUNK_BYTES``. Its time on the meta clock is that of its
eager ops, which move more bytes than inductor's two fused passes do.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 1 << 24
"""The fp32 scratch of one chunk of rows (16 MiB): small beside any logits it stands for."""


def chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk: as many as keep one fp32 chunk within ``CHUNK_BYTES``, at least 1."""
    return max(1, min(rows, CHUNK_BYTES // (4 * max(vocab, 1))))


class _CompiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
        rows, vocab = logits.shape
        row_max = torch.empty((rows, 1), dtype=torch.float32, device=logits.device)
        lse = torch.empty((rows, 1), dtype=torch.float32, device=logits.device)
        step = chunk_rows(rows, vocab)
        for start in range(0, rows, step):
            part = logits[start : start + step].to(torch.float32, copy=True)  # never in place
            top = part.amax(dim=1, keepdim=True)
            row_max[start : start + step] = top
            part.sub_(top).exp_()
            lse[start : start + step] = part.sum(dim=1, keepdim=True).log_().add_(top)
            del part
        valid = targets != ignore_index
        picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).float()
        count = valid.sum()
        loss = ((lse - picked).squeeze(1) * valid).sum() / count
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(logits, targets, row_max, lse, count)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        logits, targets, _row_max, lse, count = ctx.saved_tensors
        rows, vocab = logits.shape
        grad = torch.empty_like(logits)
        scale = grad_loss / count
        step = chunk_rows(rows, vocab)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            part = logits[start:stop].to(torch.float32, copy=True)
            part.sub_(lse[start:stop]).exp_()  # softmax
            target = targets[start:stop]
            valid = (target != ctx.ignore_index).unsqueeze(1)
            part.scatter_add_(
                1,
                target.clamp(min=0).unsqueeze(1),
                torch.full((stop - start, 1), -1.0, dtype=part.dtype, device=part.device),
            )
            part.mul_(valid).mul_(scale)
            grad[start:stop] = part
            del part
        return grad, None, None


def compiled_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets)`` (mean over the targets that are not
    ``ignore_index``) with the bytes of its ``torch.compile``'d form (module doc): the logits
    are ``(tokens, vocabulary)``, or ``(batch, sequence, vocabulary)`` with targets of
    ``(batch, sequence)``, in any floating dtype; the loss is fp32."""
    if logits.dim() == 3:
        logits, targets = logits.flatten(0, 1), targets.flatten(0, 1)
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            "compiled_cross_entropy takes logits of (tokens, vocabulary) and targets of "
            f"(tokens,), or (batch, sequence, ...) of both; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    return _CompiledCrossEntropy.apply(logits, targets, ignore_index)


# torchtitan 0.3's chunked head and loss (``ChunkedLossWrapper``), read in the 0.3.0 wheel's
# torchtitan/components/loss.py: every Llama config of its registry computes the head and the
# loss this way, in ``num_chunks = 8`` pieces of the sequence (models/llama3/
# config_registry.py), so what ``--format torchtitan`` runs holds an eighth of the logits.
# Its bytes, as that code makes them: the final norm's output is split along the sequence
# (``torch.split`` then ``.contiguous()``: a copy when the batch holds more than one
# sample, views otherwise), each piece detached as a leaf, and the targets split the same
# way; an fp32 gradient buffer of the hidden states' shape is zeroed (``GradAccumulator``);
# each chunk then runs the head, the loss over the chunk's targets divided by the step's
# count, and its own backward at once
# (the head's weight gradient accumulates, the chunk's input gradient is copied into the
# buffer and dropped); the buffer is cast to the hidden states' dtype and saved by an
# autograd Function (``_DecoderOutputGradientBackProp``) whose backward hands it to the
# decoder. So no chunk's logits outlive the chunk, and from the loss to the decoder's
# backward the step holds one gradient of the hidden states.


class _DecoderGradient(torch.autograd.Function):
    """The loss's value, whose backward hands the decoder the gradient the chunks made
    (``_DecoderOutputGradientBackProp``). The upstream gradient (1 for a loss, the scale
    under accumulation) multiplies it in place, so no second tensor of that size is made:
    torchtitan's returns the saved one as it is."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor):
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss), None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    chunks: int = 8,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), targets)`` (mean over the targets that are not
    ``ignore_index``) computed as torchtitan 0.3's ``ChunkedLossWrapper`` computes it, with
    its bytes (the comment above): ``hidden`` is ``(batch, sequence, width)`` (the final
    norm's output), ``targets`` ``(batch, sequence)``, the sequence a multiple of
    ``chunks``. The head and the loss run, and their backward with them, chunk by chunk
    inside this call, so the head's parameters have their gradients once it returns; the
    returned fp32 loss's backward runs the decoder's. Call it where a model file computes
    its loss, in place of the head and ``F.cross_entropy``, to plan a torchtitan 0.3 run.
    FSDP2 runs it (memplan's ``fsdp``, and torchtitan's sharding and replication); torch's
    DDP refuses a backward per chunk inside the forward ("Expected to mark a
    variable ready only once": its reducer marks the head's parameters ready at the first),
    as it would torchtitan's wrapper."""
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            "chunked_cross_entropy takes hidden states of (batch, sequence, width) and "
            f"targets of (batch, sequence); got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(
            f"chunked_cross_entropy: chunks must be a whole number >= 1, got {chunks!r}"
        )
    seq = hidden.shape[1]
    if seq % chunks:
        raise ValueError(
            f"chunked_cross_entropy: the sequence ({seq}) must be a multiple of chunks "
            f"({chunks}), as torchtitan's ChunkedLossWrapper requires"
        )
    width = seq // chunks
    pieces = [c.contiguous() for c in torch.split(hidden, [width] * chunks, dim=1)]
    labels = [c.contiguous() for c in torch.split(targets, [width] * chunks, dim=1)]
    count = (targets != ignore_index).sum()
    training = hidden.requires_grad and torch.is_grad_enabled()
    grad = torch.zeros_like(hidden, dtype=torch.float32) if training else None
    total = hidden.new_zeros((), dtype=torch.float32)
    for i, piece in enumerate(pieces):
        leaf = piece.detach().requires_grad_(training)
        pieces[i] = leaf  # the list holds every piece to the end, as torchtitan's does
        with torch.enable_grad() if training else torch.no_grad():
            logits = head(leaf)
            part = (
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1).float(),
                    labels[i].flatten(0, 1),
                    reduction="sum",
                    ignore_index=ignore_index,
                )
                / count
            )
        total = total + part.detach()
        if training:
            part.backward()
            grad[:, i * width : (i + 1) * width] = leaf.grad
            leaf.grad = None
        del logits, part
    if not training:
        return total
    decoder_grad = grad.to(hidden.dtype)
    del grad
    return _DecoderGradient.apply(hidden, decoder_grad, total)
