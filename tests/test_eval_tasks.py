"""The synthetic task suite (dllm_jax.eval): its tokenizer, seeded samples, scoring, evaluation on tiny
random models, and `dllm-jax eval`."""

import json
import re

import numpy as np
import pytest

from dllm_jax.cli import main
from dllm_jax.eval import (SPECIAL_IDS, TASKS, VOCAB_SIZE, EvalResult, Sample, build_tokenizer, evaluate,
                           load_tokenizer, make_samples, max_answer_length, min_context_length, score)
from dllm_jax.eval import tasks, vocab
from dllm_jax.testing import no_compilation, tiny_llada_config, tiny_sdar_config, write_hf_checkpoint
from dllm_jax.tokenizer import ChatTokenizer

TOKENIZER = build_tokenizer()
IDS = dict(mask_token_id=SPECIAL_IDS.mask, pad_token_id=SPECIAL_IDS.pad)
LLADA = tiny_llada_config(vocab_size=VOCAB_SIZE, tokenizer_vocab_size=VOCAB_SIZE, eos_token_id=SPECIAL_IDS.eos,
                          eot_token_id=SPECIAL_IDS.eos, max_position_embeddings=320, **IDS)
SDAR = tiny_sdar_config(vocab_size=VOCAB_SIZE, eos_token_ids=(SPECIAL_IDS.eos,), max_position_embeddings=320, **IDS)


def words(sample: Sample) -> list[str]:
    return [TOKENIZER.id_to_token(int(i)) for i in sample.prompt_ids]


def same(a: Sample, b: Sample) -> bool:
    fields = ("task", "answer", "context_length", "seed", "index")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and np.array_equal(a.prompt_ids, b.prompt_ids) \
        and np.array_equal(a.answer_ids, b.answer_ids)


def test_vocabulary_is_fixed_disjoint_and_its_special_ids_distinct():
    assert len(set(vocab.VOCABULARY)) == VOCAB_SIZE == TOKENIZER.get_vocab_size() == 512
    assert TOKENIZER.get_vocab() == {word: i for i, word in enumerate(vocab.VOCABULARY)}
    assert len(set(vars(SPECIAL_IDS).values())) == 4 and vocab.special_ids(TOKENIZER) == SPECIAL_IDS
    assert [TOKENIZER.id_to_token(i) for i in (SPECIAL_IDS.pad, SPECIAL_IDS.mask, SPECIAL_IDS.eos)] == \
        ["<pad>", "<mask>", "<eos>"]
    # filler text never holds a template word, a key, a variable or a digit: answers are unambiguous
    assert not set(vocab.FILLER_WORDS) & set(vocab.TEMPLATE_WORDS + vocab.KEYS + vocab.VARIABLES + vocab.DIGITS)


def test_tokenizer_round_trips_task_text_and_writes_numbers_digit_by_digit(tmp_path, rng):
    ids = TOKENIZER.encode("the pass key is 40712 .").ids
    assert [TOKENIZER.id_to_token(i) for i in ids] == ["the", "pass", "key", "is", "4", "0", "7", "1", "2", "."]
    sample = make_samples(str(rng.choice(TASKS)), 200, 1, int(rng.integers(1000)), TOKENIZER)[0]
    text = TOKENIZER.decode(sample.prompt_ids.tolist())
    assert TOKENIZER.encode(text).ids == sample.prompt_ids.tolist()
    assert TOKENIZER.decode(sample.answer_ids.tolist()) == sample.answer  # EOS dropped as a special token

    build_tokenizer(tmp_path)  # the saved directory loads as the checkpoint tokenizer, with the same ids
    assert load_tokenizer(tmp_path).encode(text).ids == sample.prompt_ids.tolist()
    chat = ChatTokenizer(tmp_path)  # its chat template adds nothing: task prompts go in as they are
    assert chat.encode(text).tolist() == chat.encode(text, chat=False).tolist() == [sample.prompt_ids.tolist()]
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path / "missing")


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_deterministic_per_seed_and_differ_across_seeds(task, rng):
    seed = int(rng.integers(-2**40, 2**40))
    first = make_samples(task, 160, 4, seed, TOKENIZER)
    assert all(map(same, first, make_samples(task, 160, 4, seed, TOKENIZER)))
    assert all(map(same, first[:2], make_samples(task, 160, 2, seed, TOKENIZER)))  # sample i: its own stream
    assert [s.index for s in first] == [0, 1, 2, 3] and {s.seed for s in first} == {seed}
    other = make_samples(task, 160, 4, seed + 1, TOKENIZER)
    assert not any(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(first, other))
    assert len({s.prompt_ids.tobytes() for s in first}) == 4


@pytest.mark.parametrize("task", TASKS)
def test_prompts_fill_the_context_and_answers_end_with_eos(task, rng):
    context = int(rng.integers(min_context_length(task), 400))
    for sample in make_samples(task, context, 3, int(rng.integers(1000)), TOKENIZER):
        assert sample.prompt_ids.dtype == sample.answer_ids.dtype == np.int32
        assert len(sample.prompt_ids) == (min(context, tasks.SANITY_CONTEXT) if task == "sanity" else context)
        assert sample.answer_ids[-1] == SPECIAL_IDS.eos and len(sample.answer_ids) <= max_answer_length(task)
        assert not np.isin(sample.prompt_ids, list(vars(SPECIAL_IDS).values())).any()
        assert words(sample)[-2:] == ["answer", ":"]
        assert sample.answer.split() == [TOKENIZER.id_to_token(int(i)) for i in sample.answer_ids[:-1]]
        assert all(w in vocab.DIGITS for w in sample.answer.split())
        assert not sample.prompt_ids.flags.writeable


def needles(text: list[str], head: list[str]) -> list[list[str]]:
    """The sentences of `text` that start with `head`, each up to its '.'."""
    starts = [i for i in range(len(text)) if text[i:i + len(head)] == head and (i == 0 or text[i - 1] == ".")]
    return [text[i:text.index(".", i)] for i in starts]


def test_passkey_hides_one_key_and_asks_for_it(rng):
    for sample in make_samples("passkey", 300, 5, int(rng.integers(1000)), TOKENIZER):
        text = words(sample)
        (needle,) = needles(text, ["the", "pass", "key", "is"])
        assert needle[4:] == sample.answer.split() and len(needle[4:]) == tasks.PASSKEY_DIGITS
        assert text[-8:] == "what is the pass key ? answer :".split()


def test_niah_multikey_queries_exactly_one_of_its_distinct_keys(rng):
    depths = []
    for sample in make_samples("niah_multikey", 300, 8, int(rng.integers(1000)), TOKENIZER):
        text = words(sample)
        found = needles(text[:-11], "the special magic number for".split())
        keys = [n[5] for n in found]
        assert len(found) == tasks.NIAH_NEEDLES and len(set(keys)) == len(keys) and set(keys) <= set(vocab.KEYS)
        assert len({tuple(n[7:]) for n in found}) == tasks.NIAH_NEEDLES  # distinct numbers
        queried = text[-4]
        assert text[-11:] == f"what is the special magic number for {queried} ? answer :".split()
        assert [n[7:] for n in found if n[5] == queried] == [sample.answer.split()]
        depths.append(keys.index(queried))
    assert len(set(depths)) > 1  # the queried needle is not always the first


def resolve(text: list[str], variable: str) -> list[str]:
    """The value of `variable` by following the VAR assignments of `text` (an independent reading)."""
    assignments = {n[1]: n[3:] for n in needles(text, ["VAR"])}
    value = assignments[variable]
    while value[0] == "VAR":
        value = assignments[value[1]]
    return value


def test_variable_tracking_answer_is_the_value_its_chain_resolves_to(rng):
    for sample in make_samples("variable_tracking", 300, 5, int(rng.integers(1000)), TOKENIZER):
        text = words(sample)
        statements = needles(text[:-10], ["VAR"])
        assert len(statements) == tasks.VT_CHAINS * (tasks.VT_HOPS + 1)
        assert len({s[1] for s in statements}) == len(statements)  # each variable assigned once
        assert text[-10:-4] == "what is the value of VAR".split()
        assert resolve(text[:-10], text[-4]) == sample.answer.split()
        values = {tuple(s[3:]) for s in statements if s[3] != "VAR"}
        assert len(values) == tasks.VT_CHAINS  # distractor chains hold other values


def test_sanity_copies_or_reverses_its_digits(rng):
    kinds = set()
    for sample in make_samples("sanity", 4096, 10, int(rng.integers(1000)), TOKENIZER):
        text = words(sample)
        start = max(i for i, w in enumerate(text) if w in ("copy", "reverse"))
        sequence = text[start + 1:-3]
        expected = sequence[::-1] if text[start] == "reverse" else sequence
        assert sample.answer.split() == expected and len(text) == tasks.SANITY_CONTEXT
        kinds.add(text[start])
    assert kinds == {"copy", "reverse"}


def test_make_samples_refuses_bad_arguments():
    with pytest.raises(ValueError, match="task must be one of"):
        make_samples("needle", 1024, 1, 0, TOKENIZER)
    with pytest.raises(ValueError, match="num_samples must be a positive integer, got 0"):
        make_samples("passkey", 1024, 0, 0, TOKENIZER)
    for task in TASKS:
        minimum = min_context_length(task)
        assert len(make_samples(task, minimum, 1, 0, TOKENIZER)[0].prompt_ids) == minimum
        with pytest.raises(ValueError, match=f"too short for {task}.* take {minimum} tokens"):
            make_samples(task, minimum - 1, 1, 0, TOKENIZER)
    with pytest.raises(ValueError, match="seed must be an integer"):
        make_samples("passkey", 1024, 1, 0.5, TOKENIZER)
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="lacks .* words of the task vocabulary"):
        make_samples("passkey", 1024, 1, 0, Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")))
    with pytest.raises(ValueError, match="tokenizers.Tokenizer or a ChatTokenizer"):
        make_samples("passkey", 1024, 1, 0, "tokenizer.json")


def test_score_is_an_exact_match_up_to_eos(rng):
    sample = make_samples("passkey", 64, 1, int(rng.integers(1000)), TOKENIZER)[0]
    answer = sample.answer_ids.tolist()
    eos = SPECIAL_IDS.eos
    assert score(sample, answer)
    assert score(sample, np.asarray(answer + [eos, 17, SPECIAL_IDS.mask]))  # whatever follows the EOS is ignored
    assert not score(sample, answer[:-1])  # truncated: no EOS
    assert not score(sample, answer[:-1] + [SPECIAL_IDS.pad])  # no EOS where it belongs
    assert not score(sample, answer[:-2] + [eos])  # stopped one digit early
    assert not score(sample, [answer[0]] + answer)  # an extra token before the answer
    wrong, at = list(answer), int(rng.integers(len(answer) - 1))
    zero = vocab.VOCABULARY.index("0")
    wrong[at] = zero + (answer[at] - zero + int(rng.integers(1, 10))) % 10  # another digit
    assert not score(sample, wrong)
    assert not score(sample, [])


def check_result(result: EvalResult, samples: list[Sample], gen: int) -> None:
    assert result.num_samples == len(result.records) == len(samples)
    assert result.accuracy == np.mean([r.correct for r in result.records]) == result.num_correct / len(samples)
    for record, sample in zip(result.records, samples):
        assert (record.index, record.task, record.answer, record.prompt_length) == \
            (sample.index, sample.task, sample.answer, len(sample.prompt_ids))
        assert record.correct == score(sample, record.predicted_ids) and len(record.predicted_ids) <= gen
        eos = record.predicted_ids.index(SPECIAL_IDS.eos) if SPECIAL_IDS.eos in record.predicted_ids else gen
        assert record.predicted == TOKENIZER.decode(list(record.predicted_ids[:eos]))
    json.dumps(result.to_dict())


def test_evaluate_runs_a_random_llada_model_and_keeps_one_record_per_sample(tiny_model, rng):
    samples = make_samples("passkey", 96, 3, int(rng.integers(1000)), TOKENIZER)
    result = evaluate(tiny_model(LLADA), samples, progress=False)
    gen = max_answer_length("passkey")
    assert result.options == dict(gen_length=gen, steps=gen, block_length=gen, temperature=0.0)
    assert (result.tasks, result.context_lengths, result.method) == (("passkey",), (96,), "dense")
    check_result(result, samples, gen)
    assert all(len(r.predicted_ids) == gen for r in result.records)  # LLaDA fills its whole answer region
    assert evaluate(tiny_model(LLADA), samples, batch_size=2, progress=False) == result  # greedy: batching is invisible


def test_evaluate_runs_a_random_sdar_model(tiny_model, rng):
    samples = make_samples("sanity", 64, 2, int(rng.integers(1000)), TOKENIZER)
    result = evaluate(tiny_model(SDAR), samples, tokenizer=TOKENIZER, progress=False)
    # 9 answer tokens in whole blocks, one token per step
    assert result.options == dict(max_new_tokens=12, denoising_steps=4, top_k=1, remasking="low_confidence_static")
    check_result(result, samples, 12)


def test_evaluate_refuses_a_model_of_other_token_ids(tiny_model):
    samples = make_samples("passkey", 64, 1, 0, TOKENIZER)
    with pytest.raises(ValueError, match=r"end with EOS id\(s\) \[2\], but the model stops on \(141,\)"):
        evaluate(tiny_model(tiny_llada_config()), samples, progress=False)
    with pytest.raises(ValueError, match="gen_length=4 is shorter than the longest answer"):
        evaluate(tiny_model(LLADA), samples, gen_length=4, progress=False)
    with pytest.raises(ValueError, match="one or more Samples"):
        evaluate(tiny_model(LLADA), [], progress=False)


@pytest.mark.parametrize("config", [LLADA, SDAR], ids=["llada", "sdar"])
def test_evaluate_refuses_a_context_beyond_the_models_positions_before_compiling(tiny_model, config):
    """Both numbers named, nothing compiled: prompts of 512 tokens for a model of 320 positions, and prompts
    that fit whose answer window does not (dllm-jax eval's check: tests/test_cli_hardening.py)."""
    model = tiny_model(config)
    with no_compilation(), pytest.raises(ValueError, match=r"512 tokens.* context of 320 positions"):
        evaluate(model, make_samples("passkey", 512, 2, 0, TOKENIZER), progress=False)
    with no_compilation(), pytest.raises(ValueError, match=r"exceeds the model's context of 320 positions"):
        evaluate(model, make_samples("passkey", 318, 1, 0, TOKENIZER), progress=False)


def test_eval_command_prints_the_accuracy_and_writes_json(tmp_path, capsys):
    model = write_hf_checkpoint(tmp_path / "llada", LLADA)
    build_tokenizer(model)
    out = tmp_path / "results" / "passkey.json"
    assert main(["eval", "--model", str(model), "--task", "passkey", "--context", "256", "--samples", "2",
                 "--dtype", "float32", "--quiet", "--json", str(out)]) == 0
    line = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["num_samples"] == len(written["records"]) == 2 and written["tasks"] == ["passkey"]
    assert line.startswith(f"passkey at 256 tokens, dense: accuracy {written['accuracy']:.3f} "
                           f"({written['num_correct']}/2)")
    expected = make_samples("passkey", 256, 2, 0, TOKENIZER)
    assert [r["answer"] for r in written["records"]] == [s.answer for s in expected]

    assert "wrong answers" not in line  # passkey has no distractors
    niah = tmp_path / "niah.json"
    assert main(["eval", "--model", str(model), "--task", "niah_multikey", "--context", "128", "--samples", "3",
                 "--dtype", "float32", "--quiet", "--json", str(niah)]) == 0
    records = json.loads(niah.read_text())["records"]
    wrong, taken = sum(not r["correct"] for r in records), sum(r["distractor"] is not None for r in records)
    assert wrong == 0 or f"wrong answers: {taken} of {wrong} a distractor's whole value" in capsys.readouterr().out

    assert main(["eval", "--model", str(model), "--task", "passkey", "--context", "8"]) == 2
    assert "--context 8 is too short for --task passkey" in capsys.readouterr().err  # named by its flag
    assert main(["eval", "--model", str(model), "--task", "passkey", "--method", "mage"]) == 2
    assert "SDAR" in capsys.readouterr().err


def test_samples_list_their_statements_values_in_text_order():
    """Sample.values: every digit value the prompt states, in the order the text has them, the answer's among
    them (NIAH: 4 needles, VT: 2 chains, passkey: the key; sanity: none)."""
    expected = {"niah_multikey": 4, "variable_tracking": 2, "passkey": 1, "sanity": 0}
    for task, count in expected.items():
        for sample in make_samples(task, 256, 5, 3, TOKENIZER):
            assert len(sample.values) == count and len(set(sample.values)) == count
            text = TOKENIZER.decode(sample.prompt_ids.tolist())
            places = [text.index(f" {value} .") for value in sample.values]
            assert places == sorted(places)
            assert count == 0 or sample.answer in sample.values


def test_a_wrong_answer_that_is_a_distractor_records_its_place():
    from dllm_jax.eval.evaluate import record

    sample = make_samples("niah_multikey", 256, 1, 5, TOKENIZER)[0]
    eos = int(sample.answer_ids[-1])

    def ids(value):
        return np.array([*TOKENIZER.encode(value, add_special_tokens=False).ids, eos, eos])

    for place, value in enumerate(sample.values, 1):
        got = record(sample, ids(value), TOKENIZER)
        if value == sample.answer:
            assert got.correct and got.distractor is None
        else:
            assert not got.correct and got.distractor == place
    digits_of_none = next(v for v in ("1 2 3 4", "5 6 7 8", "9 0 9 0") if v not in sample.values)
    assert record(sample, ids(digits_of_none), TOKENIZER).distractor is None


def test_task_options_make_the_lookup_easier_or_harder():
    """niah_multikey's `needles` and variable_tracking's `hops` and `ask_back` (a curriculum's knobs): the
    prompt states that many needles / that many assignments after each value / asks a variable that many
    assignments before its chain's last; the defaults are the evaluated tasks, sample for sample; bad
    options are refused."""
    for needles in (1, 2, 6):
        for sample in make_samples("niah_multikey", 256, 4, 2, TOKENIZER, options={"needles": needles}):
            assert len(sample.values) == needles and sample.answer in sample.values
            assert TOKENIZER.decode(sample.prompt_ids.tolist()).count("magic number for") == needles + 1
    for hops in (0, 2):
        for sample in make_samples("variable_tracking", 256, 4, 2, TOKENIZER, options={"hops": hops}):
            text = TOKENIZER.decode(sample.prompt_ids.tolist())
            assert text.count("= VAR") == 2 * hops and len(sample.values) == 2 and sample.answer in sample.values
            asked = text.split("value of VAR ")[1].split()[0]
            if hops == 0:  # the question names the variable the value is assigned to
                assert f"VAR {asked} = {sample.answer} ." in text
    for hops, back in ((1, 1), (3, 2)):
        for sample in make_samples("variable_tracking", 256, 4, 2, TOKENIZER, options={"hops": hops, "ask_back": back}):
            text = TOKENIZER.decode(sample.prompt_ids.tolist())
            asked = text.split("value of VAR ")[1].split()[0]
            assigned = dict(re.findall(r"VAR (\S+) = ((?:VAR \S+)|(?:\d(?: \d)*)) \.", text))
            steps, name = 0, asked
            while assigned[name].startswith("VAR"):  # follow the chain to its value
                steps, name = steps + 1, assigned[name].split()[1]
            assert steps == hops - back and assigned[name] == sample.answer
            assert f"= VAR {asked} ." in text  # not the chain's last: a later variable is assigned from it
    for task, knob in (("niah_multikey", {"needles": 4}), ("variable_tracking", {"hops": 1, "ask_back": 0})):
        given, default = (make_samples(task, 300, 3, 9, TOKENIZER, options=o) for o in (knob, None))
        assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(given, default))
    assert min_context_length("niah_multikey", {"needles": 1}) < min_context_length("niah_multikey")
    with pytest.raises(ValueError, match=r"needles must be an integer in \[1, 16\], got 0"):
        make_samples("niah_multikey", 256, 1, 0, TOKENIZER, options={"needles": 0})
    with pytest.raises(ValueError, match=r"ask_back=2 goes past the chain's first variable: at most hops=1"):
        make_samples("variable_tracking", 256, 1, 0, TOKENIZER, options={"ask_back": 2})
    with pytest.raises(ValueError, match="passkey has no option"):
        make_samples("passkey", 256, 1, 0, TOKENIZER, options={"hops": 0})
    with pytest.raises(ValueError, match="too short for niah_multikey"):
        make_samples("niah_multikey", 100, 1, 0, TOKENIZER, options={"needles": 8})
