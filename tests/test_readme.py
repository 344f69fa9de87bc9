"""The README and the docs/ pages stay true: the README's Python quickstart runs as printed (on a tiny checkpoint
standing in for the download), its two commands are the Makefile's, every relative link of README.md and docs/*.md
reaches a file (and heading), every page of docs/ is linked from the README, and docs/cli.md names every
subcommand and flag of `dllm-jax`."""

import contextlib
import io
import re
from pathlib import Path

import pytest

from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint, write_tiny_tokenizer

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def test_quickstart_runs_as_printed(tmp_path, monkeypatch, capsys):
    section = README.read_text().split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 15
    config = tiny_llada_config(mask_token_id=150, eos_token_id=141, pad_token_id=141)
    write_tiny_tokenizer(write_hf_checkpoint(tmp_path / "LLaDA-8B-Instruct", config), 160, mask_token_id=150,
                         eos_token_id=141)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README quickstart", "exec"), namespace)
    assert namespace["out"].shape == (1, namespace["ids"].shape[1] + 128)
    assert capsys.readouterr().out.strip()  # the decoded answer was printed


def test_the_two_commands_are_the_makefiles():
    section = README.read_text().split("## Install and run", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^make (\w+)", re.search(r"```sh\n(.*?)```", section, re.S).group(1), re.M)
    assert commands == ["demo", "test"]
    targets = set(re.findall(r"^(\w+):", (ROOT / "Makefile").read_text(), re.M))
    assert {"demo", "test"} <= targets


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} does not exist"
        if anchor:
            assert target.suffix == ".md" and anchor in anchors(target), f"{page.name}: no heading for {link}"


def test_the_readme_links_every_docs_page_and_stays_short():
    text = README.read_text()
    assert DOCS.is_dir() and not [p.name for p in DOCS.glob("*.md") if f"](docs/{p.name})" not in text]
    assert len(text.splitlines()) <= 150


def cli_help(*argv: str) -> str:
    """`dllm-jax ARGV --help`, unwrapped (one option per line)."""
    from dllm_jax.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def test_every_subcommand_and_flag_is_in_docs_cli(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    cli_md = (DOCS / "cli.md").read_text()
    commands = re.search(r"\{([\w,+-]+)\}", cli_help()).group(1).split(",")
    assert {"convert", "generate", "eval", "train", "demo"} <= set(commands)
    missing = []
    for command in commands:
        if not re.search(rf"dllm-jax {re.escape(command)}\b", cli_md):
            missing.append(command)
        for flag in re.findall(r"^  (?:-\w, )?(--[\w-]+)", cli_help(command), re.M):
            if flag != "--help" and not re.search(rf"`{re.escape(flag)}[` ]", cli_md):
                missing.append(f"{command} {flag}")
    assert not missing, f"not in docs/cli.md: {missing}"
