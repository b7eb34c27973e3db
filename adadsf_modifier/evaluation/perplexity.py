"""Sliding-window perplexity for any causal LM, as in
https://huggingface.co/docs/transformers/perplexity, but with the NLL summed from the
logits (a model's ``.loss`` is a per-window mean): every token but the first is scored
exactly once, with at least ``max_length - stride`` tokens of context.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from loguru import logger
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from adadsf_modifier.utils import model_device

__all__ = ["PerplexityResult", "perplexity", "sliding_windows", "token_stream"]


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl = exp(nll)``, ``nll`` the mean per scored token (nats), ``tokens`` the
    tokens scored (the stream length minus one)."""

    ppl: float
    nll: float
    tokens: int


def sliding_windows(
    num_tokens: int, max_length: int, stride: int
) -> Iterator[tuple[int, int, int]]:
    """``(begin, end, trg_len)``: window ``[begin, end)`` scores its last ``trg_len``
    tokens (the first window's first token excepted: it has no context).

    Unlike the Hugging Face recipe, ``stride == max_length`` steps ``max_length - 1``: a
    window's first token has no context, so the windows must overlap by one token.
    """
    step = min(stride, max_length - 1)
    prev_end = 0
    for begin in range(0, num_tokens, step):
        end = min(begin + max_length, num_tokens)
        yield begin, end, end - prev_end
        prev_end = end
        if end == num_tokens:
            break


def _validate(
    max_length: int, stride: int, batch_size: int, max_tokens: int | None
) -> None:
    if max_length < 2:
        raise ValueError(
            "max_length must be at least 2 (one context + one scored token), got "
            f"{max_length}"
        )
    if stride <= 0:
        raise ValueError(f"stride must be positive, got {stride}")
    if stride > max_length:
        raise ValueError(
            f"stride ({stride}) must not exceed max_length ({max_length}): tokens "
            "between windows would never be scored"
        )
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (or None), got {max_tokens}")


def token_stream(
    tokenizer, texts: Sequence[str] | str | None, input_ids
) -> torch.Tensor:
    """The 1-D token stream: ``input_ids``, or ``"\\n\\n".join(texts)`` tokenized."""
    if input_ids is not None:
        if texts is not None:
            raise ValueError("pass either texts or input_ids, not both")
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(
                f"input_ids must be a 1-D token stream, got shape {tuple(ids.shape)}"
            )
        return ids
    if texts is None:
        raise ValueError("texts is required when input_ids is not given")
    if tokenizer is None:
        raise ValueError("a tokenizer is required to score texts")
    if isinstance(texts, str):
        texts = [texts]
    text = "\n\n".join(texts)
    if not text.strip():
        raise ValueError("no text to score: texts are empty or whitespace only")
    # verbose=False: a stream longer than model_max_length is expected (windows)
    encoded = tokenizer(text, return_tensors="pt", verbose=False)
    return encoded["input_ids"][0]


def _window_batch(
    ids: torch.Tensor, group: Sequence[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, target)`` of windows, right-padded; ``target[b,
    j]`` is the token at ``j + 1`` where window ``b`` scores it, else -100."""
    rows = [ids[begin:end] for begin, end, _ in group]
    batch = pad_sequence(rows, batch_first=True, padding_value=0)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    lengths = torch.tensor([r.numel() for r in rows])
    first = (lengths - torch.tensor([t for _, _, t in group])).clamp(min=1)
    position = torch.arange(1, batch.shape[1])
    scored = (position >= first[:, None]) & (position < lengths[:, None])
    return batch, mask, batch[:, 1:].masked_fill(~scored, -100)


def perplexity(
    model: torch.nn.Module,
    tokenizer,
    texts: Sequence[str] | str | None,
    max_length: int = 512,
    stride: int = 256,
    max_tokens: int | None = None,
    batch_size: int = 1,
    *,
    input_ids: Sequence[int] | torch.Tensor | None = None,
    show_progress: bool = True,
) -> PerplexityResult:
    """Sliding-window perplexity of ``model`` on ``texts`` (joined with ``"\\n\\n"``,
    tokenized once) or on the 1-D stream ``input_ids``.

    ``model(input_ids=, attention_mask=, use_cache=False)`` must return ``.logits`` (or
    a tuple led by them). ``max_tokens`` keeps the stream's first tokens;
    ``batch_size`` windows go per forward (the last, shorter one right-padded and
    masked, which cannot change a causal model's earlier logits). ``ValueError`` for
    sizes that score nothing, empty text or a stream under two tokens.
    """
    _validate(max_length, stride, batch_size, max_tokens)
    ids = token_stream(tokenizer, texts, input_ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = int(ids.numel())
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score, the stream has {n}")

    windows = list(sliding_windows(n, max_length, stride))
    device = model_device(model)
    was_training = model.training
    model.eval()
    nll_sum = 0.0
    scored = 0
    bar = tqdm(total=len(windows), desc="perplexity", disable=not show_progress)
    try:
        with torch.inference_mode(), bar:
            for first in range(0, len(windows), batch_size):
                group = windows[first : first + batch_size]
                batch, mask, target = _window_batch(ids, group)
                out = model(
                    input_ids=batch.to(device),
                    attention_mask=mask.to(device),
                    use_cache=False,
                )
                logits = out.logits if hasattr(out, "logits") else out[0]
                logits = logits[:, :-1, :].float()
                target = target.to(logits.device)
                nll_sum += float(
                    F.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]),
                        target.reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                )
                scored += int((target != -100).sum())
                bar.update(len(group))
                if scored:
                    bar.set_postfix(ppl=f"{math.exp(nll_sum / scored):.3f}")
    finally:
        model.train(was_training)

    if scored != n - 1:  # invariant of sliding_windows; insurance against future edits
        raise RuntimeError(f"scored {scored} tokens, expected {n - 1}")
    nll = nll_sum / scored
    result = PerplexityResult(ppl=math.exp(nll), nll=nll, tokens=scored)
    logger.info(
        f"perplexity={result.ppl:.4f} nll={result.nll:.4f} tokens={result.tokens} "
        f"(max_length={max_length}, stride={stride}, windows={len(windows)})"
    )
    return result
