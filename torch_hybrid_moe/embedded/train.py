"""Train the embedded MoE language models on the Python standard library (seeded, CPU, minutes).

    python -m torch_hybrid_moe.embedded.train [--only deepseek-tiny] [--steps 1000] [--out DIR | --replace-shipped]

Each model is a transformers class (DeepseekV3ForCausalLM, MixtralForCausalLM) with a byte-level BPE
tokenizer trained on the same corpus. Experts are kept balanced the way each architecture does it:
DeepSeek-V3's auxiliary-loss-free bias update (the score-correction bias moves against each expert's
load after every step), Mixtral's load-balancing auxiliary loss. The report (held-out perplexity
against a unigram baseline, per-layer load entropy, temporal reuse) is written beside the weights, and the
held-out text beside them (`heldout.txt`). The shipped models and held-out text are replaced only with
--replace-shipped: another Python's standard library splits into another held-out text, which would no longer
match the shipped traces.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from . import MODELS_DIR
from .corpus import SEPARATOR, SHIPPED_HELDOUT, split_corpus
from .evaluation import perplexity, record_routing, routing_report, unigram_perplexity

VOCAB = 2048
SEQ = 256


@dataclass(frozen=True)
class Recipe:
    name: str
    config: Callable[[int], PretrainedConfig]
    lr: float
    bias_update: float  # DeepSeek-V3 load-balancing bias step; 0 to disable


def deepseek_tiny(vocab: int) -> PretrainedConfig:
    return DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=320,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=32,
        head_dim=16,  # type: ignore[call-arg]  # not in the signature; the config keeps it as an attribute
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def mixtral_tiny(vocab: int) -> PretrainedConfig:
    return MixtralConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


RECIPES = {
    "deepseek-tiny": Recipe("deepseek-tiny", deepseek_tiny, lr=3e-3, bias_update=1e-3),
    "mixtral-tiny": Recipe("mixtral-tiny", mixtral_tiny, lr=3e-3, bias_update=0.0),
}


def train_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SEPARATOR, eos_token=SEPARATOR, pad_token=SEPARATOR, model_max_length=1024
    )


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for chunk in tokenizer(texts, add_special_tokens=False).input_ids:
        ids.extend(chunk)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _balance_bias_(model: torch.nn.Module, routed: dict[int, list[torch.Tensor]], step: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
    for idx, (topk_ids,) in routed.items():
        gate = model.model.layers[idx].mlp.gate
        load = torch.bincount(topk_ids.reshape(-1), minlength=gate.e_score_correction_bias.numel()).float()
        gate.e_score_correction_bias.add_(step * torch.sign(load.mean() - load))


def train(recipe: Recipe, train_ids: torch.Tensor, steps: int, batch: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(recipe.config(VOCAB)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc=f"training {recipe.name}", unit="step")
    for _ in bar:
        starts = torch.randint(0, train_ids.numel() - SEQ - 1, (batch,), generator=gen)
        x = torch.stack([train_ids[s : s + SEQ] for s in starts.tolist()])
        with record_routing(model) as routed:
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if recipe.bias_update:
            with torch.no_grad():
                _balance_bias_(model, routed, recipe.bias_update)
        bar.set_postfix(loss=f"{out.loss.item():.3f}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(RECIPES), action="append")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-train-chars", type=int, default=12_000_000)
    parser.add_argument("--out", type=Path, help="where the models and held-out text go (default: ./embedded-models)")
    parser.add_argument(
        "--replace-shipped", action="store_true", help="write into the package's own models/ and data/ (maintainers)"
    )
    args = parser.parse_args()
    if min(args.steps, args.batch, args.max_train_chars) < 1:
        parser.error("--steps, --batch and --max-train-chars must be >= 1")
    if args.replace_shipped and args.out is not None:
        parser.error("--replace-shipped writes the package's own models/; drop --out, or drop --replace-shipped")
    out_dir = MODELS_DIR if args.replace_shipped else args.out or Path("embedded-models")
    if not args.replace_shipped and out_dir.resolve().is_relative_to(MODELS_DIR.parents[1].resolve()):
        parser.error(f"--out {out_dir} is inside the package; pass --replace-shipped to replace the shipped models")
    heldout_path = SHIPPED_HELDOUT if args.replace_shipped else out_dir / "heldout.txt"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train_texts, heldout_texts = split_corpus(args.max_train_chars)
    # checked before anything is written: a corpus cut below one file, or below one training window, fails inside
    # transformers' tokenizer or torch.randint otherwise
    default = parser.get_default("max_train_chars")
    too_few = (
        f"--max-train-chars {args.max_train_chars} leaves too little text to train on; give more (default {default})"
    )
    if not train_texts:
        parser.error(too_few)
    tokenizer = train_tokenizer(train_texts, VOCAB)
    train_ids = encode(tokenizer, train_texts)
    if train_ids.numel() <= SEQ + 1:
        parser.error(too_few)
    heldout_text = SEPARATOR.join(heldout_texts)[:400_000]
    heldout_ids = encode(tokenizer, [heldout_text])
    heldout_path.parent.mkdir(parents=True, exist_ok=True)
    heldout_path.write_text(heldout_text, encoding="utf-8")
    print(
        f"corpus: {len(train_texts)} training files, {train_ids.numel()} tokens; held out {heldout_ids.numel()} tokens"
    )
    for name in args.only or sorted(RECIPES):
        start = time.time()
        model = train(RECIPES[name], train_ids, args.steps, args.batch, args.seed)
        out = out_dir / name
        model.generation_config.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.config.output_router_logits = False  # the aux loss is for training: shipped configs are for inference
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        report = {
            "steps": args.steps,
            "batch": args.batch,
            "seq": SEQ,
            "seed": args.seed,
            "train_tokens_seen": args.steps * args.batch * SEQ,
            "train_minutes": (time.time() - start) / 60,
            "parameters": sum(p.numel() for p in model.parameters()),
            "heldout_ppl": perplexity(model, heldout_ids),
            "unigram_ppl": unigram_perplexity(train_ids, heldout_ids, VOCAB),
            **routing_report(model, heldout_ids),
        }
        (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
