from __future__ import annotations

from fpdoctor.report.redact import MASK, is_secret_key, redact, redact_text


def test_secret_keys():
    for key in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "github_token", "DB_PASSWORD", "OPENAI_API_KEY"):
        assert is_secret_key(key), key
    for key in ("TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "KEYBOARD", "PWD"):
        assert not is_secret_key(key), key


def test_values_under_secret_keys_are_masked():
    doc = redact({"env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz", "CUDA_HOME": "/usr/local/cuda"}})
    assert doc == {"env": {"HF_TOKEN": MASK, "CUDA_HOME": "/usr/local/cuda"}}


def test_secrets_inside_text():
    text = (
        "pip index https://alice:s3cretpw@pypi.example.com/simple and "
        "export WANDB_API_KEY=0123456789abcdef0123456789abcdef token hf_ABCDEFGHIJKLMNOPQRSTUV12 "
        "url https://host/x?token=abc123&page=2 and AKIAABCDEFGHIJKLMNOP"
    )
    out = redact_text(text)
    for secret in (
        "alice",
        "s3cretpw",
        "0123456789abcdef0123456789abcdef",
        "hf_ABCDEFGHIJKLMNOPQRSTUV12",
        "abc123",
        "AKIAABCDEFGHIJKLMNOP",
    ):
        assert secret not in out, secret
    assert "pypi.example.com/simple" in out and "page=2" in out


def test_plain_text_is_untouched():
    text = "Is CUDA available: True\nGPU 0: NVIDIA H20\nNvidia driver version: 560.28.03"
    assert redact_text(text) == text
