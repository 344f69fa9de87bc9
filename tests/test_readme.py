"""The README's Python quickstart runs as printed, on a tiny checkpoint standing in for the download."""

import re
from pathlib import Path

from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint, write_tiny_tokenizer

README = Path(__file__).parent.parent / "README.md"


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
