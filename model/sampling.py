"""Generation: block-wise diffusion sampling (CDLM families) and ordinary AR sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.config import EOS_ID


@dataclass
class GenerationTrace:
    """What each generated token was decided from (for replaying attributions).

    ``snapshots[s]`` is the exact input (B, L_s) of model call ``s``; ``step[b, p]`` is the
    call that committed position p of row b (-1 for prompt positions); ``out_pos[b, p]`` is
    the output row of that call whose logits chose the token (p for diffusion, p - 1 for AR).
    """

    snapshots: list[torch.Tensor] = field(default_factory=list)
    step: torch.Tensor | None = None
    out_pos: torch.Tensor | None = None
    prompt_len: int = 0

    def source(self, b: int, pos: int) -> tuple[torch.Tensor, int]:
        """(snapshot row (L,), output position) that committed token ``pos`` of row ``b``."""
        s = int(self.step[b, pos])
        if s < 0:
            raise ValueError(f"position {pos} is part of the prompt, not generated")
        return self.snapshots[s][b], int(self.out_pos[b, pos])


def _call(model, x: torch.Tensor, steer):
    # the hook kwarg is only passed when steering, so plain callables still work as models
    return model(x) if steer is None else model(x, steer=steer(x))


def _forbid_specials(logits: torch.Tensor, cfg, forbid=()) -> torch.Tensor:
    # [MASK] and [PAD] are never emitted; they are inputs, not outputs. ``forbid``: more ids
    # the caller bans (e.g. the pieces of a corpus placeholder such as WikiText's <unk>).
    logits = logits.clone()
    logits[..., [cfg.mask_token_id, cfg.pad_token_id, *forbid]] = float("-inf")
    return logits


def _pick(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and its probability (the confidence). Gumbel-max in float64 when sampling."""
    logits = logits.double()
    if temperature <= 0:
        probs = logits.softmax(-1)
        conf, tok = probs.max(-1)
        return tok, conf
    scaled = logits / temperature
    u = torch.rand(scaled.shape, generator=generator, dtype=torch.float64, device=scaled.device)
    gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0)))
    tok = (scaled + gumbel).argmax(-1)
    conf = scaled.softmax(-1).gather(-1, tok[..., None]).squeeze(-1)
    return tok, conf


def commit_schedule(n_masked: int, steps: int) -> list[int]:
    """Linear schedule: how many tokens to commit at each of ``steps`` steps (sums to n)."""
    steps = max(1, min(steps, n_masked))
    return [n_masked // steps + (1 if i < n_masked % steps else 0) for i in range(steps)]


@torch.no_grad()
def diffusion_generate(model, prompt: torch.Tensor, max_new_tokens: int, steps_per_block: int | None = None,
                       temperature: float = 0.0, generator: torch.Generator | None = None,
                       trace: GenerationTrace | None = None, steer=None, forbid=()) -> torch.Tensor:
    """Block-wise masked-diffusion decoding.

    Append [MASK] x max_new_tokens; for each block in order, repeat: run the model on the
    sequence up to the block's end (block-causal attention makes later positions
    irrelevant), predict every still-masked position, commit the most confident ones
    (count from a linear schedule); move on when the block is full.
    ``trace`` (optional) is filled with every step's input snapshot and, per committed
    token, the step it was committed at. ``steer(x) -> hook`` (optional) builds the
    model's residual-stream hook for input ``x`` (model/steering.py). ``forbid``: token ids
    never committed.
    """
    cfg = model.cfg
    prompt = prompt.view(1, -1) if prompt.dim() == 1 else prompt
    B, P = prompt.shape
    total = P + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"prompt + new tokens = {total} > max_seq_len {cfg.max_seq_len}")
    x = torch.cat([prompt, prompt.new_full((B, max_new_tokens), cfg.mask_token_id)], dim=1)
    if trace is not None:
        trace.prompt_len = P
        trace.step = torch.full((B, total), -1, dtype=torch.long)
        trace.out_pos = torch.full((B, total), -1, dtype=torch.long)
    bs = cfg.block_size
    for start in range((P // bs) * bs, total, bs):
        end = min(start + bs, total)
        n_masked = int((x[0, start:end] == cfg.mask_token_id).sum())
        for n_commit in commit_schedule(n_masked, steps_per_block or bs):
            logits = _forbid_specials(_call(model, x[:, :end], steer)[:, start:end].float(), cfg, forbid)
            tok, conf = _pick(logits, temperature, generator)
            masked = x[:, start:end] == cfg.mask_token_id
            conf = conf.masked_fill(~masked, -1.0)
            pick = conf.topk(n_commit, dim=-1).indices
            if trace is not None:
                trace.snapshots.append(x[:, :end].clone())
                rows = torch.arange(B)[:, None].expand_as(pick)
                trace.step[rows, start + pick] = len(trace.snapshots) - 1
                trace.out_pos[rows, start + pick] = start + pick
            block = x[:, start:end]
            block.scatter_(1, pick, tok.gather(1, pick))
    return x


@torch.no_grad()
def ar_generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                generator: torch.Generator | None = None, stop_at_eos: bool = False,
                trace: GenerationTrace | None = None, steer=None, forbid=()) -> torch.Tensor:
    """Left-to-right sampling (no KV cache: each step re-runs the context window).
    ``trace`` / ``steer`` / ``forbid``: as in ``diffusion_generate`` (the snapshot is the context)."""
    cfg = model.cfg
    x = prompt.view(1, -1) if prompt.dim() == 1 else prompt
    B, P = x.shape
    if trace is not None:
        trace.prompt_len = P
        trace.step = torch.full((B, P + max_new_tokens), -1, dtype=torch.long)
        trace.out_pos = torch.full((B, P + max_new_tokens), -1, dtype=torch.long)
    for _ in range(max_new_tokens):
        ctx = x[:, -cfg.max_seq_len:]
        logits = _forbid_specials(_call(model, ctx, steer)[:, -1].float(), cfg, forbid)
        tok, _ = _pick(logits, temperature, generator)
        if trace is not None:
            trace.snapshots.append(ctx.clone())
            trace.step[:, x.shape[1]] = len(trace.snapshots) - 1
            trace.out_pos[:, x.shape[1]] = ctx.shape[1] - 1
        x = torch.cat([x, tok[:, None]], dim=1)
        if stop_at_eos and bool((tok == EOS_ID).all()):
            break
    return x


def generate(model, prompt: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
    """Dispatch on the family: diffusion sampling for CDLM, AR sampling otherwise."""
    was = model.training
    model.eval()
    try:
        if model.cfg.is_diffusion:
            return diffusion_generate(model, prompt, max_new_tokens, **kw)
        kw.pop("steps_per_block", None)
        return ar_generate(model, prompt, max_new_tokens, **kw)
    finally:
        model.train(was)
