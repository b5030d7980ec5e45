"""Framework overhead: the quickstart's GRPO phase in Miles against a bare single-file GRPO loop.

Both start from the same SFT checkpoint (made by Miles' own SFT recipe) and do the same work:
same model, prompts, 16 prompts x 8 samples per step, max 4 new tokens, AdamW at the same learning
rate, gradient clipping, one optimizer step per batch. Prints the wall times and their ratios to the bare loop:
Miles with ``backend.share_prefixes=false`` (the same work: the framework's overhead) and with its defaults.

    python benchmarks/grpo_overhead.py [--steps 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from miles.run.runner import prepare, train

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")
# name: Miles' overrides (None: the bare loop). Without prefix sharing Miles does the bare loop's very work: its
# ratio is the framework's overhead; the default shares each group's prompt in the training forward.
VARIANTS: dict[str, tuple[str, ...] | None] = {
    "bare single-file loop": None,
    "miles, backend.share_prefixes=false": ("backend.share_prefixes=false",),
    "miles (defaults)": (),
}


def bare_grpo(model_dir: Path, train_file: Path, steps: int, seed: int) -> tuple[float, list[float]]:
    """A plain GRPO loop in one function: sample with a KV cache, reward, group-normalize, PPO-clip step."""
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_prompts, n_samples, max_new, eos, pad = 16, 8, 4, tok.eos_token_id, tok.pad_token_id
    rewards_per_step = []
    start = time.perf_counter()
    for _ in range(steps):
        batch_rows = [rows[rng.randrange(len(rows))] for _ in range(n_prompts)]
        prompts = [tok(r["prompt"])["input_ids"] for r in batch_rows for _ in range(n_samples)]
        labels = [r["label"] for r in batch_rows for _ in range(n_samples)]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = (ids != pad).long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache, out, done = DynamicCache(), [], torch.zeros(len(prompts), dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                           use_cache=True).logits[:, -1]
            for _ in range(max_new):
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
                nxt = torch.where(done, pad, nxt)
                out.append(nxt)
                done |= nxt == eos
                if done.all():
                    break
                mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], 1)
                pos = pos[:, -1:] + 1
                logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                               use_cache=True).logits[:, -1]
        gen_ids = torch.stack(out, 1).tolist()
        responses = []
        for row in gen_ids:
            resp = []
            for t in row:
                resp.append(t)
                if t == eos:
                    break
            responses.append(resp)
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        rewards = torch.tensor([float(t.strip() == label) for t, label in zip(texts, labels)])
        rewards_per_step.append(rewards.mean().item())
        grouped = rewards.view(n_prompts, n_samples)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        seqs = [p + r for p, r in zip(prompts, responses)]
        L = max(map(len, seqs))
        x = torch.tensor([s + [pad] * (L - len(s)) for s in seqs])
        loss_mask = torch.zeros(len(seqs), L - 1)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            loss_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
        logits = model(input_ids=x).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, x[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        a = adv[:, None]
        per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        loss = (per_tok * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return time.perf_counter() - start, rewards_per_step


def miles_grpo(model_dir: Path, run_dir: Path, steps: int, seed: int,
               overrides: tuple[str, ...] = ()) -> tuple[float, list[float]]:
    prepared = prepare(CONFIG, [f"run.dir={run_dir}", f"model.path={model_dir}", "sft.steps=0", "run.eval_size=0",
                                "run.progress=false", f"run.steps={steps}", f"run.seed={seed}", *overrides])
    summary = train(prepared)
    rewards = [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary["time_s"]["rl"], rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train(prepare(CONFIG, [f"run.dir={tmp / 'sft'}", "run.steps=0", "run.progress=false"]))
        model_dir, train_file = tmp / "sft" / "sft_model", tmp / "sft" / "data" / "train.jsonl"
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        window = min(10, args.steps)
        for repeat in range(args.repeats):
            # Rotate the order, so that no variant always runs on a warmer (or busier) machine.
            names = list(VARIANTS)[repeat % len(VARIANTS):] + list(VARIANTS)[:repeat % len(VARIANTS)]
            line = []
            for name in names:
                if VARIANTS[name] is None:
                    t, rewards = bare_grpo(model_dir, train_file, args.steps, seed=repeat)
                else:
                    t, rewards = miles_grpo(model_dir, tmp / f"{len(line)}-{repeat}", args.steps, seed=repeat,
                                            overrides=VARIANTS[name])
                times[name].append(t)
                line.append(f"{name} {t:.2f} s (reward {sum(rewards[:window]) / window:.3f} -> "
                            f"{sum(rewards[-window:]) / window:.3f})")
            print(f"repeat {repeat}: " + ", ".join(line), flush=True)
    bare = min(times["bare single-file loop"])
    print(f"\nGRPO phase, {args.steps} steps of 16 prompts x 8 samples (best of {args.repeats}):")
    for name in VARIANTS:
        best = min(times[name])
        ratios = sorted(m / b for m, b in zip(times[name], times["bare single-file loop"]))
        print(f"  {name:<34}: {best:7.2f} s  ({1000 * best / args.steps:5.1f} ms/step)  ratio {best / bare:6.3f}  "
              f"(per repeat: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
