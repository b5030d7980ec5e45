"""What a forward pass gives the rows of the running batch: their tokens with log-probs, top log-probs and entropy,
until each stops or reaches its budget, and a prompt's own log-probs (:mod:`miles.engine.batcher`)."""

from __future__ import annotations

import torch

from miles.engine.request import Request
from miles.engine.sampling import top_logprobs

__all__ = ["take_tokens", "fill_prompt_logprobs", "NON_FINITE"]

NON_FINITE = "the model produced non-finite logits (NaN or inf): check the weights"


def take_tokens(rows: list[Request], tokens: torch.Tensor, reported: torch.Tensor, finite: torch.Tensor | None,
                upto: torch.Tensor | None, version: int) -> list[int]:
    """Give each row its first ``upto`` [B] (None: all) of ``tokens`` [B, J], with their log-probs under
    ``reported`` [B, J, V] (the logits of the distribution ``logprobs_of`` names) and the weight ``version`` that
    sampled them, until it stops or reaches its budget; a row whose logits were not ``finite`` [B] (None: all were)
    is aborted. Returns the tokens each row took."""
    batch, width = tokens.shape
    all_logprobs = reported.log_softmax(-1)
    logprobs = all_logprobs.gather(2, tokens.unsqueeze(2)).squeeze(2).tolist()
    k = max((r.top_logprobs_num for r in rows if r.return_logprob), default=0)
    top = top_logprobs(all_logprobs.flatten(0, 1), k) if k else None
    entropy = (torch.special.entr(all_logprobs.exp()).sum(dim=-1).tolist()
               if any(r.return_entropy for r in rows) else None)
    taken = []
    counts = [width] * batch if upto is None else upto.tolist()
    oks = [True] * batch if finite is None else finite.tolist()
    for i, (r, ids, ok, n) in enumerate(zip(rows, tokens.tolist(), oks, counts)):
        taken.append(0)
        if not ok:
            r.finish = {"type": "abort", "message": NON_FINITE}
            continue
        if r.budget <= 0:  # max_new_tokens 0: the prompt's log-probs only, as SGLang
            r.finish = {"type": "length", "length": 0}
            continue
        for j, token in enumerate(ids[:n]):
            r.output_ids.append(token)
            r.output_versions.append(version)
            r.output_logprobs.append(logprobs[i][j])
            if top is not None and r.return_logprob and r.top_logprobs_num:
                r.output_top.append(top[i * width + j][: r.top_logprobs_num])
            if entropy is not None and r.return_entropy:
                r.output_entropy.append(entropy[i][j])
            taken[-1] += 1
            if token in r.stop_ids:
                r.finish = {"type": "stop", "matched": token}
            elif len(r.output_ids) >= r.budget:
                r.finish = {"type": "length", "length": len(r.output_ids)}
            if r.finish is not None:
                break
    return taken


def fill_prompt_logprobs(r: Request, logits: torch.Tensor) -> None:
    """Log-probs of ``r``'s prompt tokens from ``logprob_start_len`` (``logits``: [L - 1, V], the predictions of
    tokens 1..L-1); the first token has none."""
    logprobs = logits.log_softmax(dim=-1)
    targets = torch.tensor(r.prompt[1:], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top = top_logprobs(logprobs, r.top_logprobs_num) if r.top_logprobs_num else [None] * len(chosen)
    start = r.logprob_start_len
    r.input_logprobs = ([None] + chosen)[start:]
    r.input_top = ([None] + top)[start:] if r.top_logprobs_num else []
