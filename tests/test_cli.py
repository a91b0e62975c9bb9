"""The command line: --version, defaults in every --help, user errors as one line with exit status 2 (traceback
only with --debug), generate on a tiny checkpoint; and the engine's errors for broken checkpoints (they name the
file and the key)."""

from __future__ import annotations

import json
import shutil

import pytest

from engine_helpers import add_tokenizer, rewrite_config, save_tiny, words
from flashdecode import __version__
from flashdecode.cli import build_parser, main
from flashdecode.engine import LLM
from helpers import SUBPROCESS_TIMEOUT_S


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return add_tokenizer(save_tiny(tmp_path_factory.mktemp("cli") / "m", "llama"))


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of ``flashdecode argv``."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"flashdecode {__version__}"


def _subparsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield name, sub
                yield from _subparsers(sub)


def test_every_help_shows_defaults(capsys):
    parser = build_parser()
    names = []
    for name, sub in _subparsers(parser):
        names.append(name)
        text = sub.format_help()  # a help string with a stray % would raise here
        if any(a.default not in (None, False, "==SUPPRESS==") and a.help for a in sub._actions):
            assert "(default:" in text, name
    assert {"demo", "generate", "serve", "bench"} <= set(names)
    assert "(default:" in parser.format_help()


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "/no/such/dir", "--prompt", "1,2"], "config.json"),
    (["generate", "--model", "{ckpt}", "--prompt", "1,,2"], "empty token id"),
    (["generate", "--model", "{ckpt}", "--prompt", "w1", "--temperature", "nan"], "temperature"),
    (["generate", "--model", "{ckpt}", "--prompt", "w1", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--model", "{ckpt}", "--prompt-len", "3", "--page-size", "0"], "--page-size"),
    (["generate", "--model", "{ckpt}"], "--prompt"),
    (["generate", "--model", "{ckpt}", "--prompt", "w1", "--temperature", "hot"], "--temperature"),
    (["serve", "--model", "{ckpt}", "--port", "70000"], "--port"),
    (["nonsense"], "invalid choice"),
])
def test_user_errors_are_one_line_exit_2(capsys, ckpt, argv, needle):
    code, _, err = run_cli(capsys, *[a.format(ckpt=ckpt) for a in argv])
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line and not line.startswith("INFO")]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="config.json"):
        main(["--debug", "generate", "--model", "/no/such/dir", "--prompt", "1,2"])


def test_prompt_ids_without_tokenizer_and_text_prompt(capsys, ckpt, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").unlink()
    code, _, err = run_cli(capsys, "generate", "--model", str(bare), "--prompt", "hello there")
    assert code == 2 and "comma-separated token ids" in err.splitlines()[-1]
    code, out, _ = run_cli(capsys, "generate", "--model", str(bare), "--prompt", "1, 2,3", "--max-tokens", "4")
    assert code == 0 and "generated 4 (length)" in out
    code, ahead, _ = run_cli(capsys, "generate", "--model", str(bare), "--prompt", "1, 2,3", "--max-tokens", "4",
                             "--async-scheduling", "on")  # the same tokens, launched ahead of the host
    assert code == 0 and "token ids:" in ahead and [l for l in ahead.splitlines() if "token ids" in l] == [
        l for l in out.splitlines() if "token ids" in l]
    code, out, _ = run_cli(capsys, "generate", "--model", str(ckpt), "--prompt", "w1 w2", "--max-tokens", "3")
    ids = LLM(ckpt, device="cpu", use_tqdm=False).generate("w1 w2", use_tqdm=False)[0].token_ids[:3]
    assert code == 0 and f"text: {words(ids)}" in out


@pytest.mark.parametrize("change,needle", [
    ("list", "expected a JSON object"),
    ("no_hidden", "missing required key 'hidden_size'"),
    ("fewer_layers", "num_hidden_layers=1"),
    ("bad_json", "not valid JSON"),
    ("heads_string", "'num_attention_heads' must be an int"),
])
def test_broken_config_errors_name_the_file_and_key(ckpt, tmp_path, change, needle):
    path = tmp_path / change
    shutil.copytree(ckpt, path)
    cfg = path / "config.json"
    if change == "list":
        cfg.write_text(json.dumps([json.loads(cfg.read_text())]))
    elif change == "no_hidden":
        rewrite_config(path, hidden_size=None)
    elif change == "fewer_layers":
        rewrite_config(path, num_hidden_layers=1)
    elif change == "bad_json":
        cfg.write_text("{")
    else:
        rewrite_config(path, num_attention_heads="4")
    with pytest.raises(ValueError) as info:
        LLM(path, device="cpu", use_tqdm=False)
    assert needle in str(info.value) and "config.json" in str(info.value)


def test_serve_subprocess_answers_on_loopback(ckpt):
    """`flashdecode serve` as a user starts it (own process, CPU picked by itself): /health, then a completion."""
    import httpx

    from engine_helpers import start_serve

    proc, url = start_serve(["--model", str(ckpt), "--served-model-name", "tiny", "--max-model-len", "64"])
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 3,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_BLOCK_SERVER_PACKAGES = """
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "starlette"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Missing())
"""


def test_cli_works_without_the_server_packages(tmp_path):
    """Without FastAPI / uvicorn (the "serve" extra) every other command still parses and runs, and `serve` says in
    one line what to install (exit status 2)."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_BLOCK_SERVER_PACKAGES)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    run = lambda *argv: subprocess.run([sys.executable, "-m", "flashdecode", *argv], env=env, text=True,  # noqa
                                       capture_output=True, timeout=SUBPROCESS_TIMEOUT_S)
    helped = run("bench", "decode", "--help")
    assert helped.returncode == 0 and "--contexts" in helped.stdout, helped.stderr
    served = run("serve", "--random-weights", "llama3.2-1b", "--device", "cpu")
    assert served.returncode == 2 and "pip install 'flashdecode[serve]'" in served.stderr, served.stderr
    assert "Traceback" not in served.stderr and len(served.stderr.strip().splitlines()) == 1
