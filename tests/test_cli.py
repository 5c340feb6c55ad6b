"""CLI contract: --help works; bad input is one error line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmkit.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "llmkit.cli", *args], check=False, capture_output=True, text=True,
                          timeout=120)


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("models", "chat"):
        assert cmd in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["models", "--bogus"], "unrecognized arguments: --bogus"),
        (["chat", "hi", "--max-new-tokens", "zero"], "'zero' is not an integer"),
        (["chat", "hi", "--max-new-tokens", "-3"], "must be > 0"),
        (["chat", "hi", "--top-p", "2"], "must be in (0, 1]"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, needle):
    r = run_cli(*argv)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_unknown_model_is_one_line_exit_2(tmp_path):
    r = run_cli("chat", "hi", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown model" in lines[0] and "smollm2-135m-instruct" in lines[0], r.stderr


def test_user_error_raised_inside_a_command_is_one_line_exit_2(tmp_path):
    # `python -m llmkit.cli` runs cli.py as __main__; the command raises llmkit.cli.UserError,
    # which must still be caught there (it was a traceback when the two classes differed)
    r = run_cli("guard", "fit", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "g"))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no such file" in lines[0] and "missing.jsonl" in lines[0]


def test_models_lists_default_alias(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out


def test_bitsandbytes_hub_kernel_notice_is_filtered_but_other_warnings_pass():
    import logging

    import llmkit  # noqa: F401 - installs the filter

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    mk = lambda msg: logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, (), None)
    assert not log.filter(mk("Failed to load CPU gemm_4bit_forward from kernels-community: %s."))
    assert log.filter(mk("something else went wrong"))
