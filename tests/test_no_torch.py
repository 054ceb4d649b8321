"""The run path needs no torch: torch is a test dependency only.

Each check runs in a fresh interpreter where ``import torch`` fails (a ``sitecustomize`` puts
``None`` in ``sys.modules['torch']``), as on a machine with only the default dependencies.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import requires_smollm2, smollm2_gguf_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_without_torch(tmp_path, code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    site = tmp_path / "no_torch_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # import torch fails\n")
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_torch_is_really_blocked(tmp_path):
    """The harness itself can fail: importing torch in it must raise."""
    result = _run_without_torch(tmp_path, "import torch")
    assert result.returncode != 0 and "torch" in result.stderr


@requires_smollm2
def test_default_model_tokenizer_and_config_load_without_torch(tmp_path):
    result = _run_without_torch(tmp_path, f"""
        from jaxrunner.models.loading.gguf import load_gguf_tokenizer, open_gguf
        tok = load_gguf_tokenizer({smollm2_gguf_path()!r})
        text = tok.apply_chat_template([{{"role": "user", "content": "Hi"}}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, (text, tok.decode(ids))
        assert open_gguf({smollm2_gguf_path()!r}).hf_config["vocab_size"] == len(tok)
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_hf_directory_tokenizer_loads_without_torch(tmp_path, tiny_checkpoints):
    result = _run_without_torch(tmp_path, f"""
        from jaxrunner.models.loading.hf import load_hf_tokenizer, read_hf_config
        tok = load_hf_tokenizer({tiny_checkpoints['qwen2']!r})
        assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
        read_hf_config({tiny_checkpoints['qwen2']!r})
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.slow
@requires_smollm2
def test_readme_generate_command_runs_without_torch(tmp_path):
    """The README's run command, through the console entry point, in an interpreter without torch."""
    result = _run_without_torch(tmp_path, """
        import sys
        from jaxrunner.cli import main
        sys.exit(main(["generate", "--max-tokens", "12", "What is the capital of France?"]))
    """, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout, (result.stdout, result.stderr[-3000:])
    assert "PyTorch was not found" not in result.stderr  # no advice to install what is not needed


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["byte-level-bpe", "sentencepiece"])
def test_gguf_tokenizers_build_without_torch(tmp_path, sentencepiece):
    from test_gguf import Q, hf_weights, write_gguf

    path = write_gguf(tmp_path / "t.gguf", "llama", hf_weights("llama", tied=False), Q.F32,
                      sentencepiece=sentencepiece)
    result = _run_without_torch(tmp_path, f"""
        from jaxrunner.models.loading.gguf import load_gguf_tokenizer
        tok = load_gguf_tokenizer({path!r})
        assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
