"""Train the bundled tiny Llama from scratch on text that ships with CPython.

Data: `pydoc_data.topics.topics` plus the docstrings of the standard library's source files (read with
`ast`, nothing is imported). One document per pydoc topic and one per stdlib module, in a fixed order;
a fixed ~5% of the documents (by a hash of their name) is held out for evaluation.

Output (only these files): config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json (with a chat_template), heldout.txt.

    python examples/train_tiny.py                       # defaults: the bundled checkpoint
    python examples/train_tiny.py --steps 100 --out /tmp/tiny   # a quick smoke run

Runs on one CPU thread. The planned step count fixes the cosine schedule. Without --steps the script times
the warm-up steps (their learning rate does not depend on the plan) and plans as many steps as fit in
--budget-min; it prints the number, and `--steps N` replays that schedule exactly.
--budget-min also stays a hard cap: training stops early (and says so) if the machine slows down.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
BOS, EOS = "<|bos|>", "<|eos|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
HELDOUT_MAX_BYTES = 300_000
EVAL_RESERVE_S = 60.0  # wall time kept for evaluation and saving


# ---------------------------------------------------------------------------------------------- data
def _docstrings(tree: ast.Module, module: str) -> str:
    """The module's docstrings in source order, each under a one-line header (module, class or def)."""
    parts = []

    def visit(node):
        doc = ast.get_docstring(node)
        if isinstance(node, ast.Module):
            head = f"Module {module}"
        elif isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            head = f"class {node.name}({bases}):" if bases else f"class {node.name}:"
        else:
            prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            head = f"{prefix} {node.name}({ast.unparse(node.args)}):"
        if doc and doc.strip():
            parts.append(f"{head}\n{doc.strip()}")
        for child in node.body:
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(tree)
    return "\n\n".join(parts)


def load_documents() -> list[tuple[str, str]]:
    """[(name, text)]: pydoc topics (sorted by key), then stdlib modules (sorted by path)."""
    from pydoc_data.topics import topics

    docs = [(f"topic:{k}", topics[k].strip()) for k in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-"))
        files += [Path(root) / n for n in sorted(names) if n.endswith(".py")]
    for f in sorted(files, key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = f.relative_to(stdlib).with_suffix("").as_posix().split("/")
        if rel[-1] == "__init__":
            rel = rel[:-1]
        module = ".".join(rel)
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        text = _docstrings(tree, module)
        if text:
            docs.append((f"module:{module}", text))
    return [(n, t) for n, t in docs if t]


def is_heldout(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] % 20 == 0  # ~5% of documents


# ----------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encoding a single text prepends <|bos|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """<|bos|> doc <|eos|> for each document, concatenated."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.long)


def chunks(stream: torch.Tensor, seq: int) -> torch.Tensor:
    """Non-overlapping windows of seq+1 tokens (inputs and shifted targets); the tail is dropped."""
    n = (len(stream) - 1) // seq
    return torch.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)])


# ------------------------------------------------------------------------------------------- model
def build_model(args, vocab_size: int, bos_id: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        initializer_range=0.02,
    )
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def mean_nll(model, data: torch.Tensor, batch: int, autocast: bool) -> float:
    """Mean next-token NLL (nats) over every target token of the windows in data."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        x = data[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def unigram_nll(train_targets: torch.Tensor, eval_targets: torch.Tensor, vocab: int) -> float:
    """Add-one smoothed unigram over BPE tokens, fit on train_targets, scored on eval_targets."""
    counts = torch.bincount(train_targets.reshape(-1), minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return -logp[eval_targets.reshape(-1)].mean().item()


# -------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "pystdlib-5m"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="planned optimizer steps (fixes the cosine schedule); default: planned from --budget-min "
        "after timing the first steps, and printed",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--budget-min", type=float, default=25.0, help="wall-clock cap for the whole run")
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 (bf16 autocast is the default)")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)

    t_start = time.time()
    deadline = t_start + args.budget_min * 60
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    autocast = not args.no_autocast
    if args.warmup < 10:
        p.error("--warmup must be at least 10: the step plan is timed during warm-up")

    # data and split
    docs = load_documents()
    train_docs = [(n, t) for n, t in docs if not is_heldout(n)]
    held_docs = [(n, t) for n, t in docs if is_heldout(n)]
    print(
        f"python {sys.version.split()[0]}: {len(docs)} documents, {sum(len(t) for _, t in docs)} chars; "
        f"held out {len(held_docs)} documents, {sum(len(t) for _, t in held_docs)} chars",
        flush=True,
    )

    tok = train_tokenizer([t for _, t in train_docs], args.vocab)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train_stream = encode_stream(tok, [t for _, t in train_docs])
    held_stream = encode_stream(tok, [t for _, t in held_docs])
    train_data, held_data = chunks(train_stream, args.seq), chunks(held_stream, args.seq)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}; train {len(train_stream)} tokens ({len(train_data)} windows), "
        f"held-out {len(held_stream)} tokens ({len(held_data)} windows)",
        flush=True,
    )

    # model and optimizer
    model = build_model(args, tok.get_vocab_size(), bos_id, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters ({n_params / 1e6:.2f}M)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    planned = args.steps or 10**9  # without --steps: replaced by the plan at the end of warm-up

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = min(1.0, (step - args.warmup) / max(1, planned - args.warmup))
        lo = args.lr * args.min_lr_frac
        return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * t))

    # training: windows reshuffled each epoch by a seeded generator
    gen = torch.Generator().manual_seed(args.seed)
    order, pos, epoch = torch.randperm(len(train_data), generator=gen), 0, 0
    model.train()
    t_train = time.time()
    running, step, t_probe = None, 0, None
    while step < planned:
        if step == 5:
            t_probe = time.time()  # the first steps are slower; time the ones after them
        if step == args.warmup and args.steps is None:
            per_step = (time.time() - t_probe) / (args.warmup - 5)
            planned = step + max(1, int(0.95 * (deadline - EVAL_RESERVE_S - time.time()) / per_step))
            print(
                f"planned {planned} steps from {per_step:.2f}s/step (rerun with --steps {planned} "
                f"for the same schedule)",
                flush=True,
            )
        if time.time() > deadline - EVAL_RESERVE_S:
            print(f"wall-clock budget reached: stopping at step {step} of {planned}", flush=True)
            break
        if pos + args.batch > len(order):
            order, pos, epoch = torch.randperm(len(train_data), generator=gen), 0, epoch + 1
        x = train_data[order[pos : pos + args.batch]]
        pos += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % args.log_every == 0 or step == planned - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}  epoch {epoch}  lr {lr_at(step):.2e}  loss {loss.item():.3f}  "
                f"(avg {running:.3f})  {el:.0f}s  {(step + 1) * args.batch * args.seq / el:.0f} tok/s",
                flush=True,
            )
        step += 1
    train_time = time.time() - t_train
    print(
        f"trained {step} steps ({step * args.batch * args.seq} tokens, {epoch + 1} epochs begun) in {train_time:.0f}s",
        flush=True,
    )

    # evaluation: round the weights to bf16 first, so the numbers describe the saved checkpoint
    model = model.to(torch.bfloat16).to(torch.float32)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    train_sample = train_data[torch.randperm(len(train_data), generator=eval_gen)[: max(len(held_data), 64)]]
    train_ppl = math.exp(mean_nll(model, train_sample, 8, autocast=False))
    held_ppl = math.exp(mean_nll(model, held_data, 8, autocast=False))
    uni_ppl = math.exp(unigram_nll(train_data[:, 1:], held_data[:, 1:], tok.get_vocab_size()))
    print(
        f"perplexity: train (sample of {len(train_sample)} windows) {train_ppl:.2f}  held-out {held_ppl:.2f}  "
        f"unigram baseline (held-out) {uni_ppl:.2f}",
        flush=True,
    )

    save(model, tok, bos_id, eos_id, held_docs, Path(args.out))
    print(f"saved to {args.out}; total wall time {time.time() - t_start:.0f}s", flush=True)
    return 0


def save(model, tok, bos_id, eos_id, held_docs, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = model.to(torch.bfloat16)
        # Sampling defaults for `llmc run` and transformers: greedy decoding of a model this small loops.
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=True, temperature=0.7, top_k=40
        )
        model.save_pretrained(tmp, safe_serialization=True)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copyfile(Path(tmp) / name, out / name)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    text = "".join(f"### {n}\n{t}\n\n" for n, t in held_docs)
    if len(text.encode()) > HELDOUT_MAX_BYTES:  # keep a sample: whole documents, in order, under the cap
        kept, size = [], 0
        for n, t in held_docs:
            piece = f"### {n}\n{t}\n\n"
            if size + len(piece.encode()) <= HELDOUT_MAX_BYTES:
                kept.append(piece)
                size += len(piece.encode())
        text = "".join(kept)
    (out / "heldout.txt").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
