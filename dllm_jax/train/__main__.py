"""`python -m dllm_jax.train`: trains a tiny LLaDA or SDAR model on the synthetic tasks of dllm_jax.eval.

  python -m dllm_jax.train --family llada --config tiny --task passkey,sanity --context 1024 \\
      --steps 2000 --batch 16 --out runs/llada [--resume] [--stop-at 500]

OUT holds the run (checkpoints/, train_config.json, history.json, loss.png, see dllm_jax.train.run_folder)
and, after every invocation, OUT/hf: the weights so far as an HF checkpoint with the task tokenizer
(`dllm_jax.load_model(OUT/hf)`, `dllm-jax eval --model OUT/hf`). Training samples use seeds >= 2**31
(drawn from --seed and the step): evaluate on seeds below that to test on prompts never trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from dllm_jax.flags import (finite_float, non_negative_float, non_negative_int, number, one_line, positive_float,
                            positive_int)
from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.train.attention import CHUNK
from dllm_jax.train.task_batches import SDAR_BLOCK, batch_source, option_variants, task_options_of

# "medium" is "small" twice as deep (6.6M parameters; 13 MB stored in bfloat16, --export-dtype), the shape of the
# shipped models, which are grown from a trained "small" by --grow-layers: trained from scratch on the full tasks, it
# learns nothing within ~4k steps (checkpoints/README.md). Their heads are 32 wide; "small-64" and "medium-64"
# have 4 query / 2 KV heads of 64 (the width the Hopper kernels take; the same parameter count), the
# only way to 64-wide heads for LLaDA, whose head_dim is hidden_size / num_heads (SDAR's can be widened,
# --widen-heads).
SIZES = {"tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192),
         "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768),
         "medium": dict(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=768),
         "small-64": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768,
                          head_dim=64),
         "medium-64": dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=768,
                           head_dim=64)}
SDAR_HEAD_DIM = 32  # SDAR's head width where a size names none (LLaDA's is always hidden_size / num_heads)


# RoPE bases of a new model. LLaDA's is 1e4, not LLaDA-8B's 5e5: with 32-wide heads the larger base leaves
# too few angles that resolve single-token offsets, and a bidirectional model must order its answer by
# position. SDAR's is SDAR-8B's 1e6, which the shipped tiny SDAR was trained with.
ROPE_THETA = {"llada": 10000.0, "sdar": 1000000.0}


def checked_rope_theta(theta: float) -> float:
    if not theta > 1:
        raise ValueError(f"rope_theta must be > 1, got {theta}")
    return theta


def model_config(family: str, size: str, *, vocab_size: int, special, max_positions: int,
                 rope_theta: float | None = None):
    """The architecture `size` (a key of SIZES) of `family` over the task vocabulary; `rope_theta`
    (default ROPE_THETA[family]) is its RoPE base."""
    shapes = dict(SIZES[size])
    head_dim = shapes.pop("head_dim", SDAR_HEAD_DIM)
    theta = checked_rope_theta(ROPE_THETA[family] if rope_theta is None else rope_theta)
    if family == "llada":
        return LLaDAConfig(**shapes, rope_theta=theta, vocab_size=vocab_size, tokenizer_vocab_size=vocab_size,
                           max_position_embeddings=max_positions, mask_token_id=special.mask,
                           eos_token_id=special.eos, pad_token_id=special.pad, eot_token_id=special.eos)
    return SDARConfig(**shapes, head_dim=head_dim, rope_theta=theta, vocab_size=vocab_size,
                      max_position_embeddings=max_positions, block_size=SDAR_BLOCK, mask_token_id=special.mask,
                      eos_token_ids=(special.eos,), pad_token_id=special.pad)


train_seed = number(int, "an integer in [0, 2**31)", lambda v: 0 <= v < 2**31)
open_fraction = number(float, "a number in (0, 1)", lambda v: 0 < v < 1)

# the flag that sets each field a resume compares (`dllm_jax.train.run_folder.run_differences`)
FLAG_OF = {"learning_rate": "--lr", "batch_size": "--batch", "warmup_steps": "--warmup",
           "weight_decay": "--weight-decay", "grad_clip": "--grad-clip", "compute_dtype": "--dtype", "eps": "--min-t",
           "stratified_t": "--stratified-t", "seed": "--seed", "seq_length": "--context (its longest batch)",
           "family": "--family",
           "model": "the model (--family, --config, --rope-theta, --init, --grow-layers, --widen-heads, "
                    "--regroup-heads, --max-positions)",
           "batches.task": "--task", "batches.context": "--context", "batches.niah_needles": "--niah-needles",
           "batches.vt_hops": "--vt-hops", "batches.vt_ask_back": "--vt-ask-back",
           "batches.pad_in_loss": "--no-pad-loss"}


def comma_list(kind):
    """argparse type: a comma-separated list of `kind` (a type or one of the CLI's checked number types)."""
    def parse(text: str):
        try:
            values = [kind(part) for part in text.split(",") if part]
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__} ({e}), got "
                                             f"{text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="python -m dllm_jax.train", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=[arguments()])


def arguments() -> argparse.ArgumentParser:
    """The training flags, as a parent parser (no -h) shared by this module and `dllm-jax train`."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--family", choices=("llada", "sdar"), required=True)
    p.add_argument("--config", choices=tuple(SIZES), default="tiny", help="model size")
    p.add_argument("--rope-theta", type=finite_float, default=None,
                   help="RoPE base of a new model (default: LLaDA 1e4, SDAR 1e6); with --init, the checkpoint's base "
                        "replaced (a larger base for longer contexts: the trained attention then sees other angles, "
                        "a warm start; default: the checkpoint's own)")
    p.add_argument("--task", type=comma_list(str), default=["passkey"],
                   help="task(s), comma-separated (dllm_jax.eval.TASKS); each sample draws one")
    p.add_argument("--context", type=comma_list(positive_int), default=[1024],
                   help="context length(s) in tokens, comma-separated; each batch draws one (a length listed twice "
                        "is drawn twice as often) and is padded only to that context's longest sample")
    p.add_argument("--niah-needles", type=comma_list(positive_int), default=None,
                   help="needles per niah_multikey sample (default: the task's 4); fewer make a curriculum's first "
                        "step; several, comma-separated: each sample draws one")
    p.add_argument("--vt-hops", type=comma_list(non_negative_int), default=None,
                   help="assignments after the value in variable_tracking (default: the task's 1); 0 asks for the "
                        "variable that holds the value, a curriculum's first step; several, comma-separated: each "
                        "sample draws one (e.g. 0,1 keeps the one-lookup samples beside the hop)")
    p.add_argument("--vt-ask-back", type=comma_list(non_negative_int), default=None,
                   help="variable_tracking asks the variable this many assignments before its chain's last (default "
                        "0, at most every --vt-hops value); 0,1 with one hop mixes the task with questions a "
                        "copy-after-the-name shortcut gets wrong")
    p.add_argument("--steps", type=positive_int, required=True, help="total optimizer steps of the run (the schedule's length)")
    p.add_argument("--stop-at", type=positive_int, default=None, help="stop after this step (resume later with --resume)")
    p.add_argument("--max-minutes", type=positive_float, default=None,
                   help="also stop after this many minutes of training (resume later with --resume)")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="peak learning rate; a run whose loss turns NaN or Inf stops with exit status 2, its last "
                        "finite checkpoint and export kept")
    p.add_argument("--warmup", type=non_negative_int, default=100)
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1)
    p.add_argument("--grad-clip", type=positive_float, default=1.0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    p.add_argument("--no-pad-loss", dest="pad_in_loss", action="store_false",
                   help="train on the answer only; by default the answer is padded to the window `dllm-jax eval` "
                        "generates into (the task's longest answer) and the model learns to fill it")
    p.add_argument("--stratified-t", action="store_true",
                   help="draw each batch's masking ratios stratified over [min_t, 1) (one per 1/n of it, for the n rows "
                        "(LLaDA) or blocks (SDAR)) instead of iid: lower variance of the 1/t weights")
    p.add_argument("--attention-chunk", type=positive_int, default=CHUNK, metavar="N",
                   help="queries per chunk of the training attention: memory of one chunk's scores against the whole "
                        "sequence instead of [L, L] (dllm_jax.train.attention); a smaller chunk for longer contexts")
    p.add_argument("--min-t", type=open_fraction, default=1e-3,
                   help="masking ratios are drawn from U(min_t, 1) (LLaDA's eps); a larger floor spends more of the "
                        "loss on mostly-masked answers, where the needle must be found rather than read off the "
                        "answer digits already shown")
    p.add_argument("--seed", type=train_seed, default=None,
                   help="seeds the batches (each step's context and samples) and the masking (default 0); a run "
                        "started with --init from a run of the same seed would draw that run's samples again, so "
                        "the default is refused there: give each run of a curriculum its own --seed")
    p.add_argument("--data-workers", type=non_negative_int, default=min(4, max(1, (os.cpu_count() or 2) - 1)),
                   help="background processes building the batches ahead of the step (0: build them in the loop)")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=500,
                   help="checkpoint every this many steps (0: only at the end of each call); the last two are kept")
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", type=Path, required=True,
                   help="run directory: new, empty, or this run's own (with --resume); never inside another run or "
                        "overlapping --init")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--init", type=Path, default=None,
                   help="start a new run from the weights of this HF checkpoint (e.g. checkpoints/tiny-sdar-tasks, "
                        "to teach it more tasks); its config.json replaces --config")
    p.add_argument("--grow-layers", type=positive_int, default=None,
                   help="with --init: deepen the checkpoint's model to this many layers (a multiple of its own): each "
                        "layer is followed by copies with zero output projections, so training starts from exactly the "
                        "checkpoint's function (dllm_jax.train.surgery.grow_layers)")
    p.add_argument("--widen-heads", type=positive_int, default=None, metavar="HEAD_DIM",
                   help="with --init (SDAR): widen the checkpoint's heads to this head_dim (a multiple of its own, e.g. "
                        "32 -> 64 for the Hopper kernels), computing exactly the checkpoint's function "
                        "(dllm_jax.train.surgery.widen_heads)")
    p.add_argument("--regroup-heads", type=positive_int, default=None, metavar="NUM_HEADS",
                   help="with --init (LLaDA, whose head_dim is hidden_size / num_heads): merge the checkpoint's query "
                        "and KV heads into this many query heads, as many times wider (e.g. 8 x 32 -> 4 x 64); lossy, "
                        "a warm start to train on (dllm_jax.train.surgery.regroup_heads)")
    p.add_argument("--max-positions", type=positive_int, default=None, metavar="N",
                   help="max_position_embeddings of the trained model (default: an --init checkpoint's own, else "
                        "max(longest --context, 4096)); raising an --init checkpoint's extends its context (RoPE has "
                        "no weights per position)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def run(args) -> Path:
    from dllm_jax.eval import TASKS, build_tokenizer, min_context_length, vocab
    from dllm_jax.train import TrainConfig, export_hf, train

    unknown = [t for t in args.task if t not in TASKS]
    if unknown:
        raise ValueError(f"--task: unknown task(s) {unknown}; choose from {list(TASKS)}")
    options = task_options_of(args)
    unused = sorted(set(options) - set(args.task))
    if unused:
        raise ValueError(f"--niah-needles / --vt-hops / --vt-ask-back set options of {unused}, which --task does "
                         "not train")
    least = {t: max(min_context_length(t, o) for o in option_variants(options.get(t))) for t in args.task}
    short = [f"{t} needs >= {least[t]}" for t in args.task for c in args.context if c < least[t]]
    if short:
        raise ValueError(f"--context {args.context} too short: {sorted(set(short))}")
    for flag, value in (("--grow-layers", args.grow_layers), ("--widen-heads", args.widen_heads),
                        ("--regroup-heads", args.regroup_heads)):
        if value is not None and args.init is None:
            raise ValueError(f"{flag} changes the model of an --init checkpoint: give --init")
    if args.stop_at is not None and args.stop_at > args.steps:
        raise ValueError(f"--stop-at {args.stop_at} is past --steps {args.steps} (the run's last step)")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps}")
    args.seed = run_seed(args)
    check_out(args)
    tokenizer = build_tokenizer()
    special = vocab.special_ids(tokenizer)
    batches = batch_source(args, tokenizer)
    length = batches.length  # the longest bucket
    if args.init is None:
        model, params = model_config(args.family, args.config, vocab_size=tokenizer.get_vocab_size(),
                                     special=special, max_positions=args.max_positions or max(length, 4096),
                                     rope_theta=args.rope_theta), None
    else:
        model, params = initial_weights(args, special, vocab_size=tokenizer.get_vocab_size(), length=length)
    config = TrainConfig(model=model, steps=args.steps, batch_size=args.batch, seq_length=length,
                         learning_rate=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay,
                         grad_clip=args.grad_clip, compute_dtype=args.dtype, run_dir=str(args.out),
                         checkpoint_every=args.checkpoint_every, log_every=args.log_every, seed=args.seed,
                         stratified_t=args.stratified_t, eps=args.min_t, attention_chunk=args.attention_chunk)
    settings = batch_settings(args)
    if args.resume:
        check_resume(args.out, config, settings)
    result = train(config, batches, params=params, resume=args.resume, stop_at=args.stop_at,
                   max_seconds=None if args.max_minutes is None else 60 * args.max_minutes, progress=args.progress,
                   data_workers=args.data_workers, batch_settings=settings)
    hf_dir = export_hf(result.params, model, args.out / "hf", dtype=args.export_dtype)
    build_tokenizer(hf_dir)
    last = result.history[-1] if result.history else None
    done = f"step {int(result.state.step)}/{config.steps}"
    loss = f"; loss {last['loss']:.4f}" if last else ""
    print(f"{done}{loss}; HF checkpoint in {hf_dir}")
    return hf_dir


def run_seed(args) -> int:
    """--seed, 0 by default; ValueError for the default where --init comes from a run seeded 0 (its
    train_config.json beside or above the HF directory): each step's samples depend on (seed, step) alone,
    so such a run would replay the earlier run's samples wherever the contexts match (the long-context
    SDAR runs L3, L5 and L6 did, and reached a training loss near 0 while their evaluation stayed at 80%)."""
    if args.seed is not None:
        return args.seed
    if args.init is not None and not args.resume:
        for path in (args.init / "train_config.json", args.init.parent / "train_config.json"):
            if path.is_file():
                if json.loads(path.read_text()).get("seed") == 0:
                    raise ValueError(f"--init {args.init} comes from a run with seed 0 ({path}), this run's "
                                     "default: its steps would draw that run's samples again; give --seed N (a new "
                                     "seed, or 0 to replay them on purpose)")
                break
    return 0


def batch_settings(args) -> dict:
    """What shapes the batches beyond TrainConfig, as train_config.json records it (a resume must match)."""
    return {"task": args.task, "context": args.context, "niah_needles": args.niah_needles, "vt_hops": args.vt_hops,
            "vt_ask_back": args.vt_ask_back, "pad_in_loss": args.pad_in_loss}


def check_out(args) -> None:
    """--out must be a place a run may own (`loop.check_run_location`) apart from --init: the run writes
    OUT/hf, OUT/train_config.json and rotates OUT/checkpoints, which must never touch the checkpoint it
    starts from (the converter's rule: not the same directory, not inside it, not containing it)."""
    from dllm_jax.checkpoint.atomic import path_relation
    from dllm_jax.train.run_folder import check_run_location

    if args.init is not None:
        relation = path_relation(args.out, args.init)
        if relation:
            raise ValueError(f"--out {args.out} {relation} --init {args.init}: the run would overwrite the checkpoint "
                             "it starts from; choose an --out outside it")
    try:
        check_run_location(args.out)
    except ValueError as e:
        raise ValueError(f"--out: {e}") from None


def check_resume(out: Path, config, settings: dict) -> None:
    """Before any work: a run that holds checkpoints resumes only with its own settings; the flags that
    differ are named with their stored and new values."""
    from dllm_jax.train.run_folder import CONFIG_FILE, Run, read_json, run_differences

    if Run(out).latest_step() is None:
        return
    stored = out / CONFIG_FILE
    if not stored.is_file():
        raise ValueError(f"--resume: {stored} is missing, so this call's flags cannot be checked against the run's")
    changed = run_differences(read_json(stored, "the run's configuration"), config, settings)
    if changed:
        listed = "; ".join(f"{FLAG_OF.get(k, k)} was {short(old)}, now {short(new)}" for k, (old, new) in changed.items())
        raise ValueError(f"--resume: this call's flags differ from the run's ({stored}): {listed}")


def short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def initial_weights(args, special, *, vocab_size: int, length: int):
    """(model config, float32 parameters in the checkpoint layout) of the HF checkpoint `args.init`,
    checked against the run: its family, the task tokenizer's ids and the sequence length."""
    from dllm_jax.checkpoint.hf import read_hf_params
    from dllm_jax.config import read_hf_config
    from dllm_jax.train.surgery import grow_layers, regroup_heads, widen_heads

    if args.resume:
        raise ValueError("--init starts a new run from a checkpoint's weights; --resume continues a run: give one")
    _, model = read_hf_config(args.init)
    if model.family != args.family:
        raise ValueError(f"--init {args.init} holds a {model.family} model, not --family {args.family}")
    if model.quantize:
        raise ValueError(f"--init {args.init} is a conversion quantized to {model.quantize}: training starts from "
                         "full-precision weights; give the HF checkpoint it was converted from")
    eos = model.stop_ids
    ids = (model.mask_token_id, model.pad_token_id, eos[0])
    if ids != (special.mask, special.pad, special.eos) or model.vocab_size < vocab_size:
        raise ValueError(f"--init {args.init}: mask/pad/eos ids {ids} and vocabulary {model.vocab_size} do not fit "
                         f"the task tokenizer ({special.mask}, {special.pad}, {special.eos}; {vocab_size} tokens)")
    if args.family == "sdar" and model.block_size != SDAR_BLOCK:
        raise ValueError(f"--init {args.init} has block size {model.block_size}; the task training uses {SDAR_BLOCK}")
    positions = args.max_positions or model.max_position_embeddings
    if positions < length:
        raise ValueError(f"--init {args.init} allows {positions} positions; the run needs {length}"
                         + ("" if args.max_positions else " (raise them with --max-positions)"))
    params = read_hf_params(args.init, model, dtype="float32", progress=False)
    model = dataclasses.replace(model, max_position_embeddings=positions)
    if args.rope_theta is not None:
        model = dataclasses.replace(model, rope_theta=checked_rope_theta(args.rope_theta))
    if args.grow_layers is not None:
        params = grow_layers(params, args.grow_layers)
        model = dataclasses.replace(model, num_layers=args.grow_layers)
    if args.widen_heads is not None:
        params = widen_heads(params, model, args.widen_heads)
        model = dataclasses.replace(model, head_dim=args.widen_heads)
    if args.regroup_heads is not None:
        params = regroup_heads(params, model, args.regroup_heads)
        model = dataclasses.replace(model, num_heads=args.regroup_heads,
                                    num_kv_heads=model.num_kv_heads * args.regroup_heads // model.num_heads)
    return model, params


def main(argv: list[str] | None = None) -> int:
    """0 on success; 2 on a bad flag (argparse) or a refused input (one line on stderr, no traceback)."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as e:
        print(f"python -m dllm_jax.train: error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
