"""bench/report.py: every result record names its code and a command to paste, and its figure can be redrawn from
the record alone."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from flashdecode.bench import report


@pytest.mark.parametrize("argv, want", [
    (["/root/tree/flashdecode/__main__.py", "bench", "decode", "--out", "/root/out", "--quick"],
     "python -m flashdecode bench decode --quick"),
    (["/usr/bin/flashdecode", "bench", "e2e", "--out=/tmp/x", "--contexts", "512,4096"],
     "python -m flashdecode bench e2e --contexts 512,4096"),
    ([str(report.REPO_ROOT / "benchmarks/probes/stream.py"), "--contexts", "4096"],
     "python -m benchmarks.probes.stream --contexts 4096"),
])
def test_user_command_is_pasteable_from_the_repository_root(argv, want):
    assert report.user_command(argv) == want


def test_write_json_records_commit_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/flashdecode/__main__.py", "bench", "prefill", "--out", str(tmp_path)])
    path = report.write_json(tmp_path / "r.json", "prefill", {"device": "cpu"}, [{"a": 1}], {"peers": ["ours"]})
    record = json.loads(path.read_text())
    assert record["command"] == "python -m flashdecode bench prefill"
    commit = report.git_commit()
    assert record["git_commit"] == commit and (commit is None or len(commit.split("+")[0]) >= 7)
    assert record["rows"] == [{"a": 1}] and record["peers"] == ["ours"]


def test_best_peer_ignores_our_own_variants_and_missing_numbers():
    record = {"peers": ["ours", "ours-pdl", "FA2", "cuDNN", "nd"]}
    peers = report.external_peers(record)
    assert peers == ["FA2", "cuDNN"]
    assert report.best_peer({"ours": 1.0, "ours-pdl": 0.5, "FA2": 3.0, "cuDNN": None}, peers, True) == ("FA2", 3.0)
    assert report.best_peer({"FA2": 300.0, "cuDNN": 400.0}, peers, False) == ("cuDNN", 400.0)


@pytest.mark.skipif(not importlib.util.find_spec("matplotlib"), reason="matplotlib not installed")
def test_decode_figure_is_drawn_from_the_record(tmp_path):
    rows = [dict(sweep="ctx", batch=1, context=c, layout=layout, nheads=16, nheads_kv=2, headdim=128,
                 floor_us=c / 3000, ours=2 + c / 2500, FA2=4 + c / 2000, FlashInfer=3 + c / 2400)
            for layout in ("contig", "page16") for c in (512, 4096, 32768)]
    record = {"kind": "decode", "env": {"device": "test"}, "peers": ["ours", "FA2", "FlashInfer"], "rows": rows}
    path = report.plot_record(record, tmp_path / "d.png")
    assert path is not None and path.stat().st_size > 10_000
    assert report.plot_record({"kind": "unknown", "rows": []}, tmp_path / "u.png") is None


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, report.REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_built_from_latest_and_add_replaces_the_same_benchmark(tmp_path, monkeypatch):
    md = _load_script("write_benchmarks_md")
    rows = [dict(sweep="ctx", batch=1, context=c, layout="contig", nheads=16, nheads_kv=2, headdim=128,
                 floor_us=c / 3000, ours=2 + c / 2500, FA2=4 + c / 2000, **{"ours_%floor": 50.0})
            for c in (512, 4096, 32768)]
    old = {"kind": "decode", "env": {"device": "test", "date": "2026-01-01 00:00 UTC"}, "peers": ["ours", "FA2"],
           "command": "/root/tree/flashdecode/__main__.py bench decode --out /root/out --quick", "rows": rows}
    new = dict(old, env={"device": "test", "date": "2026-01-02 00:00 UTC"})
    latest, runs = tmp_path / "latest", tmp_path / "runs"
    runs.mkdir()
    (runs / "decode_a.json").write_text(json.dumps(old))
    (runs / "decode_b.json").write_text(json.dumps(new))
    page = tmp_path / "benchmarks.md"
    for name in ("decode_a.json", "decode_b.json"):  # the second run of the same benchmark replaces the first
        monkeypatch.setattr(sys, "argv", ["x", "--latest", str(latest), "--out", str(page), "--add",
                                          str(runs / name), "--commit", "abc1234"])
        assert md.main() == 0
    assert sorted(p.name for p in latest.glob("*.json")) == ["decode_b.json"]
    record = json.loads((latest / "decode_b.json").read_text())
    assert record["git_commit"] == "abc1234" and record["command"] == "python -m flashdecode bench decode --quick"
    text = page.read_text()
    assert "| 1.93x |" in text  # FA2 / ours at 512 tokens: (4 + 512 / 2000) / (2 + 512 / 2500)
    assert md.benchmark_key(record) == "decode:contig"


def test_benchmarks_page_renders_the_8bit_decode_and_serving_records(tmp_path, monkeypatch):
    md = _load_script("write_benchmarks_md")
    env = {"device": "test", "date": "2026-01-01 00:00 UTC"}
    fp8 = {"kind": "fp8_decode", "env": env, "git_commit": "abc", "command": "python -m benchmarks.probes.fp8_decode",
           "rows": [{"shape": "b1 16/2", "batch": 1, "context": 131072, "ours bf16 contig": 49.5,
                     "ours fp8-token contig": 30.0, "speedup fp8-token vs bf16 contig": 1.65}]}
    serve = {"kind": "serve", "env": env, "git_commit": "abc", "command": "flashdecode bench serve",
             "rows": [{"ok": 32, "failed": 0, "concurrency": 32, "prompt_len": 1024, "output_len": 256,
                       "output_tokens_per_s": 1234.5, "generate_output_tokens_per_s": 1300.0,
                       "serve_vs_generate": 0.95, "ttft_ms": {"p50": 100.0, "p99": 200.0},
                       "tpot_ms": {"p50": 20.0, "p99": None}, "endpoint": "completions", "model": "m", "layers": 2}]}
    latest = tmp_path / "latest"
    latest.mkdir()
    (latest / "fp8_decode_a.json").write_text(json.dumps(fp8))
    (latest / "serve_a.json").write_text(json.dumps(serve))
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(sys, "argv", ["x", "--latest", str(latest), "--out", str(page)])
    assert md.main() == 0
    text = page.read_text()
    assert "| b1 16/2 | 1 | 128k | 49.5 | 30.0 | 1.65 | - |" in text
    assert "| 32 / 0 | 32 | 1024 / 256 | 1234 | 1300 | 0.95 | 100.0 / 200.0 | 20.0 / - |" in text
    assert text.index("8-bit KV caches") < text.index("Serving")


def test_benchmarks_page_renders_the_paged_prefill_record(tmp_path, monkeypatch):
    from flashdecode.bench import paged_prefill

    md = _load_script("write_benchmarks_md")
    row = dict(mode="paged fwd", dtype="bf16", headdim=128, nheads=32, nheads_kv=8, batch=4, page_size=16, chunk=512,
               cached=32768, causal=True, paged=300.0, contig=320.0, FI=280.0, FI_backend="fa3")
    row.update({"paged/contig": 300.0 / 320.0, "paged/FI": 300.0 / 280.0})
    # a row with both kernels: the Triton one the default dispatch takes, the Gluon one forced
    row2 = dict(row, page_size=128, paged_backend="triton", triton=300.0, gluon=390.0, gluon_applies=True)
    row2.update({"gluon/triton": 1.3, "gluon/FI": 390.0 / 280.0})
    record = {"kind": "paged_prefill", "env": {"device": "test", "date": "2026-01-01 00:00 UTC"},
              "git_commit": "abc", "command": "python -m flashdecode bench prefill --paged --no-grid",
              "rows": [row, row2]}
    latest = tmp_path / "latest"
    latest.mkdir()
    (latest / "paged_prefill_a.json").write_text(json.dumps(record))
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(sys, "argv", ["x", "--latest", str(latest), "--out", str(page)])
    assert md.main() == 0
    text = page.read_text()
    assert "| 16 | 512 | 32768 | 4 | - | 300 | - | - | 320 | 280 | fa3 | 0.94 | 1.07 | - | - |" in text
    assert "| 128 | 512 | 32768 | 4 | triton | 300 | 300 | 390 | 320 | 280 | fa3 | 0.94 | 1.07 | 1.30 | 1.39 |" in text
    assert paged_prefill.summary_line(row) == ("paged fwd page16 chunk512 +32768 cached: ours 300 TFLOP/s, contig 320 "
                                               "(0.94x), FI(fa3) 280 (1.07x)")
    assert paged_prefill.summary_line(row2).endswith("ours (triton) 300 TFLOP/s, contig 320 (0.94x), FI(fa3) 280 "
                                                     "(1.07x); gluon 390 (1.30x triton, 1.39x FI)")
    assert not paged_prefill.failed(row2) and paged_prefill.failed(dict(row2, gluon=None))


def test_prune_keeps_only_results_named_in_full(tmp_path):
    prune = _load_script("prune_results")
    text = "`decodetune_x_2026-11-22T0739.json`, `decodetune_x_2026-11-22T0741_b16.json`, `..._T1207.json`"
    named = [tmp_path / n for n in ("decodetune_x_2026-11-22T0739.json", "decodetune_x_2026-11-22T0741_b16.json")]
    others = [tmp_path / n for n in ("decodetune_x_2026-11-22T0741_b64.json", "decodetune_x_2026-11-22T1207.json",
                                     "decodetune_x_2026-11-22T0739_b1.json")]
    assert all(prune.cited(p, text) for p in named)
    assert not any(prune.cited(p, text) for p in others)  # a sibling of a named run, a stamp alone, a longer name


def test_fp8_decode_figure_is_drawn_from_the_record(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"shape": "b1 16/2", "batch": 1, "context": c, "ours bf16 page16": 2 + c / 2500,
             "ours fp8-token page16": 2 + c / 4000, "FlashInfer fp8 page16": 3 + c / 3500, "fp8_floor_us": c / 6000}
            for c in (4096, 32768, 131072)] + [{"shape": "llama3-8b", "batch": 16, "context": 8192}]
    path = report.plot_record({"kind": "fp8_decode", "rows": rows}, tmp_path / "fp8.png")
    assert path is not None and path.stat().st_size > 0


def test_benchmarks_page_renders_kernel_time_records(tmp_path, monkeypatch):
    """The kernel-time section: one row per (mode, head dim, shape, mask) over the kernel_time records of latest/,
    ours against the best peer present in that row ("-" where a peer did not run)."""
    md = _load_script("write_benchmarks_md")
    shape = dict(d=128, b=1, s=16384, h=16, hkv=16, causal=True)
    fwd = {"device": "GPU", "torch": "t", "rounds": 3, "calls": 10,
           "rows": [dict(shape, mode="fwd", impl=impl, tflops=t) for impl, t in (("ours", 690.0), ("cuDNN", 600.0),
                                                                                   ("FA3", 720.0))]}
    both = dict(fwd, bf16_matmul_tflops=800.0,
                rows=[dict(shape, mode="fwd+bwd", impl="ours", tflops=550.0, pct_matmul=68.75),
                      dict(shape, mode="fwd+bwd", impl="cuDNN", tflops=500.0, pct_matmul=62.5)])
    text = md._kernel_time_section({"a.json": fwd, "b.json": both})
    assert "| fwd | 128 | 1x16k | yes | 690.0 | 600.0 | 720.0 | 0.96 | - |" in text  # (no matmul in the record)
    assert "| fwd+bwd | 128 | 1x16k | yes | 550.0 | 500.0 | - | 1.10 | 69 |" in text
    assert "GPU, torch t" in text and "latest/a.json" in text
    assert md._kernel_time_section({}) == ""
    # in latest/, by kind: drawn before the other sections; --add replaces the record of the same modes only
    latest, page = tmp_path / "latest", tmp_path / "benchmarks.md"
    latest.mkdir()
    for name, record in (("kernel_time_a.json", fwd), ("kernel_time_b.json", both)):
        (latest / name).write_text(json.dumps(dict(record, kind="kernel_time")))
    newer = tmp_path / "kernel_time_c.json"
    newer.write_text(json.dumps(dict(fwd, kind="kernel_time", command="python -m benchmarks.probes.kernel_time")))
    monkeypatch.setattr(sys, "argv", ["x", "--latest", str(latest), "--out", str(page), "--add", str(newer),
                                      "--commit", "abc1234"])
    assert md.main() == 0
    assert sorted(p.name for p in latest.glob("*.json")) == ["kernel_time_b.json", "kernel_time_c.json"]
    assert "`python -m benchmarks.probes.kernel_time` - GPU, torch t" in page.read_text()


def test_every_result_the_docs_name_is_in_the_repository():
    """README, docs/ and the targets table name result records by file name; each must exist under
    benchmarks/results/ (a record kept only in git history is cited as `git show <commit>:<path>`)."""
    import re

    results = report.REPO_ROOT / "benchmarks" / "results"
    have = {p.name for p in results.rglob("*") if p.is_file()}
    record = re.compile(r"[A-Za-z0-9][\w.-]*_20\d\d-\d\d-\d\d(?:T\d{4})?[\w.-]*?\.(?:json|md|png|log|txt|csv)")
    pages = [report.REPO_ROOT / "README.md", results / "targets.md", *sorted((report.REPO_ROOT / "docs").glob("*.md"))]
    missing = [(page.name, name) for page in pages
               for name in record.findall(re.sub(r"git show \S+", "", page.read_text()))
               if name not in have]
    assert not missing


def test_readme_headlines_are_written_from_the_records_in_latest(tmp_path):
    """README's speed block is what scripts/write_benchmarks_md.py writes from benchmarks/results/latest/ (rerun it
    after adding records), and rewriting the block leaves the rest of the file as it was."""
    md = _load_script("write_benchmarks_md")
    block = md.speed_block(*md.load_latest(report.REPO_ROOT / report.LATEST))
    assert block in (report.REPO_ROOT / "README.md").read_text()
    assert block.count("\n- **") >= 5 and block.count("(benchmarks/results/latest/") >= 6
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{md.SPEED_BEGIN}\n- stale\n{md.SPEED_END}\n\n## More\n")
    assert md.write_speed_block(readme, block)
    assert readme.read_text() == f"# x\n\n{block}\n\n## More\n"
    unmarked = tmp_path / "other.md"
    unmarked.write_text("no block here\n")
    assert not md.write_speed_block(unmarked, block) and unmarked.read_text() == "no block here\n"


def test_benchmarks_page_renders_the_hf_generate_records_eager_and_compiled_apart(tmp_path, monkeypatch):
    """bench.host --generate's records: eager and compiled rows may come from separate runs, each its own section;
    a backend that failed is named. Its --rows entries parse, a bad one names itself."""
    from flashdecode.bench import host

    assert host.parse_rows("dynamic:1x512, static:1x65536") == [("dynamic", 1, 512), ("static", 1, 65536)]
    with pytest.raises(ValueError, match="eager:1x512"):
        host.parse_rows("eager:1x512")
    md = _load_script("write_benchmarks_md")
    latest = tmp_path / "latest"
    latest.mkdir()
    base = dict(batch=1, context=4096, layers=8, new_tokens=64)
    for cache, row in (("dynamic", dict(ours_decode_tok_s=120.0, sdpa_decode_tok_s=100.0, ours_vs_sdpa=1.2,
                                        ours_vs_sdpa_e2e=1.1, ours_prefill_s=0.05, sdpa_prefill_s=0.06)),
                       ("static", dict(ours_decode_tok_s=300.0, sdpa_error="RuntimeError: boom"))):
        record = {"kind": "hf_generate", "env": {"device": "test", "date": "2026-01-01 00:00 UTC"},
                  "git_commit": "abc", "command": "python -m flashdecode.bench.host --generate --no-host",
                  "rows": [dict(base, cache=cache, **row)]}
        (latest / f"hf_generate_{cache}.json").write_text(json.dumps(record))
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(sys, "argv", ["x", "--latest", str(latest), "--out", str(page)])
    assert md.main() == 0
    text = page.read_text()
    assert "| dynamic | 1 | 4k | 120.0 | 100.0 | 1.20x | 1.10x | 0.050 / 0.060 |" in text
    assert "| static | 1 | 4k | 300.0 | - |" in text and "static 1x4096 sdpa: RuntimeError: boom" in text
    assert text.count("## transformers generate with our attention backend") == 2


def test_records_of_one_minute_do_not_overwrite_each_other(tmp_path):
    """Two runs named by the same minute keep both records (-2 before the suffix); overwrite=True rewrites one
    record in place (a record written as its rows complete)."""
    path = tmp_path / "serve_gpu_2026-01-01T0000.json"
    first = report.write_json(path, "custom", {}, [{"a": 1}])
    second = report.write_json(path, "custom", {}, [{"a": 2}])
    assert first == path and second == tmp_path / "serve_gpu_2026-01-01T0000-2.json"
    assert json.loads(first.read_text())["rows"] == [{"a": 1}] and json.loads(second.read_text())["rows"] == [{"a": 2}]
    again = report.write_json(path, "custom", {}, [{"a": 3}], overwrite=True)
    assert again == path and json.loads(path.read_text())["rows"] == [{"a": 3}]


def test_serving_workloads_get_their_own_sections_and_the_prefix_caching_headline(tmp_path):
    """Records of `bench serve --workload` (no LLM.generate beside them) are keyed by workload and features, each
    with its section; the shared-prefix pair, caching on and off, gives README's prefix-caching line (its ratios
    computed from the two records), and a record without the generate comparison gives no serving headline."""
    md = _load_script("write_benchmarks_md")
    env = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-01-01 00:00 UTC"}

    def record(caching: bool, ttft: float, seconds: float) -> dict:
        row = {"ok": 64, "failed": 0, "concurrency": 64, "prompt_len": 128, "output_len": 128, "prefix_len": 4096,
               "num_requests": 64, "output_tokens_per_s": 1000.0, "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
               "tpot_ms": {"p50": 10.0, "p99": 12.0}, "endpoint": "completions", "model": "m", "layers": 2,
               "workload": "shared-prefix", "prefix_caching": caching, "chunked_prefill": False,
               "duration_s": seconds}
        return {"kind": "serve", "env": env, "git_commit": "abc", "command": "flashdecode bench serve", "rows": [row]}
    latest = tmp_path / "latest"
    latest.mkdir()
    (latest / "serve_on.json").write_text(json.dumps(record(True, 500.0, 2.0)))
    (latest / "serve_off.json").write_text(json.dumps(record(False, 3500.0, 9.0)))
    records, kernel_time = md.load_latest(latest)
    assert {md.benchmark_key(r) for r in records.values()} == {md.PREFIX_ON, md.PREFIX_OFF}
    block = md.speed_block(records, kernel_time)
    assert "- **Prefix caching** (H100, 64 requests sharing a 4096-token prefix" in block
    assert "TTFT p50 500 ms against 3500 ms without it (7.0x), total 2.00 s against 9.00 s (4.5x)" in block
    assert "serve_on.json" in block and "serve_off.json" in block and "**Serving**" not in block
    sections = [md.section(path, r, None) for path, r in records.items()]
    assert all("the shared-prefix workload" in s and "against `LLM.generate`" not in s for s in sections)
