"""An lm-evaluation-harness model (`lm_eval --model dllm_jax` through this module's command line, which is the
harness's own with the model registered): a checkpoint loaded with `dllm_jax.load_model`, scored in this process.

    python -m dllm_jax.eval.harness --model dllm_jax --model_args checkpoint=checkpoints/tiny-llada-tasks,mc_num=32 \\
        --tasks <task> [--include_path <folder of local tasks>] [--batch_size 32]

  * generate_until: `dllm_jax.generate` on each context (its text as given: the harness applies chat templates
    itself with --apply_chat_template), with the family's evaluation options for `max_gen_toks` new tokens (greedy,
    one token a step: `Family.eval_options`), the text cut before the first `until` string.
  * loglikelihood (LLaDA; SDAR / TraDo and LLaDA2 block by block): the official LLaDA evaluation's Monte-Carlo
    estimate (`dllm_jax.eval.likelihood`: mc_num draws in batches of --batch_size rows, its defaults 128 and 32;
    a block-diffusion model's is the sum of its answer blocks' estimates), and the greedy check where
    is_check_greedy=true (else False, as the official default for most tasks). The context's trailing
    whitespace moves to the continuation before encoding, as the official model does.
  * loglikelihood_rolling (perplexity tasks): the text in disjoint windows of the model's positions
    (lm-eval's rolling windows, as its Hugging Face model makes them: each window's context is the token before it,
    the first's the model's last stop id), each window's estimate as loglikelihood's, summed.

Model arguments: checkpoint (required), dtype (bfloat16), mc_num (128), is_check_greedy (false), seed (0, the
draws' and the sampler's). Needs lm-eval (`pip install 'dllm-jax[harness]'`).
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

try:
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    raise ImportError(f"dllm_jax.eval.harness needs lm-evaluation-harness ({e.name} is missing): "
                      "pip install 'dllm-jax[harness]'") from None

from dllm_jax import validation as check
from dllm_jax.eval import likelihood


@register_model("dllm_jax")
class DllmJaxLM(LM):
    def __init__(self, checkpoint: str, dtype: str = "bfloat16", mc_num: int = likelihood.MC_NUM,
                 batch_size: int | str = likelihood.BATCH_SIZE, is_check_greedy: bool = False, seed: int = 0,
                 device: str | None = None, max_batch_size: int | None = None):
        super().__init__()
        from dllm_jax import load_model
        from dllm_jax.families import family_of
        from dllm_jax.tokenizer import ChatTokenizer

        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto: give the rows of one Monte-Carlo draw as a number (--batch_size 32)")
        self.batch_size = check.integer("batch_size", int(batch_size), minimum=1)
        self.mc_num = check.integer("mc_num", int(mc_num), minimum=self.batch_size)
        self.is_check_greedy, self.seed = bool(is_check_greedy), check.integer("seed", int(seed), minimum=0)
        self.checkpoint = str(checkpoint)
        self.model = load_model(checkpoint, dtype=dtype, progress=False)
        self.family = family_of(self.model.config)
        self.tokenizer = ChatTokenizer(checkpoint)

    @property
    def tokenizer_name(self) -> str:
        return self.checkpoint

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.render_messages(chat_history)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids): the continuation's are the whole text's past the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        return head, whole[len(head):]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in tqdm(requests, desc="log-likelihoods"):
            prompt, answer = self.encode_pair(*request.args)
            if not prompt or not answer:
                raise ValueError(f"a request encodes to an empty context or continuation: {request.args!r}")
            out.append((self.estimate(prompt, answer),
                        self.is_check_greedy and likelihood.greedy_answer(self.model, prompt, answer)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in tqdm(requests, desc="rolling log-likelihoods"):
            (text,) = request.args
            windows = get_rolling_token_windows(self.encode(text), self.model.config.stop_ids[-1],
                                                self.model.config.max_position_embeddings, context_len=1)
            out.append(sum(self.estimate(*make_disjoint_window(window)) for window in windows))
        return out

    def estimate(self, prompt: list[int], answer: list[int]) -> float:
        """The likelihood estimate of answer given prompt (`likelihood.log_likelihood`'s ValueError for a model it
        does not estimate)."""
        return likelihood.log_likelihood(self.model, prompt, answer, mc_num=self.mc_num, batch_size=self.batch_size,
                                         seed=self.seed)

    def generate_until(self, requests) -> list[str]:
        from dllm_jax.generate import generate

        if self.family.eval_options is None:
            raise ValueError(f"generate_until has no evaluation options for {self.family.label} checkpoints")
        out = []
        for request in tqdm(requests, desc="generating"):
            context, kwargs = request.args
            until = [kwargs["until"]] if isinstance(kwargs.get("until"), str) else list(kwargs.get("until") or [])
            length = int(kwargs.get("max_gen_toks", 256))
            ids = np.asarray([self.encode(context)], np.int32)
            options = self.family.eval_options(length, self.model.config, {})
            row = np.asarray(generate(self.model, ids, seed=self.seed, **options))[0, ids.shape[1]:][:length]
            stops = np.flatnonzero(np.isin(row, self.model.config.stop_ids))
            text = self.tokenizer.decode(row[:stops[0]] if stops.size else row,
                                         skip=(self.model.config.mask_token_id,))
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


if __name__ == "__main__":
    cli_evaluate()
