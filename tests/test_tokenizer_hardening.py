"""A checkpoint's tokenizer files and chat template are untrusted input: every bad file is a ValueError
naming it (one line through the CLI, exit status 2), and a hostile template stops at a time or size bound.

The bounds come from dllm_jax.chat_template inside each hostile test, so that against code without them the
test fails at the import instead of hanging or filling the memory."""

import json

import pytest

from dllm_jax.cli import main
from dllm_jax.testing import tiny_llada_config, write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer

QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_dir(directory, chat_template=QWEN_TEMPLATE, **config):
    """A tiny tokenizer whose tokenizer_config.json holds `chat_template` and the `config` entries."""
    directory.mkdir(exist_ok=True)
    write_tiny_tokenizer(directory, 160, mask_token_id=150, eos_token_id=141)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": chat_template} | config))
    return directory


def load_and_render(directory, **kwargs) -> str:
    return ChatTokenizer(directory, **kwargs).render("w1 w2")


def set_config(directory, text: str):
    (directory / "tokenizer_config.json").write_text(text)


def set_jinja(directory, data: bytes):
    (directory / "chat_template.jinja").write_bytes(data)


def set_tokenizer(directory, text: str):
    (directory / "tokenizer.json").write_text(text)


# (how the files go wrong, the file the message names, what else it says)
BAD_FILES = {
    "syntax error": (lambda d: tokenizer_dir(d, "{% for %}"), "tokenizer_config.json (chat_template)",
                     "syntax error at line 1"),
    "syntax error in chat_template.jinja": (lambda d: set_jinja(tokenizer_dir(d), b"hi\n{{ messages["),
                                            "chat_template.jinja", "syntax error at line 2"),
    "chat_template.jinja not UTF-8": (lambda d: set_jinja(tokenizer_dir(d), b"\xff\xfe{{ x }}"),
                                      "chat_template.jinja", "not UTF-8"),
    "raise_exception": (lambda d: tokenizer_dir(d, "{{ raise_exception('System role not supported') }}"),
                        "tokenizer_config.json (chat_template)", "raised 'System role not supported'"),
    "list entry without template": (lambda d: tokenizer_dir(d, [{"name": "default"}]),
                                    "tokenizer_config.json (chat_template)", "entry 0"),
    "list entry not an object": (lambda d: tokenizer_dir(d, ["{{ x }}"]), "tokenizer_config.json (chat_template)",
                                 "entry 0"),
    "named list": (lambda d: tokenizer_dir(d, [{"name": "tool_use", "template": "hi"},
                                               {"name": "default", "template": "{{ raise_exception('no') }}"}]),
                   "tokenizer_config.json (chat_template 'default')", "raised 'no'"),
    "empty template list": (lambda d: tokenizer_dir(d, []), "tokenizer_config.json (chat_template)", "empty list"),
    "int template": (lambda d: tokenizer_dir(d, 5), "tokenizer_config.json (chat_template)", "got int 5"),
    "wordwrap (its time grows with a long word's square)": (lambda d: tokenizer_dir(d, "{{ 'x'|wordwrap(1) }}"),
                                                             "tokenizer_config.json (chat_template)",
                                                             "No filter named 'wordwrap'"),
    "config a JSON list": (lambda d: set_config(tokenizer_dir(d), "[1, 2]"), "tokenizer_config.json",
                           "must hold a JSON object, got list"),
    "config not JSON": (lambda d: set_config(tokenizer_dir(d), "{'chat_template': 1"), "tokenizer_config.json",
                        "not valid JSON"),
    "garbage tokenizer.json": (lambda d: set_tokenizer(tokenizer_dir(d), "\x00garbage"), "tokenizer.json",
                               "not a tokenizers tokenizer.json"),
    "tokenizer.json of the wrong shape": (lambda d: set_tokenizer(tokenizer_dir(d), '{"model": 3}'),
                                          "tokenizer.json", "not a tokenizers tokenizer.json"),
    "bos_token an int": (lambda d: tokenizer_dir(d, bos_token=5), "tokenizer_config.json", "bos_token must be"),
    "eos_token content an int": (lambda d: tokenizer_dir(d, eos_token={"content": 7}), "tokenizer_config.json",
                                 "eos_token must be"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_tokenizer_or_template_file_is_a_value_error_naming_it(tmp_path, case):
    make, file, what = BAD_FILES[case]
    make(tmp_path)
    with pytest.raises(ValueError) as info:
        load_and_render(tmp_path)
    message = str(info.value)
    assert f"{tmp_path / file.split()[0]}" in message and file in message and what in message
    assert "\n" not in message


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append(1) }}",  # the immutable sandbox
])
def test_a_blocked_template_injection_is_a_value_error(tmp_path, template):
    with pytest.raises(ValueError, match=r"tokenizer_config\.json \(chat_template\): .*blocked by the sandbox"):
        load_and_render(tokenizer_dir(tmp_path, template))


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # writes nothing
    "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}{% endmacro %}"
    "{{ m() }}",  # writes into a macro's buffer, output only at its end
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(64) }}",  # no loop at all
])
def test_a_template_that_never_ends_stops_at_the_time_bound(tmp_path, template):
    from dllm_jax.chat_template import RenderLimits

    with pytest.raises(ValueError, match=r"tokenizer_config\.json \(chat_template\): the chat template ran past "
                                         r"the render time bound of 0\.2 s \(RenderLimits\.seconds"):
        load_and_render(tokenizer_dir(tmp_path, template), limits=RenderLimits(seconds=0.2))


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**10 }}",
    "{{ 10**10 * 'x' }}",
    "{{ [1] * 10**10 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'x'.center(10**10) }}",
    "{{ 'x'|center(10**10) }}",
    "{% set b = 'x' * 10**7 %}{{ ([b] * 1000)|join }}",
    "{% set b = 'x' * 10**6 %}{{ b.replace('x', b) }}",
    "{% set b = 'x' * 10**6 %}{{ b|replace('x', b) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{% set b = 'x' * 10**6 %}{{ range(100000)|map('replace', '', b)|join }}",
    "{% set b = 'x' * 10**7 %}{{ [b, b, b, b, b, b, b, b, b, b] ~ '' }}",
    "{{ (range(100000)|list)|tojson(indent=100000) }}",
    # one call that builds far more than its arguments: a long separator, a sum copying its running total,
    # tab stops, a translation table, and a string taken apart into more items than the bound holds
    "{% set b = 'x' * 10**6 %}{{ range(100000)|join(b) }}",
    "{% set b = 'x' * 10**6 %}{{ b|join(b) }}",
    "{% set b = 'x' * 10**6 %}{{ b.join(['x'] * 100000) }}",
    "{{ ([[1]] * 100000)|sum(start=[])|length }}",
    "{% set b = '\t' * 1000 %}{{ b.expandtabs(60000000) }}",
    "{% set b = 'x' * 10**6 %}{{ b.translate({120: 'y' * 100000}) }}",
    "{% set b = 'x' * 10**7 %}{{ b|list|length }}",
    "{% set b = 'x' * 10**7 %}{{ b|sort|length }}",
    "{% set b = 'x ' * 10**7 %}{{ b.split()|length }}",
])
def test_a_template_that_grows_without_end_stops_at_the_size_bound(tmp_path, template):
    from dllm_jax.chat_template import RENDER_CHARS

    with pytest.raises(ValueError, match=rf"tokenizer_config\.json \(chat_template\): the chat template .* more than "
                                         rf"{RENDER_CHARS} characters, the render size bound \(RenderLimits\.chars"):
        load_and_render(tokenizer_dir(tmp_path, template))


def test_huge_integers_stop_at_the_integer_bound(tmp_path):
    from dllm_jax.chat_template import RENDER_INT_BITS

    with pytest.raises(ValueError, match=rf"chat_template\): the chat template computes an integer of more than "
                                         rf"{RENDER_INT_BITS} bits"):
        load_and_render(tokenizer_dir(tmp_path, "{{ 2 ** 1000000 }}"))


def test_real_templates_render_within_the_bounds(tmp_path):
    from dllm_jax.eval import build_tokenizer
    from dllm_jax.chat_template import RenderLimits

    assert load_and_render(tokenizer_dir(tmp_path / "qwen")) == \
        "<|im_start|>user\nw1 w2<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "tasks").mkdir()
    build_tokenizer(tmp_path / "tasks")  # the task suite's template: the prompt as it is
    assert load_and_render(tmp_path / "tasks") == "w1 w2"
    busy = ("{% for m in messages %}{{ loop.index }}{{ m['content']|trim|upper }}{% endfor %}{{ messages|tojson }}"
            "{{ '%s-%d' % ('a', 3) }}{{ 'b{}'.format(4) }}{{ (range(50)|list)|join(',')|length }}")
    rendered = '1W1 W2[{"content": "w1 w2", "role": "user"}]a-3b4139'
    assert load_and_render(tokenizer_dir(tmp_path / "busy", busy)) == rendered
    chains = ("{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('|') }}"
              "{{ []|map|list }}{{ (messages|groupby('role'))|list|length }}{{ ['b', 'a']|sort|join(',') }}"
              "{{ ','.join(['c', 'd']) }}{{ [[1], [2]]|sum(start=[]) }}{{ 'ba'|unique|list|max }}")
    assert load_and_render(tokenizer_dir(tmp_path / "chains", chains)) == "w1 w2[]1a,bc,d[1, 2]b"
    long = "w1 " * 1_000_000  # a long prompt is not a hostile template
    assert ChatTokenizer(tmp_path / "qwen").render(long).count("w1") == 1_000_000
    with pytest.raises(ValueError, match="RenderLimits.seconds must lie in"):
        RenderLimits(seconds=0)
    with pytest.raises(ValueError, match="RenderLimits.chars must be a positive integer"):
        RenderLimits(chars=0)


@pytest.mark.parametrize("template,what", [
    ("{{ ''.__class__ }}", "blocked by the sandbox"),
    ("{% if %}", "syntax error"),
])
def test_the_command_line_reports_a_bad_template_in_one_line(tmp_path, capsys, template, what):
    """Before any weights: the checkpoint needs only its config.json and tokenizer files."""
    config = tiny_llada_config(mask_token_id=150, eos_token_id=141, pad_token_id=141)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config() | {"torch_dtype": "float32"}))
    tokenizer_dir(tmp_path, template)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w1 w2", "--gen-length", "4", "--steps", "4",
                 "--block-length", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dllm-jax generate: error: ")
    assert f"{tmp_path / 'tokenizer_config.json'} (chat_template)" in err and what in err
