"""The engine over several CPU processes (gloo): tensor parallelism (heads / MLP columns sharded, KV heads sharded
or replicated) and context parallelism (KV pages dealt round robin, decode merged across ranks) give the
single-process engine's greedy tokens and logits on the tiny checkpoints."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
import torch

from engine_helpers import random_prompts, save_tiny
from flashdecode.distributed.launch import spawn
from flashdecode.engine import LLM, SamplingParams
from helpers import SUBPROCESS_TIMEOUT_S

CPU_RANKS = dict(backend="gloo", env={"TRITON_INTERPRET": "1"})  # CPU tensors, Triton's interpreter, GPU or not
NEW_TOKENS = 6
PROMPT_LENS = [13, 2, 27]  # ragged; with 4-token pages the cp ranks hold different shares, rank 1 none of "2"


def _run(llm: LLM, prompts, params):
    """Greedy tokens of every prompt, the decode steps' logits (step, rows, vocab) and one prompt's logits."""
    logits = []
    decode = llm.runner.decode

    def recording_decode(seqs, tables, **kw):
        out = decode(seqs, tables, **kw)
        logits.append(out[0].clone())
        return out

    llm.runner.decode = recording_decode
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], logits, llm.prompt_logits(prompts[0])


def _engine(path, tp=1, cp=1, backend=None):
    return LLM(str(path), device="cpu", dtype="float32", page_size=4, max_num_seqs=4, max_model_len=64,
               attn_backend=backend, tensor_parallel_size=tp, context_parallel_size=cp)


def _worker(rank, jobs, cli_argv=None):
    """jobs: (name, path, tp, cp, backend, params) run in order on every rank; then (cli_argv) the `generate`
    command as one of the ranks (rank 0 prints, the others are silenced)."""
    results = {}
    prompts = random_prompts(PROMPT_LENS, seed=1)
    for name, path, tp, cp, backend, params in jobs:
        results[name] = _run(_engine(path, tp, cp, backend), prompts, params)
    if cli_argv is not None:
        from flashdecode.engine import cli

        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            code = cli.run(parser.parse_args(cli_argv))
        results["cli"] = (code, printed.getvalue())
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {"llama": save_tiny(root / "llama", "llama"),  # 4 heads, 2 KV heads: tp=2 shards the KV heads
            "qwen2-mqa": save_tiny(root / "qwen2", "qwen2", num_key_value_heads=1)}  # tp=2 replicates the KV head


def _expected(path):
    """The single-process engine (the CPU's torch backend: no Triton in this process)."""
    return _run(_engine(path), random_prompts(PROMPT_LENS, seed=1), SamplingParams(max_new_tokens=NEW_TOKENS))


def _assert_same(got, want, name, atol=2e-5):
    tokens, logits, prompt_logits = got
    assert tokens == want[0], f"{name}: tokens {tokens} != {want[0]}"
    assert len(logits) == len(want[1]), name
    for step, (a, b) in enumerate(zip(logits, want[1])):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=f"{name}: decode step {step} logits")
    torch.testing.assert_close(prompt_logits, want[2], atol=atol, rtol=1e-4, msg=f"{name}: prompt logits")


def test_tp_and_cp_engines_match_single_process(checkpoints):
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)  # unseeded: rank 0's draw must win
    jobs = [("tp2", checkpoints["llama"], 2, 1, None, greedy),
            ("tp2-replicated-kv", checkpoints["qwen2-mqa"], 2, 1, None, greedy),
            ("cp2", checkpoints["llama"], 1, 2, None, greedy),
            ("cp2-flashdecode", checkpoints["qwen2-mqa"], 1, 2, "flashdecode", greedy),
            ("tp2-sampled", checkpoints["llama"], 2, 1, None, sampled),
            # the single-process Triton engine runs in the ranks, where the interpreter is on
            ("single-flashdecode", checkpoints["qwen2-mqa"], 1, 1, "flashdecode", greedy)]
    cli_prompt = [5, 6, 7, 8, 9, 10, 11]
    cli_argv = ["--model", str(checkpoints["llama"]), "--prompt", ",".join(map(str, cli_prompt)), "--max-new-tokens",
                "4", "--device", "cpu", "--dtype", "float32", "--page-size", "4", "--max-model-len", "32", "--tp", "2"]
    per_rank = spawn(_worker, 2, (jobs, cli_argv), timeout_s=SUBPROCESS_TIMEOUT_S, **CPU_RANKS)
    want = {"llama": _expected(checkpoints["llama"]), "qwen2-mqa": _expected(checkpoints["qwen2-mqa"])}
    cli_tokens = _engine(checkpoints["llama"]).generate([cli_prompt], SamplingParams(max_new_tokens=4))[0].token_ids
    assert per_rank[0]["cli"] == (0, per_rank[0]["cli"][1]) and f"token ids: {cli_tokens}" in per_rank[0]["cli"][1]
    assert per_rank[1]["cli"] == (0, "")  # only rank 0 prints
    for rank, results in enumerate(per_rank):
        _assert_same(results["tp2"], want["llama"], f"tp2 rank {rank}")
        _assert_same(results["tp2-replicated-kv"], want["qwen2-mqa"], f"tp2-replicated-kv rank {rank}")
        _assert_same(results["cp2"], want["llama"], f"cp2 rank {rank}")
        _assert_same(results["cp2-flashdecode"], results["single-flashdecode"], f"cp2-flashdecode rank {rank}",
                     atol=1e-4)
    # sampling: every rank continues with the same (rank 0's) tokens
    assert per_rank[0]["tp2-sampled"][0] == per_rank[1]["tp2-sampled"][0]
    assert all(len(t) == NEW_TOKENS for t in per_rank[0]["tp2-sampled"][0])


def test_tp_cp_together_match_single_process(checkpoints):
    """tp=2 x cp=2 on 4 ranks: heads sharded within each cp rank, pages dealt across them."""
    jobs = [("tp2cp2", checkpoints["llama"], 2, 2, None, SamplingParams(max_new_tokens=NEW_TOKENS))]
    per_rank = spawn(_worker, 4, (jobs,), timeout_s=SUBPROCESS_TIMEOUT_S, **CPU_RANKS)
    want = _expected(checkpoints["llama"])
    for rank, results in enumerate(per_rank):
        _assert_same(results["tp2cp2"], want, f"tp2cp2 rank {rank}")


def test_parallel_sizes_are_checked(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _engine(checkpoints["llama"], tp=0)
    with pytest.raises(RuntimeError, match="torchrun"):  # 2 ranks wanted, no process group, not under torchrun
        _engine(checkpoints["llama"], tp=2)
